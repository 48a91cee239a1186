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
    let _rng = crate::testutil::rng();
    check_against_hf(&fixture("llama_tiny"), &fixture("llama_tiny"));
}

/// Untied head, default RoPE, loaded from one file and from a sharded index.
#[test]
fn untied_and_sharded_checkpoints_match_hugging_face() {
    let _rng = crate::testutil::rng();
    check_against_hf(&fixture("llama_tiny_untied"), &fixture("llama_tiny_untied"));
    check_against_hf(&fixture("llama_tiny_untied/sharded"), &fixture("llama_tiny_untied"));
}

/// llama3 scaling by hand: high frequencies kept, low ones divided by `factor`, a ramp between.
#[test]
fn llama3_inverse_frequencies_follow_the_formula() {
    let _rng = crate::testutil::rng();
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
    let _rng = crate::testutil::rng();
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
    let _rng = crate::testutil::rng();
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

/// An inference pass stacks q / k / v_proj and gate / up_proj (one multiply per input): the logits
/// stay, the parameters save as themselves, and an in-place update (an optimizer step) reaches the
/// stacked multiply.
#[test]
fn stacked_projections_keep_the_logits_and_follow_updates() {
    let _rng = crate::testutil::rng();
    let (vs, model) = hf::load_llama(&fixture("llama_tiny"), Device::Cpu).unwrap();
    let x = (Tensor::arange(24, (Kind::Int64, Device::Cpu)).view([2, 12]) * 7).remainder(128);
    let logits = |m: &Llama| tch::no_grad(|| m.logits(&m.hidden(&x)));
    let before = logits(&model);
    let mut cache = model.new_cache(2, Kind::Float, Device::Cpu);
    let _ = tch::no_grad(|| model.extend(&mut cache, &x.narrow(1, 0, 3)));
    for b in &model.layers {
        assert!(b.qkv_stack.get(&[&b.q_proj.weight, &b.k_proj.weight, &b.v_proj.weight]).is_some(), "q / k / v not stacked");
        assert!(b.gate_up_stack.get(&[&b.gate_proj.ws, &b.up_proj.ws]).is_some(), "gate / up not stacked");
    }
    // What the logits below go through (autograd off, no adapter), and what a training pass does not.
    let a = Tensor::ones([1, 1, model.cfg.hidden_size as i64], (Kind::Float, Device::Cpu));
    assert!(tch::no_grad(|| Llama::stacked_qkv(&model.layers[0], &a, Pass::Eval)).is_some());
    assert!(Llama::stacked_qkv(&model.layers[0], &a, Pass::Train).is_none());
    assert!(max_diff(&logits(&model), &before) < 1e-5);
    tch::no_grad(|| {
        for (i, (_, v)) in vs.variables().into_iter().enumerate() {
            let _ = v.shallow_clone().g_mul_scalar_(1.0 + 0.01 * (i % 7) as f64);
        }
    });
    let updated = logits(&model);
    assert!(max_diff(&updated, &before) > 1e-3, "the update must change the logits for this test to mean anything");
    // The same weights in a model that never stacked them, through its checkpoint.
    let dir = tempfile::tempdir().unwrap();
    hf::save_llama(&vs, &model.cfg, dir.path()).unwrap();
    let (_vs2, fresh) = hf::load_llama(dir.path(), Device::Cpu).unwrap();
    assert!(max_diff(&updated, &logits(&fresh)) < 1e-5, "{}", max_diff(&updated, &logits(&fresh)));
}

/// A STILL student's gate projection joins the q / k / v stack: its prefill (the gate from the
/// stacked product, `Heads::projected`) equals the full forward (the gate from W_g itself), in f64.
#[test]
fn a_still_gate_from_the_stacked_multiply_equals_its_own() {
    let _rng = crate::testutil::seeded(5);
    let mut cfg = crate::testutil::tiny_llama(128, Family::Llama);
    cfg.attention = Attention::Linearized(serde_yaml::from_str("{kind: still, chunk: 8, tokens_per_chunk: 2}").unwrap());
    let mut vs = tch::nn::VarStore::new(Device::Cpu);
    let m = Llama::build(&vs.root(), cfg).unwrap();
    vs.double();
    let x = (Tensor::arange(2 * 30, (Kind::Int64, Device::Cpu)).view([2, 30]) * 13).remainder(128);
    let full = tch::no_grad(|| m.logits(&m.hidden(&x)));
    let mut cache = m.new_cache(2, Kind::Double, Device::Cpu);
    let got = tch::no_grad(|| m.extend(&mut cache, &x));
    assert!(m.layers.iter().all(|b| Llama::qkv_parts(b).len() == 4 && b.qkv_stack.get(&Llama::qkv_parts(b)).is_some()), "W_g not stacked");
    let err = max_diff(&got, &full);
    assert!(err < 1e-10, "{err}");
}

use crate::spec::{AttentionImpl, AttentionKind, AttentionSpec, DarAct};

fn load(name: &str) -> (tch::nn::VarStore, Llama) {
    hf::load_llama(&fixture(name), Device::Cpu).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

fn dar(kind: AttentionKind, d_down: usize, window: usize, implementation: AttentionImpl) -> AttentionSpec {
    crate::testutil::softmax(kind, d_down, window).with_implementation(implementation)
}

/// The model's softmax options computed by `imp`.
fn with_imp(m: &Llama, imp: AttentionImpl) -> AttentionSpec {
    m.cfg.attention.softmax().expect("a softmax kind").clone().with_implementation(imp)
}

/// OLMo 2 (QK-norm over the whole projections, norms on sublayer outputs, no input norm, GQA,
/// untied head) against transformers' Olmo2ForCausalLM.
#[test]
fn olmo2_matches_hugging_face() {
    let _rng = crate::testutil::rng();
    check_against_hf(&fixture("olmo2_tiny"), &fixture("olmo2_tiny"));
    let (_vs, m) = load("olmo2_tiny");
    assert_eq!(m.cfg.family, Family::Olmo2);
}

/// OLMo 2 save → load: same config (model_type olmo2) and logits; a DAR config survives config.json.
#[test]
fn olmo2_and_dar_configs_round_trip() {
    let _rng = crate::testutil::rng();
    let (vs, model) = load("olmo2_tiny");
    let dir = tempfile::tempdir().unwrap();
    hf::save_llama(&vs, &model.cfg, dir.path()).unwrap();
    let text = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    assert!(text.contains("\"olmo2\"") && text.contains("Olmo2ForCausalLM"), "{text}");
    let (_vs2, again) = hf::load_llama(dir.path(), Device::Cpu).unwrap();
    assert_eq!(again.cfg, model.cfg);
    let x = Tensor::arange(40, (Kind::Int64, Device::Cpu)).view([2, 20]);
    assert_eq!(max_diff(&model.logits(&model.hidden(&x)), &again.logits(&again.hidden(&x))), 0.0);
    let mut cfg = model.cfg.clone();
    cfg.attention = crate::attention::Attention::Softmax(dar(AttentionKind::Dar, 16, 7, AttentionImpl::Sdpa));
    assert_eq!(LlamaConfig::from_hf_json(&cfg.to_hf_json().to_string()).unwrap(), cfg);
    // DAR is never written as the stock Olmo2ForCausalLM (which would drop the bottleneck): attnlab's
    // architecture, whose auto_map names a module of the remote code saved beside it.
    let v = cfg.to_hf_json();
    assert_eq!((v["model_type"].as_str(), v["architectures"][0].as_str()), (Some("attnlab_olmo2"), Some("AttnlabOlmo2ForCausalLM")));
    let module = v["auto_map"]["AutoModelForCausalLM"].as_str().unwrap().split('.').next().unwrap().to_string();
    assert!(hf::REMOTE_CODE.iter().any(|(f, code)| *f == format!("{module}.py") && code.contains("class AttnlabOlmo2ForCausalLM")));
    let bad = r#"{"model_type": "gpt2", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}"#;
    assert!(LlamaConfig::from_hf_json(bad).unwrap_err().to_string().contains("gpt2"));
}

/// Set every layer's bottleneck to (down, up).
fn set_bottlenecks(m: &Llama, down: &Tensor, up: &Tensor) {
    tch::no_grad(|| {
        for i in 0..m.cfg.num_hidden_layers {
            let (d, u) = m.bottleneck(i).unwrap();
            d.shallow_clone().copy_(down);
            u.shallow_clone().copy_(up);
        }
    });
}

/// dar.md §1: with d_down = d and W_up·W_down = I the global keys/values equal the local ones, so DAR
/// (any window, uniform included, every implementation) is the original model. A random bottleneck
/// must change the logits (the global path is really used).
#[test]
fn dar_with_identity_bottleneck_equals_the_original_model() {
    let _rng = crate::testutil::rng();
    for name in ["llama_tiny", "olmo2_tiny"] {
        let (vs, mut m) = load(name);
        let x = (Tensor::arange(48, (Kind::Int64, Device::Cpu)).view([2, 24]) * 7).remainder(128);
        let want = tch::no_grad(|| m.logits(&m.hidden(&x)));
        let d = m.cfg.hidden_size;
        m.add_dar(&vs.root(), dar(AttentionKind::Dar, d, 5, AttentionImpl::Reference)).unwrap();
        let random = tch::no_grad(|| m.logits(&m.hidden(&x)));
        assert!(max_diff(&random, &want) > 1e-2, "{name}: small_init bottleneck left the logits unchanged");
        let eye = Tensor::eye(d as i64, (Kind::Float, Device::Cpu));
        set_bottlenecks(&m, &eye, &eye);
        for (kind, w) in [(AttentionKind::Dar, 5), (AttentionKind::Dar, 1), (AttentionKind::Uniform, 0)] {
            for imp in [AttentionImpl::Reference, AttentionImpl::Sdpa, AttentionImpl::Auto] {
                m.set_attention(dar(kind, d, w, imp)).unwrap();
                let got = tch::no_grad(|| m.logits(&m.hidden(&x)));
                assert!(max_diff(&got, &want) < 1e-4, "{name} {kind:?} w={w} {imp:?}: {}", max_diff(&got, &want));
            }
        }
    }
}

/// The absorbed global path `(a·W_down)·(W_k·W_up)ᵀ` (+ k_norm, RoPE) equals projecting the explicit
/// `h' = a·W_down·W_up` with the layer's own q/k/v path (dar.md §2), GQA and OLMo 2's k_norm included.
#[test]
fn bottleneck_keys_equal_the_direct_form() {
    let _rng = crate::testutil::rng();
    for name in ["llama_tiny", "olmo2_tiny"] {
        let (vs, mut m) = load(name);
        let _rng = crate::testutil::seeded(3);
        m.add_dar(&vs.root(), dar(AttentionKind::Dar, 16, 4, AttentionImpl::Reference)).unwrap();
        let x = (Tensor::arange(20, (Kind::Int64, Device::Cpu)).view([2, 10]) * 11).remainder(128);
        let (cos, sin) = m.rope(0, 10, Device::Cpu);
        let a = m.kv_input(0, &m.embed(&x));
        let b = &m.layers[0];
        let bn = b.attn.bottleneck().unwrap();
        let kv = LayerKv { model: &m, block: b, cos: &cos, sin: &sin, span: None };
        let (kg, vg) = bn.distant(&a, &kv, a.size()[1]);
        let h_prime = a.linear::<Tensor>(&bn.down, None).linear::<Tensor>(&bn.up, None);
        let (_, k, v) = m.qkv(b, &h_prime, &cos, &sin, Pass::Eval);
        assert_eq!(kg.size(), vec![2, 2, 10, 16], "{name}: kv_heads heads");
        assert!(max_diff(&kg, &k) < 1e-5 && max_diff(&vg, &v) < 1e-5, "{name}");
        // Split-merge's distant keys stop at T − w: the prefix at the forward's own positions.
        let (kp, vp) = bn.distant(&a, &kv, 6);
        assert!(max_diff(&kp, &kg.narrow(2, 0, 6)) < 1e-6 && max_diff(&vp, &vg.narrow(2, 0, 6)) < 1e-6, "{name}: prefix");
    }
}

/// Document segments and in-document positions by hand.
#[test]
fn doc_segments_by_hand() {
    let _rng = crate::testutil::rng();
    let docs = Tensor::from_slice(&[7i64, 7, 3, 3, 3, 7, 0, 0]).view([1, 8]);
    let (seg, pos) = crate::attention::doc_segments(&docs);
    assert_eq!(Vec::<i64>::try_from(seg.flatten(0, -1)).unwrap(), vec![1, 1, 2, 2, 2, 3, 4, 4]);
    assert_eq!(Vec::<i64>::try_from(pos.flatten(0, -1)).unwrap(), vec![0, 1, 0, 1, 2, 0, 0, 1]);
}

/// A packed row (documents of 5, 9 and 2 tokens) gives, token for token, the logits of running each
/// document alone: no attention across documents, RoPE restarting per document. Vanilla and DAR
/// (window 3, random bottleneck, so distant keys go through it), reference and SDPA paths.
#[test]
fn packed_documents_equal_separate_runs() {
    let _rng = crate::testutil::rng();
    for name in ["llama_tiny", "olmo2_tiny"] {
        for dar_on in [false, true] {
            let (vs, mut m) = load(name);
            let _rng = crate::testutil::seeded(5);
            if dar_on {
                m.add_dar(&vs.root(), dar(AttentionKind::Dar, 16, 3, AttentionImpl::Reference)).unwrap();
            }
            let x = (Tensor::arange(32, (Kind::Int64, Device::Cpu)).view([2, 16]) * 13).remainder(128);
            let lens = [5i64, 9, 2];
            let ids: Vec<i64> = lens.iter().enumerate().flat_map(|(d, &n)| std::iter::repeat(d as i64 + 10).take(n as usize)).collect();
            // Row 1 is one document: it must equal the plain forward.
            let docs = Tensor::stack(&[Tensor::from_slice(&ids), Tensor::full([16], 4i64, (Kind::Int64, Device::Cpu))], 0);
            for imp in [AttentionImpl::Reference, AttentionImpl::Sdpa] {
                m.set_attention(with_imp(&m, imp)).unwrap();
                let packed = tch::no_grad(|| m.logits(&m.hidden_docs(&x, Some(&docs))));
                let mut at = 0;
                for &n in &lens {
                    let alone = tch::no_grad(|| m.logits(&m.hidden(&x.narrow(0, 0, 1).narrow(1, at, n))));
                    let d = max_diff(&packed.narrow(0, 0, 1).narrow(1, at, n), &alone);
                    assert!(d < 1e-4, "{name} dar={dar_on} {imp:?} doc at {at}: {d}");
                    at += n;
                }
                let whole = tch::no_grad(|| m.logits(&m.hidden(&x.narrow(0, 1, 1))));
                assert!(max_diff(&packed.narrow(0, 1, 1), &whole) < 1e-4, "{name} dar={dar_on} {imp:?} single-document row");
            }
        }
    }
}

/// DAR decoding with the two-set cache (prefill, then one token at a time) equals the full forward.
#[test]
fn dar_cached_decoding_equals_full_forward() {
    let _rng = crate::testutil::rng();
    for name in ["llama_tiny", "olmo2_tiny"] {
        let (vs, mut m) = load(name);
        let _rng = crate::testutil::seeded(9);
        m.add_dar(&vs.root(), dar(AttentionKind::Dar, 16, 3, AttentionImpl::Reference)).unwrap();
        let x = (Tensor::arange(24, (Kind::Int64, Device::Cpu)).view([2, 12]) * 5).remainder(128);
        let full = tch::no_grad(|| m.logits(&m.hidden(&x)));
        let mut cache = m.new_cache(2, Kind::Float, Device::Cpu);
        let mut got = vec![tch::no_grad(|| m.extend(&mut cache, &x.narrow(1, 0, 4)))];
        for t in 4..12 {
            got.push(tch::no_grad(|| m.extend(&mut cache, &x.narrow(1, t, 1))));
        }
        let d = max_diff(&Tensor::cat(&got, 1), &full);
        assert!(d < 1e-4, "{name}: {d}");
        // The decode above took each latent from the stacked multiply (`Heads::projected`), the
        // forward from W_down itself.
        assert!(m.layers.iter().all(|b| Llama::qkv_parts(b).len() == 4 && b.qkv_stack.get(&Llama::qkv_parts(b)).is_some()), "{name}: W_down not stacked");
        // The latent cache (dar.md §3): batch 2 × 2 layers × (T·d_down + 2·w·d_kv) f32, d_kv = 2 KV heads × 16.
        assert_eq!(cache.bytes(), 2 * 2 * (12 * 16 + 2 * 3 * 2 * 16) * 4);
    }
}

/// The latent cache in f64: prefill (1 or 5 tokens), then one token at a time: the logits equal
/// the full forward on every prefix (llama and olmo2, uniform and DAR with windows inside and beyond the
/// sequence, linear and sigmoid latents), and the cache holds exactly (T·d_down + 2·min(w, T)·d_kv)
/// elements per layer and sequence, d_kv = kv_heads·head_dim — not the query heads' width.
#[test]
fn dar_latent_cache_equals_full_forward_on_every_prefix() {
    let _rng = crate::testutil::rng();
    let t_max = 9;
    let x = (Tensor::arange(2 * t_max, (Kind::Int64, Device::Cpu)).view([2, t_max]) * 7).remainder(128);
    for name in ["llama_tiny", "olmo2_tiny"] {
        for (kind, w, act) in [(AttentionKind::Uniform, 0, DarAct::Linear), (AttentionKind::Dar, 1, DarAct::Linear), (AttentionKind::Dar, 3, DarAct::Sigmoid), (AttentionKind::Dar, 40, DarAct::Linear)] {
            let (mut vs, mut m) = load(name);
            let _rng = crate::testutil::seeded(11);
            let act = serde_yaml::to_value(act).unwrap();
            let a: AttentionSpec = serde_yaml::from_str(&format!("{{kind: {}, d_down: 12, window: {w}, dar_act: {}, impl: reference}}", kind.name(), act.as_str().unwrap())).unwrap();
            m.add_dar(&vs.root(), a).unwrap();
            vs.double();
            let (kvh, hd) = (m.cfg.num_key_value_heads as i64, m.cfg.head_dim() as i64);
            assert!(kvh < m.cfg.num_attention_heads as i64, "the fixture has GQA");
            let full: Vec<Tensor> = (1..=t_max).map(|t| tch::no_grad(|| m.logits(&m.hidden(&x.narrow(1, 0, t))))).collect();
            let mut worst = 0f64;
            // Prefill (the forward's kernels), then a piece of `piece` tokens (the masked path over
            // the cache), then one token at a time.
            for (prompt, piece) in [(1, 1), (5, 1), (2, 4)] {
                let mut cache = m.new_cache(2, Kind::Double, Device::Cpu);
                let first = tch::no_grad(|| m.extend(&mut cache, &x.narrow(1, 0, prompt)));
                worst = worst.max(max_diff(&first, &full[prompt as usize - 1]));
                let mut t = prompt;
                while t < t_max {
                    let len = if t == prompt { piece } else { 1 };
                    let step = tch::no_grad(|| m.extend(&mut cache, &x.narrow(1, t, len)));
                    worst = worst.max(max_diff(&step, &full[(t + len) as usize - 1].narrow(1, t, len)));
                    t += len;
                    let n = t;
                    let per_layer = n * 12 + 2 * (w as i64).min(n) * kvh * hd;
                    assert_eq!(cache.bytes(), 2 * 2 * per_layer * 8, "{name} {kind:?} w={w}: batch 2 × 2 layers × f64 after {n} tokens");
                }
            }
            eprintln!("{name} {kind:?} w={w} {act:?}: max |Δlogits| {worst:.2e}");
            assert!(worst < 1e-12, "{name} {kind:?} w={w} {act:?}: {worst}");
        }
    }
}

/// A DAR model written as a Hugging Face folder (bottleneck weights + attnlab_attention) loads back as
/// the same DAR model.
#[test]
fn dar_checkpoint_round_trips() {
    let _rng = crate::testutil::rng();
    let (vs, mut m) = load("olmo2_tiny");
    let _rng = crate::testutil::seeded(4);
    m.add_dar(&vs.root(), dar(AttentionKind::Dar, 16, 3, AttentionImpl::Sdpa)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    hf::save_llama(&vs, &m.cfg, dir.path()).unwrap();
    let (_vs2, again) = hf::load_llama(dir.path(), Device::Cpu).unwrap();
    assert_eq!(again.cfg, m.cfg);
    let x = (Tensor::arange(40, (Kind::Int64, Device::Cpu)).view([2, 20]) * 3).remainder(128);
    assert_eq!(max_diff(&m.logits(&m.hidden(&x)), &again.logits(&again.hidden(&x))), 0.0);
}

/// `window` attention in the Llama family: it changes the function (vs vanilla), the SDPA path equals
/// the reference, a packed row equals its documents run alone, and decoding equals the forward with a
/// cache of only the last w tokens: 2·min(w, T)·d_kv per layer and sequence.
#[test]
fn window_attention_decodes_packs_and_matches_reference() {
    let _rng = crate::testutil::rng();
    let x = (Tensor::arange(24, (Kind::Int64, Device::Cpu)).view([2, 12]) * 5).remainder(128);
    for name in ["llama_tiny", "olmo2_tiny"] {
        let (_vs, mut m) = load(name);
        let vanilla = tch::no_grad(|| m.logits(&m.hidden(&x)));
        m.set_attention(dar(AttentionKind::Window, 0, 3, AttentionImpl::Reference)).unwrap();
        let full = tch::no_grad(|| m.logits(&m.hidden(&x)));
        assert!(max_diff(&full, &vanilla) > 1e-3, "{name}: window 3 of 12 must differ from vanilla");
        let mut cache = m.new_cache(2, Kind::Float, Device::Cpu);
        let mut got = vec![tch::no_grad(|| m.extend(&mut cache, &x.narrow(1, 0, 4)))];
        for t in 4..12 {
            got.push(tch::no_grad(|| m.extend(&mut cache, &x.narrow(1, t, 1))));
            assert_eq!(cache.bytes(), 2 * 2 * (2 * 3 * 2 * 16) * 4, "{name}: batch 2 × 2 layers × 2·w·d_kv f32");
        }
        assert!(max_diff(&Tensor::cat(&got, 1), &full) < 1e-5, "{name} decode");
        let docs = Tensor::from_slice(&[1i64, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2]).view([1, 12]);
        for imp in [AttentionImpl::Reference, AttentionImpl::Sdpa] {
            m.set_attention(with_imp(&m, imp)).unwrap();
            let fwd = tch::no_grad(|| m.logits(&m.hidden(&x)));
            assert!(max_diff(&fwd, &full) < 1e-5, "{name} {imp:?} vs reference");
            let packed = tch::no_grad(|| m.logits(&m.hidden_docs(&x.narrow(0, 0, 1), Some(&docs))));
            for (at, n) in [(0, 5), (5, 7)] {
                let alone = tch::no_grad(|| m.logits(&m.hidden(&x.narrow(0, 0, 1).narrow(1, at, n))));
                assert!(max_diff(&packed.narrow(1, at, n), &alone) < 1e-5, "{name} {imp:?} doc at {at}");
            }
        }
    }
}

/// STILL and LoLCATs students prefill a whole prompt in one chunk-parallel call (every chunk at once:
/// the window softmax, the selected set, the linear state of earlier chunks as a chunked prefix sum),
/// as `generate` now does at any length, then decode: every logit equals feeding the same tokens one
/// at a time from an empty cache (the chunk-by-chunk path), in f64, for every routing metric with and
/// without a budget, with grouped-query heads.
#[test]
fn linearized_prefill_at_once_equals_token_by_token() {
    let _rng = crate::testutil::rng();
    let (t, prompt) = (40i64, 29i64);
    let x = (Tensor::arange(2 * t, (Kind::Int64, Device::Cpu)).view([2, t]) * 11).remainder(128);
    let routings = ["self_saliency", "self_saliency_reference_code", "diag_attention", "self_logit", "key_norm", "random", "uniform", "none"];
    let mut variants: Vec<String> = routings
        .iter()
        .flat_map(|r| [format!("{{kind: still, chunk: 8, tokens_per_chunk: 2, routing: {r}}}"), format!("{{kind: still, chunk: 8, budget: {{m: 28, max_len: 40}}, routing: {r}}}")])
        .collect();
    variants.push("{kind: lolcats, window: 8}".into());
    for yaml in &variants {
        let _rng = crate::testutil::seeded(9);
        let mut cfg = crate::testutil::tiny_llama(128, Family::Llama);
        cfg.attention = Attention::Linearized(serde_yaml::from_str(yaml).unwrap());
        let mut vs = tch::nn::VarStore::new(Device::Cpu);
        let m = Llama::build(&vs.root(), cfg).unwrap();
        vs.double();
        let mut at_once = m.new_cache(2, Kind::Double, Device::Cpu);
        let mut got = vec![tch::no_grad(|| m.extend(&mut at_once, &x.narrow(1, 0, prompt)))];
        let mut one_by_one = m.new_cache(2, Kind::Double, Device::Cpu);
        let mut want = Vec::new();
        for p in 0..t {
            want.push(tch::no_grad(|| m.extend(&mut one_by_one, &x.narrow(1, p, 1))));
            if p >= prompt {
                got.push(tch::no_grad(|| m.extend(&mut at_once, &x.narrow(1, p, 1))));
            }
        }
        let err = max_diff(&Tensor::cat(&got, 1), &Tensor::cat(&want, 1));
        assert!(err < 1e-10, "{yaml}: {err}");
        assert_eq!(at_once.bytes(), one_by_one.bytes(), "{yaml}: the same cache");
    }
}

/// The device-side decode step of every Llama layer kind (what `eval::stepper` replays as a CUDA
/// graph: position a device tensor, shapes fixed by the span; STILL / LoLCATs route each chunk in
/// `prepare_at` before its first token and keep Sel and the window in fixed buffers): after prompts
/// that end mid-chunk, on a chunk boundary and before any routing, every step's logits equal
/// feeding the tokens one at a time through `extend` (the growing cache, itself equal to the
/// prefill), in f64, with grouped-query heads, spans that change between steps and steps that cross
/// several chunk starts. Then `extend` goes on from the fixed form (turned back), the cache's bytes
/// the growing one's. LoLCATs' sliding compat window has no such step (None).
#[test]
fn device_side_steps_equal_token_by_token() {
    use crate::attention::cache::StepAt;
    use crate::attention::AttentionKind;
    let _rng = crate::testutil::rng();
    let t = 44i64;
    let x = (Tensor::arange(2 * t, (Kind::Int64, Device::Cpu)).view([2, t]) * 13 + 5).remainder(128);
    // DAR / uniform twice: rebuilding the distant keys, and reading the latents through the
    // absorbed k / v map (`KvMap::absorbed`, `dar::read_latents`) at every span.
    let mut variants: Vec<(String, Attention)> = [(AttentionKind::Vanilla, 0, 0), (AttentionKind::Window, 0, 5), (AttentionKind::Dar, 8, 5), (AttentionKind::Uniform, 8, 0), (AttentionKind::Dar, 8, 5), (AttentionKind::Uniform, 8, 0)]
        .into_iter()
        .enumerate()
        .map(|(i, (k, d, w))| (format!("{k:?}{}", if i >= 4 { " absorbed" } else { "" }), Attention::Softmax(crate::testutil::softmax(k, d, w))))
        .collect();
    let hybrids = [
        "{kind: still, chunk: 8, tokens_per_chunk: 2}",
        "{kind: still, chunk: 8, budget: {m: 28, max_len: 44}, routing: self_saliency_reference_code}",
        "{kind: still, chunk: 8, tokens_per_chunk: 3, routing: random, gate: false}",
        "{kind: still, chunk: 8, tokens_per_chunk: 2, routing: uniform, normalizer: max_compensated}",
        "{kind: still, chunk: 8, tokens_per_chunk: 2, routing: key_norm, linear_branch: false}",
        "{kind: still, chunk: 8, routing: oracle}",
        "{kind: lolcats, window: 8}",
    ];
    variants.extend(hybrids.iter().map(|y| (y.to_string(), Attention::Linearized(serde_yaml::from_str(y).unwrap()))));
    for (name, attention) in &variants {
        let _rng = crate::testutil::seeded(11);
        let mut cfg = crate::testutil::tiny_llama(128, Family::Llama);
        cfg.attention = attention.clone();
        let mut vs = tch::nn::VarStore::new(Device::Cpu);
        let m = Llama::build(&vs.root(), cfg).unwrap();
        vs.double();
        for b in &m.layers {
            if let Some(st) = b.attn.still() {
                st.set_oracle(Some(vec![1, 3, 9, 17, 18, 30]));
            }
        }
        let mut one_by_one = m.new_cache(2, Kind::Double, Device::Cpu);
        let want: Vec<Tensor> = (0..t).map(|p| tch::no_grad(|| m.extend(&mut one_by_one, &x.narrow(1, p, 1)))).collect();
        for prompt in [5i64, 16, 21] {
            let mut cache = m.new_cache(2, Kind::Double, Device::Cpu);
            cache.reserve(t);
            if name.ends_with("absorbed") {
                cache.layers.iter_mut().for_each(|l| l.state::<crate::attention::dar::DarCache>().set_absorb_from(0));
            }
            let _ = tch::no_grad(|| m.extend(&mut cache, &x.narrow(1, 0, prompt)));
            let steps_to = t - 4;
            for p in prompt..steps_to {
                m.prepare_at(&mut cache, p, t);
                let at = StepAt { pos: Tensor::from_slice(&[p]), span: if p % 2 == 0 { p + 1 } else { t } };
                let h = m.extend_hidden_at(&mut cache, &x.narrow(1, p, 1), &at).unwrap_or_else(|| panic!("{name}: a device-side step"));
                cache.advance(1);
                let e = max_diff(&m.logits(&h), &want[p as usize]);
                assert!(e < 1e-10, "{name} prompt {prompt} step {p}: {e}");
            }
            // The growing form again, from where the device-side steps left it.
            for p in steps_to..t {
                let e = max_diff(&tch::no_grad(|| m.extend(&mut cache, &x.narrow(1, p, 1))), &want[p as usize]);
                assert!(e < 1e-10, "{name} prompt {prompt}: extend at {p} after device-side steps: {e}");
            }
            assert_eq!(cache.bytes(), one_by_one.bytes(), "{name} prompt {prompt}: the same cache bytes");
        }
    }
    // The sliding compat window folds a token per step: no device-side step, and the cache untouched.
    let mut cfg = crate::testutil::tiny_llama(128, Family::Llama);
    cfg.attention = Attention::Linearized(serde_yaml::from_str("{kind: lolcats, window: 8, decode_window: sliding}").unwrap());
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let m = Llama::build(&vs.root(), cfg).unwrap();
    let mut cache = m.new_cache(2, Kind::Float, Device::Cpu);
    let _ = tch::no_grad(|| m.extend(&mut cache, &x.narrow(1, 0, 5)));
    m.prepare_at(&mut cache, 5, t);
    assert!(m.extend_hidden_at(&mut cache, &x.narrow(1, 5, 1), &StepAt { pos: Tensor::from_slice(&[5i64]), span: t }).is_none());
}
