//! Where a fine-tuning job's checkpoint and training text come from, and
//! where its fine-tuned model goes.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Declares a Hugging Face repository source: `repo` (documented by the
/// caller: a model's or a dataset's), `revision`, the caller's own fields,
/// then the fields that say how the hub is reached (`endpoint`,
/// `allowInsecureHttp`, `tokenSecret`). The model's and the data's source
/// share these, so they are written once here; the field order is the
/// serialized order. `token_for` ends the first sentence of
/// `tokenSecret`'s description (what the token is for).
macro_rules! hugging_face_repository {
    (
        $(#[$struct_attr:meta])*
        pub struct $name:ident {
            $(#[$repo_attr:meta])*
            pub repo: String,
            $(
                $(#[$field_attr:meta])*
                pub $field:ident: $type:ty,
            )*
        }
        token_for = $token_for:tt;
    ) => {
        $(#[$struct_attr])*
        pub struct $name {
            $(#[$repo_attr])*
            #[schemars(
                length(min = 3, max = 200),
                regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
            )]
            pub repo: String,
            /// A branch, tag or commit.
            #[serde(default = "default_revision")]
            #[schemars(length(min = 1, max = 200))]
            pub revision: String,
            $(
                $(#[$field_attr])*
                pub $field: $type,
            )*
            /// The hub or a mirror, as `HF_ENDPOINT` (default `https://huggingface.co`).
            /// Must be `https://`: the token of `tokenSecret` is sent here. A plain
            /// `http://` mirror needs `allowInsecureHttp: true` as well.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            #[schemars(length(max = 500), regex(pattern = r"^https?://[^\s]+$"))]
            pub endpoint: Option<String>,
            /// Accept a plain `http://` `endpoint` (a mirror on a network you trust):
            /// the token of `tokenSecret`, if any, and the files then travel
            /// unencrypted and unauthenticated. Default false: `endpoint` must be
            /// `https://`.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub allow_insecure_http: Option<bool>,
            /// A key of a Secret in the job's namespace holding the Hugging Face
            #[doc = $token_for]
            /// Only a user who may `get` that Secret may name it: the chart's
            /// admission policy (`secretAccessPolicy`) refuses a job whose creator
            /// may not read it. The token is mounted, read-only, as a file into the
            /// job's initializer pod alone (never into its workers, never as an
            /// environment variable) and sent only to `endpoint`, as an
            /// `Authorization: Bearer` header (a redirect keeps it only on the same
            /// host over https; a CDN's signed URL gets none).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub token_secret: Option<SecretKey>,
        }
    };
}

/// Where a checkpoint to fine-tune is, and how long its training samples are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.huggingFace) != has(self.volume)",
     "message": "model.pretrained: set exactly one of huggingFace (repo, revision) or volume (claimName, path)"},
    {"rule": "self == oldSelf",
     "message": "model.pretrained is immutable: the initializer has read this checkpoint and the job is planned from it; create a new job for another checkpoint"}
]))]
pub struct PretrainedModel {
    /// A Hugging Face repository, downloaded into the job's checkpoint volume
    /// (once: retries and later attempts reuse it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugging_face: Option<HuggingFaceSource>,
    /// A directory on a PersistentVolumeClaim holding config.json,
    /// `*.safetensors` (or shards and model.safetensors.index.json) and tokenizer.json.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<VolumePath>,
    /// Tokens per training sample.
    #[schemars(range(min = 1, max = 131072))]
    pub sequence_length: u32,
}

hugging_face_repository! {
    /// A Hugging Face model repository.
    #[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "!has(self.endpoint) || self.endpoint.startsWith('https://') || (has(self.allowInsecureHttp) && self.allowInsecureHttp)",
         "fieldPath": ".endpoint",
         "reason": "FieldValueForbidden",
         "message": "model.pretrained.huggingFace.endpoint: must start with https:// (the token of tokenSecret is sent there); for a plain-HTTP mirror on a network you trust, also set allowInsecureHttp: true"}
    ]))]
    pub struct HuggingFaceSource {
        /// `owner/name`, e.g. `meta-llama/Llama-3.2-1B`.
        pub repo: String,
        /// Whether the checkpoint is shared with the namespace's other jobs
        /// ([`ModelCacheMode`], whose description the CRD shows).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub cache: Option<ModelCacheMode>,
    }
    token_for = "token, for gated or private repositories.";
}

