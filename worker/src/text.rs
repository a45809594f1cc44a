//! Training text, from files to samples: documents from JSONL (one JSON object
//! a line, the text under a field, `text` by default) or plain text (one
//! document a file), tokenized with the checkpoint's own tokenizer (Hugging
//! Face `tokenizers`, read offline from `tokenizer.json`), joined with the
//! end-of-sequence token into one stream, packed into samples of
//! `sequence_length + 1` tokens (the inputs and, shifted by one, the targets;
//! consecutive samples share one token), shuffled by the job's seed, and shared
//! out over ranks so that every sample goes to exactly one rank. With
//! `data.packing: documents` ([`pack_documents`]) whole examples are placed
//! into padded samples instead, each attended to and positioned alone.
//!
//! [`crate::data::TextSamples`] turns the packed samples into training batches.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use headroom_api::{DataSplit, TrainOn};
use minijinja::Value;
use minijinja::value::ValueKind;
use tokenizers::Tokenizer;

use crate::chat::{Template, attr, ordered_json};

/// How a data file holds its examples.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Format {
    /// One JSON object a line (see [`Example`] for what a row may be);
    /// plain text is the string under `field`.
    Jsonl { field: String },
    /// Parquet: each row read as a JSONL line's object.
    Parquet { field: String },
    /// The whole file is one document.
    PlainText,
}

impl From<&headroom_api::DataFormat> for Format {
    fn from(format: &headroom_api::DataFormat) -> Self {
        match format {
            headroom_api::DataFormat::Jsonl { field } => Format::Jsonl {
                field: field.clone(),
            },
            headroom_api::DataFormat::Parquet { field } => Format::Parquet {
                field: field.clone(),
            },
            headroom_api::DataFormat::Text => Format::PlainText,
        }
    }
}

/// Data Headroom cannot train on, saying where and what would work.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {problem}")]
    Line {
        path: PathBuf,
        line: usize,
        problem: String,
    },
    #[error("{path}: {problem}")]
    File { path: PathBuf, problem: String },
    #[error("tokenizer {path}: {problem}")]
    Tokenizer { path: PathBuf, problem: String },
    #[error(
        "the data has {tokens} tokens: too few for one sample of {needed} (sequence length + 1); add text or shorten the sequence"
    )]
    TooShort { tokens: usize, needed: usize },
}

/// One training example, as a row (or a plain-text file) gives it.
#[derive(Clone, Debug)]
pub enum Example {
    /// Plain text: a `text` file, or a row's string under the format's field.
    Text(String),
    /// `prompt` and `completion` strings.
    Prompted { prompt: String, completion: String },
    /// `messages` (a list of `{role, content, …}`), or a conversational
    /// prompt/completion pair joined into one conversation whose messages
    /// from `completion_from` on are the completion. `extra` is what TRL
    /// hands the chat template besides the messages: the row's `tools`
    /// (a list, or a JSON string of one) and the entries of its
    /// `chat_template_kwargs` (e.g. `enable_thinking`).
    Chat {
        messages: Vec<Value>,
        completion_from: Option<usize>,
        extra: Vec<(String, Value)>,
    },
}

/// An example and where it is: the file and its 1-based row (line).
#[derive(Clone, Debug)]
pub struct Located {
    pub example: Example,
    pub path: Arc<Path>,
    pub row: usize,
}

impl Located {
    fn error(&self, problem: String) -> TextError {
        TextError::Line {
            path: self.path.to_path_buf(),
            line: self.row,
            problem,
        }
    }
}

/// Where a job's data is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataLocation {
    /// A file, or a glob pattern naming several.
    Pattern(PathBuf),
    /// A split of a dataset repository downloaded into `dir`, its files
    /// found there as on the hub ([`crate::dataset_layout`]).
    Split { dir: PathBuf, split: DataSplit },
}

impl DataLocation {
    /// The data of a job's files: `data_file`, or its split.
    pub fn new(data_file: &str, split: Option<&DataSplit>) -> Self {
        match split {
            Some(split) => DataLocation::Split {
                dir: PathBuf::from(data_file),
                split: split.clone(),
            },
            None => DataLocation::Pattern(PathBuf::from(data_file)),
        }
    }
}

impl From<&Path> for DataLocation {
    fn from(path: &Path) -> Self {
        DataLocation::Pattern(path.to_path_buf())
    }
}

impl From<&PathBuf> for DataLocation {
    fn from(path: &PathBuf) -> Self {
        DataLocation::Pattern(path.clone())
    }
}

impl std::fmt::Display for DataLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DataLocation::Pattern(p) => write!(f, "{}", p.display()),
            DataLocation::Split { dir, split } => match &split.subset {
                Some(subset) => write!(
                    f,
                    "{} (subset {subset}, split {})",
                    dir.display(),
                    split.split
                ),
                None => write!(f, "{} (split {})", dir.display(), split.split),
            },
        }
    }
}

/// The files of `data`: a pattern's (see [`pattern_files`]), or those of a
/// split in its download directory.
pub fn data_files(data: &DataLocation, format: &Format) -> Result<Vec<PathBuf>, TextError> {
    let (dir, split) = match data {
        DataLocation::Pattern(pattern) => return pattern_files(pattern),
        DataLocation::Split { dir, split } => (dir, split),
    };
    let bad = |problem: String| TextError::File {
        path: dir.clone(),
        problem,
    };
    let mut relative = Vec::new();
    let mut pending = vec![dir.clone()];
    while let Some(at) = pending.pop() {
        let entries =
            std::fs::read_dir(&at).map_err(|e| bad(format!("reading {}: {e}", at.display())))?;
        for entry in entries {
            let entry = entry.map_err(|e| bad(format!("reading {}: {e}", at.display())))?;
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if let Ok(rel) = path.strip_prefix(dir) {
                let parts: Vec<String> = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                relative.push(parts.join("/"));
            }
        }
    }
    let readme = std::fs::read_to_string(dir.join(crate::dataset_layout::README)).ok();
    let files = crate::dataset_layout::split_files(&relative, readme.as_deref(), split, format)
        .map_err(bad)?;
    Ok(files.iter().map(|f| dir.join(f)).collect())
}

