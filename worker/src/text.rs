//! Training text, from files to samples: documents from JSONL (one JSON object
//! a line, the text under a field, `text` by default) or plain text (one
//! document a file), tokenized with the checkpoint's own tokenizer (Hugging
//! Face `tokenizers`, read offline from `tokenizer.json`), joined with the
//! end-of-sequence token into one stream, packed into samples of
//! `sequence_length + 1` tokens (the inputs and, shifted by one, the targets;
//! consecutive samples share one token), shuffled by the job's seed, and shared
//! out over ranks so that every sample goes to exactly one rank.
//!
//! [`crate::data::TextSamples`] turns the packed samples into training batches.

use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;

/// How a data file holds its documents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Format {
    /// One JSON object a line; the document is the string under `field`.
    Jsonl { field: String },
    /// The whole file is one document.
    PlainText,
}

impl From<&headroom_api::DataFormat> for Format {
    fn from(format: &headroom_api::DataFormat) -> Self {
        match format {
            headroom_api::DataFormat::Jsonl { field } => Format::Jsonl {
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
    #[error("tokenizer {path}: {problem}")]
    Tokenizer { path: PathBuf, problem: String },
    #[error(
        "the data has {tokens} tokens: too few for one sample of {needed} (sequence length + 1); add text or shorten the sequence"
    )]
    TooShort { tokens: usize, needed: usize },
}

/// The documents of one data file.
pub fn read_documents(path: &Path, format: &Format) -> Result<Vec<String>, TextError> {
    let text = std::fs::read_to_string(path).map_err(|source| TextError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let field = match format {
        Format::PlainText => return Ok(vec![text]),
        Format::Jsonl { field } => field,
    };
    let mut docs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = |problem: String| TextError::Line {
            path: path.to_path_buf(),
            line: i + 1,
            problem,
        };
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| at(format!("not a JSON object: {e}")))?;
        let object = value
            .as_object()
            .ok_or_else(|| at("not a JSON object".into()))?;
        match object.get(field) {
            Some(serde_json::Value::String(s)) => docs.push(s.clone()),
            Some(other) => return Err(at(format!("field `{field}` is not a string: {other}"))),
            None => {
                let keys: Vec<&str> = object.keys().map(String::as_str).collect();
                return Err(at(format!(
                    "no field `{field}` (this line has: {}); set the data's field name",
                    keys.join(", ")
                )));
            }
        }
    }
    Ok(docs)
}

/// Loads a `tokenizer.json` (no network).
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer, TextError> {
    Tokenizer::from_file(path).map_err(|e| TextError::Tokenizer {
        path: path.to_path_buf(),
        problem: e.to_string(),
    })
}

/// What packing produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packed {
    pub documents: usize,
    /// Tokens in the stream (end-of-sequence tokens included).
    pub tokens: usize,
    /// Each `sequence_length + 1` tokens long, in stream order.
    pub samples: Vec<Vec<u32>>,
}

/// Tokenizes every document (no special tokens added by the tokenizer: the
/// stream's only separator is `eos`), appends `eos` after each, and cuts the
/// stream into samples of `sequence_length + 1` tokens with a stride of
/// `sequence_length`. A tail shorter than a sample is dropped.
pub fn pack(
    tokenizer: &Tokenizer,
    documents: &[String],
    eos: u32,
    sequence_length: usize,
) -> Result<Packed, TextError> {
    let mut stream: Vec<u32> = Vec::new();
    for doc in documents {
        let encoding = tokenizer
            .encode(doc.as_str(), false)
            .map_err(|e| TextError::Tokenizer {
                path: PathBuf::from("(loaded)"),
                problem: e.to_string(),
            })?;
        stream.extend_from_slice(encoding.get_ids());
        stream.push(eos);
    }
    let needed = sequence_length + 1;
    if sequence_length == 0 || stream.len() < needed {
        return Err(TextError::TooShort {
            tokens: stream.len(),
            needed,
        });
    }
    let count = (stream.len() - 1) / sequence_length;
    let samples = (0..count)
        .map(|k| stream[k * sequence_length..k * sequence_length + needed].to_vec())
        .collect();
    Ok(Packed {
        documents: documents.len(),
        tokens: stream.len(),
        samples,
    })
}

/// The assignment's text, tokenized with the checkpoint's tokenizer and
/// packed into samples of `sequence_length + 1` tokens; errors name the file.
pub(crate) fn load_text(
    files: &headroom_api::PayloadFiles,
    sequence_length: usize,
) -> Result<Vec<Vec<u32>>, String> {
    let tokenizer_path = Path::new(&files.model_dir).join("tokenizer.json");
    let tokenizer = load_tokenizer(&tokenizer_path).map_err(|e| e.to_string())?;
    let eos = end_of_sequence(Path::new(&files.model_dir), &tokenizer).ok_or_else(|| {
        format!(
            "{}: no end-of-sequence token (config.json eos_token_id, or </s>, <|endoftext|>, <|end_of_text|> in the vocabulary)",
            tokenizer_path.display()
        )
    })?;
    let format = Format::from(&files.data_format);
    let data = Path::new(&files.data_file);
    let docs = read_documents(data, &format).map_err(|e| e.to_string())?;
    let packed = pack(&tokenizer, &docs, eos, sequence_length)
        .map_err(|e| format!("{}: {e}", data.display()))?;
    Ok(packed.samples)
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
