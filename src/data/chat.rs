//! Chat-format SFT data: conversations (`messages: [{role, content}]`) from local JSON / JSON lines /
//! parquet files or Hugging Face dataset files (the Tülu 3 SFT mixture), rendered with the model's
//! Jinja chat template (minijinja), with loss on assistant tokens only, and packed several to a row
//! with per-token document ids and positions that restart at every conversation.
//!
//! Assistant tokens are found by rendering prefixes (the idea behind HF's
//! `return_assistant_tokens_mask`): the characters an assistant turn adds are those between the
//! rendering of the messages before it with the generation prompt and the rendering that ends with
//! it. A template whose renderings are not prefixes of each other is refused.
use crate::data::Tok;
use crate::{Error, IoContext, Result};
use serde::{Deserialize, Serialize};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Label of a position that is not scored (PyTorch's `ignore_index`).
pub const IGNORE: i64 = -100;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

pub type Conversation = Vec<Message>;

/// Where conversations come from: a local file / directory / `dir/train-*.parquet` wildcard, or
/// files of a Hugging Face dataset repository. `field` names the messages column (`messages`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ChatSource {
    Local {
        path: PathBuf,
        #[serde(default = "default_field")]
        field: String,
    },
    Hub {
        hf: HubChat,
    },
    /// Alpaca records (instruction / input / output, JSON array or lines) as one-turn conversations.
    Alpaca {
        alpaca: PathBuf,
    },
}

/// Files of a Hugging Face dataset repository: the text sources' `spec::HubSource` (`repo`,
/// `revision`, `files`, e.g. `[data/train-00000-of-00006.parquet]`), its `field` defaulting to
/// `messages` here.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(transparent)]
pub struct HubChat(pub crate::spec::HubSource);

impl<'de> Deserialize<'de> for HubChat {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let mut v = serde_yaml::Value::deserialize(d)?;
        if let Some(m) = v.as_mapping_mut() {
            m.entry("field".into()).or_insert_with(|| default_field().into());
        }
        serde_yaml::from_value(v).map(HubChat).map_err(serde::de::Error::custom)
    }
}

fn default_field() -> String {
    "messages".into()
}

/// Every conversation of a source, in file order.
pub fn read_conversations(src: &ChatSource) -> Result<Vec<Conversation>> {
    let (files, field) = match src {
        ChatSource::Local { path, field } => (super::sources::list_files(path)?, field),
        ChatSource::Hub { hf: HubChat(hf) } => {
            let files = hf.files.iter().map(|f| crate::hub::dataset_file(&hf.repo, hf.revision.as_deref(), f)).collect::<Result<Vec<_>>>()?;
            (files, &hf.field)
        }
        ChatSource::Alpaca { alpaca } => return Ok(read_alpaca(alpaca)?.into_iter().map(|(ins, inp, out)| alpaca_conversation(&ins, &inp, &out)).collect()),
    };
    let mut out = Vec::new();
    for f in &files {
        out.extend(read_file(f, field)?);
    }
    Ok(out)
}

/// Read Alpaca records from a JSON array or JSON-lines file.
pub fn read_alpaca(path: &Path) -> Result<Vec<(String, String, String)>> {
    let text = std::fs::read_to_string(path).at(path)?;
    let values: Vec<serde_json::Value> = if text.trim_start().starts_with('[') {
        serde_json::from_str(&text)?
    } else {
        text.lines().filter(|l| !l.trim().is_empty()).map(serde_json::from_str).collect::<std::result::Result<_, _>>()?
    };
    let field = |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or("").to_string();
    Ok(values.iter().map(|v| (field(v, "instruction"), field(v, "input"), field(v, "output"))).collect())
}

/// user: the instruction (and the input after a blank line, when there is one); assistant: the output.
pub fn alpaca_conversation(instruction: &str, input: &str, output: &str) -> Conversation {
    let user = if input.is_empty() { instruction.to_string() } else { format!("{instruction}\n\n{input}") };
    vec![Message { role: "user".into(), content: user }, Message { role: "assistant".into(), content: output.into() }]
}

/// One file: a JSON array, JSON lines (optionally .gz / .zst), or parquet.
pub fn read_file(path: &Path, field: &str) -> Result<Vec<Conversation>> {
    let rows: Vec<serde_json::Value> = if path.to_string_lossy().ends_with(".parquet") {
        parquet_rows(path, field)?
    } else {
        let mut text = String::new();
        super::sources::open(path)?.read_to_string(&mut text).at(path)?;
        if text.trim_start().starts_with('[') {
            serde_json::from_str(&text).map_err(|e| Error::Data(format!("{}: {e}", path.display())))?
        } else {
            let mut rows = Vec::new();
            for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
                rows.push(serde_json::from_str(line).map_err(|e| Error::Data(format!("{}:{}: {e}", path.display(), i + 1)))?);
            }
            rows
        }
    };
    rows.iter()
        .enumerate()
        .map(|(i, row)| {
            let msgs = row.get(field).ok_or_else(|| Error::Data(format!("{} row {}: no field `{field}`", path.display(), i + 1)))?;
            serde_json::from_value(msgs.clone()).map_err(|e| Error::Data(format!("{} row {}: `{field}` is not a list of {{role, content}}: {e}", path.display(), i + 1)))
        })
        .collect()
}

