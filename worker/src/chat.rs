//! A checkpoint's chat template, rendered as transformers'
//! `apply_chat_template` renders it: the Jinja template of
//! `tokenizer_config.json`'s `chat_template` (or `chat_template.jinja`
//! beside it) with `messages`, `bos_token`, `eos_token`,
//! `add_generation_prompt` and the row's other fields (`tools`, …) in the
//! context, Python's string methods (`.strip()`, `.startswith()`, …) and
//! `raise_exception`, with Jinja's `trim_blocks` and `lstrip_blocks` as
//! transformers sets them.
//!
//! Which characters of a rendered conversation are the assistant's
//! ([`Template::assistant_spans`]): most templates lack transformers'
//! `{% generation %}` markers (TRL's `assistant_only_loss` then refuses
//! them), so each assistant turn is found by rendering: it starts where
//! the conversation before it, rendered with the generation prompt, ends,
//! and runs through its content and the end of turn the template writes
//! after that content (`<|im_end|>\n`, `<|eot_id|>`, `<end_of_turn>\n`),
//! which the model must learn to stop on — what TRL's generation-tagged
//! training templates cover.

use std::path::Path;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;

/// A chat template ready to render.
pub struct Template {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for Template {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Template(..)")
    }
}

/// A special token as `tokenizer_config.json` writes it: a string, or an
/// `AddedToken` object with its `content`.
fn token_string(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

/// The template's source: `chat_template.jinja`, else `tokenizer_config.json`'s
/// `chat_template` (a string, or a list of named templates of which
/// `default` is the one transformers uses without a name).
fn template_source(model_dir: &Path, config: &Json) -> Option<String> {
    if let Ok(s) = std::fs::read_to_string(model_dir.join("chat_template.jinja")) {
        return Some(s);
    }
    match config.get("chat_template")? {
        Json::String(s) => Some(s.clone()),
        Json::Array(named) => named.iter().find_map(|t| {
            (t.get("name").and_then(Json::as_str) == Some("default"))
                .then(|| t.get("template").and_then(Json::as_str).map(str::to_owned))
                .flatten()
        }),
        _ => None,
    }
}

impl Template {
    /// The checkpoint's template; `Ok(None)` when it has none.
    pub fn load(model_dir: &Path) -> Result<Option<Template>, String> {
        let config_path = model_dir.join("tokenizer_config.json");
        let config: Json = match std::fs::read_to_string(&config_path) {
            Ok(s) => serde_json::from_str(&s)
                .map_err(|e| format!("{}: not JSON: {e}", config_path.display()))?,
            Err(_) => Json::Null,
        };
        let Some(source) = template_source(model_dir, &config) else {
            return Ok(None);
        };
        let special = |key: &str| config.get(key).and_then(token_string).unwrap_or_default();
        Template::new(source, special("bos_token"), special("eos_token"))
            .map(Some)
            .map_err(|e| format!("{}: chat template: {e}", model_dir.display()))
    }

    /// A template from its Jinja source and the tokenizer's special tokens.
    pub fn new(source: String, bos_token: String, eos_token: String) -> Result<Template, Error> {
        let mut env = Environment::new();
        // transformers renders with trim_blocks and lstrip_blocks on.
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        // transformers' tojson is Python's json.dumps (no HTML escapes,
        // `, ` and `: ` separators, keys in the order written).
        env.add_filter("tojson", python_json);
        env.add_template_owned("chat", source)?;
        Ok(Template {
            env,
            bos_token,
            eos_token,
        })
    }

    /// `messages` rendered with the row's other fields (`extra`) in the context.
    pub fn render(
        &self,
        messages: &[Value],
        extra: &[(String, Value)],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let context = Value::from_pairs(extra.iter().cloned().chain([
            ("messages".to_owned(), Value::from(messages.to_vec())),
            ("bos_token".to_owned(), Value::from(self.bos_token.clone())),
            ("eos_token".to_owned(), Value::from(self.eos_token.clone())),
            (
                "add_generation_prompt".to_owned(),
                Value::from(add_generation_prompt),
            ),
        ]));
        let template = self.env.get_template("chat").map_err(|e| e.to_string())?;
        template.render(context).map_err(|e| match e.kind() {
            ErrorKind::InvalidOperation => format!("the chat template refused it: {e}"),
            _ => format!("the chat template failed: {e:#}"),
        })
    }

    /// The byte ranges of `rendered` (the whole conversation, rendered
    /// without the generation prompt) that each assistant turn of
    /// `messages` occupies: from the end of the conversation before it
    /// (rendered with the generation prompt) through its content and the
    /// end of turn after it (what follows the content both when the turn
    /// ends the conversation and where it stands: a span may end inside
    /// the next turn's first token, which the tokenization then leaves
    /// out). An error names the turn the template does not render that way.
    pub fn assistant_spans(
        &self,
        messages: &[Value],
        extra: &[(String, Value)],
        rendered: &str,
    ) -> Result<Vec<std::ops::Range<usize>>, String> {
        let mut spans = Vec::new();
        let mut cursor = 0;
        for (i, message) in messages.iter().enumerate() {
            if attr(message, "role").as_str() != Some("assistant") {
                continue;
            }
            let prompt = self.render(&messages[..i], extra, true)?;
            if !rendered.starts_with(&prompt) || prompt.len() < cursor {
                return Err(format!(
                    "messages[{i}]: the chat template renders the conversation before this assistant turn differently when it goes on; train on all tokens (data.trainOn: all)"
                ));
            }
            let alone = self.render(&messages[..=i], extra, false)?;
            let content = attr(message, "content");
            let content = content.as_str().unwrap_or("");
            // The template may trim the content (Llama 3, Gemma 3 do).
            let (found, content) = [content, content.trim()]
                .into_iter()
                .find_map(|c| alone.rfind(c).map(|at| (at, c)))
                .ok_or_else(|| {
                    format!("messages[{i}]: the chat template does not render this assistant turn's content as written; train on all tokens (data.trainOn: all)")
                })?;
            let start = prompt.len();
            let at = rendered[start..]
                .find(content)
                .map(|k| start + k)
                .ok_or_else(|| {
                    format!("messages[{i}]: the chat template renders this assistant turn differently when the conversation goes on; train on all tokens (data.trainOn: all)")
                })?;
            // The end of turn: what follows the content both when the turn
            // ends the conversation and here (a template may end the whole
            // conversation with eos, as Phi-4-mini's does).
            let end_of_turn = common_prefix_len(
                &alone[found + content.len()..],
                &rendered[at + content.len()..],
            );
            let end = at + content.len() + end_of_turn;
            spans.push(start..end);
            cursor = end;
        }
        Ok(spans)
    }
}

/// Bytes at the start of `a` and `b` that are the same characters.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.chars()
        .zip(b.chars())
        .take_while(|(x, y)| x == y)
        .map(|(x, _)| x.len_utf8())
        .sum()
}

