use super::*;
use std::collections::HashMap;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf_tiny").join(name)
}

fn expected() -> HashMap<String, Tensor> {
    Tensor::read_safetensors(fixture("expected.safetensors")).unwrap().into_iter().collect()
}

/// Every tensor of the fixture (Q8_0, Q4_0, Q4_1, F16, BF16, F32) against numpy's dequantization.
#[test]
fn every_supported_type_dequantizes_as_numpy_does() {
    let _rng = crate::testutil::rng();
    let g = Gguf::open(&fixture("tiny.gguf")).unwrap();
    let want = expected();
    let mut types = std::collections::BTreeSet::new();
    for t in &g.tensors {
        let got = g.dequantize(&t.name).unwrap();
        let w = &want[&format!("deq.{}", t.name)];
        assert_eq!(got.size(), w.size(), "{}", t.name);
        let diff = (&got - w).abs().max().double_value(&[]);
        assert!(diff <= 1e-7, "{} ({}): max |Δ| = {diff}", t.name, type_name(t.type_id));
        types.insert(type_name(t.type_id));
    }
    assert_eq!(types.into_iter().collect::<Vec<_>>(), ["BF16", "F16", "F32", "Q4_0", "Q4_1", "Q8_0"]);
}

/// Q4_1 by hand: d = 0.5, m = -1, nibbles 0..15 in the low halves and 15..0 in the high ones.
#[test]
fn q4_1_block_by_hand() {
    let mut b = Vec::new();
    b.extend(half::f16::from_f32(0.5).to_le_bytes());
    b.extend(half::f16::from_f32(-1.0).to_le_bytes());
    b.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
    let v = dequantize(DType::Q4_1, &b);
    let want: Vec<f32> = (0..16).map(|i| 0.5 * i as f32 - 1.0).chain((0..16).map(|i| 0.5 * (15 - i) as f32 - 1.0)).collect();
    assert_eq!(v, want);
}

/// Interleaved rotary rows (pairs 2i, 2i+1) back to rotate-half order (i, i + hd/2), per head.
#[test]
fn rotary_rows_unpermute_per_head() {
    let _rng = crate::testutil::rng();
    // Two heads of head dim 4: stored rows 0..8 (interleaved) → HF rows [0, 2, 1, 3, 4, 6, 5, 7].
    let w = Tensor::arange(8, (Kind::Float, tch::Device::Cpu)).view([8, 1]);
    let got: Vec<f32> = Vec::try_from(unpermute_rotary(&w, 2).view([-1])).unwrap();
    assert_eq!(got, [0., 2., 1., 3., 4., 6., 5., 7.]);
}

/// The tiny llama of the fixture (q / k permuted, tied head) gives transformers' logits.
#[test]
fn tiny_llama_matches_transformers_gguf_loader() {
    let _rng = crate::testutil::rng();
    let path = fixture("tiny.gguf");
    let (_vs, model) = load_llama(path.to_str().unwrap(), tch::Device::Cpu).unwrap();
    let c = &model.cfg;
    assert_eq!((c.vocab_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.num_hidden_layers), (264, 64, 4, 2, 96, 2));
    assert!(c.tie_word_embeddings);
    let e = expected();
    let logits = tch::no_grad(|| model.logits(&model.hidden(&e["input_ids"])));
    let want = &e["logits"];
    let diff = (&logits - want).abs().max().double_value(&[]);
    let tol = 1e-4 * want.abs().max().double_value(&[]);
    assert!(diff <= tol, "max |Δlogits| = {diff} (tolerance {tol})");
}

/// Tokenizer and chat template from the metadata reproduce transformers' ids.
#[test]
fn tokenizer_and_chat_template_from_metadata_match_transformers() {
    let _rng = crate::testutil::rng();
    let g = Gguf::open(&fixture("tiny.gguf")).unwrap();
    let tok = crate::data::Tok::from_json(&tokenizer::tokenizer_json(&g).unwrap(), "tiny.gguf").unwrap();
    let e = expected();
    let ids = |t: &Tensor| Vec::<i64>::try_from(t).unwrap().into_iter().map(|i| i as u32).collect::<Vec<_>>();
    assert_eq!(tok.encode("the thin tin hen then\nsaid: 42 is 7 x 6!").unwrap(), ids(&e["text_ids"]));
    let chat = tokenizer::chat_template(&g).unwrap().expect("fixture has a template");
    let msgs = [crate::data::chat::Message { role: "user".into(), content: "the hen".into() }];
    let text = chat.render(&msgs, true).unwrap();
    assert_eq!(tok.encode(&text).unwrap(), ids(&e["chat_ids"]));
    assert_eq!(tokenizer::eos_id(&g), Some(2));
    assert_eq!(tokenizer::special_token(&g, "tokenizer.ggml.bos_token_id").unwrap(), "<|im_start|>");
}

