//! Conversations and prompt/completion rows against transformers and TRL.
//!
//! `tests/fixtures/chat/expected.json` holds, for the public Llama 3,
//! Qwen3, Gemma 3 and Phi-3 chat templates and for plain prompt/completion
//! rows, the token ids and labels TRL's `SFTTrainer` prepares (its
//! defaults, `assistant_only_loss`, `completion_only_loss: false`), and
//! `masked_loss.json` a loss transformers' Llama computes with masked
//! labels (`generate.py`, run once; versions in the README). The worker
//! must give the same ids and the same masks, and the same loss.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::{Device, Int, Tensor, TensorData};
use headroom_api::{Packing, TrainOn};
use headroom_worker::chat::Template;
use headroom_worker::data::IGNORED_TARGET;
use headroom_worker::initialize::inspect::inspect_data;
use headroom_worker::model::hf::HfCheckpoint;
use headroom_worker::model::{LmShape, StageLayout, TransformerLm};
use headroom_worker::text::{
    Format, Located, Tokenization, example_of, load_packed, load_tokenizer, read_documents,
    read_examples,
};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/chat")
        .join(name)
}

fn json(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name)).expect("fixture");
    serde_json::from_str(&text).expect("JSON")
}

#[test]
fn token_ids_and_labels_equal_trl() {
    let tokenizer = load_tokenizer(&fixture("tokenizer.json")).expect("tokenizer");
    let cases = json("expected.json");
    let cases = cases.as_array().expect("a list of cases");
    let mut masked_kinds = 0;
    for (n, case) in cases.iter().enumerate() {
        let s = |k: &str| case[k].as_str().map(str::to_owned);
        let template = s("template").map(|name| {
            let source = std::fs::read_to_string(fixture(&format!("templates/{name}.jinja")))
                .expect("template");
            Template::new(
                source,
                s("bos").unwrap_or_default(),
                s("eos").unwrap_or_default(),
            )
            .expect("template parses")
        });
        let eos = tokenizer
            .token_to_id(&s("eos").expect("eos"))
            .expect("eos in the vocabulary");
        let train_on: TrainOn = serde_json::from_value(case["train_on"].clone()).expect("trainOn");
        // The row as a JSONL line (keys in the order Python wrote them).
        let row = s("row").expect("row");
        let located = Located {
            example: example_of(&row, "text").expect("a valid row"),
            path: Arc::from(Path::new("expected.json")),
            row: n + 1,
        };
        let how = Tokenization {
            tokenizer: &tokenizer,
            template: template.as_ref(),
            eos,
            train_on,
            model_dir: Path::new("fixture"),
        };
        let got = how
            .tokenize(&located)
            .unwrap_or_else(|e| panic!("case {n} ({:?} {train_on:?}): {e}", s("template")));
        let want_ids: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).expect("ids");
        let want_labels: Vec<i64> = serde_json::from_value(case["labels"].clone()).expect("labels");
        let what = format!("case {n}: {:?} {train_on:?} {}", s("template"), case["row"]);
        assert_eq!(got.ids, want_ids, "{what}: token ids");
        let labels: Vec<i64> = got
            .ids
            .iter()
            .zip(&got.trained)
            .map(|(&id, &on)| if on { i64::from(id) } else { IGNORED_TARGET })
            .collect();
        assert_eq!(labels, want_labels, "{what}: labels");
        masked_kinds += usize::from(labels.contains(&IGNORED_TARGET));
    }
    // The fixture exercises masks, not only whole sequences.
    assert!(
        cases.len() >= 30 && masked_kinds >= 10,
        "{} cases, {masked_kinds} masked",
        cases.len()
    );
}

/// Largest difference from transformers' loss measured here: printed with
/// `--nocapture`; the bound leaves room for another CPU.
const LOSS_TOLERANCE: f64 = 1e-5;

