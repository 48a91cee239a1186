use super::*;

fn msg(role: &str, content: &str) -> Message {
    Message { role: role.into(), content: content.into() }
}

/// A word-level tokenizer (split on whitespace) whose ids are the positions in `WORDS`;
/// `<|endoftext|>` is an added special token, so it splits out of `answer<|endoftext|>`.
const WORDS: [&str; 14] = ["<|endoftext|>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "hello", "there", "hi", "friend", "bye", "ok", "user:", "assistant:", "be"];

fn tok() -> Tok {
    let vocab: serde_json::Map<String, serde_json::Value> = WORDS.iter().enumerate().map(|(i, w)| (w.to_string(), serde_json::json!(i))).collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 0, "content": "<|endoftext|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    Tok::from_json(&json.to_string(), "test").unwrap()
}

fn id(w: &str) -> i64 {
    WORDS.iter().position(|x| *x == w).unwrap() as i64
}

fn two_turns() -> Conversation {
    vec![msg("user", "hello there"), msg("assistant", "hi friend"), msg("user", "bye"), msg("assistant", "ok")]
}

#[test]
fn builtin_template_renders_the_tulu_format() {
    let t = ChatTemplate::builtin("<|endoftext|>");
    let conv = [msg("system", "be"), msg("user", "hello"), msg("assistant", "hi"), msg("user", "bye"), msg("assistant", "ok")];
    assert_eq!(t.render(&conv, false).unwrap(), "<|system|>\nbe\n<|user|>\nhello\n<|assistant|>\nhi<|endoftext|>\n<|user|>\nbye\n<|assistant|>\nok<|endoftext|>");
    assert_eq!(t.render(&conv[..2], true).unwrap(), "<|system|>\nbe\n<|user|>\nhello\n<|assistant|>\n");
}

/// A Llama-3-style template from a tokenizer_config.json: bos_token, Python's `.strip()`,
/// an AddedToken-object eos_token, `raise_exception`.
#[test]
fn template_from_tokenizer_config_renders_known_output() {
    let dir = tempfile::tempdir().unwrap();
    let src = "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'].strip() }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}";
    let cfg = serde_json::json!({"chat_template": src, "bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>", "special": true}});
    let p = dir.path().join("tokenizer_config.json");
    std::fs::write(&p, cfg.to_string()).unwrap();
    let t = ChatTemplate::from_tokenizer_config(&p).unwrap().unwrap();
    assert_eq!(t.eos_token, "<|eot_id|>");
    let out = t.render(&[msg("user", "  hello "), msg("assistant", "hi")], true).unwrap();
    assert_eq!(out, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
    let err = t.render(&[msg("tool", "x")], false).unwrap_err().to_string();
    assert!(err.contains("no tools"), "{err}");
    // No chat_template: None (the caller falls back to the built-in one).
    std::fs::write(&p, r#"{"eos_token": "</s>"}"#).unwrap();
    assert!(ChatTemplate::from_tokenizer_config(&p).unwrap().is_none());
}

#[test]
fn only_assistant_tokens_and_their_eos_are_labelled() {
    let e = encode(&two_turns(), &ChatTemplate::builtin("<|endoftext|>"), &tok(), 0).unwrap();
    let words = ["<|user|>", "hello", "there", "<|assistant|>", "hi", "friend", "<|endoftext|>", "<|user|>", "bye", "<|assistant|>", "ok", "<|endoftext|>"];
    assert_eq!(e.tokens, words.iter().map(|w| id(w)).collect::<Vec<_>>());
    let i = IGNORE;
    assert_eq!(e.labels, vec![i, i, i, i, id("hi"), id("friend"), 0, i, i, i, id("ok"), 0]);
}

/// A template that prints no EOS: one scored EOS is appended after each answer.
#[test]
fn eos_is_appended_when_the_template_has_none() {
    let t = ChatTemplate::new("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}", "", "").unwrap();
    let e = encode(&two_turns(), &t, &tok(), 0).unwrap();
    let i = IGNORE;
    let (u, a) = (id("user:"), id("assistant:"));
    assert_eq!(e.tokens, vec![u, id("hello"), id("there"), a, id("hi"), id("friend"), 0, u, id("bye"), a, id("ok"), 0]);
    assert_eq!(e.labels, vec![i, i, i, i, id("hi"), id("friend"), 0, i, i, i, id("ok"), 0]);
}

#[test]
fn a_template_that_is_not_prefix_stable_is_refused() {
    let t = ChatTemplate::new("{% for m in messages|reverse %}{{ m.content }} {% endfor %}", "", "").unwrap();
    let err = encode(&two_turns(), &t, &tok(), 0).unwrap_err().to_string();
    assert!(err.contains("not prefix-stable at message 1"), "{err}");
}

fn ex(tokens: &[i64], labels: &[i64]) -> Encoded {
    Encoded { tokens: tokens.to_vec(), labels: labels.to_vec() }
}

#[test]
fn packing_keeps_conversations_whole_with_doc_ids_and_positions() {
    let i = IGNORE;
    let examples = [
        ex(&[1, 2, 3, 4], &[i, i, 3, 4]),          // 3 pairs
        ex(&[5, 6, 7], &[i, 6, 7]),                // 2 pairs: fits beside the first (5 of 6)
        ex(&[8, 9, 10, 11, 12], &[i, i, 10, 11, 12]), // 4 pairs: next row
        ex(&[13, 14, 15], &[i, i, i]),             // nothing scored: dropped
        ex(&[20, 21, 22, 23, 24, 25, 26, 27, 28], &[i, 21, 22, 23, 24, 25, 26, 27, 28]), // 8 pairs: cut to 6
    ];
    let (rows, stats) = pack(&examples, 6, 99);
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0].inputs, vec![1, 2, 3, 5, 6, 99]);
    assert_eq!(rows[0].targets, vec![i, 3, 4, 6, 7, i]);
    assert_eq!(rows[0].doc_ids, vec![0, 0, 0, 1, 1, 2]);
    assert_eq!(rows[0].positions, vec![0, 1, 2, 0, 1, 0]);
    assert_eq!(rows[1].inputs, vec![8, 9, 10, 11, 99, 99]);
    assert_eq!(rows[1].targets, vec![i, 10, 11, 12, i, i]);
    assert_eq!(rows[1].doc_ids, vec![0, 0, 0, 0, 1, 1]);
    assert_eq!(rows[1].positions, vec![0, 1, 2, 3, 0, 1]);
    assert_eq!(rows[2].inputs, vec![20, 21, 22, 23, 24, 25]);
    assert_eq!(rows[2].targets, vec![21, 22, 23, 24, 25, 26]);
    assert_eq!(rows[2].doc_ids, vec![0; 6]);
    assert_eq!(stats, PackStats { conversations: 5, truncated: 1, dropped: 1, rows: 3, scored_tokens: 2 + 2 + 3 + 6 });
}

