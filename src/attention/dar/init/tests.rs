use super::*;
use crate::model::hf;
use crate::finetune::dar_start::{add_dar_to_pretrained, BottleneckInit};
use crate::attention::AttentionSpec;
use crate::model::llama::{Family, Llama, LlamaConfig, RopeScaling};
use crate::spec::{AttentionImpl, AttentionKind};
use std::path::Path;
use tch::nn::{OptimizerConfig, VarStore};
use tch::Device;

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

fn dar(d_down: usize, window: usize) -> AttentionSpec {
    crate::testutil::softmax(AttentionKind::Dar, d_down, window).with_implementation(AttentionImpl::Reference)
}

/// By hand: rows ±2·e1, ±1·e2 have C = diag(2, 0.5); the top direction is e1 and projecting onto it
/// loses 0.5 per row on average.
#[test]
fn pca_of_a_hand_made_cloud() {
    let _rng = crate::testutil::rng();
    let a = Tensor::from_slice(&[2.0f64, 0.0, 0.0, 1.0, -2.0, 0.0, 0.0, -1.0]).view([4, 2]);
    let (u, vals) = pca_basis(&a, 1);
    assert_eq!(Vec::<f64>::try_from(vals).unwrap(), vec![2.0, 0.5]);
    let u: Vec<f64> = Vec::try_from(u.flatten(0, -1)).unwrap();
    assert!((u[0].abs() - 1.0).abs() < 1e-12 && u[1].abs() < 1e-12, "{u:?}");
}

/// The mean squared reconstruction error of projecting onto the top-k directions equals the sum of
/// the discarded eigenvalues (random anisotropic cloud, every k).
#[test]
fn pca_reconstruction_error_is_the_discarded_eigenvalues() {
    let _rng = crate::testutil::seeded(1);
    let scales = Tensor::from_slice(&[5.0f64, 3.0, 2.0, 1.0, 0.5, 0.25]);
    let a = Tensor::randn([300, 6], (Kind::Double, Device::Cpu)) * scales + 0.3;
    for k in 1..=6 {
        let (u, vals) = pca_basis(&a, k);
        let err = (&a - a.matmul(&u).matmul(&u.tr())).pow_tensor_scalar(2).sum(Kind::Double).double_value(&[]) / 300.0;
        let tail = vals.narrow(0, k as i64, 6 - k as i64).sum(Kind::Double).double_value(&[]);
        assert!((err - tail).abs() < 1e-9 * (1.0 + tail), "k={k}: {err} vs {tail}");
    }
}

/// PCA with d_down = d makes W_up·W_down = I: the DAR model is the original one; at d/4 the returned
/// discarded fraction is what projecting the layer's own K/V input actually loses.
#[test]
fn pca_at_full_width_gives_the_original_logits() {
    let _rng = crate::testutil::rng();
    for name in ["llama_tiny", "olmo2_tiny"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
        let x = (Tensor::arange(48, (Kind::Int64, Device::Cpu)).view([2, 24]) * 7).remainder(128);
        let (vs, mut m) = hf::load_llama(&dir, Device::Cpu).unwrap();
        let want = tch::no_grad(|| m.logits(&m.hidden(&x)));
        let d = m.cfg.hidden_size;
        let lost = add_dar_to_pretrained(&mut m, &vs.root(), dar(d, 4), BottleneckInit::Pca, Some(&x), None).unwrap();
        assert!(lost.iter().all(|&f| f.abs() < 1e-9), "{lost:?}");
        let got = tch::no_grad(|| m.logits(&m.hidden(&x)));
        assert!(max_diff(&got, &want) < 1e-4, "{name}: {}", max_diff(&got, &want));

        let (vs, mut m) = hf::load_llama(&dir, Device::Cpu).unwrap();
        let lost = add_dar_to_pretrained(&mut m, &vs.root(), dar(d / 4, 4), BottleneckInit::Pca, Some(&x), None).unwrap();
        let a = tch::no_grad(|| m.kv_input(0, &m.embed(&x))).reshape([-1, d as i64]).to_kind(Kind::Double);
        let (down, up) = m.bottleneck(0).unwrap();
        let rec = a.matmul(&down.to_kind(Kind::Double).tr()).matmul(&up.to_kind(Kind::Double).tr());
        let frac = (&a - rec).pow_tensor_scalar(2).sum(Kind::Double).double_value(&[]) / a.pow_tensor_scalar(2).sum(Kind::Double).double_value(&[]);
        assert!((frac - lost[0]).abs() < 1e-5 && lost[0] > 0.0, "{name}: measured {frac}, reported {}", lost[0]);
    }
}