/// `value[key]`, undefined where it has none.
pub fn attr(value: &Value, key: &str) -> Value {
    value.get_attr(key).unwrap_or_default()
}

/// A JSON text as a template value whose objects keep their keys in the
/// order written (as Python's `json.loads` keeps them), so `tojson` writes
/// a tool's schema as transformers does.
pub fn ordered_json(text: &str) -> Result<Value, serde_json::Error> {
    serde_json::from_str::<Ordered>(text).map(|o| o.0)
}

struct Ordered(Value);

impl<'de> serde::Deserialize<'de> for Ordered {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(OrderedVisitor).map(Ordered)
    }
}

struct OrderedVisitor;

impl<'de> serde::de::Visitor<'de> for OrderedVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::from(()))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Ordered(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::from(items))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut pairs = Vec::new();
        while let Some((k, Ordered(v))) = map.next_entry::<String, Ordered>()? {
            pairs.push((k, v));
        }
        Ok(Value::from_pairs(pairs))
    }
}

/// Jinja's `tojson` as transformers defines it: `json.dumps(value,
/// ensure_ascii=False, indent=indent)`.
fn python_json(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(i) if i.is_none() => None,
        Some(i) => Some(usize::try_from(i)?),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, indent, 0)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    out: &mut String,
    v: &Value,
    indent: Option<usize>,
    depth: usize,
) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    // Python writes `, ` between items unless it indents (then `,`).
    let comma = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&python_number(v)),
        ValueKind::String => write_string(out, v.as_str().unwrap_or_default()),
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(comma);
                }
                newline(out, depth + 1);
                write_string(out, &k.to_string());
                out.push_str(": ");
                write_json(out, &v.get_item(k)?, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(comma);
                }
                newline(out, depth + 1);
                write_json(out, item, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
    }
    Ok(())
}