/// Every digit is its own pre-token under `smollm` (a merge of two digits never applies).
#[test]
fn smollm_pre_tokenizer_splits_digits() {
    let _rng = crate::testutil::rng();
    let g = Gguf::open(&fixture("tiny.gguf")).unwrap();
    let tok = crate::data::Tok::from_json(&tokenizer::tokenizer_json(&g).unwrap(), "tiny.gguf").unwrap();
    let pre = tok.inner.get_pre_tokenizer().unwrap();
    let mut s = tokenizers::PreTokenizedString::from("a 123");
    tokenizers::PreTokenizer::pre_tokenize(pre, &mut s).unwrap();
    let pieces: Vec<String> = s.get_splits(tokenizers::OffsetReferential::Original, tokenizers::OffsetType::Byte).into_iter().map(|(p, _, _)| p.to_string()).collect();
    assert_eq!(pieces, ["a", "Ġ", "1", "2", "3"]);
}

/// `export` writes a Hugging Face Llama folder: loaded back by the HF loader it gives transformers'
/// logits of the GGUF, and its tokenizer files carry the same vocabulary and chat template.
#[test]
fn export_writes_a_hugging_face_llama_folder() {
    let _rng = crate::testutil::rng();
    let dir = tempfile::tempdir().unwrap();
    export(fixture("tiny.gguf").to_str().unwrap(), dir.path()).unwrap();
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "LlamaForCausalLM");
    assert_eq!((config["bos_token_id"].as_u64(), config["eos_token_id"].as_u64()), (Some(1), Some(2)));
    let (_vs, model) = super::super::hf::load_llama(dir.path(), tch::Device::Cpu).unwrap();
    let e = expected();
    let logits = tch::no_grad(|| model.logits(&model.hidden(&e["input_ids"])));
    let diff = (&logits - &e["logits"]).abs().max().double_value(&[]);
    assert!(diff <= 1e-4 * e["logits"].abs().max().double_value(&[]), "max |Δlogits| = {diff}");
    let tok = crate::data::Tok::load(&crate::spec::TokenizerSpec::Path(dir.path().join("tokenizer.json").display().to_string())).unwrap();
    let want: Vec<u32> = Vec::<i64>::try_from(&e["text_ids"]).unwrap().into_iter().map(|i| i as u32).collect();
    assert_eq!(tok.encode("the thin tin hen then\nsaid: 42 is 7 x 6!").unwrap(), want);
    let chat = crate::data::chat::ChatTemplate::from_tokenizer_config(&dir.path().join("tokenizer_config.json")).unwrap().unwrap();
    assert!(chat.source.contains("<|im_start|>") && chat.eos_token == "<|im_end|>");
}

fn err(path: &Path) -> String {
    match Gguf::open(path).and_then(|g| llama_config(&g).map(|c| (g, c))).and_then(|(g, c)| llama_weights(&g, &c)) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_files_are_refused_naming_file_and_field() {
    let _rng = crate::testutil::rng();
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(fixture("tiny.gguf")).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 100]).unwrap();
    let e = err(&cut);
    assert!(e.contains("cut.gguf: truncated: tensor `output_norm.weight`"), "{e}");
    std::fs::write(&cut, &bytes[..3000]).unwrap();
    let e = err(&cut);
    assert!(e.contains("cut.gguf: truncated:") && e.contains("tokenizer.ggml"), "{e}");
    let magic = dir.path().join("magic.gguf");
    std::fs::write(&magic, [b"GGML".as_slice(), &bytes[4..]].concat()).unwrap();
    let e = err(&magic);
    assert!(e.contains("magic.gguf: not a GGUF file"), "{e}");
    let e = err(&fixture("wrong_arch.gguf"));
    assert!(e.contains("wrong_arch.gguf: general.architecture = `gpt2`"), "{e}");
    let e = err(&fixture("bad_shape.gguf"));
    assert!(e.contains("bad_shape.gguf: tensor `blk.0.attn_k.weight` has shape [64, 64]") && e.contains("head_count_kv") && e.contains("[32, 64]"), "{e}");
    let e = err(&fixture("unsupported.gguf"));
    assert!(e.contains("unsupported.gguf: tensor `blk.0.attn_q.weight` has type Q5_0"), "{e}");
}

#[test]
fn known_names_resolve_or_say_how_to_fetch() {
    let _rng = crate::testutil::rng();
    let e = resolve("gguf:nope").unwrap_err().to_string();
    assert!(e.contains("unknown GGUF model name") && e.contains("smollm2"), "{e}");
    assert_eq!(resolve("x/y.gguf").unwrap(), PathBuf::from("x/y.gguf"));
    assert!(is_gguf("gguf:smollm2") && is_gguf("a/b.gguf") && !is_gguf("hf:a/b"));
}

// ---------------------------------------------------------------------------------------------
// The real model: SmolLM2-135M-Instruct Q4_1 (scripts/fetch-smollm2.sh, `make smollm2`)
// ---------------------------------------------------------------------------------------------

/// The paragraph of scripts/make_smollm2_fixture.py.
const PARAGRAPH: &str = "The river runs through the old town, past the market and the stone church, before it reaches the sea. In summer, children swim near the bridge while their parents sit in the shade and talk about the harvest, the weather and the news from the city.";

use tests_support::smollm2;

fn ids_of(t: &Tensor) -> Vec<u32> {
    Vec::<i64>::try_from(t).unwrap().into_iter().map(|i| i as u32).collect()
}