/// The files `pattern` names: itself, or where it holds `*`, `?` or `[`,
/// the files matching it as a glob, in name order (at least one).
pub fn pattern_files(pattern: &Path) -> Result<Vec<PathBuf>, TextError> {
    let text = pattern.to_string_lossy();
    if !text.contains(['*', '?', '[']) {
        return Ok(vec![pattern.to_path_buf()]);
    }
    let bad = |problem: String| TextError::File {
        path: pattern.to_path_buf(),
        problem,
    };
    let mut files: Vec<PathBuf> = glob::glob(&text)
        .map_err(|e| bad(format!("not a glob pattern: {e}")))?
        .filter_map(Result::ok)
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(bad(
            "no file matches this pattern; check data.volume.path (e.g. data/train-*.parquet)"
                .into(),
        ));
    }
    Ok(files)
}

/// Every example of `data` (a file, a glob or a split), in file and row order.
pub fn read_examples(
    data: impl Into<DataLocation>,
    format: &Format,
) -> Result<Vec<Located>, TextError> {
    let mut examples = Vec::new();
    for path in data_files(&data.into(), format)? {
        let path: Arc<Path> = Arc::from(path.as_path());
        match format {
            Format::PlainText => {
                let text = std::fs::read_to_string(&path).map_err(|source| TextError::Read {
                    path: path.to_path_buf(),
                    source,
                })?;
                examples.push(Located {
                    example: Example::Text(text),
                    path,
                    row: 1,
                });
            }
            Format::Jsonl { field } => read_jsonl(&path, field, &mut examples)?,
            Format::Parquet { field } => read_parquet(&path, field, &mut examples)?,
        }
    }
    check_one_kind(&examples)?;
    Ok(examples)
}

fn read_jsonl(path: &Arc<Path>, field: &str, into: &mut Vec<Located>) -> Result<(), TextError> {
    let bytes = std::fs::read(path).map_err(|source| TextError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    if bytes.starts_with(b"PAR1") {
        return Err(TextError::File {
            path: path.to_path_buf(),
            problem: "a Parquet file, read as JSONL: set data.format: parquet".into(),
        });
    }
    let text = String::from_utf8(bytes).map_err(|e| TextError::File {
        path: path.to_path_buf(),
        problem: format!("not UTF-8 text: {e}"),
    })?;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = |problem: String| TextError::Line {
            path: path.to_path_buf(),
            line: i + 1,
            problem,
        };
        into.push(Located {
            example: example_of(line, field).map_err(at)?,
            path: path.clone(),
            row: i + 1,
        });
    }
    Ok(())
}

fn read_parquet(path: &Arc<Path>, field: &str, into: &mut Vec<Located>) -> Result<(), TextError> {
    let file = std::fs::File::open(path).map_err(|source| TextError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let bad = |problem: String| TextError::File {
        path: path.to_path_buf(),
        problem,
    };
    let reader = parquet::file::serialized_reader::SerializedFileReader::new(file)
        .map_err(|e| bad(format!("not a Parquet file Headroom reads: {e}")))?;
    for (i, row) in reader.into_iter().enumerate() {
        let row = row.map_err(|e| bad(format!("row {}: {e}", i + 1)))?;
        let at = |problem: String| TextError::Line {
            path: path.to_path_buf(),
            line: i + 1,
            problem: format!("row {}: {problem}", i + 1),
        };
        let json = row_json(&row);
        into.push(Located {
            example: example_of(&json, field).map_err(at)?,
            path: path.clone(),
            row: i + 1,
        });
    }
    Ok(())
}

/// A Parquet row as JSON text with its fields in the schema's order, as
/// Python (pyarrow, `datasets`) hands rows to a chat template; the record
/// API's own `to_json_value` sorts the keys. Scalars are written as that
/// API writes them.
fn row_json(row: &parquet::record::Row) -> String {
    use parquet::record::Field;
    fn field(f: &Field, out: &mut String) {
        match f {
            Field::Group(row) => object(row.get_column_iter().map(|(k, v)| (k.clone(), v)), out),
            Field::ListInternal(list) => {
                out.push('[');
                for (i, e) in list.elements().iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    field(e, out);
                }
                out.push(']');
            }
            Field::MapInternal(map) => object(
                map.entries().iter().map(|(k, v)| {
                    let key = k.to_json_value();
                    (
                        key.as_str().map_or_else(|| key.to_string(), str::to_string),
                        v,
                    )
                }),
                out,
            ),
            scalar => out.push_str(&scalar.to_json_value().to_string()),
        }
    }
    fn object<'a>(entries: impl Iterator<Item = (String, &'a Field)>, out: &mut String) {
        out.push('{');
        for (i, (key, value)) in entries.enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&serde_json::Value::String(key).to_string());
            out.push(':');
            field(value, out);
        }
        out.push('}');
    }
    let mut out = String::new();
    object(row.get_column_iter().map(|(k, v)| (k.clone(), v)), &mut out);
    out
}

