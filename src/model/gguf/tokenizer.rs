//! The tokenizer and chat template a GGUF carries in its metadata (`tokenizer.ggml.*`,
//! `tokenizer.chat_template`), as a Hugging Face `tokenizer.json` and a [`ChatTemplate`].
//!
//! Byte-level BPE (`tokenizer.ggml.model = gpt2`) only. Pre-tokenizers by `tokenizer.ggml.pre`:
//! `smollm` splits every digit alone and then applies the GPT-2 regex (byte-level); `gpt2` and
//! `default` the GPT-2 regex alone. Control tokens (token type 3) are special added tokens; no BOS is
//! added unless `tokenizer.ggml.add_bos_token` says so (then attnlab's BOS rule adds it where it does).
use super::{Gguf, Value};
use crate::data::chat::ChatTemplate;
use crate::{Error, Result};
use serde_json::json;

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

fn strings<'a>(g: &'a Gguf, key: &str) -> Result<Vec<&'a str>> {
    match g.get(key) {
        Some(Value::Array(a)) => a.iter().enumerate().map(|(i, v)| v.as_str().ok_or_else(|| Error::Data(format!("{}: {key}[{i}] is not a string", g.path.display())))).collect(),
        _ => Err(g.missing(key, "an array of strings")),
    }
}

const TOKENS: &str = "tokenizer.ggml.tokens";

/// `tokenizer.ggml.tokens`, checked: a non-empty array of distinct strings with no more entries than
/// the embedding table (`token_embd.weight`) has rows, so that every id the tokenizer makes has one.
fn tokens(g: &Gguf) -> Result<Vec<&str>> {
    let bad = |msg: String| Error::Data(format!("{}: {msg}", g.path.display()));
    let tokens = strings(g, TOKENS)?;
    if tokens.is_empty() {
        return Err(bad(format!("{TOKENS} is empty")));
    }
    if let Some(rows) = g.tensor("token_embd.weight").map(|t| t.shape()[0] as u64) {
        if tokens.len() as u64 > rows {
            return Err(bad(format!("{TOKENS} has {} entries but token_embd.weight has {rows} rows: expected at most one token per row of the embedding table", tokens.len())));
        }
    }
    let mut seen = std::collections::HashMap::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        if let Some(j) = seen.insert(*t, i) {
            return Err(bad(format!("{TOKENS}[{i}] = {t:?} repeats {TOKENS}[{j}]: expected distinct tokens")));
        }
    }
    Ok(tokens)
}

/// Every `tokenizer.ggml.*_token_id` the metadata gives: an id of one of the tokens. With
/// `tokenizer.ggml.add_bos_token` set, the BOS id must be given.
fn check_special_ids(g: &Gguf, n_tokens: usize) -> Result<()> {
    let bad = |msg: String| Error::Data(format!("{}: {msg}", g.path.display()));
    for (key, v) in g.metadata.range("tokenizer.ggml.".to_string()..).take_while(|(k, _)| k.starts_with("tokenizer.ggml.")) {
        if !key.ends_with("_token_id") {
            continue;
        }
        match v.as_u64() {
            Some(id) if id < n_tokens as u64 => {}
            _ => return Err(bad(format!("{key} = {v:?}: expected a token id below {n_tokens} (the size of {TOKENS})"))),
        }
    }
    if matches!(g.get("tokenizer.ggml.add_bos_token"), Some(Value::Bool(true))) && g.get("tokenizer.ggml.bos_token_id").is_none() {
        return Err(bad("tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing".into()));
    }
    Ok(())
}

/// `tokenizer.ggml.merges`: each `a b` of two tokens whose join is a token too (what a BPE merge
/// makes), so that the tokenizer built from them never fails on a merge the file cannot back.
fn merges<'a>(g: &'a Gguf, vocab: &std::collections::HashSet<&str>) -> Result<Vec<&'a str>> {
    let key = "tokenizer.ggml.merges";
    let merges = strings(g, key)?;
    for (i, m) in merges.iter().enumerate() {
        let parts: Vec<&str> = m.split(' ').collect();
        let why = match parts.as_slice() {
            [a, b] if !a.is_empty() && !b.is_empty() => {
                let joined = format!("{a}{b}");
                let missing = [*a, *b, joined.as_str()].into_iter().find(|t| !vocab.contains(t)).map(|t| format!("`{t}` is not in {TOKENS}"));
                missing
            }
            _ => Some("expected two tokens separated by one space".to_string()),
        };
        if let Some(why) = why {
            return Err(Error::Data(format!("{}: {key}[{i}] = {m:?}: {why}", g.path.display())));
        }
    }
    Ok(merges)
}