/// `Shared`: the checkpoint is downloaded once per namespace, endpoint,
/// repository and revision into a shared read-only claim
/// (`headroom-model-<hash>`) that every job naming the same weights reads,
/// and the job's own claim is sized without it. `Private`: it is downloaded
/// into the job's own checkpoint claim (`model/`). Default: `Shared` for
/// `training.method` `lora` and `qlora` (a frozen base), `Private` for
/// `full`. A branch is resolved once, when the shared copy is downloaded;
/// name a commit to pin one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ModelCacheMode {
    /// One read-only copy per namespace, endpoint, repository and revision.
    Shared,
    /// A copy on the job's own checkpoint claim.
    Private,
}

/// One key of a Secret in the job's namespace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKey {
    /// The Secret's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Default `token`.
    #[serde(default = "default_token_key")]
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// A path on a PersistentVolumeClaim in the job's namespace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!self.path.startsWith('/') && !self.path.split('/').exists(p, p == '..')",
     "message": "path is relative to the claim's root and must not contain '..' (e.g. models/llama-3.2-1b)"}
]))]
pub struct VolumePath {
    /// A PersistentVolumeClaim in the job's namespace.
    #[schemars(length(min = 1, max = 253))]
    pub claim_name: String,
    /// Relative to the claim's root; empty for the root itself.
    #[serde(default)]
    #[schemars(length(max = 1000))]
    pub path: String,
}

/// The training text.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.huggingFace) != has(self.volume)",
     "message": "data: set exactly one of huggingFace (repo, and file or split) or volume (claimName, path)"},
    {"rule": "!(has(self.format) && self.format == 'text' && has(self.trainOn) && (self.trainOn == 'assistant' || self.trainOn == 'completion'))",
     "fieldPath": ".trainOn",
     "message": "data.trainOn: assistant and completion need JSONL or Parquet rows (conversations, prompt/completion pairs); a text file is plain text: use trainOn auto or all"},
    {"rule": "self == oldSelf",
     "message": "data is immutable: the initializer has read this text and the job's samples come from it; create a new job for other data"}
]))]
pub struct DataSpec {
    /// The data file on a claim; `path` may be a glob pattern
    /// (`data/train-*.parquet`): its files are read in name order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<VolumePath>,
    /// Files of a Hugging Face dataset repository (a file, a glob pattern
    /// or a split), downloaded into the job's checkpoint volume by the
    /// initializer (once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugging_face: Option<HuggingFaceDataFile>,
    /// `jsonl` (one JSON object a line), `parquet` (one such object a
    /// row) or `text` (the file is one document). A JSONL or Parquet row is
    /// a conversation (`messages`: a list of `{role, content}`, rendered
    /// with the checkpoint's chat template), a prompt/completion pair
    /// (`prompt`, `completion`: strings, or message lists) or plain text
    /// under `field`; every row of the data is of one kind.
    #[serde(default)]
    pub format: TextFormat,
    /// The field holding a plain-text row's document.
    #[serde(default = "default_text_field")]
    #[schemars(length(min = 1, max = 200))]
    pub field: String,
    /// Which tokens the loss is computed on: `auto` (TRL's defaults: the
    /// completion of prompt/completion rows, every token otherwise),
    /// `assistant` (a conversation's assistant turns), `completion` (a
    /// prompt/completion row's completion) or `all`.
    #[serde(default)]
    pub train_on: TrainOn,
    /// How examples become samples of `sequenceLength + 1` tokens:
    /// `stream` (the default: examples joined into one stream and cut at
    /// every `sequenceLength` tokens, so a sample may span documents and
    /// attention runs across them) or `documents` (whole examples placed
    /// into samples best-fit decreasing, as TRL's `pack_dataset(strategy:
    /// "bfd")`; each token attends only to its own example and positions
    /// restart at each; an example longer than a sample is truncated).
    #[serde(default)]
    pub packing: Packing,
}