/// A row's example, from the row as JSON text: `messages` makes a
/// conversation, `prompt` and `completion` a prompt/completion pair, else
/// the string under `field`. An error names the field at fault.
pub fn example_of(row: &str, field: &str) -> Result<Example, String> {
    let row = ordered_json(row).map_err(|e| format!("not a JSON object: {e}"))?;
    if row.kind() != ValueKind::Map {
        return Err("not a JSON object".into());
    }
    let get = |k: &str| Some(attr(&row, k)).filter(|v| !v.is_undefined());
    if let Some(messages) = get("messages") {
        return Ok(Example::Chat {
            messages: message_list(&messages, "messages")?,
            completion_from: None,
            extra: template_context(&row)?,
        });
    }
    if let (Some(prompt), Some(completion)) = (get("prompt"), get("completion")) {
        return match (prompt.kind(), completion.kind()) {
            (ValueKind::String, ValueKind::String) => Ok(Example::Prompted {
                prompt: prompt.to_string(),
                completion: completion.to_string(),
            }),
            (ValueKind::Seq, ValueKind::Seq) => {
                let mut messages = message_list(&prompt, "prompt")?;
                let completion_from = messages.len();
                messages.extend(message_list(&completion, "completion")?);
                Ok(Example::Chat {
                    messages,
                    completion_from: Some(completion_from),
                    extra: template_context(&row)?,
                })
            }
            _ => Err(format!(
                "`prompt` and `completion` must both be strings or both be message lists (here {} and {})",
                kind_of(&prompt),
                kind_of(&completion)
            )),
        };
    }
    match get(field) {
        Some(text) if text.kind() == ValueKind::String => Ok(Example::Text(text.to_string())),
        Some(other) => Err(format!("field `{field}` is not a string: {other}")),
        None => {
            let keys: Vec<String> = row
                .try_iter()
                .map(|k| k.map(|k| k.to_string()).collect())
                .unwrap_or_default();
            Err(format!(
                "no field `{field}`, `messages` or `prompt` and `completion` (this row has: {}); set data.field to the text's field",
                keys.join(", ")
            ))
        }
    }
}

/// What the chat template sees of a row besides its messages, as TRL
/// passes it: `tools` (a list, or a JSON string of one) and the entries
/// of `chat_template_kwargs`.
fn template_context(row: &Value) -> Result<Vec<(String, Value)>, String> {
    let mut context = Vec::new();
    let tools = attr(row, "tools");
    match tools.kind() {
        ValueKind::Undefined | ValueKind::None => {}
        ValueKind::String => {
            let parsed = ordered_json(tools.as_str().unwrap_or_default())
                .map_err(|e| format!("`tools` is a string but not JSON: {e}"))?;
            context.push(("tools".to_owned(), parsed));
        }
        ValueKind::Seq => context.push(("tools".to_owned(), tools)),
        _ => return Err(format!("`tools` is {}, not a list", kind_of(&tools))),
    }
    let kwargs = attr(row, "chat_template_kwargs");
    match kwargs.kind() {
        ValueKind::Undefined | ValueKind::None => {}
        ValueKind::Map => {
            for key in kwargs.try_iter().map_err(|e| e.to_string())? {
                let value = kwargs.get_item(&key).map_err(|e| e.to_string())?;
                context.push((key.to_string(), value));
            }
        }
        _ => {
            return Err(format!(
                "`chat_template_kwargs` is {}, not an object",
                kind_of(&kwargs)
            ));
        }
    }
    Ok(context)
}

fn kind_of(v: &Value) -> &'static str {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => "null",
        ValueKind::Bool => "a boolean",
        ValueKind::Number => "a number",
        ValueKind::String => "a string",
        ValueKind::Seq => "a list",
        ValueKind::Map => "an object",
        _ => "a value",
    }
}

/// A list of `{role, content}` objects under `name`.
fn message_list(value: &Value, name: &str) -> Result<Vec<Value>, String> {
    if value.kind() != ValueKind::Seq {
        return Err(format!(
            "`{name}` is {}, not a list of {{role, content}}",
            kind_of(value)
        ));
    }
    let messages: Vec<Value> = value.try_iter().map_err(|e| e.to_string())?.collect();
    if messages.is_empty() {
        return Err(format!("`{name}` is empty"));
    }
    for (k, m) in messages.iter().enumerate() {
        if m.kind() != ValueKind::Map {
            return Err(format!(
                "`{name}[{k}]` is {}, not {{role, content}}",
                kind_of(m)
            ));
        }
        let role = attr(m, "role");
        match role.kind() {
            ValueKind::String => {}
            ValueKind::Undefined => {
                return Err(format!(
                    "`{name}[{k}]` has no `role` (each message is {{role, content}})"
                ));
            }
            _ => {
                return Err(format!(
                    "`{name}[{k}].role` is {}, not a string",
                    kind_of(&role)
                ));
            }
        }
        let content = attr(m, "content");
        match content.kind() {
            ValueKind::String | ValueKind::Seq | ValueKind::None => {}
            // A tool-calling assistant turn may have no content.
            ValueKind::Undefined if !attr(m, "tool_calls").is_undefined() => {}
            ValueKind::Undefined => return Err(format!("`{name}[{k}]` has no `content`")),
            _ => {
                return Err(format!(
                    "`{name}[{k}].content` is {}, not a string",
                    kind_of(&content)
                ));
            }
        }
    }
    Ok(messages)
}

fn kind_name(e: &Example) -> &'static str {
    match e {
        Example::Text(_) => "plain text",
        Example::Prompted { .. } => "prompt/completion strings",
        Example::Chat {
            completion_from: Some(_),
            ..
        } => "prompt/completion message lists",
        Example::Chat { .. } => "a conversation (`messages`)",
    }
}