/// The tokenizer.json text of `g`'s tokenizer.
pub fn tokenizer_json(g: &Gguf) -> Result<String> {
    let model = g.str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(Error::Data(format!("{}: tokenizer.ggml.model = `{model}`: only byte-level BPE (`gpt2`) tokenizers are read", g.path.display())));
    }
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre = match g.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("default") {
        "smollm" => json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level]}),
        "gpt2" | "default" => byte_level,
        other => {
            return Err(Error::Data(format!("{}: tokenizer.ggml.pre = `{other}`: pre-tokenizers read are smollm, gpt2 and default", g.path.display())));
        }
    };
    let tokens = tokens(g)?;
    check_special_ids(g, tokens.len())?;
    let merges = merges(g, &tokens.iter().copied().collect())?;
    // llama.cpp's token types: 0 undefined, 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    let types: Vec<i64> = match g.get("tokenizer.ggml.token_type") {
        Some(Value::Array(a)) if a.len() == tokens.len() => a
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::Int(t @ 0..=6) => Ok(*t),
                _ => Err(Error::Data(format!("{}: tokenizer.ggml.token_type[{i}] = {v:?}: expected a token type 0 to 6", g.path.display()))),
            })
            .collect::<Result<_>>()?,
        Some(_) => return Err(Error::Data(format!("{}: tokenizer.ggml.token_type is not an integer array as long as tokenizer.ggml.tokens ({})", g.path.display(), tokens.len()))),
        None => vec![1; tokens.len()],
    };
    let vocab: serde_json::Map<String, serde_json::Value> = tokens.iter().enumerate().map(|(i, t)| (t.to_string(), json!(i))).collect();
    let added: Vec<serde_json::Value> = types
        .iter()
        .enumerate()
        .filter(|(_, &t)| t == CONTROL || t == USER_DEFINED)
        .map(|(i, &t)| json!({"id": i, "content": tokens[i], "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": t == CONTROL}))
        .collect();
    let tj = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": pre, "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges},
    });
    Ok(tj.to_string())
}

/// The string of token `key` (`tokenizer.ggml.bos_token_id`, …), "" when absent.
pub fn special_token(g: &Gguf, key: &str) -> Result<String> {
    let Some(v) = g.get(key) else { return Ok(String::new()) };
    let id = v.as_u64().ok_or_else(|| g.missing(key, "a token id"))?;
    let id = usize::try_from(id).unwrap_or(usize::MAX);
    let tokens = tokens(g)?;
    tokens.get(id).map(|t| t.to_string()).ok_or_else(|| Error::Data(format!("{}: {key} = {id} is outside tokenizer.ggml.tokens ({})", g.path.display(), tokens.len())))
}

/// The end-of-sequence id (`tokenizer.ggml.eos_token_id`), if the metadata names one.
pub fn eos_id(g: &Gguf) -> Option<u32> {
    g.get("tokenizer.ggml.eos_token_id").and_then(Value::as_u64).and_then(|i| u32::try_from(i).ok())
}

/// `tokenizer.chat_template` with the BOS / EOS strings it may print; None when there is none.
pub fn chat_template(g: &Gguf) -> Result<Option<ChatTemplate>> {
    let Some(source) = g.get("tokenizer.chat_template") else { return Ok(None) };
    let source = source.as_str().ok_or_else(|| g.missing("tokenizer.chat_template", "a string"))?;
    let (bos, eos) = (special_token(g, "tokenizer.ggml.bos_token_id")?, special_token(g, "tokenizer.ggml.eos_token_id")?);
    ChatTemplate::new(source, &bos, &eos).map(Some).map_err(|e| Error::Data(format!("{}: tokenizer.chat_template: {e}", g.path.display())))
}

/// A tokenizer_config.json for an exported folder: the chat template and special tokens, so that
/// transformers' `apply_chat_template` and attnlab's finetune read the same template.
pub fn tokenizer_config(g: &Gguf) -> Result<serde_json::Value> {
    let mut v = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": special_token(g, "tokenizer.ggml.bos_token_id")?,
        "eos_token": special_token(g, "tokenizer.ggml.eos_token_id")?,
        "unk_token": special_token(g, "tokenizer.ggml.unknown_token_id")?,
        "pad_token": special_token(g, "tokenizer.ggml.padding_token_id")?,
        "add_bos_token": matches!(g.get("tokenizer.ggml.add_bos_token"), Some(Value::Bool(true))),
        "clean_up_tokenization_spaces": false,
    });
    if let Some(t) = g.get("tokenizer.chat_template").and_then(Value::as_str) {
        v["chat_template"] = json!(t);
    }
    Ok(v)
}