/// A number as Python's `repr`: integers as they are, floats with a
/// fractional part or an exponent (`21.0`, `1e-05`).
fn python_number(v: &Value) -> String {
    if let Some(i) = v.as_i64()
        && !v.to_string().contains(['.', 'e', 'E', 'i', 'N'])
    {
        return i.to_string();
    }
    let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        // Python: 1e-05, 1.5e+16.
        let s = format!("{f:e}");
        let (mantissa, exponent) = s.split_once('e').unwrap_or((&s, "0"));
        let e: i32 = exponent.parse().unwrap_or(0);
        return format!("{mantissa}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs());
    }
    let s = format!("{f}");
    if s.contains('.') { s } else { format!("{s}.0") }
}

/// A JSON string as Python's `json.dumps(ensure_ascii=False)` writes it.
fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fixture(name: &str) -> String {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/chat/templates")
            .join(format!("{name}.jinja"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    fn conversation() -> Vec<Value> {
        messages(json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And Italy?"},
            {"role": "assistant", "content": " Rome. "}
        ]))
    }

    fn messages(v: Json) -> Vec<Value> {
        let v = ordered_json(&v.to_string()).expect("JSON");
        v.try_iter().expect("a list").collect()
    }

    #[test]
    fn assistant_spans_cover_each_reply_and_its_end_of_turn() {
        let t = Template::new(fixture("qwen3"), String::new(), "<|im_end|>".into()).expect("qwen3");
        let messages = conversation();
        let text = t.render(&messages, &[], false).expect("render");
        let spans = t.assistant_spans(&messages, &[], &text).expect("spans");
        let parts: Vec<&str> = spans.iter().map(|r| &text[r.clone()]).collect();
        // Qwen3 writes an empty thinking block into the last reply only.
        assert_eq!(
            parts,
            [
                "Paris.<|im_end|>\n",
                "<think>\n\n</think>\n\n Rome. <|im_end|>\n"
            ]
        );
        let t = Template::new(fixture("llama3"), "<|begin_of_text|>".into(), String::new())
            .expect("llama3");
        let text = t.render(&messages, &[], false).expect("render");
        assert!(
            text.starts_with("<|begin_of_text|><|start_header_id|>system"),
            "{text}"
        );
        let spans = t.assistant_spans(&messages, &[], &text).expect("spans");
        let parts: Vec<&str> = spans.iter().map(|r| &text[r.clone()]).collect();
        assert_eq!(parts, ["Paris.<|eot_id|>", "Rome.<|eot_id|>"]);
        // Phi-4-mini ends the conversation with eos, not each turn.
        let t = Template::new(
            fixture("phi4mini"),
            "<|endoftext|>".into(),
            "<|endoftext|>".into(),
        )
        .expect("phi4mini");
        let text = t.render(&messages, &[], false).expect("render");
        let spans = t.assistant_spans(&messages, &[], &text).expect("spans");
        let parts: Vec<&str> = spans.iter().map(|r| &text[r.clone()]).collect();
        // The first reply's span ends inside the next turn's `<|user|>`:
        // the tokenizer's offsets leave that token out (tests/chat_reference.rs).
        assert_eq!(parts, ["Paris.<|end|><|", " Rome. <|end|><|endoftext|>"]);
    }

    #[test]
    fn a_template_that_refuses_a_conversation_says_why() {
        let t = Template::new(fixture("gemma3"), "<bos>".into(), "<eos>".into()).expect("gemma3");
        let messages = messages(json!([
            {"role": "user", "content": "a"}, {"role": "user", "content": "b"}
        ]));
        let e = t
            .render(&messages, &[], false)
            .expect_err("roles must alternate");
        assert!(e.contains("must alternate"), "{e}");
    }

    #[test]
    fn tojson_writes_as_python_json_dumps() {
        let t = Template::new(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}".into(),
            String::new(),
            String::new(),
        )
        .expect("template");
        let x = ordered_json(r#"{"z": 1, "a": [true, null, 2.5, 1e-5, "<\"é\n>"], "m": {}}"#)
            .expect("JSON");
        let out = t
            .env
            .get_template("chat")
            .expect("t")
            .render(Value::from_pairs([("x", x)]))
            .expect("render");
        assert_eq!(
            out,
            "{\"z\": 1, \"a\": [true, null, 2.5, 1e-05, \"<\\\"é\\n>\"], \"m\": {}}|{\n  \"z\": 1,\n  \"a\": [\n    true,\n    null,\n    2.5,\n    1e-05,\n    \"<\\\"é\\n>\"\n  ],\n  \"m\": {}\n}"
        );
    }
}