/// Mean next-token cross-entropy of `ids` `[1, T]`.
fn paragraph_loss(model: &Llama, ids: &Tensor) -> f64 {
    let t = ids.size()[1];
    let logits = tch::no_grad(|| model.logits(&model.hidden(ids)));
    logits.narrow(1, 0, t - 1).view([t - 1, -1]).cross_entropy_for_logits(&ids.narrow(1, 1, t - 1).view([-1])).double_value(&[])
}

/// fp32 logits within 1e-4 (relative to the largest) of transformers' on the same GGUF, the same
/// tokenization and chat prompt, the same 32 greedy tokens; the paragraph's loss; and the q / k
/// permutation shown to matter (left interleaved, the loss rises by more than half a nat).
#[test]
fn smollm2_matches_transformers() {
    let _rng = crate::testutil::rng();
    let path = smollm2();
    let t0 = std::time::Instant::now();
    let (vs, model) = load_llama(&path, tch::Device::Cpu).unwrap();
    let load_s = t0.elapsed().as_secs_f64();
    let c = &model.cfg;
    assert_eq!((c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.vocab_size), (30, 576, 9, 3, 1536, 49152));
    assert!(c.tie_word_embeddings && (c.rope_theta - 100000.0).abs() < 1e-6);
    let params: i64 = vs.trainable_variables().iter().map(|v| v.numel() as i64).sum();
    assert_eq!(params, 134_515_008);
    let e: HashMap<String, Tensor> = Tensor::read_safetensors(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2/expected.safetensors")).unwrap().into_iter().collect();

    let tok = load_tok(&path).unwrap();
    assert_eq!(tok.encode(PARAGRAPH).unwrap(), ids_of(&e["paragraph_ids"]));
    let ids = e["paragraph_ids"].view([1, -1]);
    let t1 = std::time::Instant::now();
    let logits = tch::no_grad(|| model.logits(&model.hidden(&ids))).squeeze_dim(0);
    let forward_s = t1.elapsed().as_secs_f64();
    let mut worst: f64 = 0.0;
    for (got, want) in [(logits.narrow(1, 0, 1024), &e["logits_slice"]), (logits.get(-1), &e["logits_last"]), (logits.logsumexp([-1], false), &e["logsumexp"])] {
        let rel = (&got - want).abs().max().double_value(&[]) / want.abs().max().double_value(&[]);
        worst = worst.max(rel);
    }
    assert!(worst <= 1e-4, "logits differ from transformers' by {worst:e} of the largest");
    let loss = paragraph_loss(&model, &ids);
    let want_loss = e["loss"].double_value(&[]);
    assert!((loss - want_loss).abs() < 1e-4, "loss {loss} vs transformers {want_loss}");

    let g = Gguf::open(Path::new(&path)).unwrap();
    let chat = tokenizer::chat_template(&g).unwrap().expect("SmolLM2 carries a chat template");
    let msgs = [crate::data::chat::Message { role: "user".into(), content: "What is the capital of France?".into() }];
    let prompt = tok.encode(&chat.render(&msgs, true).unwrap()).unwrap();
    assert_eq!(prompt, ids_of(&e["chat_ids"]));
    let t2 = std::time::Instant::now();
    let mut cache = model.new_cache(1, Kind::Float, tch::Device::Cpu);
    let mut next = tch::no_grad(|| model.extend(&mut cache, &Tensor::from_slice(&prompt.iter().map(|&i| i as i64).collect::<Vec<_>>()).view([1, -1]))).get(0).get(-1).argmax(-1, false);
    let mut greedy = Vec::new();
    for _ in 0..32 {
        greedy.push(next.int64_value(&[]) as u32);
        next = tch::no_grad(|| model.extend(&mut cache, &next.view([1, 1]))).get(0).get(-1).argmax(-1, false);
    }
    let decode_s = t2.elapsed().as_secs_f64();
    assert_eq!(greedy, ids_of(&e["greedy_ids"]), "greedy ids: {:?}", tok.decode(&greedy));

    // Put q / k back in llama.cpp's interleaved order: the model gets much worse.
    tch::no_grad(|| {
        for (name, mut var) in vs.variables() {
            let heads = if name.ends_with("q_proj.weight") { c.num_attention_heads } else if name.ends_with("k_proj.weight") { c.num_key_value_heads } else { continue };
            let (rows, cols) = (var.size()[0], var.size()[1]);
            let interleaved = var.reshape([heads as i64, 2, rows / heads as i64 / 2, cols]).transpose(1, 2).reshape([rows, cols]);
            var.copy_(&interleaved);
        }
    });
    let wrong = paragraph_loss(&model, &ids);
    assert!(wrong > loss + 0.5, "q/k left interleaved: loss {wrong} vs {loss}");
    eprintln!("smollm2: load {load_s:.1}s, forward of {} tokens {forward_s:.2}s, 32 greedy tokens {decode_s:.2}s; max rel. logit error {worst:.2e}; loss {loss:.4} (transformers {want_loss:.4}); q/k not un-permuted: {wrong:.4}", ids.size()[1]);
}
