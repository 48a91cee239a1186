//! Attention variants, one file each, behind one interface (`layer.rs`: [`Layer`], [`Heads`],
//! [`Attention`]): `vanilla` (causal softmax), `dar` (DAR and uniform = DAR with window 0), `window`
//! (sliding window only), `still` and `lolcats` (linearized hybrids; feature maps in
//! `feature_maps.rs`). The softmax kinds are registered below through `kinds.rs` (their options are
//! the spec's `attention:`), the hybrids through `hybrids.rs` (a linearize spec's `attention:`). A model hands each layer its rotated heads; the variant computes the rest. This
//! file holds what the variants share: masks, packed-document segments and the explicit masked
//! softmax every fast path is tested against. Decode caches: `cache.rs`.
#[macro_use]
pub mod kinds;
#[macro_use]
pub mod hybrids;
pub mod cache;
#[cfg(test)]
mod conformance;
pub mod feature_maps;
pub mod layer;

// The softmax attention kinds, registered once: each line is a module (its file) and the kinds it
// defines (`SoftmaxKind` types), in the order of tables, plot legends and `bench`; the first is the
// default. A new kind is its file plus one line here (kinds.rs says what it must answer).
softmax_kinds! {
    vanilla: Vanilla;
    dar: Dar, Uniform;
    window: Window;
    sink: Sink;
}

// The linearized hybrids (`attnlab linearize`), registered once: each line is a module (its file),
// the `Variant` it is and its options type (`HybridKind`, hybrids.rs says what it must answer). A
// new hybrid is its file plus one line here.
hybrid_kinds! {
    still: Still(StillConfig);
    lolcats: Lolcats(LolcatsConfig);
    liger_gla: LigerGla(LigerGlaConfig);
}

pub use dar::{dar, dar_sdpa, split_merge_supported, AttentionInit, DarAct};
pub use hybrids::HybridKind;
pub use kinds::{AttentionImpl, LineStyle, Settings, SoftmaxKind};
pub use layer::{forward_prefix, is_bottleneck_param, AbsorbedKv, Attention, Heads, KvMap, Layer, LayerDims, LayerOp, Positions};
pub use vanilla::causal;
use tch::{Device, Kind, Tensor};

/// Whether an inference call over `t` keys takes cuDNN (through SDPA / split-merge-cudnn) instead of
/// flash: from [`PREFILL_CUDNN_FROM`] keys on, or as `ATTNLAB_PREFILL_SDPA_FROM` says (N, or `off`).
pub fn cudnn_for_long_prefill(t: i64) -> bool {
    static FROM: std::sync::OnceLock<Option<i64>> = std::sync::OnceLock::new();
    FROM.get_or_init(|| prefill_cudnn_from(std::env::var("ATTNLAB_PREFILL_SDPA_FROM").ok().as_deref())).is_some_and(|n| t >= n)
}

/// A warm cuDNN beats flash on long prefills and a process's first call at a shape pays its plan
/// (one H100, Pythia-70M shape, warm / first call, seconds: vanilla 0.0069 / 0.538 vs flash 0.0093 at
/// 16K, 0.064 / 0.116 vs 0.094 at 64K; `gpu_bench.sh prefill`, results/bench/2026-12-06d-h100/). From
/// 32K keys on, one call repays the plan.
pub const PREFILL_CUDNN_FROM: i64 = 32768;

/// `ATTNLAB_PREFILL_SDPA_FROM`'s value: unset, the default; `off`, never; else the first length.
fn prefill_cudnn_from(var: Option<&str>) -> Option<i64> {
    match var.map(str::trim) {
        None | Some("") => Some(PREFILL_CUDNN_FROM),
        Some("off") => None,
        Some(v) => Some(v.parse().unwrap_or_else(|_| panic!("ATTNLAB_PREFILL_SDPA_FROM={v:?}: expected a number of keys or `off`"))),
    }
}

/// Whether autograd will ask for a gradient through any of `ts` (false at inference, under no_grad).
pub fn needs_grad(ts: &[&Tensor]) -> bool {
    ts.iter().any(|t| t.requires_grad())
}

/// `kernels::flash_attention` on heads `[B, H, T, hd]` (the kernel's `[B, T, H, hd]` by transposed
/// views), causal with a left window (`< 0`: unbounded).
pub fn flash_heads(q: &Tensor, k: &Tensor, v: &Tensor, window_left: i64) -> Tensor {
    let bthd = |x: &Tensor| x.transpose(1, 2);
    crate::kernels::flash_attention(&bthd(q), &bthd(k), &bthd(v), window_left).unwrap_or_else(|e| panic!("flash attention failed: {e}")).transpose(1, 2)
}

