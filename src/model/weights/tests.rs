//! Safetensors files and Hugging Face folders (config.json against the weights): defects refused
//! naming the file and what is wrong, and random single defects of both files of a folder.
use super::*;
use crate::model::{hf, LlamaConfig};
use crate::testutil::mutate::{self, Loaded};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// A safetensors file of `header` (JSON text) and `data`.
fn st(header: &str, data: &[u8]) -> Vec<u8> {
    [(header.len() as u64).to_le_bytes().as_slice(), header.as_bytes(), data].concat()
}

fn read_err(bytes: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("w.safetensors");
    std::fs::write(&p, bytes).unwrap();
    let e = read_safetensors(&p).err().expect("refused").to_string();
    assert!(e.contains("w.safetensors: "), "{e}");
    e
}

#[test]
fn safetensors_headers_are_validated() {
    let ok = st(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#, &[0; 8]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ok.safetensors"), &ok).unwrap();
    let t = read_safetensors(&dir.path().join("ok.safetensors")).unwrap();
    assert_eq!((t[0].0.as_str(), t[0].1.size()), ("a", vec![2]));
    let cases = [
        (st(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#, &[0; 16]), "not a valid safetensors file"),
        (st(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#, &[0; 8]), "header: tensor `a` appears twice"),
        (st(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#, &[0; 8]), "invalid offset"),
        (st(r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#, &[0; 8]), "invalid shape, data type, or offset"),
        (st(r#"{"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}}"#, &[0; 8]), "overflow"),
        (st(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#, &[0; 12]), "not fully covered"),
        (st(r#"{"a":{"dtype":"F8_E4M3","shape":[8],"data_offsets":[0,8]}}"#, &[0; 8]), "tensor `a` has dtype F8_E4M3, which torch does not hold"),
        (st(r#"{"a":{"dtype":"Q4","shape":[8],"data_offsets":[0,8]}}"#, &[0; 8]), "invalid JSON in header"),
        ([u64::MAX.to_le_bytes().as_slice(), b"{}"].concat(), "header too large"),
        (b"abc".to_vec(), "header too small"),
    ];
    for (bytes, want) in cases {
        let e = read_err(&bytes);
        assert!(e.contains(want), "want {want:?}: {e}");
    }
    let e = read_safetensors(dir.path()).err().unwrap().to_string();
    assert!(e.contains("is a directory, not a safetensors file"), "{e}");
}

/// A copy of the tiny Llama folder to break.
fn tiny_folder() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("llama_tiny").join(f), dir.path().join(f)).unwrap();
    }
    dir
}

fn set_config(dir: &Path, key: &str, v: serde_json::Value) {
    let p = dir.join("config.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    c[key] = v;
    std::fs::write(&p, c.to_string()).unwrap();
}

#[test]
fn config_json_is_checked_against_the_weights_before_a_layer_is_built() {
    let cases = [
        ("num_hidden_layers", serde_json::json!(1u64 << 30), "config.json: num_hidden_layers = 1073741824, but the weights have layers model.layers.0 to model.layers.1"),
        ("hidden_size", serde_json::json!(1u64 << 20), "config.json: vocab_size = 128, hidden_size = 1048576, but model.embed_tokens.weight has shape [128, 64]"),
        ("intermediate_size", serde_json::json!(1u64 << 30), "config.json: intermediate_size = 1073741824, but model.layers.0.mlp.up_proj.weight has shape [176, 64]"),
        ("vocab_size", serde_json::json!(1u64 << 30), "model.embed_tokens.weight has shape [128, 64]"),
        ("num_attention_heads", serde_json::json!(0), "config.json: `num_attention_heads` = 0: expected an integer from 1"),
        ("num_attention_heads", serde_json::json!(3), "expected heads that divide the width"),
        ("num_key_value_heads", serde_json::json!(3), "KV heads that divide the heads"),
        ("hidden_size", serde_json::json!(64.5), "`hidden_size` = 64.5: expected an integer"),
        ("rms_norm_eps", serde_json::json!(-1.0), "`rms_norm_eps` = -1.0: expected a finite number above 0"),
        ("tie_word_embeddings", serde_json::json!("yes"), "`tie_word_embeddings` = \"yes\": expected true or false"),
    ];
    for (key, v, want) in cases {
        let dir = tiny_folder();
        set_config(dir.path(), key, v);
        // The fixture's head_dim would disagree first.
        set_config(dir.path(), "head_dim", serde_json::Value::Null);
        let e = hf::load_llama(dir.path(), tch::Device::Cpu).err().unwrap().to_string();
        assert!(e.contains(&dir.path().join("config.json").display().to_string()) && e.contains(want), "{key}: {e}");
    }
    // A shard named outside the folder.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("llama_tiny/config.json"), dir.path().join("config.json")).unwrap();
    std::fs::write(dir.path().join("model.safetensors.index.json"), r#"{"weight_map": {"a": "../elsewhere.safetensors"}}"#).unwrap();
    let e = hf::load_llama(dir.path(), tch::Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("weight_map.a = \"../elsewhere.safetensors\": expected the name of a file in the folder"), "{e}");
    // A non-finite weight, named.
    let dir = tiny_folder();
    let w: Vec<(String, Tensor)> = read_safetensors(&dir.path().join("model.safetensors")).unwrap();
    let i = w.iter().position(|(n, _)| n == "model.norm.weight").unwrap();
    let _ = w[i].1.get(3).fill_(f64::INFINITY);
    Tensor::write_safetensors(&w, dir.path().join("model.safetensors")).unwrap();
    let e = hf::load_llama(dir.path(), tch::Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("model.norm.weight holds non-finite values"), "{e}");
}

/// The model of a folder, its weights sorted by name; its configuration with the scalars a file may
/// set freely (epsilon, rope base and scaling, context length) put to `like`'s.
fn load(dir: &Path, like: Option<&LlamaConfig>) -> crate::Result<(LlamaConfig, Vec<(String, Tensor)>)> {
    let (vs, model) = hf::load_llama(dir, tch::Device::Cpu)?;
    let mut cfg = model.cfg.clone();
    if let Some(l) = like {
        (cfg.rms_norm_eps, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings) = (l.rms_norm_eps, l.rope_theta, l.rope_scaling.clone(), l.max_position_embeddings);
    }
    let mut w: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((cfg, w))
}

fn same(got: (LlamaConfig, Vec<(String, Tensor)>), want: &(LlamaConfig, Vec<(String, Tensor)>)) -> Loaded {
    if got.0 != want.0 {
        return Loaded::Differs(format!("config {:?}", got.0));
    }
    if got.1.len() != want.1.len() {
        return Loaded::Differs("a different set of weights".into());
    }
    match got.1.iter().zip(&want.1).find(|((n, a), (m, b))| n != m || !a.equal(b)) {
        Some(((n, _), _)) => Loaded::Differs(format!("weight {n}")),
        None => Loaded::Same,
    }
}

/// Random single defects of a Hugging Face folder's safetensors header (and truncations anywhere),
/// then of its config.json: each refused naming the file, or the model loads as the original.
#[test]
fn mutated_safetensors_headers_and_configs_are_refused_or_load_as_the_original() {
    let want = load(&fixture("llama_tiny"), None).unwrap();
    let dir = tiny_folder();
    let weights = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let header = 0..8 + u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
    let t = mutate::run("safetensors header", &weights, &dir.path().join("model.safetensors"), header, 38, 600, 1 << 30, |_| {
        load(dir.path(), Some(&want.0)).map(|got| same(got, &want)).map_err(|e| e.to_string())
    });
    assert!(t.refused > t.tried / 2, "{t:?}");
    std::fs::write(dir.path().join("model.safetensors"), &weights).unwrap();
    let config = std::fs::read(dir.path().join("config.json")).unwrap();
    let t = mutate::run("config.json", &config, &dir.path().join("config.json"), 0..config.len(), 38, 600, 1 << 30, |_| {
        load(dir.path(), Some(&want.0)).map(|got| same(got, &want)).map_err(|e| e.to_string())
    });
    assert!(t.refused > t.tried / 3, "{t:?}");
}