#[test]
fn a_masked_loss_equals_transformers() {
    let expected = json("masked_loss.json");
    let ids: Vec<Vec<i64>> = serde_json::from_value(expected["input_ids"].clone()).expect("ids");
    let labels: Vec<Vec<i64>> = serde_json::from_value(expected["labels"].clone()).expect("labels");
    let want = expected["loss"].as_f64().expect("loss");
    let (batch, seq) = (ids.len(), ids[0].len() - 1);
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/tiny-llama");
    let checkpoint = HfCheckpoint::open(&dir, seq as u32).expect("checkpoint");
    let shape = LmShape::Llama(checkpoint.shape.clone());
    let layout = StageLayout::whole(&shape);
    let device = Device::flex();
    let mut model = TransformerLm::new(&shape, &layout, 0, &device);
    checkpoint.load_stage(&mut model, &layout).expect("weights");
    // transformers shifts the labels: position t predicts label t + 1.
    let tokens: Vec<i64> = ids.iter().flat_map(|r| r[..seq].to_vec()).collect();
    let targets: Vec<i64> = labels.iter().flat_map(|r| r[1..].to_vec()).collect();
    let unmasked: Vec<i64> = ids.iter().flat_map(|r| r[1..].to_vec()).collect();
    let tensor =
        |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [batch, seq]), &device);
    let loss = |targets: Vec<i64>| -> f64 {
        let l = model.loss(tensor(tokens.clone()), tensor(targets));
        f64::from(l.into_data().iter::<f32>().next().expect("a value"))
    };
    let got = loss(targets);
    eprintln!(
        "masked loss {got:.7} vs transformers {want:.7}: |diff| {:.2e}",
        (got - want).abs()
    );
    assert!(
        (got - want).abs() <= LOSS_TOLERANCE,
        "masked loss {got} vs transformers {want}"
    );
    let whole = loss(unmasked);
    assert!(
        (whole - want).abs() > 100.0 * LOSS_TOLERANCE,
        "the masks change the loss ({whole} unmasked)"
    );
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("headroom-chat-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("tmp");
    d
}

