use super::*;
use crate::spec::{AttentionImpl, AttentionKind, DarAct};
use crate::model::loss::chunked_cross_entropy;
use crate::train::checkpoint::load_weights;
use tch::{nn::VarStore, Device, Kind};

pub(super) fn cfg(kind: AttentionKind, d_down: usize, window: usize) -> NeoxConfig {
    NeoxConfig {
        vocab: 97,
        d_model: 32,
        layers: 2,
        heads: 4,
        ffn: 128,
        rotary_pct: 0.25,
        rotary_base: 10000.0,
        ln_eps: 1e-5,
        gelu: Gelu::Erf,
        attention: crate::testutil::softmax(kind, d_down, window),
    }
}

pub(super) fn build(c: NeoxConfig, seed: i64) -> (VarStore, GptNeox) {
    let _rng = crate::testutil::seeded(seed);
    let mut vs = VarStore::new(Device::Cpu);
    let m = GptNeox::new(&vs.root(), c);
    vs.double();
    (vs, m)
}

/// Copy every variable `dst` shares with `src` (by name).
fn copy_shared(src: &VarStore, dst: &VarStore) {
    let s = src.variables();
    tch::no_grad(|| {
        for (name, mut v) in dst.variables() {
            if let Some(t) = s.get(&name) {
                v.copy_(t);
            }
        }
    });
}

pub(super) fn ids(b: i64, t: i64) -> Tensor {
    let _rng = crate::testutil::seeded(7);
    Tensor::randint(97, [b, t], (Kind::Int64, Device::Cpu))
}

