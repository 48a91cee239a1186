use super::*;
use crate::model::hf;
use crate::train::optim::{AdamW, Hyper};
use std::path::Path;
use tch::{Device, Kind};

fn teacher() -> (nn::VarStore, super::super::LlamaConfig) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama_tiny");
    let (vs, m) = hf::load_llama(&dir, Device::Cpu).unwrap();
    (vs, m.cfg.clone())
}

fn still(yaml: &str) -> Variant {
    serde_yaml::from_str(&format!("{{kind: still, {yaml}}}")).unwrap()
}

fn no_lora() -> LoraConfig {
    LoraConfig { targets: vec![], ..LoraConfig::default() }
}

fn ids(t: i64) -> Tensor {
    Tensor::randint(128, [2, t], (Kind::Int64, Device::Cpu))
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// still.md §12 (exact limit): with L ≤ 2C every query sees its whole prefix by softmax, so the hybrid's
/// logits are the teacher's for any feature map; a short chunk must differ (the test can fail).
#[test]
fn exact_softmax_settings_equal_the_teacher() {
    tch::manual_seed(1);
    let (tvs, cfg) = teacher();
    let x = ids(32);
    let vs = nn::VarStore::new(Device::Cpu);
    let h = Hybrid::from_teacher(&vs, &tvs, cfg.clone(), &still("chunk: 16"), &no_lora()).unwrap();
    let want = tch::no_grad(|| h.llama.logits(&h.llama.hidden(&x)));
    let got = tch::no_grad(|| h.logits(&x, false));
    assert!(max_diff(&got, &want) < 1e-4, "exact STILL differs: {}", max_diff(&got, &want));
    let (loss, _) = tch::no_grad(|| h.attention_transfer_loss(&x));
    assert!(loss.double_value(&[]) < 1e-6);

    let vs2 = nn::VarStore::new(Device::Cpu);
    let h2 = Hybrid::from_teacher(&vs2, &tvs, cfg, &still("chunk: 4, tokens_per_chunk: 1"), &no_lora()).unwrap();
    let got2 = tch::no_grad(|| h2.logits(&x, false));
    assert!(max_diff(&got2, &want) > 1e-4, "a 4-token chunk cannot be exact");
}

fn snapshot(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vs.variables().into_iter().map(|(n, t)| (n, t.detach().copy())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Stage 1: the loss is 1000 · mean over layers of the per-head MSE, it decreases under AdamW, and
/// only the new attention parameters change.
#[test]
fn stage1_loss_decreases_and_only_new_params_change() {
    tch::manual_seed(2);
    let (tvs, cfg) = teacher();
    for variant in [still("chunk: 4, tokens_per_chunk: 1"), serde_yaml::from_str("{kind: lolcats, window: 4, feature_dim: 8}").unwrap()] {
        let vs = nn::VarStore::new(Device::Cpu);
        let h = Hybrid::from_teacher(&vs, &tvs, cfg.clone(), &variant, &LoraConfig::default()).unwrap();
        for (n, t) in vs.variables() {
            let _ = t.shallow_clone().set_requires_grad(is_attention_param(&n));
        }
        let before = snapshot(&vs);
        let params = crate::train::named_parameters(&vs);
        assert!(!params.is_empty() && params.iter().all(|(n, _)| is_attention_param(n)));
        let mut opt = AdamW::new(params, Hyper { betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.0 });
        let x = ids(32);
        let mut losses = Vec::new();
        for _ in 0..15 {
            opt.zero_grad();
            let (loss, per_layer) = h.attention_transfer_loss(&x);
            assert_eq!(per_layer.size(), vec![2]);
            assert!((loss.double_value(&[]) - 1000.0 * per_layer.mean(Kind::Float).double_value(&[])).abs() < 1e-6 * loss.double_value(&[]).max(1.0));
            loss.backward();
            opt.step(1e-2).unwrap();
            losses.push(loss.double_value(&[]));
        }
        assert!(losses[14] < 0.9 * losses[0], "{variant:?}: stage-1 loss did not decrease: {losses:?}");
        let after = snapshot(&vs);
        let mut changed = 0;
        for ((n, a), (_, b)) in before.iter().zip(&after) {
            let same = a.equal(b);
            if is_attention_param(n) {
                changed += (!same) as usize;
            } else {
                assert!(same, "{n} changed in stage 1");
            }
        }
        assert!(changed > 0);
    }
}

/// LoRA with B = 0 leaves the hybrid unchanged; with B ≠ 0 the merged export gives the same logits.
#[test]
fn lora_identity_at_init_and_merge_matches() {
    tch::manual_seed(3);
    let (tvs, cfg) = teacher();
    let x = ids(24);
    let variant = still("chunk: 4, tokens_per_chunk: 1");
    let lora = LoraConfig { targets: ["q_proj", "k_proj", "v_proj", "o_proj", "g_proj"].iter().map(|s| s.to_string()).collect(), ..LoraConfig::default() };
    let vs = nn::VarStore::new(Device::Cpu);
    let mut h = Hybrid::from_teacher(&vs, &tvs, cfg.clone(), &variant, &lora).unwrap();
    assert_eq!(h.lora.len(), 2 * 5);
    assert!(vs.variables().contains_key("model.layers.1.self_attn.g_proj.lora_B"));
    let with = tch::no_grad(|| h.logits(&x, false));
    let adapters = std::mem::take(&mut h.lora);
    let without = tch::no_grad(|| h.logits(&x, false));
    assert!(with.equal(&without), "B = 0 must leave the logits unchanged");
    h.lora = adapters;
    tch::no_grad(|| {
        for l in h.lora.values() {
            l.b.shallow_clone().copy_(&(Tensor::randn(l.b.size(), (Kind::Float, Device::Cpu)) * 0.05));
        }
    });
    let unmerged = tch::no_grad(|| h.logits(&x, false));
    assert!(max_diff(&unmerged, &without) > 1e-4);
    let vs2 = nn::VarStore::new(Device::Cpu);
    let h2 = Hybrid::from_teacher(&vs2, &tvs, cfg, &variant, &no_lora()).unwrap();
    hf::copy_into(&vs2, h.merged_weights().into_iter().collect(), Path::new("merged")).unwrap();
    let merged = tch::no_grad(|| h2.logits(&x, false));
    assert!(max_diff(&merged, &unmerged) < 1e-4, "merged ≠ unmerged: {}", max_diff(&merged, &unmerged));
}

/// The export folder (merged weights, config.json, hybrid.yaml) loads back into the same model: a LoRA'd
/// LoLCATs student (B ≠ 0, so merging matters) gives the same logits after the round trip.
#[test]
fn export_round_trip() {
    tch::manual_seed(4);
    let (tvs, cfg) = teacher();
    let x = ids(24);
    let variant: Variant = serde_yaml::from_str("{kind: lolcats, window: 4, feature_dim: 8}").unwrap();
    let lora = LoraConfig { targets: vec!["q_proj".into(), "v_proj".into()], ..LoraConfig::default() };
    let vs = nn::VarStore::new(Device::Cpu);
    let h = Hybrid::from_teacher(&vs, &tvs, cfg, &variant, &lora).unwrap();
    tch::no_grad(|| {
        for l in h.lora.values() {
            l.b.shallow_clone().copy_(&(Tensor::randn(l.b.size(), (Kind::Float, Device::Cpu)) * 0.05));
        }
        let _ = vs.variables()["model.layers.0.self_attn.window_factors"].shallow_clone().fill_(0.7);
    });
    let dir = tempfile::tempdir().unwrap();
    h.save_export(&variant, dir.path()).unwrap();
    let (_vs2, back) = Hybrid::load_export(dir.path(), Device::Cpu).unwrap();
    let (want, got) = tch::no_grad(|| (h.logits(&x, false), back.logits(&x, false)));
    assert!(max_diff(&got, &want) < 1e-4, "{}", max_diff(&got, &want));
    let HybridAttention::Lolcats(l) = &back.attn[0] else { panic!("variant lost") };
    assert!((l.gamma() - 0.7f64.exp() / (1.0 + 0.7f64.exp())).abs().max().double_value(&[]) < 1e-6, "trained γ kept");
}