/// Calibration on packed rows sees each layer's inputs as `hidden_docs` computes them: layer 1's
/// reported discarded fraction is what its bottleneck loses on the packed layer-1 inputs.
#[test]
fn pca_calibration_follows_document_ids() {
    let _rng = crate::testutil::rng();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/olmo2_tiny");
    let x = (Tensor::arange(48, (Kind::Int64, Device::Cpu)).view([2, 24]) * 7).remainder(128);
    let docs = Tensor::arange(48, (Kind::Int64, Device::Cpu)).view([2, 24]).divide_scalar_mode(7, "floor");
    let (vs, mut m) = hf::load_llama(&dir, Device::Cpu).unwrap();
    let lost = add_dar_to_pretrained(&mut m, &vs.root(), dar(16, 4), BottleneckInit::Pca, Some(&x), Some(&docs)).unwrap();
    let a1 = tch::no_grad(|| {
        let (seg, cos, sin) = m.doc_tables(&x, Some(&docs));
        let x1 = m.layer_forward_docs(0, &m.embed(&x), &cos, &sin, seg.as_ref());
        m.kv_input(1, &x1).reshape([-1, 64]).to_kind(Kind::Double)
    });
    let (down, up) = m.bottleneck(1).unwrap();
    let rec = a1.matmul(&down.to_kind(Kind::Double).tr()).matmul(&up.to_kind(Kind::Double).tr());
    let frac = (&a1 - rec).pow_tensor_scalar(2).sum(Kind::Double).double_value(&[]) / a1.pow_tensor_scalar(2).sum(Kind::Double).double_value(&[]);
    assert!((frac - lost[1]).abs() < 1e-5, "measured {frac}, reported {}", lost[1]);
    // Without the document ids layer 1 sees other inputs, so its calibration differs.
    let (vs, mut plain) = hf::load_llama(&dir, Device::Cpu).unwrap();
    let lost_plain = add_dar_to_pretrained(&mut plain, &vs.root(), dar(16, 4), BottleneckInit::Pca, Some(&x), None).unwrap();
    assert!((lost_plain[0] - lost[0]).abs() < 1e-9 && (lost_plain[1] - lost[1]).abs() > 1e-6, "{lost_plain:?} vs {lost:?}");
}