/// The `field` column of a parquet file as JSON rows (polars writes the list-of-struct column as JSON).
#[cfg(feature = "analysis")]
fn parquet_rows(path: &Path, field: &str) -> Result<Vec<serde_json::Value>> {
    use polars::prelude::*;
    let err = |e: PolarsError| Error::Data(format!("{}: {e}", path.display()));
    let file = std::fs::File::open(path).at(path)?;
    let mut df = ParquetReader::new(file).with_columns(Some(vec![field.to_string()])).finish().map_err(err)?;
    let mut buf = Vec::new();
    JsonWriter::new(&mut buf).with_json_format(JsonFormat::JsonLines).finish(&mut df).map_err(err)?;
    let text = String::from_utf8_lossy(&buf);
    text.lines().filter(|l| !l.trim().is_empty()).map(|l| serde_json::from_str(l).map_err(|e| Error::Data(format!("{}: {e}", path.display())))).collect()
}

#[cfg(not(feature = "analysis"))]
fn parquet_rows(path: &Path, _field: &str) -> Result<Vec<serde_json::Value>> {
    Err(Error::Data(format!("{}: parquet needs the `analysis` feature (polars); this is a lean build", path.display())))
}

// ---------------------------------------------------------------------------------------------
// Chat template
// ---------------------------------------------------------------------------------------------

/// The Tülu 3 / OLMo 2 SFT format, used when the model folder has no `chat_template`.
pub const BUILTIN_TEMPLATE: &str = "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'assistant' %}{% if not loop.last %}{{ '<|assistant|>\\n' + message['content'] + eos_token + '\\n' }}{% else %}{{ '<|assistant|>\\n' + message['content'] + eos_token }}{% endif %}{% endif %}{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}{% endfor %}";

/// A Jinja chat template with the special-token strings it may print.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    pub source: String,
    pub bos_token: String,
    pub eos_token: String,
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        let mut env = minijinja::Environment::new();
        // HF templates call Python string methods (`.strip()`, `.startswith()`) and `raise_exception`.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source.to_string()).map_err(|e| Error::Data(format!("chat template: {e}")))?;
        Ok(ChatTemplate { env, source: source.to_string(), bos_token: bos_token.into(), eos_token: eos_token.into() })
    }

    /// The built-in Tülu format with the tokenizer's EOS string.
    pub fn builtin(eos_token: &str) -> ChatTemplate {
        Self::new(BUILTIN_TEMPLATE, "", eos_token).expect("the built-in template parses")
    }

    /// `chat_template` (a string, or a list of `{name, template}` where `default` is used) and the
    /// `bos_token` / `eos_token` strings of a tokenizer_config.json; None when it has no template.
    pub fn from_tokenizer_config(path: &Path) -> Result<Option<ChatTemplate>> {
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).at(path)?).map_err(|e| Error::Data(format!("{}: {e}", path.display())))?;
        let source = match v.get("chat_template") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(list)) => {
                let named = |n: &str| list.iter().find(|t| t["name"] == n).and_then(|t| t["template"].as_str());
                match named("default") {
                    Some(s) => s.to_string(),
                    None => return Err(Error::Data(format!("{}: chat_template list has no `default` entry", path.display()))),
                }
            }
            _ => return Ok(None),
        };
        // Special tokens are a string or an AddedToken object with `content`.
        let token = |k: &str| v.get(k).and_then(|t| t.as_str().or_else(|| t.get("content").and_then(|c| c.as_str()))).unwrap_or("").to_string();
        Self::new(&source, &token("bos_token"), &token("eos_token")).map(Some).map_err(|e| Error::Data(format!("{}: {e}", path.display())))
    }

    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let t = self.env.get_template("chat").expect("added in new");
        t.render(minijinja::context! { messages => messages, bos_token => &self.bos_token, eos_token => &self.eos_token, add_generation_prompt => add_generation_prompt })
            .map_err(|e| Error::Data(format!("chat template: {e:#}")))
    }

    /// Byte ranges of `render(messages)` that assistant turns add (their content and whatever the
    /// template prints after it, e.g. EOS), found by rendering prefixes.
    pub fn assistant_spans(&self, messages: &[Message]) -> Result<(String, Vec<(usize, usize)>)> {
        let full = self.render(messages, false)?;
        let mut spans = Vec::new();
        for (i, m) in messages.iter().enumerate().filter(|(_, m)| m.role == "assistant") {
            let before = self.render(&messages[..i], true)?;
            let upto = self.render(&messages[..=i], false)?;
            if !upto.starts_with(&before) || !full.starts_with(&upto) {
                return Err(Error::Data(format!("chat template is not prefix-stable at message {i} ({}): cannot tell assistant tokens apart", m.role)));
            }
            if upto.len() > before.len() {
                spans.push((before.len(), upto.len()));
            }
        }
        Ok((full, spans))
    }
}