/// Every example of one kind, as TRL requires of a dataset.
fn check_one_kind(examples: &[Located]) -> Result<(), TextError> {
    let Some(first) = examples.first() else {
        return Ok(());
    };
    let kind = kind_name(&first.example);
    match examples.iter().find(|e| kind_name(&e.example) != kind) {
        Some(other) => Err(other.error(format!(
            "this row is {}, but {}:{} is {kind}: every row of the data must be of one kind",
            kind_name(&other.example),
            first.path.display(),
            first.row
        ))),
        None => Ok(()),
    }
}

/// The documents of one plain-text data file (a plain file, or the text
/// field of JSONL rows).
pub fn read_documents(
    data: impl Into<DataLocation>,
    format: &Format,
) -> Result<Vec<String>, TextError> {
    read_examples(data, format)?
        .into_iter()
        .map(|e| match &e.example {
            Example::Text(s) => Ok(s.clone()),
            other => Err(e.error(format!(
                "{} where plain text was expected",
                kind_name(other)
            ))),
        })
        .collect()
}

/// Loads a `tokenizer.json` (no network).
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer, TextError> {
    Tokenizer::from_file(path).map_err(|e| TextError::Tokenizer {
        path: path.to_path_buf(),
        problem: e.to_string(),
    })
}

/// The tokenizer, chat template and end-of-sequence token an example is
/// tokenized with.
#[derive(Debug)]
pub struct Tokenization<'a> {
    pub tokenizer: &'a Tokenizer,
    pub template: Option<&'a Template>,
    pub eos: u32,
    pub train_on: TrainOn,
    /// Where the template should have come from, for errors.
    pub model_dir: &'a Path,
}

/// An example's tokens and, for each, whether the loss is computed on
/// predicting it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tokenized {
    pub ids: Vec<u32>,
    pub trained: Vec<bool>,
}

/// Leading tokens `a` and `b` have in common (TRL's `common_prefix_length`).
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn encode(tk: &Tokenizer, text: &str, special: bool) -> Result<tokenizers::Encoding, String> {
    tk.encode_char_offsets(text, special)
        .map_err(|e| format!("the tokenizer failed: {e}"))
}

impl Tokenization<'_> {
    /// `example` as training sees it: plain text as TRL tokenizes it (the
    /// tokenizer's special tokens, then `eos`, all trained); prompt/completion strings as TRL
    /// tokenizes them (the tokenizer's special tokens, the completion
    /// ending in the eos token); conversations rendered with the chat
    /// template and tokenized without special tokens (as
    /// `apply_chat_template` does), nothing appended.
    pub fn tokenize(&self, located: &Located) -> Result<Tokenized, TextError> {
        let at = |problem: String| located.error(problem);
        let train_on = self.train_on;
        let wrong = |what: &str| {
            at(format!(
                "data.trainOn: {} needs {what}; this data is {}: use trainOn: auto or all",
                serde_json::to_string(&train_on).unwrap_or_default(),
                kind_name(&located.example)
            ))
        };
        match &located.example {
            Example::Text(text) => {
                if matches!(train_on, TrainOn::Assistant) {
                    return Err(wrong("conversations (`messages`)"));
                }
                if matches!(train_on, TrainOn::Completion) {
                    return Err(wrong("prompt/completion rows"));
                }
                let ids = plain_text_ids(self.tokenizer, text, self.eos).map_err(at)?;
                let trained = vec![true; ids.len()];
                Ok(Tokenized { ids, trained })
            }
            Example::Prompted { prompt, completion } => {
                if matches!(train_on, TrainOn::Assistant) {
                    return Err(wrong("conversations (`messages` or message lists)"));
                }
                let eos = self.tokenizer.id_to_token(self.eos).unwrap_or_default();
                let mut completion = completion.clone();
                if !completion.ends_with(&eos) {
                    completion.push_str(&eos);
                }
                let prompt_ids = encode(self.tokenizer, prompt, true).map_err(at)?;
                let ids = encode(self.tokenizer, &format!("{prompt}{completion}"), true)
                    .map_err(at)?
                    .get_ids()
                    .to_vec();
                let from = common_prefix(prompt_ids.get_ids(), &ids);
                let all = matches!(train_on, TrainOn::All);
                let trained = (0..ids.len()).map(|i| all || i >= from).collect();
                Ok(Tokenized { ids, trained })
            }
            Example::Chat {
                messages,
                completion_from,
                extra,
            } => self.tokenize_chat(located, messages, *completion_from, extra),
        }
    }

    fn tokenize_chat(
        &self,
        located: &Located,
        messages: &[Value],
        completion_from: Option<usize>,
        extra: &[(String, Value)],
    ) -> Result<Tokenized, TextError> {
        let at = |problem: String| located.error(problem);
        let template = self.template.ok_or_else(|| {
            at(format!(
                "a conversation, but the checkpoint {} has no chat template (tokenizer_config.json chat_template or chat_template.jinja): use a chat model, add its template, or give plain text",
                self.model_dir.display()
            ))
        })?;
        let text = template.render(messages, extra, false).map_err(at)?;
        let encoding = encode(self.tokenizer, &text, false).map_err(at)?;
        let ids = encoding.get_ids().to_vec();
        let trained = match (self.train_on, completion_from) {
            (TrainOn::All, _) | (TrainOn::Auto, None) => vec![true; ids.len()],
            (TrainOn::Completion, None) => {
                return Err(at(
                    "data.trainOn: completion needs prompt/completion rows; this row is a conversation (`messages`): use trainOn: assistant, auto or all".into(),
                ));
            }
            (TrainOn::Auto | TrainOn::Completion, Some(from)) => {
                // As TRL: the completion starts where the prompt (rendered
                // with the generation prompt) and the whole diverge.
                let prompt = template
                    .render(&messages[..from], extra, true)
                    .map_err(at)?;
                let prompt = encode(self.tokenizer, &prompt, false).map_err(at)?;
                let n = common_prefix(prompt.get_ids(), &ids);
                (0..ids.len()).map(|i| i >= n).collect()
            }
            (TrainOn::Assistant, from) => {
                // With a prompt/completion pair TRL also masks the prompt
                // (its completion mask applies with the assistant mask).
                let from = match from {
                    Some(from) => {
                        let prompt = template
                            .render(&messages[..from], extra, true)
                            .map_err(at)?;
                        let prompt = encode(self.tokenizer, &prompt, false).map_err(at)?;
                        common_prefix(prompt.get_ids(), &ids)
                    }
                    None => 0,
                };
                let spans = template
                    .assistant_spans(messages, extra, &text)
                    .map_err(at)?;
                // A token is the assistant's when it lies inside a span:
                // it starts there and does not run past its end (a span
                // may end inside the next turn's first token, where the
                // text after a reply and a turn's header start alike).
                // Offsets are in characters; the spans are byte ranges.
                let chars: Vec<usize> = spans
                    .iter()
                    .flat_map(|r| {
                        [
                            text[..r.start].chars().count(),
                            text[..r.end].chars().count(),
                        ]
                    })
                    .collect();
                encoding
                    .get_offsets()
                    .iter()
                    .enumerate()
                    .map(|(i, &(start, end))| {
                        i >= from
                            && chars
                                .chunks(2)
                                .any(|r| (r[0]..r[1]).contains(&start) && end <= r[1])
                    })
                    .collect()
            }
        };
        Ok(Tokenized { ids, trained })
    }
}