/// A tiny model trained on a copy task (the second half of each row repeats the first, 16 tokens
/// back, beyond the window of 4) starts DAR at d/4 with a lower loss from PCA than from small_init.
#[test]
fn pca_starts_below_small_init_on_a_trained_model() {
    let _rng = crate::testutil::rng();
    tch::set_num_threads(1); // tiny matrices: threads only add overhead
    for family in [Family::Llama, Family::Olmo2] {
        let cfg = LlamaConfig {
            vocab_size: 16, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
            num_key_value_heads: 2, rms_norm_eps: 1e-5, rope_theta: 10000.0, rope_scaling: RopeScaling::Default,
            tie_word_embeddings: true, max_position_embeddings: 32, family, attention: Default::default(),
        };
        let _rng = crate::testutil::seeded(11);
        let vs = VarStore::new(Device::Cpu);
        let m = Llama::new(&vs.root(), cfg.clone());
        let batch = |n: i64| {
            let half = Tensor::randint(16, [n, 16], (Kind::Int64, Device::Cpu));
            Tensor::cat(&[&half, &half], 1)
        };
        let loss_of = |m: &Llama, x: &Tensor| {
            let logits = m.logits(&m.hidden(&x.narrow(1, 0, 31)));
            logits.reshape([-1, 16]).cross_entropy_for_logits(&x.narrow(1, 1, 31).reshape([-1]))
        };
        let mut opt = tch::nn::Adam::default().build(&vs, 1e-2).unwrap();
        let t0 = std::time::Instant::now();
        for _ in 0..150 {
            opt.backward_step(&loss_of(&m, &batch(16)));
        }
        let eval = batch(64);
        let vanilla = tch::no_grad(|| loss_of(&m, &eval)).double_value(&[]);
        let start = |init: BottleneckInit| {
            let vs2 = VarStore::new(Device::Cpu);
            let mut m2 = Llama::new(&vs2.root(), cfg.clone());
            tch::no_grad(|| {
                for (name, v) in vs2.variables() {
                    v.shallow_clone().copy_(&vs.variables()[&name]);
                }
            });
            add_dar_to_pretrained(&mut m2, &vs2.root(), dar(8, 4), init, Some(&batch(16)), None).unwrap();
            tch::no_grad(|| loss_of(&m2, &eval)).double_value(&[])
        };
        let (pca, small) = (start(BottleneckInit::Pca), start(BottleneckInit::SmallInit));
        eprintln!("{family:?} ({:.1}s): trained vanilla loss {vanilla:.4}, DAR d/4 step 0: pca {pca:.4}, small_init {small:.4}", t0.elapsed().as_secs_f64());
        // Uniform guessing is ln 16 = 2.77; a perfect copier still guesses the first 15 of the 31 targets: ≈ 15/31 of that = 1.34.
        assert!(vanilla < 1.9, "{family:?}: the model did not learn the copy task ({vanilla})");
        assert!(pca < small, "{family:?}: pca {pca} vs small_init {small}");
    }
}

/// The predicate stage 1 of fine-tuning uses picks exactly the bottleneck matrices of a DAR model.
#[test]
fn bottleneck_parameters_are_recognised() {
    let _rng = crate::testutil::rng();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/olmo2_tiny");
    let (vs, mut m) = hf::load_llama(&dir, Device::Cpu).unwrap();
    m.add_dar(&vs.root(), dar(16, 4)).unwrap();
    let mut picked: Vec<String> = vs.variables().into_keys().filter(|n| crate::attention::is_bottleneck_param(n)).collect();
    picked.sort();
    let want: Vec<String> = (0..2).flat_map(|i| ["down", "up"].map(|w| format!("model.layers.{i}.self_attn.bottleneck_{w}.weight"))).collect();
    assert_eq!(picked, want);
    assert!(crate::attention::is_bottleneck_param("gpt_neox.layers.3.attention.bottleneck_up.weight"));
    assert!(!crate::attention::is_bottleneck_param("model.layers.0.self_attn.k_proj.weight"));
}

/// A resolved tiny spec (`arch` neox or llama) with `attention` (YAML) and `train.seed`.
fn pretrain_spec(arch: &str, attention: &str, seed: u64) -> crate::spec::Spec {
    let flavor = if arch == "neox" { "tiny" } else { "llama-tiny" };
    let yaml = format!("model: {{flavor: {flavor}}}\nattention: {attention}\ndata: {{train: {{synthetic: {{seed: 1, docs: 10}}}}}}\ntrain: {{steps: 2, seed: {seed}}}\n");
    let mut s = crate::spec::from_str(&yaml, "test", &[]).unwrap();
    s.model.vocab = Some(97);
    s
}

/// Every variable of a model built from `spec`, the global generator seeded with `global`.
fn weights(spec: &crate::spec::Spec, global: i64) -> std::collections::BTreeMap<String, Tensor> {
    let _rng = crate::testutil::seeded(global);
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let _m = crate::train::run::build_model(spec, &vs);
    vs.variables().into_iter().collect()
}