// ---------------------------------------------------------------------------------------------
// Tokens and labels
// ---------------------------------------------------------------------------------------------

/// One conversation as tokens and labels (`labels[i]` = `tokens[i]` on assistant tokens, else
/// IGNORE; not yet shifted).
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    pub tokens: Vec<i64>,
    pub labels: Vec<i64>,
}

/// Tokenise the rendered conversation once (so token boundaries are the model's own) and label the
/// tokens that start inside an assistant span; an answer whose last token is not `eos` gets one.
pub fn encode(messages: &[Message], template: &ChatTemplate, tok: &Tok, eos: u32) -> Result<Encoded> {
    let (text, spans) = template.assistant_spans(messages)?;
    let enc = tok.inner.encode(text.as_str(), false).map_err(|e| Error::Tokenizer(e.to_string()))?;
    let (ids, offsets) = (enc.get_ids(), enc.get_offsets());
    let mut out = Encoded { tokens: Vec::with_capacity(ids.len() + spans.len()), labels: Vec::with_capacity(ids.len() + spans.len()) };
    for (j, (&id, &(start, _))) in ids.iter().zip(offsets).enumerate() {
        let span = spans.iter().position(|&(a, b)| start >= a && start < b);
        out.tokens.push(id as i64);
        out.labels.push(if span.is_some() { id as i64 } else { IGNORE });
        // Last token of a span without EOS: append a scored EOS.
        if let Some(s) = span {
            let next_in_same = offsets.get(j + 1).is_some_and(|&(n, _)| n >= spans[s].0 && n < spans[s].1);
            if !next_in_same && id != eos {
                out.tokens.push(eos as i64);
                out.labels.push(eos as i64);
            }
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Packing
// ---------------------------------------------------------------------------------------------

/// A packed training row of `seq_len` positions. Position i predicts `targets[i]` from `inputs[..=i]`
/// of its own document (`doc_ids`: 0, 1, … per conversation in the row, then one more id for the
/// padding); `positions` restart at 0 for every document.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedRow {
    pub inputs: Vec<i64>,
    pub targets: Vec<i64>,
    pub doc_ids: Vec<i64>,
    pub positions: Vec<i64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PackStats {
    pub conversations: usize,
    /// Longer than seq_len + 1 tokens: cut.
    pub truncated: usize,
    /// Nothing to score (no assistant token after truncation, or under two tokens).
    pub dropped: usize,
    pub rows: usize,
    pub scored_tokens: usize,
}

/// Greedy in-order packing: a conversation of n tokens gives n − 1 (input, target) pairs, all in one
/// row (cut to `seq_len` pairs when longer); a row is closed when the next conversation does not fit,
/// and padded with `pad` (never scored).
pub fn pack(examples: &[Encoded], seq_len: usize, pad: i64) -> (Vec<PackedRow>, PackStats) {
    let mut stats = PackStats { conversations: examples.len(), ..Default::default() };
    let mut rows = Vec::new();
    let empty = || PackedRow { inputs: Vec::new(), targets: Vec::new(), doc_ids: Vec::new(), positions: Vec::new() };
    let mut row = empty();
    let mut docs = 0i64;
    let close = |row: &mut PackedRow, docs: &mut i64, rows: &mut Vec<PackedRow>| {
        if row.inputs.is_empty() {
            return;
        }
        let n = seq_len - row.inputs.len();
        row.inputs.extend(std::iter::repeat_n(pad, n));
        row.targets.extend(std::iter::repeat_n(IGNORE, n));
        row.doc_ids.extend(std::iter::repeat_n(*docs, n));
        row.positions.extend(0..n as i64);
        rows.push(std::mem::replace(row, empty()));
        *docs = 0;
    };
    for e in examples {
        let pairs = e.tokens.len().saturating_sub(1).min(seq_len);
        if e.tokens.len() > seq_len + 1 {
            stats.truncated += 1;
        }
        let scored = if pairs == 0 { 0 } else { e.labels[1..=pairs].iter().filter(|&&l| l != IGNORE).count() };
        if pairs == 0 || scored == 0 {
            stats.dropped += 1;
            continue;
        }
        if row.inputs.len() + pairs > seq_len {
            close(&mut row, &mut docs, &mut rows);
        }
        row.inputs.extend_from_slice(&e.tokens[..pairs]);
        row.targets.extend_from_slice(&e.labels[1..=pairs]);
        row.doc_ids.extend(std::iter::repeat_n(docs, pairs));
        row.positions.extend(0..pairs as i64);
        docs += 1;
        stats.scored_tokens += scored;
    }
    close(&mut row, &mut docs, &mut rows);
    stats.rows = rows.len();
    (rows, stats)
}

#[cfg(test)]
mod tests;