#[test]
fn reads_json_arrays_and_json_lines_with_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let conv = serde_json::json!({"id": 1, "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]});
    let a = dir.path().join("a.json");
    std::fs::write(&a, serde_json::json!([conv, conv]).to_string()).unwrap();
    let jl = dir.path().join("b.jsonl");
    std::fs::write(&jl, format!("{conv}\n\n{conv}\n{}\n", serde_json::json!({"text": "x"}))).unwrap();
    let got = read_file(&a, "messages").unwrap();
    assert_eq!(got, vec![vec![msg("user", "hello"), msg("assistant", "hi")]; 2]);
    let err = read_file(&jl, "messages").unwrap_err().to_string();
    assert!(err.contains("b.jsonl row 3") && err.contains("`messages`"), "{err}");
    std::fs::write(&jl, format!("{conv}\n")).unwrap();
    let all = read_conversations(&ChatSource::Local { path: dir.path().into(), field: "messages".into() }).unwrap();
    assert_eq!(all.len(), 3);
    // Alpaca records become one-turn conversations; the spec form `{alpaca: PATH}` parses to that source.
    let al = dir.path().join("alpaca.txt");
    std::fs::write(&al, r#"[{"instruction": "add", "input": "1 2", "output": "3"}, {"instruction": "hi", "input": "", "output": "hello"}]"#).unwrap();
    let src: ChatSource = serde_yaml::from_str(&format!("{{alpaca: {}}}", al.display())).unwrap();
    assert_eq!(read_conversations(&src).unwrap(), vec![vec![msg("user", "add\n\n1 2"), msg("assistant", "3")], vec![msg("user", "hi"), msg("assistant", "hello")]]);
    let src: ChatSource = serde_yaml::from_str("{path: x.jsonl}").unwrap();
    assert_eq!(src, ChatSource::Local { path: "x.jsonl".into(), field: "messages".into() });
}

/// With a real byte-level BPE (GPT-NeoX), the labelled tokens decode to exactly the assistant
/// contents, each followed by EOS.
#[test]
fn labelled_bpe_tokens_decode_to_the_answers() {
    let tok = Tok::from_json(&crate::testutil::shared_text("data/tokenizers/gpt-neox-20b.json"), "gpt-neox-20b").unwrap();
    let conv = [msg("system", "Be brief."), msg("user", "What is the capital of France?"), msg("assistant", "Paris, of course."), msg("user", "And of Peru?"), msg("assistant", " Lima.")];
    let e = encode(&conv, &ChatTemplate::builtin("<|endoftext|>"), &tok, 0).unwrap();
    let ids = |v: &[i64]| v.iter().map(|&t| t as u32).collect::<Vec<_>>();
    assert_eq!(tok.decode(&ids(&e.tokens)).unwrap(), ChatTemplate::builtin("<|endoftext|>").render(&conv, false).unwrap());
    // Runs of labelled tokens, decoded one run at a time.
    let mut runs: Vec<Vec<i64>> = Vec::new();
    for (i, &l) in e.labels.iter().enumerate() {
        if l == IGNORE {
            continue;
        }
        assert_eq!(l, e.tokens[i]);
        if i == 0 || e.labels[i - 1] == IGNORE {
            runs.push(Vec::new());
        }
        runs.last_mut().unwrap().push(l);
    }
    let text: Vec<String> = runs.iter().map(|r| tok.decode(&ids(r)).unwrap()).collect();
    assert_eq!(text, ["Paris, of course.<|endoftext|>", " Lima.<|endoftext|>"]);
}

/// Parquet with a list-of-struct `messages` column (the Tülu 3 files' layout), written by polars.
#[cfg(feature = "analysis")]
#[test]
fn reads_parquet_messages() {
    use polars::prelude::*;
    let dir = tempfile::tempdir().unwrap();
    let lines = "{\"id\": \"a\", \"messages\": [{\"role\": \"user\", \"content\": \"hello\"}, {\"role\": \"assistant\", \"content\": \"hi \\\"you\\\"\"}]}\n{\"id\": \"b\", \"messages\": [{\"role\": \"user\", \"content\": \"bye\"}, {\"role\": \"assistant\", \"content\": \"ok\"}]}\n";
    let mut df = JsonReader::new(std::io::Cursor::new(lines)).with_json_format(JsonFormat::JsonLines).finish().unwrap();
    let p = dir.path().join("train-00000-of-00001.parquet");
    ParquetWriter::new(std::fs::File::create(&p).unwrap()).finish(&mut df).unwrap();
    let got = read_file(&p, "messages").unwrap();
    assert_eq!(got, vec![vec![msg("user", "hello"), msg("assistant", "hi \"you\"")], vec![msg("user", "bye"), msg("assistant", "ok")]]);
    let err = read_file(&p, "conversation").unwrap_err().to_string();
    assert!(err.contains("conversation"), "{err}");
}

/// A hub chat source is a `spec::HubSource` whose field defaults to `messages`; unknown keys are refused.
#[test]
fn hub_chat_sources_default_to_the_messages_field() {
    let src: ChatSource = serde_yaml::from_str("hf: {repo: allenai/tulu-3-sft-mixture, files: [a.parquet]}").unwrap();
    let ChatSource::Hub { hf: HubChat(h) } = &src else { panic!("{src:?}") };
    assert_eq!((h.repo.as_str(), h.revision.as_deref(), h.files.as_slice(), h.field.as_str()), ("allenai/tulu-3-sft-mixture", None, &["a.parquet".to_string()][..], "messages"));
    let src: ChatSource = serde_yaml::from_str("hf: {repo: r, revision: v1, files: [a.jsonl], field: conversations}").unwrap();
    let ChatSource::Hub { hf: HubChat(h) } = &src else { panic!("{src:?}") };
    assert_eq!((h.revision.as_deref(), h.field.as_str()), (Some("v1"), "conversations"));
    assert_eq!(serde_yaml::from_str::<ChatSource>(&serde_yaml::to_string(&src).unwrap()).unwrap(), src);
    assert!(serde_yaml::from_str::<ChatSource>("hf: {repo: r, files: [a], feld: x}").is_err());
}

#[test]
fn reads_the_shared_alpaca_file() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("alpaca.jsonl");
    std::fs::write(&path, crate::testutil::shared_text("data/alpaca/alpaca_200.jsonl")).unwrap();
    let recs = read_alpaca(&path).unwrap();
    assert_eq!(recs.len(), 200);
    assert!(!recs[0].0.is_empty() && !recs[0].2.is_empty());
}
