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

/// The k-quants and Q5 quants (random blocks, every bit pattern) against numpy's dequantization.
#[test]
fn k_quants_and_q5_dequantize_as_numpy_does() {
    let _rng = crate::testutil::rng();
    let g = Gguf::open(&fixture("kquants.gguf")).unwrap();
    let want: HashMap<String, Tensor> = Tensor::read_safetensors(fixture("kquants_expected.safetensors")).unwrap().into_iter().collect();
    let mut types = Vec::new();
    for t in &g.tensors {
        let got = g.dequantize(&t.name).unwrap();
        let w = &want[&format!("deq.{}", t.name)];
        assert_eq!(got.size(), w.size(), "{}", t.name);
        let diff = (&got - w).abs().max().double_value(&[]);
        assert!(diff <= 1e-6 * w.abs().max().double_value(&[]), "{} ({}): max |Δ| = {diff}", t.name, type_name(t.type_id));
        types.push(type_name(t.type_id));
    }
    types.sort();
    assert_eq!(types, ["Q2_K", "Q3_K", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K"]);
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
    assert!(e.contains("unsupported.gguf: tensor `blk.0.attn_q.weight` has type IQ4_NL") && e.contains("Q6_K"), "{e}");
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

// ---------------------------------------------------------------------------------------------
// Defective files: each class of defect refused naming the file's own tensors and keys
// ---------------------------------------------------------------------------------------------

/// A metadata value as GGUF bytes: (type id, bytes); integers as i32 (i64 when they do not fit),
/// floats as f64 (every f32 widens exactly), so that a file read and written back reads the same.
fn encode(v: &Value) -> (u32, Vec<u8>) {
    match v {
        Value::Int(i) => match i32::try_from(*i) {
            Ok(i) => (5, i.to_le_bytes().to_vec()),
            Err(_) => (11, i.to_le_bytes().to_vec()),
        },
        Value::UInt(u) => (10, u.to_le_bytes().to_vec()),
        Value::Float(f) => (12, f.to_le_bytes().to_vec()),
        Value::Bool(b) => (7, vec![*b as u8]),
        Value::Str(s) => (8, [(s.len() as u64).to_le_bytes().as_slice(), s.as_bytes()].concat()),
        Value::Array(a) => {
            let parts: Vec<(u32, Vec<u8>)> = a.iter().map(encode).collect();
            // One element type for the array: i64 if any integer needs it.
            let ty = if parts.iter().any(|p| p.0 == 11) { 11 } else { parts.first().map_or(8, |p| p.0) };
            let mut out = [ty.to_le_bytes().as_slice(), &(a.len() as u64).to_le_bytes()].concat();
            for (v, (t, b)) in a.iter().zip(parts) {
                match (ty, t, v) {
                    (11, 5, Value::Int(i)) => out.extend(i.to_le_bytes()),
                    _ => out.extend(b),
                }
            }
            (9, out)
        }
    }
}

/// A GGUF file of the given metadata entries (already encoded), tensor table and data section.
fn write_gguf(kv: &[(String, u32, Vec<u8>)], tensors: &[TensorInfo], data: &[u8], align: u64) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((kv.len() as u64).to_le_bytes());
    for (k, ty, v) in kv {
        out.extend((k.len() as u64).to_le_bytes());
        out.extend(k.as_bytes());
        out.extend(ty.to_le_bytes());
        out.extend(v);
    }
    for t in tensors {
        out.extend((t.name.len() as u64).to_le_bytes());
        out.extend(t.name.as_bytes());
        out.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(t.type_id.to_le_bytes());
        out.extend(t.offset.to_le_bytes());
    }
    out.resize(out.len().div_ceil(align as usize) * align as usize, 0);
    out.extend(data);
    out
}

/// tiny.gguf taken apart: metadata, the tensor table and each tensor's bytes.
struct Parts {
    kv: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
    bytes: Vec<Vec<u8>>,
}

impl Parts {
    fn tiny() -> Parts {
        let g = Gguf::open(&fixture("tiny.gguf")).unwrap();
        let bytes = g.tensors.iter().map(|t| {
            let start = (g.data_start + t.offset) as usize;
            g.map[start..start + g.byte_len(t).unwrap() as usize].to_vec()
        });
        Parts { kv: g.metadata.clone().into_iter().collect(), bytes: bytes.collect(), tensors: g.tensors.clone() }
    }

    fn set(&mut self, key: &str, v: Value) -> &mut Self {
        match self.kv.iter_mut().find(|(k, _)| k == key) {
            Some(e) => e.1 = v,
            None => self.kv.push((key.into(), v)),
        }
        self
    }

    fn remove_tensor(&mut self, name: &str) -> &mut Self {
        let i = self.tensors.iter().position(|t| t.name == name).unwrap();
        self.tensors.remove(i);
        self.bytes.remove(i);
        self
    }

    /// The data section: the tensors packed in table order at 32-byte alignment (offsets rewritten).
    fn data(&mut self) -> Vec<u8> {
        let mut data = Vec::new();
        for (t, b) in self.tensors.iter_mut().zip(&self.bytes) {
            t.offset = data.len() as u64;
            data.extend(b);
            data.resize(data.len().div_ceil(32) * 32, 0);
        }
        data
    }

    /// The file with its tensors packed.
    fn packed(&mut self) -> Vec<u8> {
        let data = self.data();
        self.file(&data)
    }

    /// The metadata encoded, to add entries the writer would not make.
    fn encoded_kv(&self) -> Vec<(String, u32, Vec<u8>)> {
        self.kv.iter().map(|(k, v)| (k.clone(), encode(v).0, encode(v).1)).collect()
    }

    /// The file with the table's offsets as they are and `data` as the data section.
    fn file(&self, data: &[u8]) -> Vec<u8> {
        write_gguf(&self.encoded_kv(), &self.tensors, data, 32)
    }
}

/// Every error a reader gives for a GGUF file, from opening it to the model and the tokenizer.
fn load_error(bytes: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.gguf");
    std::fs::write(&path, bytes).unwrap();
    let e = match load_llama(path.to_str().unwrap(), tch::Device::Cpu).and_then(|_| load_tok(path.to_str().unwrap())) {
        Ok(_) => panic!("loaded"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("bad.gguf: "), "{e}");
    for hf in ["model.layers", "self_attn", "embed_tokens", "lm_head", "tokenizer.json", "mlp."] {
        assert!(!e.contains(hf), "names `{hf}`, which is not in the file: {e}");
    }
    e
}

/// The writer is right: tiny.gguf taken apart and packed again loads as the original.
#[test]
fn a_gguf_written_back_loads_as_the_original() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("again.gguf");
    std::fs::write(&path, Parts::tiny().packed()).unwrap();
    let (a, b) = (Gguf::open(&path).unwrap(), Gguf::open(&fixture("tiny.gguf")).unwrap());
    assert_eq!(a.metadata, b.metadata);
    assert_eq!(a.tensors.iter().map(|t| (&t.name, &t.dims, t.type_id, t.offset)).collect::<Vec<_>>(), b.tensors.iter().map(|t| (&t.name, &t.dims, t.type_id, t.offset)).collect::<Vec<_>>());
    for t in &a.tensors {
        assert!(a.dequantize(&t.name).unwrap().equal(&b.dequantize(&t.name).unwrap()), "{}", t.name);
    }
    // The layouts of the types read here are ggml's.
    for id in [0, 1, 2, 3, 8, 30] {
        assert_eq!(Some(DType::of(id).unwrap().block()), layout(id), "{}", type_name(id));
    }
}

#[test]
fn offsets_misaligned_wrapping_overlapping_or_leaving_gaps_are_refused() {
    let p = Parts::tiny();
    let data: Vec<u8> = {
        let g = Gguf::open(&fixture("tiny.gguf")).unwrap();
        g.map[g.data_start as usize..].to_vec()
    };
    // The second tensor in the data section, and the one before it.
    let mut order: Vec<usize> = (0..p.tensors.len()).collect();
    order.sort_by_key(|&i| p.tensors[i].offset);
    let (first, second, last) = (order[0], order[1], *order.last().unwrap());
    let name = p.tensors[second].name.clone();
    let with = |f: &dyn Fn(&mut Parts)| {
        let mut q = Parts { kv: p.kv.clone(), tensors: p.tensors.clone(), bytes: vec![] };
        f(&mut q);
        load_error(&q.file(&data))
    };
    let e = with(&|q| q.tensors[second].offset += 4);
    assert!(e.contains(&format!("tensor `{name}`: data offset {} is not a multiple of general.alignment (32)", p.tensors[second].offset + 4)), "{e}");
    // offset + size wraps past 2^64 (the offset itself aligned).
    let e = with(&|q| q.tensors[second].offset = u64::MAX - 31);
    assert!(e.contains(&format!("truncated: tensor `{name}` ends at byte")), "{e}");
    let e = with(&|q| q.tensors[second].offset = q.tensors[first].offset);
    assert!(e.contains("overlaps tensor"), "{e}");
    // A type of fewer bytes (F32 → F16): the tensor after it would start in the middle of nowhere.
    let f32s: Vec<usize> = order.iter().copied().filter(|&i| p.tensors[i].type_id == 0).collect();
    let middle = *f32s.iter().find(|&&i| i != last).unwrap();
    let e = with(&|q| q.tensors[middle].type_id = 1);
    assert!(e.contains("GGUF tensors are packed without gaps"), "{e}");
    let e = with(&|q| {
        let t = &mut q.tensors[last];
        t.type_id = if t.type_id == 0 { 1 } else { 0 };
    });
    assert!(e.contains("bytes follow the end of the tensor data") || e.contains("truncated"), "{e}");
    let e = with(&|q| q.tensors[second].type_id = 4);
    assert!(e.contains(&format!("tensor `{name}` has type id 4 (Q4_2), which is not a ggml tensor type")), "{e}");
    let e = with(&|q| q.tensors[second].dims = vec![0, 64]);
    assert!(e.contains("each must be at least 1"), "{e}");
    let e = with(&|q| q.tensors[second].dims = vec![1 << 40, 1 << 40]);
    assert!(e.contains("their product at most 2^63 - 1"), "{e}");
    let e = with(&|q| q.tensors[second].name = q.tensors[first].name.clone());
    assert!(e.contains(&format!("tensor `{}` appears twice in the tensor table", p.tensors[first].name)), "{e}");
    let e = with(&|q| {
        q.set("general.alignment", Value::Int(48));
    });
    assert!(e.contains("general.alignment = Int(48): expected a power of two"), "{e}");
}

#[test]
fn repeated_keys_absurd_counts_and_deep_nesting_are_refused() {
    let bytes = Parts::tiny().packed();
    // A key given twice (the first would have won, silently).
    let mut q = Parts::tiny();
    q.kv.push(("llama.block_count".into(), Value::Int(2)));
    assert!(load_error(&q.packed()).contains("metadata key `llama.block_count` appears twice"));
    // Counts in the header far beyond the file: refused before anything is allocated.
    for at in [8, 16] {
        let mut b = bytes.clone();
        b[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = load_error(&b);
        assert!(e.contains("truncated: the header claims"), "{e}");
    }
    // An array claiming 2^60 strings.
    let mut q = Parts::tiny();
    let data = q.data();
    let mut kv = q.encoded_kv();
    kv.push(("big".into(), 9, [8u32.to_le_bytes().as_slice(), &(1u64 << 60).to_le_bytes()].concat()));
    let e = load_error(&write_gguf(&kv, &q.tensors, &data, 32));
    assert!(e.contains("metadata `big` claims 1152921504606846976 elements of at least 8 bytes"), "{e}");
    // Arrays of arrays 100 000 deep (the reader once recursed until the stack overflowed).
    let mut deep = Vec::new();
    for _ in 0..100_000 {
        deep.extend(9u32.to_le_bytes());
        deep.extend(1u64.to_le_bytes());
    }
    deep.extend([4u32.to_le_bytes().as_slice(), &1u64.to_le_bytes(), &0u32.to_le_bytes()].concat());
    kv.pop();
    kv.push(("deep".into(), 9, deep));
    let e = load_error(&write_gguf(&kv, &q.tensors, &data, 32));
    assert!(e.contains("metadata `deep`: arrays nested more than 8 deep"), "{e}");
    // A bool that is neither 0 nor 1, a value type that does not exist.
    kv.pop();
    kv.push(("odd".into(), 7, vec![2]));
    assert!(load_error(&write_gguf(&kv, &q.tensors, &data, 32)).contains("metadata `odd`: a bool stored as 2"));
    kv.pop();
    kv.push(("odd".into(), 13, vec![0; 8]));
    assert!(load_error(&write_gguf(&kv, &q.tensors, &data, 32)).contains("metadata `odd`: unknown metadata value type 13"));
}

#[test]
fn hyperparameters_are_checked_against_the_tensors_before_anything_is_built() {
    let cases: Vec<(&str, Value, &str)> = vec![
        ("llama.block_count", Value::Int(1 << 40), "llama.block_count = 1099511627776, but the file has tensors of blocks blk.0 to blk.1"),
        ("llama.block_count", Value::Int(1), "tensor `blk.1.attn_norm.weight` is not part of a llama model (llama.block_count = 1)"),
        ("llama.block_count", Value::Int(0), "llama.block_count = 0: expected at least 1"),
        ("llama.embedding_length", Value::Int(1 << 40), "embedding_length"),
        ("llama.feed_forward_length", Value::Int(1 << 40), "llama.feed_forward_length"),
        ("llama.attention.head_count", Value::Int(3), "expected heads that divide the width into an even head dim"),
        ("llama.attention.head_count_kv", Value::Int(3), "KV heads that divide the heads"),
        ("llama.attention.head_count", Value::Int(64), "expected heads that divide the width into an even head dim"),
        ("llama.attention.layer_norm_rms_epsilon", Value::Float(f64::NAN), "llama.attention.layer_norm_rms_epsilon = NaN: expected a finite number above 0"),
        ("llama.rope.freq_base", Value::Float(-1.0), "llama.rope.freq_base = -1: expected a finite number above 0"),
        ("llama.block_count", Value::Str("two".into()), "metadata `llama.block_count` = Str(\"two\") is not an unsigned integer"),
    ];
    for (key, v, want) in cases {
        let mut p = Parts::tiny();
        let e = load_error(&p.set(key, v).packed());
        assert!(e.contains(want), "{key}: {e}");
    }
    let mut p = Parts::tiny();
    let e = load_error(&p.remove_tensor("blk.1.ffn_up.weight").packed());
    assert!(e.contains("tensor `blk.1.ffn_up.weight` is missing"), "{e}");
    let mut p = Parts::tiny();
    let e = load_error(&p.remove_tensor("token_embd.weight").packed());
    assert!(e.contains("tensor `token_embd.weight` is missing"), "{e}");
}

#[test]
fn the_tokenizer_is_checked_against_the_embedding_table() {
    let tokens = |p: &Parts| match &p.kv.iter().find(|(k, _)| k == "tokenizer.ggml.tokens").unwrap().1 {
        Value::Array(a) => a.clone(),
        _ => unreachable!(),
    };
    let p0 = Parts::tiny();
    let mut more = tokens(&p0);
    more.push(Value::Str("zzz".into()));
    let mut types = match &p0.kv.iter().find(|(k, _)| k == "tokenizer.ggml.token_type").unwrap().1 {
        Value::Array(a) => a.clone(),
        _ => unreachable!(),
    };
    types.push(Value::Int(1));
    let mut p = Parts::tiny();
    // llama.vocab_size, when there is one, stays the embedding's.
    let e = load_error(p.set("tokenizer.ggml.tokens", Value::Array(more)).set("tokenizer.ggml.token_type", Value::Array(types)).set("llama.vocab_size", Value::Int(264)).packed().as_slice());
    assert!(e.contains("tokenizer.ggml.tokens has 265 entries but token_embd.weight has 264 rows"), "{e}");
    let mut dup = tokens(&p0);
    dup[100] = dup[99].clone();
    let e = load_error(&Parts::tiny().set("tokenizer.ggml.tokens", Value::Array(dup)).packed());
    assert!(e.contains("tokenizer.ggml.tokens[100]") && e.contains("repeats tokenizer.ggml.tokens[99]"), "{e}");
    for key in ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id"] {
        let e = load_error(&Parts::tiny().set(key, Value::Int(264)).packed());
        assert!(e.contains(&format!("{key} = Int(264): expected a token id below 264")), "{e}");
    }
    let e = load_error(&Parts::tiny().set("tokenizer.ggml.merges", Value::Array(vec![Value::Str("Ġ q".into())])).packed());
    assert!(e.contains("tokenizer.ggml.merges[0] = \"Ġ q\": `Ġq` is not in tokenizer.ggml.tokens"), "{e}");
    let e = load_error(&Parts::tiny().set("tokenizer.ggml.merges", Value::Array(vec![Value::Str("Ġt".into())])).packed());
    assert!(e.contains("expected two tokens separated by one space"), "{e}");
    let e = load_error(&Parts::tiny().set("tokenizer.ggml.token_type", Value::Array(vec![Value::Int(9); 264])).packed());
    assert!(e.contains("tokenizer.ggml.token_type[0] = Int(9): expected a token type 0 to 6"), "{e}");
}

#[test]
fn non_finite_weights_are_refused_naming_the_tensor() {
    let mut p = Parts::tiny();
    let i = p.tensors.iter().position(|t| t.name == "blk.1.ffn_norm.weight").unwrap();
    assert_eq!(p.tensors[i].type_id, 0, "an F32 tensor");
    p.bytes[i][8..12].copy_from_slice(&f32::NAN.to_le_bytes());
    let e = load_error(&p.packed());
    assert!(e.contains("tensor `blk.1.ffn_norm.weight` holds a non-finite value (NaN) at element 2"), "{e}");
    // A Q8_0 block whose fp16 scale is +inf.
    let mut p = Parts::tiny();
    let i = p.tensors.iter().position(|t| t.type_id == 8).unwrap();
    p.bytes[i][34..36].copy_from_slice(&half::f16::INFINITY.to_le_bytes());
    let e = load_error(&p.packed());
    assert!(e.contains(&format!("tensor `{}` holds a non-finite value", p.tensors[i].name)), "{e}");
}

#[test]
fn a_directory_named_as_a_model_file_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("model.gguf");
    std::fs::create_dir(&d).unwrap();
    let e = crate::model::load_pretrained(d.to_str().unwrap(), tch::Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("model.gguf: is a directory, not a GGUF file"), "{e}");
    // And a file named as a Hugging Face folder.
    let e = crate::model::load_pretrained(fixture("expected.safetensors").to_str().unwrap(), tch::Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("expected.safetensors: is a file, not a Hugging Face model folder"), "{e}");
}

/// The GGUF reader under random single defects of tiny.gguf's header and tensor table (and
/// truncations anywhere): each is refused naming the file, or the model loads with the original's
/// weights and configuration (its free scalars aside: epsilon, rope base and context length are
/// what the file says they are) and its tokenizer builds.
#[test]
fn mutated_gguf_files_are_refused_or_load_as_the_original() {
    let original = std::fs::read(fixture("tiny.gguf")).unwrap();
    let header = 0..Gguf::open(&fixture("tiny.gguf")).unwrap().data_start as usize;
    let load = |p: &Path| -> Result<(LlamaConfig, Vec<(String, Tensor)>)> {
        let (vs, model) = load_llama(p.to_str().unwrap(), tch::Device::Cpu)?;
        load_tok(p.to_str().unwrap())?;
        let mut w: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        w.sort_by(|a, b| a.0.cmp(&b.0));
        Ok((model.cfg.clone(), w))
    };
    let (want_cfg, want) = load(&fixture("tiny.gguf")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tally = crate::testutil::mutate::run("gguf", &original, &dir.path().join("mutant.gguf"), header, 38, 1200, 1 << 30, |p| {
        let (mut cfg, w) = match load(p) {
            Err(e) => {
                let e = e.to_string();
                assert!(!e.contains("model.layers") && !e.contains("tokenizer.json"), "an error naming what is not in the file: {e}");
                return Err(e);
            }
            Ok(x) => x,
        };
        (cfg.rms_norm_eps, cfg.rope_theta, cfg.max_position_embeddings) = (want_cfg.rms_norm_eps, want_cfg.rope_theta, want_cfg.max_position_embeddings);
        if cfg != want_cfg {
            return Ok(crate::testutil::mutate::Loaded::Differs(format!("config {cfg:?}")));
        }
        match w.iter().zip(&want).find(|((n, a), (m, b))| n != m || !a.equal(b)) {
            Some(((n, _), _)) => Ok(crate::testutil::mutate::Loaded::Differs(format!("weight {n}"))),
            None if w.len() != want.len() => Ok(crate::testutil::mutate::Loaded::Differs("weights".into())),
            None => Ok(crate::testutil::mutate::Loaded::Same),
        }
    });
    assert!(tally.refused > tally.tried / 2, "{tally:?}");
}