/// What packing produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packed {
    pub documents: usize,
    /// Tokens of the examples (end-of-sequence tokens included), before
    /// [`Packing::Documents`] truncates any.
    pub tokens: usize,
    /// Each `sequence_length + 1` tokens long, in stream order.
    pub samples: Vec<Vec<u32>>,
    /// Per sample, whether each of its `sequence_length` targets (its
    /// tokens from the second on) is trained; `None` when all are.
    pub trained: Option<Vec<Vec<bool>>>,
    /// Targets of the samples the loss skips.
    pub masked_targets: u64,
    /// Targets of the samples.
    pub targets: u64,
    /// Examples longer than one sample.
    pub longer_than_sample: u64,
    /// Per sample, the document each of its `sequence_length + 1` tokens
    /// belongs to (0, 1, … in the sample; padding is one more): set by
    /// [`Packing::Documents`], `None` for the stream.
    pub segments: Option<Vec<Vec<u32>>>,
}

/// How examples become samples (`data.packing`).
pub use headroom_api::Packing;

/// Packs tokenized examples as `packing` says: [`pack_tokenized`] for the
/// stream, [`pack_documents`] (padding with `pad`) for whole documents.
pub fn pack_examples(
    examples: &[Tokenized],
    packing: Packing,
    pad: u32,
    sequence_length: usize,
) -> Result<Packed, TextError> {
    match packing {
        Packing::Stream => pack_tokenized(examples, sequence_length),
        Packing::Documents => pack_documents(examples, pad, sequence_length),
    }
}

/// The order best-fit decreasing places examples of these lengths into
/// bins of `capacity` tokens, as TRL's `pack_dataset(strategy="bfd")`:
/// examples by length, longest first (ties in data order: Arrow's sort is
/// stable); each goes into the open bin with the least space that still
/// holds it (of bins with equal space, the one that got that space first),
/// else into a new bin. Lengths are at most `capacity` (truncated before);
/// empty examples take no place. Returns each bin's examples in placement
/// order, bins in the order they were opened.
pub fn best_fit_decreasing(lengths: &[usize], capacity: usize) -> Vec<Vec<usize>> {
    use std::collections::{BTreeMap, VecDeque};
    let mut order: Vec<usize> = (0..lengths.len()).filter(|&i| lengths[i] > 0).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
    let mut bins: Vec<Vec<usize>> = Vec::new();
    // Space left → the bins with exactly that much, oldest first (TRL's
    // segment tree over spaces and its `space_to_bin` deques).
    let mut open: BTreeMap<usize, VecDeque<usize>> = BTreeMap::new();
    for i in order {
        let length = lengths[i].min(capacity);
        let fit = open.range(length..capacity).next().map(|(&space, _)| space);
        let (bin, space) = match fit {
            Some(space) => {
                let queue = open.get_mut(&space).expect("a space in the map");
                let bin = queue.pop_front().expect("no empty queue is kept");
                if queue.is_empty() {
                    open.remove(&space);
                }
                (bin, space)
            }
            None => {
                bins.push(Vec::new());
                (bins.len() - 1, capacity)
            }
        };
        bins[bin].push(i);
        open.entry(space - length).or_default().push_back(bin);
    }
    bins
}