/// The global-path keys/values by the direct form `h' = (a·W_down)·W_up`, then the k/v projection.
/// Kept to test that the absorbed form computes the same function.
fn bottleneck_kv_direct(m: &GptNeox, layer: &Layer, a: &Tensor) -> (Tensor, Tensor) {
    let b = layer.attn.bottleneck().unwrap();
    let h_prime = a.linear::<Tensor>(&b.down, None).linear::<Tensor>(&b.up, None);
    let qkv = m.split_heads(&layer.query_key_value.forward(&h_prime), 3);
    (qkv[1].shallow_clone(), qkv[2].shallow_clone())
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn parameter_names_shapes_and_counts_match_hugging_face() {
    let _rng = crate::testutil::rng();
    let (vs, _) = build(cfg(AttentionKind::Vanilla, 0, 0), 0);
    let mut names: Vec<(String, Vec<i64>)> = vs.variables().into_iter().map(|(n, t)| (n, t.size())).collect();
    names.sort();
    let want_layer = [
        ("attention.dense.bias", vec![32]),
        ("attention.dense.weight", vec![32, 32]),
        ("attention.query_key_value.bias", vec![96]),
        ("attention.query_key_value.weight", vec![96, 32]),
        ("input_layernorm.bias", vec![32]),
        ("input_layernorm.weight", vec![32]),
        ("mlp.dense_4h_to_h.bias", vec![32]),
        ("mlp.dense_4h_to_h.weight", vec![32, 128]),
        ("mlp.dense_h_to_4h.bias", vec![128]),
        ("mlp.dense_h_to_4h.weight", vec![128, 32]),
        ("post_attention_layernorm.bias", vec![32]),
        ("post_attention_layernorm.weight", vec![32]),
    ];
    let mut want: Vec<(String, Vec<i64>)> = vec![
        ("embed_out.weight".into(), vec![97, 32]),
        ("gpt_neox.embed_in.weight".into(), vec![97, 32]),
        ("gpt_neox.final_layer_norm.bias".into(), vec![32]),
        ("gpt_neox.final_layer_norm.weight".into(), vec![32]),
    ];
    for l in 0..2 {
        want.extend(want_layer.iter().map(|(n, s)| (format!("gpt_neox.layers.{l}.{n}"), s.clone())));
    }
    want.sort();
    assert_eq!(names, want);

    // DAR adds exactly the two bottleneck matrices per layer, no biases.
    let (vs, _) = build(cfg(AttentionKind::Dar, 8, 4), 0);
    let extra: Vec<(String, Vec<i64>)> = vs.variables().into_iter().filter(|(n, _)| n.contains("bottleneck")).map(|(n, t)| (n, t.size())).collect();
    assert_eq!(extra.len(), 4);
    assert!(extra.contains(&("gpt_neox.layers.1.attention.bottleneck_down.weight".into(), vec![8, 32])));
    assert!(extra.contains(&("gpt_neox.layers.1.attention.bottleneck_up.weight".into(), vec![32, 8])));
}

/// pythia.md §3: total parameters of the 14m and 70m flavors with V = 50304, and §4 init σ.
#[test]
fn pythia_parameter_counts_and_init_statistics() {
    let _rng = crate::testutil::rng();
    for (d, l, h, total, s_small, s_wang) in [(128usize, 6usize, 4usize, 14_067_712i64, 0.055902, 0.029463), (512, 6, 8, 70_426_624, 0.027951, 0.014731)] {
        let c = NeoxConfig { vocab: 50304, d_model: d, layers: l, heads: h, ffn: 4 * d, ..cfg(AttentionKind::Vanilla, 0, 0) };
        let _rng = crate::testutil::seeded(0);
        let vs = VarStore::new(Device::Cpu);
        let _m = GptNeox::new(&vs.root(), c);
        let n: i64 = vs.variables().values().map(|t| t.numel() as i64).sum();
        assert_eq!(n, total, "d={d}");
        for (name, t) in vs.variables() {
            if t.numel() < 100_000 {
                continue;
            }
            let want = if name.ends_with("dense.weight") || name.ends_with("dense_4h_to_h.weight") { s_wang } else { s_small };
            let std = t.std(true).double_value(&[]);
            assert!((std / want - 1.0).abs() < 0.02, "{name}: std {std} vs {want}");
        }
    }
}

/// Logits of the tiny Hugging Face GPTNeoXForCausalLM fixture (scripts/make_neox_fixture.py):
/// same weights in, same logits out within 1e-4 in fp32, and the same loss.
#[test]
fn logits_match_hugging_face_fixture() {
    let _rng = crate::testutil::rng();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/neox_tiny");
    let c = NeoxConfig { vocab: 128, d_model: 64, layers: 2, heads: 4, ffn: 256, ..cfg(AttentionKind::Vanilla, 0, 0) };
    let vs = VarStore::new(Device::Cpu);
    let model = GptNeox::new(&vs.root(), c);
    load_weights(&vs, &dir.join("model.safetensors")).unwrap();
    let expected: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(dir.join("expected.safetensors")).unwrap().into_iter().collect();
    let x = &expected["input_ids"];
    let logits = tch::no_grad(|| model.forward(x));
    let want = &expected["logits"];
    let tol = 1e-4 * want.abs().max().double_value(&[]).max(1.0);
    assert!(max_diff(&logits, want) <= tol, "max |Δlogits| = {}", max_diff(&logits, want));
    let t = x.size()[1];
    let loss = tch::no_grad(|| model.loss_unchunked(&x.narrow(1, 0, t - 1), &x.narrow(1, 1, t - 1))).double_value(&[]);
    assert!((loss - expected["loss"].double_value(&[])).abs() < 1e-5, "loss {loss}");
}

/// dar.md §1.1: window ≥ T makes every key local, so DAR is vanilla on the shared weights.
#[test]
fn dar_with_window_beyond_sequence_is_vanilla() {
    let _rng = crate::testutil::rng();
    let (vs_dar, dar) = build(cfg(AttentionKind::Dar, 8, 16), 1);
    let (vs_van, van) = build(cfg(AttentionKind::Vanilla, 0, 0), 2);
    copy_shared(&vs_dar, &vs_van);
    let x = ids(2, 16);
    let d = max_diff(&dar.forward(&x), &van.forward(&x));
    assert!(d < 1e-10, "{d}");
    // And with a window inside the sequence they differ (the identity is not vacuous).
    let (vs_short, short) = build(cfg(AttentionKind::Dar, 8, 4), 3);
    copy_shared(&vs_dar, &vs_short);
    assert!(max_diff(&short.forward(&x), &van.forward(&x)) > 1e-3);
}

/// d_down = d with W_up·W_down = I makes the bottleneck the identity: DAR equals vanilla at any window.
#[test]
fn dar_with_identity_bottleneck_is_vanilla() {
    let _rng = crate::testutil::rng();
    let (vs_dar, dar) = build(cfg(AttentionKind::Dar, 32, 3), 4);
    let (vs_van, van) = build(cfg(AttentionKind::Vanilla, 0, 0), 5);
    copy_shared(&vs_van, &vs_dar);
    tch::no_grad(|| {
        let vars = vs_dar.variables();
        let (q, _) = Tensor::linalg_qr(&Tensor::randn([32, 32], (Kind::Double, Device::Cpu)), "reduced");
        for l in 0..2 {
            // h' = (h·downᵀ)·upᵀ = h·(up·down)ᵀ; down = Q, up = Qᵀ gives up·down = I.
            vars[&format!("gpt_neox.layers.{l}.attention.bottleneck_down.weight")].shallow_clone().copy_(&q);
            vars[&format!("gpt_neox.layers.{l}.attention.bottleneck_up.weight")].shallow_clone().copy_(&q.tr());
        }
    });
    let x = ids(2, 12);
    let d = max_diff(&dar.forward(&x), &van.forward(&x));
    assert!(d < 1e-9, "{d}");
}

/// dar.md §1.1: uniform is DAR with window 0 (every key, the current one included, bottlenecked).
#[test]
fn uniform_is_dar_with_window_zero() {
    let _rng = crate::testutil::rng();
    let (vs_u, uni) = build(cfg(AttentionKind::Uniform, 8, 0), 6);
    let (vs_d, dar0) = build(cfg(AttentionKind::Dar, 8, 0), 7);
    copy_shared(&vs_u, &vs_d);
    let x = ids(2, 10);
    assert!(max_diff(&uni.forward(&x), &dar0.forward(&x)) < 1e-12);
    // The reference path agrees with the fast path for the whole model too.
    let mut c = cfg(AttentionKind::Dar, 8, 0);
    c.attention = c.attention.with_implementation(AttentionImpl::Reference);
    let (vs_r, reference) = build(c, 8);
    copy_shared(&vs_u, &vs_r);
    assert!(max_diff(&uni.forward(&x), &reference.forward(&x)) < 1e-10);
}

/// The absorbed global-path projection equals the direct form h' = a·W_down·W_up → k/v rows.
#[test]
fn absorbed_bottleneck_equals_direct_form() {
    let _rng = crate::testutil::rng();
    for act in [DarAct::Linear, DarAct::Sigmoid] {
        let mut c = cfg(AttentionKind::Dar, 8, 4);
        let crate::attention::AttentionSpec::Dar(d) = &mut c.attention else { unreachable!() };
        d.dar_act = act;
        let (_vs, m) = build(c, 9);
        let a = Tensor::randn([2, 7, 32], (Kind::Double, Device::Cpu));
        let layer = &m.layers[1];
        let b = layer.attn.bottleneck().unwrap();
        let (down, up) = (&b.down, &b.up);
        let (k1, v1) = m.kv_through(layer, up, &b.latent(&a));
        if act == DarAct::Linear {
            let (k2, v2) = bottleneck_kv_direct(&m, layer, &a);
            assert!(max_diff(&k1, &k2) < 1e-12 && max_diff(&v1, &v2) < 1e-12);
        } else {
            // Sigmoid variant: h^D = σ(a·W_down), then the same lift and projection.
            let hd = a.linear::<Tensor>(down, None).sigmoid();
            let qkv = m.split_heads(&layer.query_key_value.forward(&hd.linear::<Tensor>(up, None)), 3);
            assert!(max_diff(&k1, &qkv[1]) < 1e-12 && max_diff(&v1, &qkv[2]) < 1e-12);
        }
    }
}

/// Split-merge's distant keys stop at T − w (`Bottleneck::distant` of n < T positions): they are
/// the first n rows of all T, rotated at the forward's own positions.
#[test]
fn distant_keys_of_a_prefix_are_the_prefix_of_all() {
    let (_vs, m) = build(cfg(AttentionKind::Dar, 8, 4), 9);
    let _rng = crate::testutil::seeded(5);
    let a = Tensor::randn([2, 7, 32], (Kind::Double, Device::Cpu));
    let (cos, sin) = m.rope.tables(0, 7, Device::Cpu);
    let layer = &m.layers[1];
    let kv = LayerKv { model: &m, layer, cos: &cos, sin: &sin, span: None };
    let b = layer.attn.bottleneck().unwrap();
    let (kg, vg) = b.distant(&a, &kv, 7);
    let (kp, vp) = b.distant(&a, &kv, 3);
    assert_eq!(kp.size(), vec![2, 4, 3, 8]);
    assert!(max_diff(&kp, &kg.narrow(2, 0, 3)) < 1e-12 && max_diff(&vp, &vg.narrow(2, 0, 3)) < 1e-12);
}

/// The fused heads op (`heads_of`: one write of each piece, one write of the projection's gradient)
/// equals the explicit views + RoPE, outputs and the gradient of the projection, for q / k / v
/// (two rotated) and DAR's k / v (one), at partial and full rotary dims and a position offset.
#[test]
fn fused_heads_equal_views_and_rope_with_gradients() {
    let _rng = crate::testutil::rng();
    for pct in [0.25, 1.0] {
        let mut c = cfg(AttentionKind::Vanilla, 0, 0);
        c.rotary_pct = pct;
        let (_vs, m) = build(c, 11);
        let (t, start) = (6i64, 3i64);
        let (cos, sin) = m.rope.tables(start, t, Device::Cpu);
        for (n, rotated) in [(3i64, 2i64), (2, 1)] {
            let _rng = crate::testutil::seeded(5 + n);
            let x = Tensor::randn([2, t, 32 * n], (Kind::Double, Device::Cpu)).set_requires_grad(true);
            let go: Vec<Tensor> = (0..n).map(|_| Tensor::randn([2, 4, t, 8], (Kind::Double, Device::Cpu))).collect();
            let grad = |parts: Vec<Tensor>| {
                let loss = parts.iter().zip(&go).map(|(p, g)| (p * g).sum(Kind::Double)).fold(Tensor::zeros([], (Kind::Double, Device::Cpu)), |a, b| a + b);
                (parts.iter().map(|p| p.detach()).collect::<Vec<_>>(), Tensor::run_backward(&[loss], &[&x], false, false)[0].shallow_clone())
            };
            let (fused, dx1) = grad(m.heads_of(&x, n, rotated, &cos, &sin));
            let views = m.split_heads(&x, n).into_iter().enumerate().map(|(i, p)| if (i as i64) < rotated { m.rope.apply(&p, &cos, &sin) } else { p }).collect();
            let (explicit, dx2) = grad(views);
            for (a, b) in fused.iter().zip(&explicit) {
                assert_eq!(a.size(), b.size());
                assert!(max_diff(a, b) < 1e-12, "pct {pct} n {n}: outputs differ by {}", max_diff(a, b));
            }
            assert!(max_diff(&dx1, &dx2) < 1e-12, "pct {pct} n {n}: gradients differ by {}", max_diff(&dx1, &dx2));
        }
    }
}

/// Head-major QKV: feature f = h·3·hd + s·hd + e (pythia.md §1.3), checked on a hand-built weight.
#[test]
fn qkv_split_is_head_major() {
    let _rng = crate::testutil::rng();
    let (_vs, m) = build(cfg(AttentionKind::Vanilla, 0, 0), 10);
    // A [1, 1, 96] projection whose value is its own feature index.
    let x = Tensor::arange(96, (Kind::Double, Device::Cpu)).view([1, 1, 96]);
    let parts = m.split_heads(&x, 3);
    for (slot, p) in parts.iter().enumerate() {
        for h in 0..4i64 {
            for e in [0i64, 7] {
                let got = p.get(0).get(h).get(0).get(e).double_value(&[]);
                assert_eq!(got, (h * 24 + slot as i64 * 8 + e) as f64);
            }
        }
    }
}

#[test]
fn gelu_is_the_erf_form() {
    let _rng = crate::testutil::rng();
    let x = Tensor::from_slice(&[-3.0f64, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0]);
    let got: Vec<f64> = Vec::try_from(x.gelu("none")).unwrap();
    let erf = |v: f64| {
        // erf via the series of the complementary form is overkill; libm's erf is reached through tch in double.
        Tensor::from(v / 2f64.sqrt()).erf().double_value(&[])
    };
    for (i, v) in [-3.0f64, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0].iter().enumerate() {
        let want = 0.5 * v * (1.0 + erf(*v));
        assert!((got[i] - want).abs() < 1e-7);
    }
    // Hand value: gelu(1) = 0.5·(1 + erf(1/√2)) = 0.8413447460685429.
    assert!((got[4] - 0.841_344_746_068_542_9).abs() < 1e-12);
}

/// The chunked loss equals the plain one in value and in every parameter gradient.
#[test]
fn chunked_loss_matches_full_logits_loss() {
    let _rng = crate::testutil::rng();
    let (vs, m) = build(cfg(AttentionKind::Dar, 8, 4), 11);
    let x = ids(3, 9);
    let y = ids(3, 9).roll([1], [1]);
    let grads = |chunked: bool| {
        for (_, mut v) in vs.variables() {
            v.zero_grad();
        }
        let loss = if chunked { chunked_cross_entropy(&m.hidden(&x).flatten(0, 1), &m.embed_out, &y.reshape([-1]), 5) } else { m.loss_unchunked(&x, &y) };
        loss.backward();
        let mut g: Vec<(String, Tensor)> = vs.variables().into_iter().map(|(n, v)| (n, v.grad().copy())).collect();
        g.sort_by(|a, b| a.0.cmp(&b.0));
        (loss.double_value(&[]), g)
    };
    let (l1, g1) = grads(true);
    let (l2, g2) = grads(false);
    assert!((l1 - l2).abs() < 1e-6, "{l1} vs {l2}");
    for ((n, a), (_, b)) in g1.iter().zip(&g2) {
        assert!(max_diff(a, b) < 1e-6, "{n}: {}", max_diff(a, b));
    }
}
