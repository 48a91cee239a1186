use super::*;
use crate::model::hf;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn check_against_hf(dir: &Path, expected_dir: &Path) {
    let (_vs, model) = hf::load_llama(dir, Device::Cpu).unwrap();
    let expected: HashMap<String, Tensor> = Tensor::read_safetensors(expected_dir.join("expected.safetensors")).unwrap().into_iter().collect();
    let x = &expected["input_ids"];
    let logits = tch::no_grad(|| model.logits(&model.hidden(x)));
    let want = &expected["logits"];
    let diff = (&logits - want).abs().max().double_value(&[]);
    let tol = 1e-4 * want.abs().max().double_value(&[]).max(1.0);
    assert!(diff <= tol, "{}: max |Δlogits| = {diff}", dir.display());
    let t = x.size()[1];
    let lp = logits.narrow(1, 0, t - 1).log_softmax(-1, Kind::Float);
    let loss = -lp.gather(2, &x.narrow(1, 1, t - 1).unsqueeze(2), false).mean(Kind::Float).double_value(&[]);
    assert!((loss - expected["loss"].double_value(&[])).abs() < 1e-5, "loss {loss}");
}

/// Tied embeddings, grouped-query attention (4 query / 2 KV heads) and llama3 RoPE scaling.
#[test]
fn tied_gqa_llama3_rope_matches_hugging_face() {
    check_against_hf(&fixture("llama_tiny"), &fixture("llama_tiny"));
}

/// Untied head, default RoPE, loaded from one file and from a sharded index.
#[test]
fn untied_and_sharded_checkpoints_match_hugging_face() {
    check_against_hf(&fixture("llama_tiny_untied"), &fixture("llama_tiny_untied"));
    check_against_hf(&fixture("llama_tiny_untied/sharded"), &fixture("llama_tiny_untied"));
}

/// llama3 scaling by hand: high frequencies kept, low ones divided by `factor`, a ramp between.
#[test]
fn llama3_inverse_frequencies_follow_the_formula() {
    let cfg = LlamaConfig::from_hf_json(&std::fs::read_to_string(fixture("llama_tiny/config.json")).unwrap()).unwrap();
    let RopeScaling::Llama3 { factor, low_freq_factor: lo, high_freq_factor: hi, original_max_position_embeddings: old } = cfg.rope_scaling.clone() else {
        panic!("fixture has llama3 scaling, got {:?}", cfg.rope_scaling)
    };
    let got: Vec<f64> = Vec::try_from(cfg.inv_freq(Device::Cpu).to_kind(Kind::Double)).unwrap();
    let hd = cfg.head_dim() as f64;
    for (i, g) in got.iter().enumerate() {
        let base = 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / hd);
        let wl = 2.0 * std::f64::consts::PI / base;
        let want = if wl < old / hi {
            base
        } else if wl > old / lo {
            base / factor
        } else {
            let s = (old / wl - lo) / (hi - lo);
            (1.0 - s) * base / factor + s * base
        };
        assert!((g - want).abs() <= 1e-6 * want, "i={i}: {g} vs {want}");
    }
}

/// save → load gives the same tensors and logits; config.json round-trips.
#[test]
fn save_and_reload_round_trip() {
    let (vs, model) = hf::load_llama(&fixture("llama_tiny"), Device::Cpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    hf::save_llama(&vs, &model.cfg, dir.path()).unwrap();
    let (_vs2, again) = hf::load_llama(dir.path(), Device::Cpu).unwrap();
    assert_eq!(again.cfg, model.cfg);
    let x = Tensor::arange(40, (Kind::Int64, Device::Cpu)).view([2, 20]);
    let d = (model.logits(&model.hidden(&x)) - again.logits(&again.hidden(&x))).abs().max().double_value(&[]);
    assert_eq!(d, 0.0);
}

/// Prefill then token-by-token decoding with the KV cache equals the full forward pass.
#[test]
fn cached_decoding_equals_full_forward() {
    let (_vs, model) = hf::load_llama(&fixture("llama_tiny"), Device::Cpu).unwrap();
    let x = (Tensor::arange(24, (Kind::Int64, Device::Cpu)).view([2, 12]) * 5).remainder(128);
    let full = tch::no_grad(|| model.logits(&model.hidden(&x)));
    let mut cache = model.new_cache(2, Kind::Float, Device::Cpu);
    let mut got = vec![tch::no_grad(|| model.extend(&mut cache, &x.narrow(1, 0, 4)))];
    for t in 4..12 {
        got.push(tch::no_grad(|| model.extend(&mut cache, &x.narrow(1, t, 1))));
    }
    let got = Tensor::cat(&got, 1);
    let d = (&got - &full).abs().max().double_value(&[]);
    assert!(d < 1e-4, "{d}");
    // GQA: the cache holds 2 KV heads, not 4 query heads.
    assert_eq!(cache.bytes(), 2 * 2 * (2 * 2 * 12 * 16) * 4);
}