/// Places whole examples into samples of `sequence_length + 1` tokens by
/// [`best_fit_decreasing`] (an example longer than a sample keeps its first
/// `sequence_length + 1` tokens, counted in `longer_than_sample`) and fills
/// the rest of a sample with `pad`. A target (token `j + 1` of a sample) is
/// trained when its token is and it continues the document of token `j`:
/// padding and each document's first token (which only the previous
/// document could predict) are not, so a document trains as if alone.
pub fn pack_documents(
    examples: &[Tokenized],
    pad: u32,
    sequence_length: usize,
) -> Result<Packed, TextError> {
    let needed = sequence_length + 1;
    let tokens: usize = examples.iter().map(|e| e.ids.len()).sum();
    let lengths: Vec<usize> = examples.iter().map(|e| e.ids.len().min(needed)).collect();
    let bins = best_fit_decreasing(&lengths, needed);
    if sequence_length == 0 || bins.is_empty() {
        return Err(TextError::TooShort { tokens, needed });
    }
    let (mut samples, mut masks, mut segments) = (Vec::new(), Vec::new(), Vec::new());
    for bin in &bins {
        let (mut ids, mut trained, mut segment) = (Vec::new(), Vec::new(), Vec::new());
        for (d, &i) in bin.iter().enumerate() {
            let e = &examples[i];
            ids.extend_from_slice(&e.ids[..lengths[i]]);
            trained.extend_from_slice(&e.trained[..lengths[i]]);
            segment.extend(std::iter::repeat_n(d as u32, lengths[i]));
        }
        let fill = needed - ids.len();
        ids.extend(std::iter::repeat_n(pad, fill));
        trained.extend(std::iter::repeat_n(false, fill));
        segment.extend(std::iter::repeat_n(bin.len() as u32, fill));
        let mask: Vec<bool> = (1..needed)
            .map(|j| trained[j] && segment[j] == segment[j - 1])
            .collect();
        samples.push(ids);
        masks.push(mask);
        segments.push(segment);
    }
    let masked_targets = masks.iter().flatten().filter(|t| !**t).count() as u64;
    let count = samples.len();
    Ok(Packed {
        documents: examples.len(),
        tokens,
        samples,
        trained: (masked_targets > 0).then_some(masks),
        masked_targets,
        targets: (count * sequence_length) as u64,
        longer_than_sample: examples.iter().filter(|e| e.ids.len() > needed).count() as u64,
        segments: Some(segments),
    })
}

/// A plain-text document's ids as TRL's `SFTTrainer` makes them: tokenized
/// with the tokenizer's special tokens (a Llama tokenizer's BOS first),
/// ending with the end-of-sequence token (TRL appends its text unless the
/// document ends with it; as an added token it is one id either way).
fn plain_text_ids(tokenizer: &Tokenizer, text: &str, eos: u32) -> Result<Vec<u32>, String> {
    let mut ids = encode(tokenizer, text, true)?.get_ids().to_vec();
    if ids.last() != Some(&eos) {
        ids.push(eos);
    }
    Ok(ids)
}

/// Tokenizes every document as [`plain_text_ids`] does and cuts the stream
/// into samples of `sequence_length + 1` tokens with a stride of
/// `sequence_length`. A tail shorter than a sample is dropped.
pub fn pack(
    tokenizer: &Tokenizer,
    documents: &[String],
    eos: u32,
    sequence_length: usize,
) -> Result<Packed, TextError> {
    let examples: Vec<Tokenized> = documents
        .iter()
        .map(|doc| {
            let ids =
                plain_text_ids(tokenizer, doc, eos).map_err(|problem| TextError::Tokenizer {
                    path: PathBuf::from("(loaded)"),
                    problem,
                })?;
            let trained = vec![true; ids.len()];
            Ok(Tokenized { ids, trained })
        })
        .collect::<Result<_, TextError>>()?;
    pack_tokenized(&examples, sequence_length)
}

/// Joins the examples into one stream and cuts it into samples of
/// `sequence_length + 1` tokens with a stride of `sequence_length` (a tail
/// shorter than a sample is dropped). A sample's target `j` (its token
/// `j + 1`) is trained when that token is.
pub fn pack_tokenized(examples: &[Tokenized], sequence_length: usize) -> Result<Packed, TextError> {
    let needed = sequence_length + 1;
    let (mut stream, mut trained) = (Vec::new(), Vec::new());
    let mut longer_than_sample = 0;
    for e in examples {
        stream.extend_from_slice(&e.ids);
        trained.extend_from_slice(&e.trained);
        longer_than_sample += u64::from(e.ids.len() > needed);
    }
    if sequence_length == 0 || stream.len() < needed {
        return Err(TextError::TooShort {
            tokens: stream.len(),
            needed,
        });
    }
    let count = (stream.len() - 1) / sequence_length;
    let window = |k: usize| k * sequence_length..k * sequence_length + needed;
    let samples = (0..count).map(|k| stream[window(k)].to_vec()).collect();
    let masks: Vec<Vec<bool>> = (0..count)
        .map(|k| trained[window(k)][1..].to_vec())
        .collect();
    let masked_targets = masks.iter().flatten().filter(|t| !**t).count() as u64;
    Ok(Packed {
        documents: examples.len(),
        tokens: stream.len(),
        samples,
        trained: (masked_targets > 0).then_some(masks),
        masked_targets,
        targets: (count * sequence_length) as u64,
        longer_than_sample,
        segments: None,
    })
}

/// The data at `files.data_file` (a file or a glob) as training sees it:
/// read, tokenized with the checkpoint's tokenizer and chat template, and
/// packed into samples of `sequence_length + 1` tokens with their masks.
pub fn load_packed(
    model_dir: &Path,
    data: impl Into<DataLocation>,
    format: &Format,
    train_on: TrainOn,
    packing: Packing,
    sequence_length: usize,
) -> Result<Packed, String> {
    let tokenizer_path = model_dir.join("tokenizer.json");
    let tokenizer = load_tokenizer(&tokenizer_path).map_err(|e| e.to_string())?;
    let eos = end_of_sequence(model_dir, &tokenizer).ok_or_else(|| {
        format!(
            "{}: no end-of-sequence token (config.json eos_token_id, or </s>, <|endoftext|>, <|end_of_text|> in the vocabulary)",
            tokenizer_path.display()
        )
    })?;
    let data = data.into();
    let examples = read_examples(data.clone(), format).map_err(|e| e.to_string())?;
    let template = match examples.first().map(|e| &e.example) {
        Some(Example::Chat { .. }) => Template::load(model_dir)?,
        _ => None,
    };
    let how = Tokenization {
        tokenizer: &tokenizer,
        template: template.as_ref(),
        eos,
        train_on,
        model_dir,
    };
    let tokenized = examples
        .iter()
        .map(|e| how.tokenize(e))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    pack_examples(&tokenized, packing, eos, sequence_length).map_err(|e| format!("{data}: {e}"))
}