/// How the examples of `spec.data` are packed into training samples.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Packing {
    /// One stream of every example (each ended by the end-of-sequence
    /// token), cut into samples with a stride of `sequenceLength`: no token
    /// is lost or padded, but a sample may hold the end of one document and
    /// the start of the next, and attends across them (pretraining-style).
    #[default]
    Stream,
    /// Whole examples, best-fit decreasing into samples (TRL's `bfd`): a
    /// sample holds one or more complete examples and padding that is not
    /// trained; attention is blocked between them and each starts at
    /// position 0, so every example trains as if alone (fine-tuning-style).
    /// An example longer than a sample keeps its first `sequenceLength + 1`
    /// tokens (counted in `status.data.longerThanSample`).
    Documents,
}

/// Which tokens of an example the loss is computed on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum TrainOn {
    /// TRL's `SFTTrainer` defaults: `completion_only_loss` for
    /// prompt/completion rows, every token of conversations and text.
    #[default]
    Auto,
    /// The tokens of the assistant turns (their content and the end of
    /// turn the template writes after it), as TRL's `assistant_only_loss`.
    Assistant,
    /// The completion of prompt/completion rows.
    Completion,
    /// Every token.
    All,
}

hugging_face_repository! {
    /// A file of a Hugging Face dataset repository.
    #[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase")]
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "!has(self.file) || (!self.file.startsWith('/') && !self.file.split('/').exists(p, p == '..' || p == '.' || p == ''))",
         "message": "data.huggingFace.file is a path or glob pattern inside the repository (e.g. data/train.jsonl, data/train-*.parquet), without a leading '/', '.' or '..'"},
        {"rule": "!has(self.file) || !self.file.endsWith('.arrow')",
         "message": "data.huggingFace.file: must be JSONL (format: jsonl), Parquet (format: parquet) or plain text (format: text); Headroom does not read Arrow files: pick the dataset's Parquet shard"},
        {"rule": "!has(self.file) || (!has(self.split) && !has(self.subset))",
         "message": "data.huggingFace: file names the files itself; split and subset pick them by the dataset's layout (its README's configs, data/<split>-*): set file, or split (and subset)"},
        {"rule": "!has(self.endpoint) || self.endpoint.startsWith('https://') || (has(self.allowInsecureHttp) && self.allowInsecureHttp)",
         "fieldPath": ".endpoint",
         "reason": "FieldValueForbidden",
         "message": "data.huggingFace.endpoint: must start with https:// (the token of tokenSecret is sent there); for a plain-HTTP mirror on a network you trust, also set allowInsecureHttp: true"}
    ]))]
    pub struct HuggingFaceDataFile {
        /// `owner/name` of a dataset repository, e.g. `HuggingFaceH4/ultrachat_200k`.
        pub repo: String,
        /// A file of the repository (`data/train.jsonl`), or a glob pattern
        /// naming several (`data/train-*.parquet`: read in name order).
        /// Without it, `split` picks the files.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[schemars(length(min = 1, max = 1000))]
        pub file: Option<String>,
        /// A split of the dataset (`train`, `train_sft`, ...), found as the
        /// `datasets` library finds it: the `data_files` of the README's
        /// `configs`, else `data/<split>-NNNNN-of-NNNNN.*` shards, else
        /// files or directories named after the split; a repository with
        /// none of these is all `train`. Default `train` when `file` is not
        /// set.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[schemars(length(min = 1, max = 100), regex(pattern = r"^\w+(\.\w+)*$"))]
        pub split: Option<String>,
        /// The config (subset) of a dataset whose README declares several
        /// (`configs:` with `config_name`); default: the one marked
        /// `default: true`, or the only one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[schemars(length(min = 1, max = 200))]
        pub subset: Option<String>,
    }
    token_for = "token, for a gated or private dataset.";
}

/// How a data file holds its documents.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum TextFormat {
    #[default]
    Jsonl,
    Text,
    Parquet,
}

/// Where the fine-tuned model goes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OutputSpec {
    /// A directory on a claim (created if missing), written in the
    /// checkpoint's Hugging Face format on success.
    pub volume: VolumePath,
}

fn default_revision() -> String {
    "main".into()
}
fn default_token_key() -> String {
    "token".into()
}
fn default_text_field() -> String {
    "text".into()
}
