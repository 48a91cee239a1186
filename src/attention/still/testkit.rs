//! Test helpers shared by the STILL files' tests.
use super::{HybridCache, LayerDims, Routing, Still, StillConfig};
use tch::{nn, Device, Kind, Tensor};

pub(super) const ALL_ROUTINGS: [Routing; 8] = [
    Routing::SelfSaliency,
    Routing::SelfSaliencyReferenceCode,
    Routing::DiagAttention,
    Routing::SelfLogit,
    Routing::KeyNorm,
    Routing::Random,
    Routing::Uniform,
    Routing::None,
];

pub(super) fn cfg(yaml: &str) -> StillConfig {
    serde_yaml::from_str(yaml).unwrap()
}

/// A STILL layer in fp64 on the CPU (H heads of width D, d_model = H·D).
pub(super) fn layer(c: &StillConfig, h: i64, d: i64, seed: i64) -> (nn::VarStore, Still) {
    let _rng = crate::testutil::seeded(seed);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let st = Still::new(&vs.root(), c, LayerDims { heads: h, head_dim: d, d_model: h * d, layer: 3 }).unwrap();
    vs.double();
    (vs, st)
}

/// q, k, v `[B, H, T, D]` and x `[B, T, H·D]`, fp64, requiring grad.
pub(super) fn inputs(b: i64, h: i64, t: i64, d: i64, seed: i64) -> Vec<Tensor> {
    let _rng = crate::testutil::seeded(seed);
    let r = |shape: &[i64]| Tensor::randn(shape, (Kind::Double, Device::Cpu)).set_requires_grad(true);
    vec![r(&[b, h, t, d]), r(&[b, h, t, d]), r(&[b, h, t, d]), r(&[b, t, h * d])]
}

/// Largest |a − b| (equal infinities count as 0: the code variant scores token 0 +∞).
pub(super) fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    if a.numel() == 0 {
        return 0.0;
    }
    (a - b).abs().where_scalarother(&a.ne_tensor(b), 0.0).max().double_value(&[])
}

pub(super) fn to_bools(x: &Tensor) -> Vec<bool> {
    Vec::<bool>::try_from(x.flatten(0, -1)).unwrap()
}

pub(super) fn decode(st: &Still, cache: &mut HybridCache, x: &[Tensor], from: i64, to: i64) -> Tensor {
    let outs: Vec<Tensor> = (from..to)
        .map(|p| {
            let at = |t: &Tensor| t.narrow(2, p, 1);
            let g = st.gate(&x[3].narrow(1, p, 1));
            st.step(cache, &at(&x[0]), &at(&x[1]), &at(&x[2]), g.as_ref())
        })
        .collect();
    Tensor::cat(&outs, 2)
}

pub(super) fn assert_same_cache(a: &HybridCache, b: &HybridCache, what: &str) {
    assert_eq!(a.pos, b.pos, "{what}: pos");
    let pairs = [
        (&a.sel_k, &b.sel_k, "sel_k"),
        (&a.sel_v, &b.sel_v, "sel_v"),
        (&a.win_k, &b.win_k, "win_k"),
        (&a.win_v, &b.win_v, "win_v"),
        (&a.win_scores, &b.win_scores, "scores"),
        (&a.s, &b.s, "S"),
        (&a.z, &b.z, "z"),
    ];
    for (x, y, name) in pairs {
        assert!(max_diff(x, y) < 1e-10, "{what}: {name} differs by {}", max_diff(x, y));
    }
}