/// The assignment's text, tokenized with the checkpoint's tokenizer and
/// packed into samples of `sequence_length + 1` tokens as `data.packing`
/// says; errors name the file.
pub(crate) fn load_text(
    files: &headroom_api::PayloadFiles,
    sequence_length: usize,
) -> Result<Packed, String> {
    load_packed(
        Path::new(&files.model_dir),
        DataLocation::new(&files.data_file, files.data_split.as_ref()),
        &Format::from(&files.data_format),
        files.train_on,
        files.packing,
        sequence_length,
    )
}

/// The id documents are separated by: config.json's `eos_token_id` (the
/// first, where it is a list), else a conventional end token of the vocabulary.
pub(crate) fn end_of_sequence(model_dir: &Path, tokenizer: &Tokenizer) -> Option<u32> {
    let config = std::fs::read_to_string(model_dir.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&config).ok()?;
    let from_config = match &v["eos_token_id"] {
        serde_json::Value::Number(n) => n.as_u64(),
        serde_json::Value::Array(a) => a.first().and_then(serde_json::Value::as_u64),
        _ => None,
    };
    from_config
        .and_then(|id| u32::try_from(id).ok())
        .or_else(|| {
            ["</s>", "<|endoftext|>", "<|end_of_text|>"]
                .iter()
                .find_map(|t| tokenizer.token_to_id(t))
        })
}