/// A checkpoint directory with the fixture tokenizer, `</s>` as its end
/// of sequence and, where given, a chat template.
fn model_dir(name: &str, template: Option<&str>) -> PathBuf {
    let dir = tmp(name);
    std::fs::copy(fixture("tokenizer.json"), dir.join("tokenizer.json")).expect("tokenizer");
    std::fs::write(dir.join("config.json"), r#"{"eos_token_id": 2}"#).expect("config");
    if let Some(t) = template {
        let source = std::fs::read_to_string(fixture(&format!("templates/{t}.jinja"))).expect("t");
        let config = serde_json::json!({"eos_token": "<|im_end|>", "chat_template": source});
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("write");
    }
    dir
}

#[test]
fn parquet_rows_train_as_their_jsonl_lines() {
    let dir = model_dir("parquet", Some("qwen3"));
    let parquet = Format::Parquet {
        field: "text".into(),
    };
    let jsonl = Format::Jsonl {
        field: "text".into(),
    };
    let rows = read_examples(&fixture("conversations.parquet"), &parquet).expect("parquet");
    assert_eq!(rows.len(), 4, "two row groups of two");
    assert_eq!(rows[3].row, 4);
    let packed = |data: &str, format: &Format| {
        load_packed(
            &dir,
            &fixture(data),
            format,
            TrainOn::Assistant,
            Packing::Stream,
            16,
        )
        .expect("packed")
    };
    let (a, b) = (
        packed("conversations.parquet", &parquet),
        packed("conversations.jsonl", &jsonl),
    );
    assert_eq!(a, b, "the same samples and masks");
    assert!(
        a.masked_targets > 0 && a.masked_targets < a.targets,
        "{a:?}"
    );
    assert_eq!(a.documents, 4);
    assert!(
        a.longer_than_sample >= 2,
        "conversations longer than 17 tokens"
    );
    let all = load_packed(
        &dir,
        &fixture("conversations.jsonl"),
        &jsonl,
        TrainOn::Auto,
        Packing::Stream,
        16,
    )
    .expect("packed");
    assert_eq!(
        (all.samples, all.masked_targets),
        (a.samples, 0),
        "auto trains every token of a conversation"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn several_files_read_as_one_in_name_order() {
    let dir = tmp("glob");
    std::fs::write(dir.join("b.jsonl"), "{\"text\": \"second\"}\n").expect("write");
    std::fs::write(
        dir.join("a.jsonl"),
        "{\"text\": \"first\"}\n{\"text\": \"also first\"}\n",
    )
    .expect("write");
    std::fs::write(dir.join("notes.txt"), "not data").expect("write");
    let format = Format::Jsonl {
        field: "text".into(),
    };
    let docs = read_documents(&dir.join("*.jsonl"), &format).expect("glob");
    assert_eq!(docs, ["first", "also first", "second"]);
    let e = read_examples(&dir.join("train-*.parquet"), &format).expect_err("no match");
    assert!(e.to_string().contains("no file matches"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn rows_that_break_the_format_name_the_file_the_row_and_the_field() {
    let dir = tmp("bad");
    let format = Format::Jsonl {
        field: "text".into(),
    };
    let cases = [
        (
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n{\"messages\": [{\"content\": \"hi\"}]}\n",
            "d.jsonl:2: `messages[0]` has no `role`",
        ),
        (
            "{\"messages\": [{\"role\": \"user\", \"content\": 3}]}\n",
            "d.jsonl:1: `messages[0].content` is a number",
        ),
        (
            "{\"prompt\": \"a\", \"completion\": [{\"role\": \"assistant\", \"content\": \"b\"}]}\n",
            "d.jsonl:1: `prompt` and `completion` must both be strings or both be message lists",
        ),
        (
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n{\"text\": \"plain\"}\n",
            "d.jsonl:2: this row is plain text, but",
        ),
        (
            "{\"body\": \"x\"}\n",
            "d.jsonl:1: no field `text`, `messages` or `prompt` and `completion` (this row has: body)",
        ),
        (
            "{\"messages\": [], \"x\": 1}\n",
            "d.jsonl:1: `messages` is empty",
        ),
    ];
    for (text, said) in cases {
        std::fs::write(dir.join("d.jsonl"), text).expect("write");
        let e = read_examples(&dir.join("d.jsonl"), &format).expect_err(said);
        assert!(e.to_string().contains(said), "{e} (expected {said})");
    }
    std::fs::copy(fixture("conversations.parquet"), dir.join("p.jsonl")).expect("copy");
    let e = read_examples(&dir.join("p.jsonl"), &format).expect_err("Parquet as JSONL");
    assert!(e.to_string().contains("set data.format: parquet"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_conversation_needs_a_template_and_train_on_must_fit_the_data() {
    let bare = model_dir("bare", None);
    let jsonl = Format::Jsonl {
        field: "text".into(),
    };
    let e = load_packed(
        &bare,
        &fixture("conversations.jsonl"),
        &jsonl,
        TrainOn::Auto,
        Packing::Stream,
        8,
    )
    .expect_err("no template");
    assert!(
        e.contains("conversations.jsonl:1")
            && e.contains(&bare.display().to_string())
            && e.contains("no chat template"),
        "{e}"
    );
    let dir = model_dir("fit", Some("qwen3"));
    let e = load_packed(
        &dir,
        &fixture("conversations.jsonl"),
        &jsonl,
        TrainOn::Completion,
        Packing::Stream,
        8,
    )
    .expect_err("no completion in a conversation");
    assert!(
        e.contains("data.trainOn: completion needs prompt/completion rows"),
        "{e}"
    );
    let plain = dir.join("plain.jsonl");
    std::fs::write(&plain, "{\"text\": \"All men are created equal.\"}\n").expect("write");
    let e = load_packed(&dir, &plain, &jsonl, TrainOn::Assistant, Packing::Stream, 4)
        .expect_err("plain text");
    assert!(
        e.contains("plain.jsonl:1: data.trainOn: \"assistant\" needs conversations"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&bare);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_initializer_reports_the_masked_share_and_the_long_examples() {
    let dir = model_dir("facts", Some("qwen3"));
    let jsonl = headroom_api::DataFormat::Jsonl {
        field: "text".into(),
    };
    let data = fixture("conversations.jsonl");
    let facts = |train_on| inspect_data(&dir, &data, &jsonl, train_on, Packing::Stream, 16, 600);
    let all = facts(TrainOn::Auto).expect("facts");
    let assistant = facts(TrainOn::Assistant).expect("facts");
    assert_eq!((all.documents, all.samples), (4, assistant.samples));
    assert_eq!(all.masked_per_mille, 0);
    let packed = load_packed(
        &dir,
        &data,
        &Format::Jsonl {
            field: "text".into(),
        },
        TrainOn::Assistant,
        Packing::Stream,
        16,
    )
    .expect("packed");
    let share = (packed.masked_targets * 1000 + packed.targets / 2) / packed.targets;
    assert_eq!(u64::from(assistant.masked_per_mille), share);
    assert!(
        (500..1000).contains(&assistant.masked_per_mille),
        "system and user turns are most of these conversations: {assistant:?}"
    );
    assert_eq!(assistant.longer_than_sample, packed.longer_than_sample);
    assert!(assistant.longer_than_sample > 0);
    // A vocabulary the tokenizer exceeds is still caught.
    let e = inspect_data(&dir, &data, &jsonl, TrainOn::Auto, Packing::Stream, 16, 100)
        .expect_err("vocabulary");
    assert!(
        e.to_string()
            .contains("beyond config.json's vocab_size 100"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Phi-4-mini ends each turn with `<|end|>` and the conversation with
/// eos: an assistant turn's tokens end with its `<|end|>` (and the last
/// with the eos), never with the next turn's `<|user|>`.
#[test]
fn assistant_tokens_end_at_the_end_of_their_turn() {
    let tokenizer = load_tokenizer(&fixture("tokenizer.json")).expect("tokenizer");
    let source = std::fs::read_to_string(fixture("templates/phi4mini.jinja")).expect("template");
    let template =
        Template::new(source, "<|endoftext|>".into(), "<|endoftext|>".into()).expect("template");
    let row = r#"{"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}, {"role": "assistant", "content": "Rome."}]}"#;
    let located = Located {
        example: example_of(row, "text").expect("row"),
        path: Arc::from(Path::new("row")),
        row: 1,
    };
    let how = Tokenization {
        tokenizer: &tokenizer,
        template: Some(&template),
        eos: tokenizer.token_to_id("<|endoftext|>").expect("eos"),
        train_on: TrainOn::Assistant,
        model_dir: Path::new("fixture"),
    };
    let got = how.tokenize(&located).expect("tokenize");
    let runs: Vec<String> = got
        .ids
        .iter()
        .zip(&got.trained)
        .collect::<Vec<_>>()
        .chunk_by(|a, b| a.1 == b.1)
        .filter(|run| *run[0].1)
        .map(|run| {
            let ids: Vec<u32> = run.iter().map(|(id, _)| **id).collect();
            tokenizer.decode(&ids, false).expect("decode")
        })
        .collect();
    assert_eq!(runs, ["Paris.<|end|>", "Rome.<|end|><|endoftext|>"]);
}

/// A Parquet row reaches the template with its fields in the schema's
/// order (as pyarrow gives Python dicts), not sorted: `role` before
/// `content`, as in the JSONL the Parquet file was written from.
#[test]
fn parquet_messages_keep_the_schema_order_of_their_fields() {
    let text = Format::Parquet {
        field: "text".into(),
    };
    let jsonl = Format::Jsonl {
        field: "text".into(),
    };
    let keys = |rows: &[Located]| -> Vec<Vec<String>> {
        rows.iter()
            .flat_map(|r| match &r.example {
                headroom_worker::text::Example::Chat { messages, .. } => messages
                    .iter()
                    .map(|m| {
                        m.try_iter()
                            .expect("a map")
                            .map(|k| k.to_string())
                            .filter(|k| k == "role" || k == "content")
                            .collect()
                    })
                    .collect::<Vec<Vec<String>>>(),
                other => panic!("a conversation, not {other:?}"),
            })
            .collect()
    };
    let from_parquet =
        keys(&read_examples(&fixture("conversations.parquet"), &text).expect("parquet"));
    let from_jsonl = keys(&read_examples(&fixture("conversations.jsonl"), &jsonl).expect("jsonl"));
    assert_eq!(from_parquet, from_jsonl);
    assert_eq!(from_parquet[0], ["role", "content"]);
}

/// Every codec pyarrow writes is read: snappy (its default), gzip, lz4,
/// zstd and brotli give the same rows.
#[test]
fn parquet_files_in_every_codec_pyarrow_writes_are_read() {
    use parquet::basic::{BrotliLevel, Compression, GzipLevel, ZstdLevel};
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;

    let dir = std::env::temp_dir().join(format!("headroom-codecs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let documents = [
        "We hold these truths",
        "to be self-evident,",
        "that all men",
    ];
    let schema = Arc::new(
        parquet::schema::parser::parse_message_type(
            "message schema { REQUIRED BYTE_ARRAY text (UTF8); }",
        )
        .expect("schema"),
    );
    let format = Format::Parquet {
        field: "text".into(),
    };
    for codec in [
        Compression::SNAPPY,
        Compression::GZIP(GzipLevel::default()),
        Compression::LZ4_RAW,
        Compression::ZSTD(ZstdLevel::default()),
        Compression::BROTLI(BrotliLevel::default()),
    ] {
        let path = dir.join(format!("{codec:?}.parquet").replace(['(', ')', ' '], ""));
        let props = Arc::new(WriterProperties::builder().set_compression(codec).build());
        let file = std::fs::File::create(&path).expect("create");
        let mut writer = SerializedFileWriter::new(file, schema.clone(), props).expect("writer");
        let mut group = writer.next_row_group().expect("row group");
        let mut column = group.next_column().expect("column").expect("one column");
        let values: Vec<ByteArray> = documents.iter().map(|d| ByteArray::from(*d)).collect();
        column
            .typed::<ByteArrayType>()
            .write_batch(&values, None, None)
            .expect("write");
        column.close().expect("close column");
        group.close().expect("close row group");
        writer.close().expect("close file");
        let read = read_documents(&path, &format).unwrap_or_else(|e| panic!("{codec:?}: {e}"));
        assert_eq!(read, documents, "{codec:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Plain text is tokenized as TRL's `SFTTrainer` tokenizes it: with the
/// tokenizer's special tokens (tiny-llama's post-processor puts BOS first)
/// and the end-of-sequence token after each document.
#[test]
fn plain_text_rows_get_the_tokenizers_special_tokens_and_the_eos() {
    let dir = model_dir("plain", None);
    let data = dir.join("plain.jsonl");
    let documents = ["We hold these truths", "to be self-evident"];
    let rows: Vec<String> = documents
        .iter()
        .map(|d| serde_json::json!({ "text": d }).to_string())
        .collect();
    std::fs::write(&data, rows.join("\n")).expect("data");
    let tokenizer = load_tokenizer(&dir.join("tokenizer.json")).expect("tokenizer");
    let bos = tokenizer.token_to_id("<s>").expect("<s>");
    let mut expected = Vec::new();
    for d in documents {
        let ids = tokenizer.encode(d, true).expect("encode");
        assert_eq!(ids.get_ids()[0], bos, "the post-processor adds BOS");
        expected.extend_from_slice(ids.get_ids());
        expected.push(2);
    }
    let jsonl = Format::Jsonl {
        field: "text".into(),
    };
    let packed = load_packed(
        &dir,
        &data,
        &jsonl,
        TrainOn::All,
        Packing::Stream,
        expected.len() - 1,
    )
    .expect("packed");
    assert_eq!(packed.samples, vec![expected]);
}