#[test]
fn dar_and_uniform_runs_start_from_the_vanilla_runs_weights_of_the_same_seed() {
    let _rng = crate::testutil::rng();
    for arch in ["neox", "llama"] {
        let vanilla = weights(&pretrain_spec(arch, "{kind: vanilla}", 5), 5);
        for att in ["{kind: dar, d_down: 16, window: 8}", "{kind: uniform, d_down: 8}", "{kind: dar, d_down: 16, window: 8, init: orthogonal}"] {
            let dar = weights(&pretrain_spec(arch, att, 5), 5);
            for (name, w) in &vanilla {
                let other = dar.get(name).unwrap_or_else(|| panic!("{arch} {att}: no {name}"));
                assert!(w.equal(other), "{arch} {att}: {name} differs from vanilla's");
            }
            let own: Vec<&String> = dar.keys().filter(|k| !vanilla.contains_key(*k)).collect();
            assert!(!own.is_empty() && own.iter().all(|k| crate::attention::is_bottleneck_param(k)), "{arch}: {own:?}");
            assert!(own.iter().all(|k| dar[*k].abs().sum(Kind::Double).double_value(&[]) > 0.0), "bottleneck left at zero");
        }
        // The bottleneck's stream depends on the run's seed only, not on the global generator's state.
        let att = "{kind: dar, d_down: 16, window: 8}";
        let (a, b, c) = (weights(&pretrain_spec(arch, att, 5), 5), weights(&pretrain_spec(arch, att, 5), 99), weights(&pretrain_spec(arch, att, 6), 5));
        for k in a.keys().filter(|k| crate::attention::is_bottleneck_param(k)) {
            assert!(a[k].equal(&b[k]), "{arch} {k}: depends on the global generator");
            assert!(!a[k].equal(&c[k]), "{arch} {k}: seeds 5 and 6 drew the same bottleneck");
        }
        // Layers draw different matrices.
        let downs: Vec<&Tensor> = a.iter().filter(|(k, _)| k.ends_with("bottleneck_down.weight")).map(|(_, v)| v).collect();
        assert!(downs.len() == 2 && !downs[0].equal(downs[1]));
    }
}

#[test]
fn orthogonal_start_has_orthonormal_rows_and_up_is_down_transposed() {
    let _rng = crate::testutil::rng();
    for (d, k) in [(64usize, 16usize), (32, 32), (48, 5)] {
        let (down, up) = pretraining_start(AttentionInit::Orthogonal, 3, 1, d, k);
        assert_eq!((down.size(), up.size()), (vec![k as i64, d as i64], vec![d as i64, k as i64]));
        assert!(up.equal(&down.tr()), "W_up = W_downᵀ exactly");
        let gram = down.to_kind(Kind::Double).matmul(&down.to_kind(Kind::Double).tr());
        let err = (gram - Tensor::eye(k as i64, (Kind::Double, tch::Device::Cpu))).abs().max().double_value(&[]);
        assert!(err < 1e-5, "d {d}, d_down {k}: ‖W_down W_downᵀ − I‖∞ = {err}");
    }
    // In a built model, and recorded in config.yaml; the default stays small_init with σ² = 2/(5d).
    let spec = pretrain_spec("neox", "{kind: dar, d_down: 16, window: 8, init: orthogonal}", 1);
    assert!(spec.to_yaml().contains("init: orthogonal"), "{}", spec.to_yaml());
    let w = weights(&spec, 1);
    let down = &w["gpt_neox.layers.0.attention.bottleneck_down.weight"];
    let up = &w["gpt_neox.layers.0.attention.bottleneck_up.weight"];
    assert!(up.equal(&down.tr()));
    let plain = pretrain_spec("neox", "{kind: dar, d_down: 16, window: 8}", 1);
    assert_eq!(plain.attention.init(), Some(AttentionInit::SmallInit));
    assert!(plain.to_yaml().contains("init: small_init"));
    let (down, up) = pretraining_start(AttentionInit::SmallInit, 1, 0, 256, 64);
    for m in [down, up] {
        let var = m.to_kind(Kind::Double).pow_tensor_scalar(2).mean(Kind::Double).double_value(&[]);
        assert!((var / (2.0 / (5.0 * 256.0)) - 1.0).abs() < 0.03, "variance {var}");
    }
    let e = crate::spec::from_str("model: {flavor: tiny}\nattention: {kind: vanilla, init: orthogonal}\ndata: {train: {synthetic: {seed: 1, docs: 10}}}\ntrain: {steps: 2}\n", "t", &[]).unwrap_err();
    assert!(e.to_string().contains("attention.init"), "{e}");
}