/// The order samples are visited in: a permutation of `0..n` that depends on
/// `seed` alone (Fisher–Yates driven by splitmix64), the same on every rank
/// and every retry, so a resumed run sees the same order.
pub fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut state = seed;
    for i in (1..n).rev() {
        let j = (crate::seeded::splitmix64(&mut state) % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// Rank `rank` of `ranks`' share of a visiting order: every `ranks`-th entry,
/// starting at `rank`. The shares are disjoint and together cover the order.
pub fn share(order: &[usize], rank: usize, ranks: usize) -> Vec<usize> {
    order
        .iter()
        .copied()
        .skip(rank)
        .step_by(ranks.max(1))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::whitespace::Whitespace;

    fn data() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../samples/data/declaration-of-independence.jsonl")
    }

    /// A word-level tokenizer over the sample text, saved as tokenizer.json
    /// and read back the way a checkpoint's is (offline, from the file).
    fn tokenizer(dir: &Path) -> (Tokenizer, u32) {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let docs = read_documents(
            &data(),
            &Format::Jsonl {
                field: "text".into(),
            },
        )
        .expect("docs");
        let mut vocab: HashMap<String, u32> = HashMap::new();
        for word in ["<unk>", "</s>"] {
            let n = vocab.len() as u32;
            vocab.insert(word.into(), n);
        }
        for doc in &docs {
            let mut split = PreTokenizedString::from(doc.as_str());
            Whitespace {}.pre_tokenize(&mut split).expect("split");
            for (word, _, _) in split.get_splits(OffsetReferential::Original, OffsetType::Byte) {
                let n = vocab.len() as u32;
                vocab.entry(word.to_string()).or_insert(n);
            }
        }
        let eos = vocab["</s>"];
        let model = WordLevel::builder()
            .vocab(vocab.into_iter().collect())
            .unk_token("<unk>".into())
            .build()
            .expect("model");
        let mut tk = Tokenizer::new(model);
        tk.with_pre_tokenizer(Some(Whitespace {}));
        let path = dir.join("tokenizer.json");
        tk.save(&path, false).expect("save");
        (load_tokenizer(&path).expect("load"), eos)
    }

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("headroom-text-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("tmp");
        d
    }

    #[test]
    fn packs_the_stream_of_documents_into_overlapping_samples() {
        let dir = tmp("pack");
        let (tk, eos) = tokenizer(&dir);
        let docs = read_documents(
            &data(),
            &Format::Jsonl {
                field: "text".into(),
            },
        )
        .expect("docs");
        assert_eq!(docs.len(), 8);
        let packed = pack(&tk, &docs, eos, 32).expect("pack");
        // The stream is each document's encoding followed by eos, in order.
        let mut stream = vec![];
        for d in &docs {
            stream.extend(tk.encode(d.as_str(), false).expect("encode").get_ids());
            stream.push(eos);
        }
        assert!(
            !stream.contains(&0),
            "every word is in the vocabulary (no <unk>)"
        );
        assert_eq!(packed.tokens, stream.len());
        assert_eq!(packed.samples.len(), (stream.len() - 1) / 32);
        for (k, s) in packed.samples.iter().enumerate() {
            assert_eq!(s.len(), 33);
            assert_eq!(s[..], stream[k * 32..k * 32 + 33]);
        }
        // Round trip through the tokenizer: the first sample reads as the text.
        let first = tk.decode(&packed.samples[0][..8], true).expect("decode");
        assert!(
            first.starts_with("When in the Course of human events"),
            "{first}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn best_fit_decreasing_places_as_trl_does() {
        // TRL's pack_dataset docstring (seq_length 4): [[1..5], [6, 7],
        // [8, 9, 10], [11]] → [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]], the
        // first example cut to 4 tokens.
        assert_eq!(
            best_fit_decreasing(&[4, 2, 3, 1], 4),
            [vec![0], vec![2, 3], vec![1]]
        );
        // Ties keep the data's order; of two bins with the same space the
        // one that got it first is filled first; the tightest fit wins
        // over an emptier bin; empty examples take no place.
        assert_eq!(
            best_fit_decreasing(&[3, 3, 2, 2, 1, 0, 1], 5),
            [vec![0, 2], vec![1, 3], vec![4, 6]]
        );
        assert_eq!(
            best_fit_decreasing(&[6, 3, 2, 2], 8),
            [vec![0, 2], vec![1, 3]]
        );
    }

    /// An example of `n` distinct ids from `first`, its prompt (the first
    /// `prompt` tokens) not trained.
    fn example(first: u32, n: u32, prompt: usize) -> Tokenized {
        Tokenized {
            ids: (first..first + n).collect(),
            trained: (0..n as usize).map(|i| i >= prompt).collect(),
        }
    }

    #[test]
    fn documents_are_packed_whole_padded_and_masked_at_their_edges() {
        let pad = 999;
        // Sequence length 7: samples of 8 tokens.
        let examples = [
            example(100, 11, 0), // longer than a sample: its first 8 tokens
            example(200, 5, 2),
            example(300, 3, 0),
            example(400, 2, 0),
            example(500, 8, 0), // exactly one sample
            example(600, 1, 0),
        ];
        let packed = pack_documents(&examples, pad, 7).expect("packed");
        assert_eq!(packed.longer_than_sample, 1);
        assert_eq!(packed.documents, 6);
        assert_eq!(packed.tokens, 30);
        // By length: 100 (8), 500 (8), 200 (5), 300 (3), 400 (2), 600 (1):
        // 300 fills 200's bin; 400 and 600 open and share a third.
        let starts: Vec<Vec<u32>> = packed
            .samples
            .iter()
            .map(|s| {
                s.iter()
                    .filter(|&&t| t != pad && t % 100 == 0)
                    .copied()
                    .collect()
            })
            .collect();
        assert_eq!(
            starts,
            [vec![100], vec![500], vec![200, 300], vec![400, 600]]
        );
        // Every token of every example (truncated to a sample) appears once.
        let mut all: Vec<u32> = packed
            .samples
            .concat()
            .into_iter()
            .filter(|&t| t != pad)
            .collect();
        all.sort_unstable();
        let mut want: Vec<u32> = examples
            .iter()
            .flat_map(|e| e.ids.iter().take(8).copied())
            .collect();
        want.sort_unstable();
        assert_eq!(all, want);
        assert_eq!(packed.samples[3], [400, 401, 600, pad, pad, pad, pad, pad]);
        let segments = packed.segments.as_ref().expect("segments");
        assert_eq!(segments[2], [0, 0, 0, 0, 0, 1, 1, 1]);
        assert_eq!(segments[3], [0, 0, 1, 2, 2, 2, 2, 2]);
        let trained = packed.trained.as_ref().expect("padding is masked");
        // 200's prompt (2 tokens: the target of 201 only) and 300's first
        // token (only 204 could predict it) are not trained.
        assert_eq!(trained[2], [false, true, true, true, false, true, true]);
        // 600 is a document of its own: its one token is no target; padding never is.
        assert_eq!(trained[3], [true, false, false, false, false, false, false]);
        assert_eq!(trained[0], [true; 7]);
        assert_eq!(packed.targets, 4 * 7);
        assert_eq!(packed.masked_targets, 2 + 6);
        // The stream packing is the one it always was.
        assert_eq!(
            pack_examples(&examples, Packing::Stream, pad, 7).expect("stream"),
            pack_tokenized(&examples, 7).expect("stream")
        );
        assert!(pack_documents(&[], pad, 7).is_err());
    }

    #[test]
    fn shuffling_depends_on_the_seed_only_and_shares_cover_every_sample_once() {
        let a = shuffled(100, 7);
        assert_eq!(a, shuffled(100, 7));
        assert_ne!(a, shuffled(100, 8));
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        let shares: Vec<Vec<usize>> = (0..3).map(|r| share(&a, r, 3)).collect();
        let mut all: Vec<usize> = shares.concat();
        all.sort_unstable();
        assert_eq!(all, (0..100).collect::<Vec<_>>());
        assert_eq!(
            shares.iter().map(Vec::len).collect::<Vec<_>>(),
            [34, 33, 33]
        );
    }

    #[test]
    fn bad_data_says_where_and_what_would_work() {
        let dir = tmp("bad");
        let path = dir.join("d.jsonl");
        std::fs::write(
            &path,
            "{\"text\": \"fine\"}\n{\"body\": \"x\", \"id\": 1}\n",
        )
        .expect("write");
        let e = read_documents(
            &path,
            &Format::Jsonl {
                field: "text".into(),
            },
        )
        .expect_err("line 2 has no text");
        let said = e.to_string();
        assert!(
            said.contains("d.jsonl:2") && said.contains("no field `text`") && said.contains("body"),
            "{said}"
        );
        let (tk, eos) = tokenizer(&dir);
        let e = pack(&tk, &["Liberty".into()], eos, 32).expect_err("two tokens");
        assert!(
            e.to_string().contains("too few for one sample of 33"),
            "{e}"
        );
        let e = load_tokenizer(&dir.join("missing.json")).expect_err("no file");
        assert!(e.to_string().contains("missing.json"), "{e}");
        let plain = dir.join("p.txt");
        std::fs::write(&plain, "All men are created equal.").expect("write");
        assert_eq!(
            read_documents(&plain, &Format::PlainText).expect("plain"),
            ["All men are created equal."]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