/// Boolean masks `[T, T]` for query i, key j: local = (0 ≤ i−j < w), global = (i−j ≥ w).
pub fn dar_masks(t: i64, window: i64, device: Device) -> (Tensor, Tensor) {
    let i = Tensor::arange(t, (Kind::Int64, device)).unsqueeze(1);
    let j = Tensor::arange(t, (Kind::Int64, device)).unsqueeze(0);
    let dist = i - j;
    let local = dist.ge(0).logical_and(&dist.lt(window));
    let global = dist.ge(window);
    (local, global)
}

/// The joint softmax of `masked_softmax_attention` through one SDPA call over the concatenated keys
/// (masks concatenated along the key axis; `[T, S_p]` or `[B, 1, T, S_p]`, all of one rank).
pub fn masked_sdpa(q: &Tensor, parts: &[(&Tensor, &Tensor, &Tensor)]) -> Tensor {
    let cat = |f: &dyn Fn(&(&Tensor, &Tensor, &Tensor)) -> Tensor, dim: i64| Tensor::cat(&parts.iter().map(f).collect::<Vec<_>>(), dim);
    let k = cat(&|p| p.0.shallow_clone(), 2);
    let v = cat(&|p| p.1.shallow_clone(), 2);
    let mask = cat(&|p| p.2.shallow_clone(), -1);
    Tensor::scaled_dot_product_attention(q, &k, &v, Some(mask), 0.0, false, None, false)
}

/// Attention with explicit masks (packed documents): the oracle for `Reference`, masked SDPA otherwise.
pub fn masked(q: &Tensor, parts: &[(&Tensor, &Tensor, &Tensor)], imp: AttentionImpl) -> Tensor {
    match imp {
        AttentionImpl::Reference => masked_softmax_attention(q, parts),
        _ => masked_sdpa(q, parts),
    }
}

/// Packed rows: document ids `[B, T]` → (segment index `[B, T]`, position within the document `[B, T]`).
/// Every run of equal ids is one segment (a new one starts wherever the id changes), so positions
/// restart at 0 at each document even if an id is reused later in the row.
pub fn doc_segments(doc_ids: &Tensor) -> (Tensor, Tensor) {
    let t = doc_ids.size()[1];
    let idx = Tensor::arange(t, (Kind::Int64, doc_ids.device())).unsqueeze(0).expand_as(doc_ids);
    let changed = doc_ids.narrow(1, 1, t - 1).ne_tensor(&doc_ids.narrow(1, 0, t - 1));
    let starts = Tensor::cat(&[changed.ones_like().narrow(1, 0, 1), changed], 1);
    let seg = starts.to_kind(Kind::Int64).cumsum(1, Kind::Int64);
    // Index of each token's segment start: the running maximum of the start indices seen so far.
    let (first, _) = idx.where_self(&starts, &idx.zeros_like()).cummax(1);
    (seg, idx - first)
}

/// `dar_masks` for packed rows `[B, 1, T, T]`: key j is visible to query i only in i's own segment
/// (`doc_segments`), local when 0 ≤ i−j < window, global when i−j ≥ window. Vanilla: window = T.
pub fn doc_dar_masks(seg: &Tensor, window: i64) -> (Tensor, Tensor) {
    let same = seg.unsqueeze(2).eq_tensor(&seg.unsqueeze(1)).unsqueeze(1);
    let (local, global) = dar_masks(seg.size()[1], window, seg.device());
    (local.logical_and(&same), global.logical_and(&same))
}

/// The oracle: one joint softmax over the union of several key sets. Each part is (keys
/// `[B, H, S_p, hd]`, values, boolean mask `[T, S_p]` of the keys each query may read); parts may have
/// different lengths (a decode step reads a window of full-width keys and a prefix of bottleneck
/// keys). Statistics in fp32 (fp64 inputs stay fp64). No (query, key position) pair may be visible in
/// two parts, and every query must see at least one key.
pub fn masked_softmax_attention(q: &Tensor, parts: &[(&Tensor, &Tensor, &Tensor)]) -> Tensor {
    let kind = if q.kind() == Kind::Double { Kind::Double } else { Kind::Float };
    masked_softmax_attention_in(q, parts, kind)
}

/// `masked_softmax_attention` with every product and the softmax in `kind` (the inputs' own dtype:
/// PyTorch's bf16 math path, the yardstick of `bench --check`).
pub fn masked_softmax_attention_in(q: &Tensor, parts: &[(&Tensor, &Tensor, &Tensor)], kind: Kind) -> Tensor {
    let hd = q.size()[3];
    let scale = 1.0 / (hd as f64).sqrt();
    let qf = q.to_kind(kind);
    let scores: Vec<Tensor> = parts
        .iter()
        .map(|(k, _, mask)| (qf.matmul(&k.to_kind(kind).transpose(-2, -1)) * scale).masked_fill(&mask.logical_not(), f64::NEG_INFINITY))
        .collect();
    let p = joint_softmax(&scores, kind, kind);
    let out = p.iter().zip(parts).map(|(p, (_, v, _))| p.matmul(&v.to_kind(kind))).reduce(|a, b| a + b);
    out.expect("at least one part").to_kind(q.kind())
}

/// One softmax (computed in `kind`, returned in `out`) over score blocks `[.., S_p]` side by side,
/// split back into one probability block per part: a joint softmax over key sets that are never
/// copied into one.
pub(crate) fn joint_softmax(scores: &[Tensor], kind: Kind, out: Kind) -> Vec<Tensor> {
    let p = Tensor::cat(scores, -1).softmax(-1, kind).to_kind(out);
    let lens: Vec<i64> = scores.iter().map(|s| *s.size().last().expect("scores have a key axis")).collect();
    p.split_with_sizes(lens.as_slice(), -1)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// f64 normal samples that require grad.
    pub(crate) fn rand(shape: &[i64], seed: i64) -> Tensor {
        let _rng = crate::testutil::seeded(seed);
        Tensor::randn(shape, (Kind::Double, Device::Cpu)).set_requires_grad(true)
    }

    pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    /// The gradients of ⟨out, go⟩ w.r.t. `wrt`; an input the path does not read (k_l at w = 0, a
    /// gate before any token left the window) has none: zero.
    pub(crate) fn grads_of(out: &Tensor, go: &Tensor, wrt: &[Tensor]) -> Vec<Tensor> {
        let gs = Tensor::run_backward(&[(out * go).sum(Kind::Double)], &wrt.iter().collect::<Vec<_>>(), true, false);
        gs.into_iter().zip(wrt).map(|(g, x)| if g.defined() { g } else { x.zeros_like() }).collect()
    }

    /// The long-prefill switch: the default when unset, never with `off`, the caller's length, and a
    /// clear refusal of anything else.
    #[test]
    fn prefill_cudnn_from_reads_its_variable() {
        assert_eq!(prefill_cudnn_from(None), Some(PREFILL_CUDNN_FROM));
        assert_eq!(prefill_cudnn_from(Some("off")), None);
        assert_eq!(prefill_cudnn_from(Some(" 16384 ")), Some(16384));
        let bad = std::panic::catch_unwind(|| prefill_cudnn_from(Some("16k"))).unwrap_err();
        assert!(bad.downcast_ref::<String>().is_some_and(|m| m.contains("ATTNLAB_PREFILL_SDPA_FROM=\"16k\"")));
    }

    /// SDPA over concatenated keys equals the explicit oracle, outputs and every input gradient,
    /// for windows inside, at and beyond the sequence.
    #[test]
    fn sdpa_matches_reference_forward_and_backward() {
        let _rng = crate::testutil::rng();
        let shape = [2, 3, 13, 8];
        for w in [0i64, 1, 4, 7, 13, 20] {
            let inputs: Vec<Tensor> = (0..5).map(|s| rand(&shape, 10 * w + s)).collect();
            let go = rand(&shape, 99).detach();
            let run = |imp| {
                let out = dar(&inputs[0], &inputs[1], &inputs[2], &inputs[3], &inputs[4], w, imp);
                (out.detach(), grads_of(&out, &go, &inputs))
            };
            let (o_ref, g_ref) = run(AttentionImpl::Reference);
            let (o_fast, g_fast) = run(AttentionImpl::Sdpa);
            assert!(max_diff(&o_ref, &o_fast) < 1e-10, "w={w} forward");
            for (i, (a, b)) in g_ref.iter().zip(&g_fast).enumerate() {
                assert!(max_diff(a, b) < 1e-10, "w={w} grad of input {i}: {}", max_diff(a, b));
            }
        }
    }

    /// The CPU band-split path (csrc/dar_band.cpp) equals the explicit oracle in fp64, outputs and all
    /// five input gradients: windows 0, 1, 4, T − 1, T, T + 5 and ones beside and beyond its block of
    /// 16 queries, ragged T (not a multiple of the block; shorter than one block), B > 1, and heads
    /// handed over as the model does (transposed views of [B, T, H, hd]); `auto` (band-split where
    /// it pays, masked SDPA elsewhere) likewise.
    #[test]
    fn band_split_matches_reference_forward_and_backward() {
        let _rng = crate::testutil::rng();
        // T 260: `auto` takes band-split for w ≤ T/16 (1, 4, 15, 16), masked SDPA above.
        for (b, h, t, hd) in [(2i64, 3i64, 13i64, 8i64), (2, 2, 37, 16), (1, 3, 64, 8), (1, 2, 260, 8)] {
            for w in [0i64, 1, 4, 15, 16, 17, 20, t - 1, t, t + 5] {
                // [B, T, H, hd] storage, [B, H, T, hd] views.
                let inputs: Vec<Tensor> = (0..5).map(|s| rand(&[b, t, h, hd], 1000 * t + 10 * w + s)).collect();
                let heads: Vec<Tensor> = inputs.iter().map(|x| x.transpose(1, 2)).collect();
                let go = rand(&[b, h, t, hd], 77).detach();
                let run = |imp| {
                    let out = dar(&heads[0], &heads[1], &heads[2], &heads[3], &heads[4], w, imp);
                    (out.detach(), grads_of(&out, &go, &inputs))
                };
                let (o_ref, g_ref) = run(AttentionImpl::Reference);
                for imp in [AttentionImpl::BandSplit, AttentionImpl::Auto] {
                    let (o, g) = run(imp);
                    assert!(max_diff(&o_ref, &o) < 1e-10, "{imp:?} T={t} w={w} forward: {}", max_diff(&o_ref, &o));
                    for (i, (a, c)) in g_ref.iter().zip(&g).enumerate() {
                        assert!(max_diff(a, c) < 1e-10, "{imp:?} T={t} w={w} grad of input {i}: {}", max_diff(a, c));
                    }
                }
            }
        }
    }

    /// Band-split in fp32 (the CPU training dtype) against the fp64 oracle: within fp32 rounding, and
    /// the kernel refuses what it does not take (w outside 0 < w < T, CUDA-only dtypes).
    #[test]
    fn band_split_fp32_and_refusals() {
        let _rng = crate::testutil::rng();
        let shape = [2, 4, 128, 16];
        let x: Vec<Tensor> = (0..5).map(|s| rand(&shape, 500 + s).detach()).collect();
        let f: Vec<Tensor> = x.iter().map(|t| t.to_kind(Kind::Float)).collect();
        let want = dar(&x[0], &x[1], &x[2], &x[3], &x[4], 8, AttentionImpl::Reference);
        let got = dar(&f[0], &f[1], &f[2], &f[3], &f[4], 8, AttentionImpl::BandSplit);
        assert!(max_diff(&want, &got.to_kind(Kind::Double)) < 1e-5, "{}", max_diff(&want, &got.to_kind(Kind::Double)));
        for w in [0, 128] {
            assert!(crate::kernels::dar_band_split(&f[0], &f[1], &f[2], &f[3], &f[4], w).is_err(), "w {w}");
        }
        let hb: Vec<Tensor> = f.iter().map(|t| t.to_kind(Kind::BFloat16)).collect();
        assert!(crate::kernels::dar_band_split(&hb[0], &hb[1], &hb[2], &hb[3], &hb[4], 8).is_err());
        // `auto` takes it where it measured faster: T ≥ 256 with w ≤ T/16, CPU fp32 / fp64 only.
        let q = |t: i64, kind: Kind| Tensor::zeros([1, 1, t, 16], (kind, tch::Device::Cpu));
        use super::dar::band_split_pays as pays;
        assert!(pays(&q(256, Kind::Float), 16) && pays(&q(2048, Kind::Double), 128));
        assert!(!pays(&q(128, Kind::Float), 8) && !pays(&q(256, Kind::Float), 17) && !pays(&q(256, Kind::Float), 0) && !pays(&q(512, Kind::BFloat16), 8));
    }

    /// Hand-computed case: T = 2, hd = 1, w = 1. Query 1 sees key 0 through the bottleneck version.
    #[test]
    fn reference_matches_hand_computation() {
        let _rng = crate::testutil::rng();
        let t = |v: &[f64]| Tensor::from_slice(v).view([1, 1, 2, 1]);
        let (q, kl, vl, kg, vg) = (t(&[1.0, 2.0]), t(&[0.5, 1.0]), t(&[10.0, 20.0]), t(&[-1.0, 3.0]), t(&[100.0, 200.0]));
        let o = dar(&q, &kl, &vl, &kg, &vg, 1, AttentionImpl::Reference);
        // Row 0: only key 0 (local) → v_l[0] = 10. Row 1: key 0 global (score 2·(−1) = −2), key 1 local (2·1 = 2).
        let (p0, p1) = ((-2f64).exp(), 2f64.exp());
        let want1 = (p0 * 100.0 + p1 * 20.0) / (p0 + p1);
        let got: Vec<f64> = Vec::<f64>::try_from(o.flatten(0, -1)).unwrap();
        assert!((got[0] - 10.0).abs() < 1e-12 && (got[1] - want1).abs() < 1e-12, "{got:?} vs [10, {want1}]");
    }
}
