//! Learned feature maps φ for the linear branch of STILL and LoLCATs (still.md §2).
//!
//! One type covers the three maps we need; all end in φ(x) = clamp_min([softmax(u) ⊕ softmax(−u)], 1e-12),
//! softmaxes over the last dimension with no temperature:
//! - **NP-Map** (STILL): Householder reflection x' = x − 2(x·û_h)û_h, per-head linear map f = x'·W_h
//!   (`[D, D]`, no bias), norm re-injection u = f/max(‖f‖, 1e-12)·‖x‖. ‖x‖ is therefore the softmax's inverse
//!   temperature: u(αx) = α·u(x), and scaling W_h changes nothing.
//! - **STILL `hedgehog`** (the "w/o NP-Map" ablation, still.md §9): the same reflection and W_h, u = f.
//! - **LoLCATs Hedgehog**: u = x·W_h with W_h `[D, F]` (F = 64), no reflection, no re-injection.
//!
//! Parameter names (relative to the map's path, e.g. `…self_attn.feature_map_q.`):
//! `hh.u` `[H, D]` (Householder vectors; NP-Map and STILL-hedgehog only) and `mlp.layer` `[H, D, F]`
//! (φ's linear map, input dim first, as LoLCATs' `FeatureMapMLP.layer`). STILL's reference code keeps W_h
//! as one `nn.Linear(D, F)` per head (`mlp.linears.{h}.weight`, `[F, D]`): `mlp.layer[h]` is its transpose.
use serde::{Deserialize, Serialize};
use tch::{nn, Kind, Tensor};

/// Which φ STILL uses (still.md §9 `feature_map`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum FeatureMapKind {
    /// Householder + per-head linear map + norm re-injection (the paper's NP-Map).
    #[default]
    NpMap,
    /// Same parameters without the norm re-injection (still.md §9 `hedgehog_d128`).
    #[serde(alias = "hedgehog_d128")]
    Hedgehog,
}

/// How W_h is initialised. `u` is always N(0, 1) (still.md §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParamInit {
    /// N(0, 0.02): what HF `from_pretrained` leaves in modules missing from the checkpoint (still.md §10 C10).
    Normal,
    /// PyTorch's kaiming-uniform as the reference constructors do: bound √(6/D) for STILL's per-head
    /// `nn.Linear`, √(6/(D·F)) for LoLCATs' 3-d `layer` (torch counts fan-in as D·F there).
    Constructor,
    /// W_h = I (needs F = D; the reference's `zero_init` option).
    Identity,
}

/// A per-head learned feature map; see the module comment.
#[derive(Debug)]
pub struct FeatureMap {
    /// Householder vectors u_h `[H, D]`, or `None` (LoLCATs).
    pub householder: Option<Tensor>,
    /// W_h `[H, D, F]`.
    pub layer: Tensor,
    /// u = f/‖f‖·‖x‖ (NP-Map) or u = f.
    pub norm_reinject: bool,
    /// The last [`FeatureMap::folded_linear`] made outside autograd and what it was made from: every
    /// prefill, decode and eval forward reuses it while the parameters stay as they are (made afresh,
    /// it is about eight small kernels a map, two maps a layer, in every call).
    folded: std::sync::Mutex<Option<(FoldedFrom, Tensor)>>,
}

/// What a folded matrix was made from: its kind, each parameter's storage, dtype and version counter
/// (an in-place write through aten moves the counter), and the writes of parameters that move no
/// counter (`util::parameter_writes`: the fused optimizer step, NCCL's broadcast).
type FoldedFrom = (Kind, Vec<(usize, Kind, i64)>, u64);

impl FeatureMap {
    /// A map from its parameters (see the fields).
    pub fn new(householder: Option<Tensor>, layer: Tensor, norm_reinject: bool) -> Self {
        FeatureMap { householder, layer, norm_reinject, folded: Default::default() }
    }

    /// STILL's map for `heads` heads of width `head_dim` (F = D).
    pub fn still(p: &nn::Path, kind: FeatureMapKind, heads: i64, head_dim: i64, init: ParamInit) -> Self {
        let householder = Some((p / "hh").var("u", &[heads, head_dim], nn::Init::Randn { mean: 0.0, stdev: 1.0 }));
        let layer = layer_var(p, heads, head_dim, head_dim, init, (6.0 / head_dim as f64).sqrt());
        FeatureMap::new(householder, layer, kind == FeatureMapKind::NpMap)
    }

    /// Its variables: W_h, and the Householder vectors when it has them.
    pub fn parameters(&self) -> Vec<Tensor> {
        self.householder.iter().chain([&self.layer]).map(Tensor::shallow_clone).collect()
    }

    /// LoLCATs' Hedgehog map with `feature_dim` F (φ has 2F features).
    pub fn hedgehog(p: &nn::Path, heads: i64, head_dim: i64, feature_dim: i64, init: ParamInit) -> Self {
        let bound = (6.0 / (head_dim * feature_dim) as f64).sqrt();
        FeatureMap::new(None, layer_var(p, heads, head_dim, feature_dim, init, bound), false)
    }

    /// Width of φ (2F).
    pub fn dim(&self) -> i64 {
        2 * self.layer.size()[2]
    }

    /// The softmax argument u `[B, H, T, F]` of x `[B, H, T, D]`, computed in x's kind (parameters are cast):
    /// f = x·W'_h with the reflection folded into W_h ([`FeatureMap::folded_linear`]: one `[H, D, F]`
    /// product a call, where reflecting every row took four passes over `[B, H, T, D]`; ‖x'‖ = ‖x‖).
    pub fn pre_softmax(&self, x: &Tensor) -> Tensor {
        let f = x.matmul(&self.folded_linear(x.kind()));
        if self.norm_reinject {
            let r = x.norm_scalaropt_dim(2, -1, true);
            &f / f.norm_scalaropt_dim(2, -1, true).clamp_min(1e-12) * r
        } else {
            f
        }
    }

    /// φ(x) `[B, H, T, 2F]` in x's kind.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let u = self.pre_softmax(x);
        Tensor::cat(&[u.softmax(-1, x.kind()), (-u).softmax(-1, x.kind())], -1).clamp_min(1e-12)
    }

    /// The map's linear part as one matrix per head `[H, D, F]` in `kind`: the Householder reflection
    /// folded into W_h, W'_h = (I − 2ûûᵀ)·W_h = W_h − 2û(ûᵀW_h), so that x·W'_h is [`FeatureMap::pre_softmax`]'s
    /// f (its u before any norm re-injection). A decode step's mixing kernel computes φ(q) from it
    /// (csrc/cuda/hybrid_step.cuh), made once per generation while the parameters stay as they are, and
    /// the prefill's linear branch (csrc/cuda/hybrid_linear.cuh) from it. Where no gradient is
    /// recorded, the matrix of the last call while the parameters are unchanged.
    pub fn folded_linear(&self, kind: Kind) -> Tensor {
        let params = self.parameters();
        if crate::util::grad_enabled() && params.iter().any(Tensor::requires_grad) {
            return self.fold(kind);
        }
        let from: FoldedFrom = (kind, params.iter().map(|p| (p.data_ptr() as usize, p.kind(), p.internal_version())).collect(), crate::util::parameter_writes());
        let mut last = self.folded.lock().expect("folded map lock");
        match last.as_ref() {
            Some((made_from, w)) if *made_from == from => w.shallow_clone(),
            _ => {
                let w = tch::no_grad(|| self.fold(kind));
                *last = Some((from, w.shallow_clone()));
                w
            }
        }
    }

    /// [`FeatureMap::folded_linear`] made afresh.
    fn fold(&self, kind: Kind) -> Tensor {
        let w = self.layer.to_kind(kind);
        let Some(u) = &self.householder else { return w.contiguous() };
        let u = u.to_kind(kind);
        let uhat = (&u / u.norm_scalaropt_dim(2, -1, true).clamp_min(1e-6)).unsqueeze(-1); // [H, D, 1]
        (&w - &uhat * uhat.transpose(-2, -1).matmul(&w) * 2.0).contiguous()
    }
}

fn layer_var(p: &nn::Path, heads: i64, d: i64, f: i64, init: ParamInit, kaiming_bound: f64) -> Tensor {
    let mlp = p / "mlp";
    match init {
        ParamInit::Normal => mlp.var("layer", &[heads, d, f], nn::Init::Randn { mean: 0.0, stdev: 0.02 }),
        ParamInit::Constructor => mlp.var("layer", &[heads, d, f], nn::Init::Uniform { lo: -kaiming_bound, up: kaiming_bound }),
        ParamInit::Identity => {
            assert_eq!(d, f, "identity init needs feature_dim = head_dim");
            let eye = Tensor::eye(d, (Kind::Float, p.device())).unsqueeze(0).repeat([heads, 1, 1]);
            mlp.var_copy("layer", &eye)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    /// Per-head loop with the Householder matrix written out: H_h = I − 2ûûᵀ, φ = softmax(±u).
    fn phi_loop(fm: &FeatureMap, x: &Tensor) -> Tensor {
        let heads = x.size()[1];
        let d = x.size()[3];
        let cols: Vec<Tensor> = (0..heads)
            .map(|h| {
                let xh = x.select(1, h); // [B, T, D]
                let w = fm.layer.get(h).to_kind(Kind::Double);
                let xr = match &fm.householder {
                    Some(u) => {
                        let u = u.get(h).to_kind(Kind::Double);
                        let uh = &u / u.dot(&u).sqrt().clamp_min(1e-6);
                        let hm = Tensor::eye(d, (Kind::Double, Device::Cpu)) - uh.outer(&uh) * 2.0;
                        xh.matmul(&hm)
                    }
                    None => xh.shallow_clone(),
                };
                let mut f = xr.matmul(&w);
                if fm.norm_reinject {
                    let fnorm = (&f * &f).sum_dim_intlist(-1, true, Kind::Double).sqrt();
                    let xnorm = (&xh * &xh).sum_dim_intlist(-1, true, Kind::Double).sqrt();
                    f = &f / fnorm * xnorm;
                }
                let e = f.exp();
                let en = (-&f).exp();
                let sp = &e / e.sum_dim_intlist(-1, true, Kind::Double);
                let sn = &en / en.sum_dim_intlist(-1, true, Kind::Double);
                Tensor::cat(&[sp, sn], -1).clamp_min(1e-12)
            })
            .collect();
        Tensor::stack(&cols, 1)
    }

    fn maps(vs: &nn::VarStore) -> Vec<FeatureMap> {
        let root = vs.root();
        vec![
            FeatureMap::still(&(&root / "np"), FeatureMapKind::NpMap, 3, 8, ParamInit::Normal),
            FeatureMap::still(&(&root / "hh"), FeatureMapKind::Hedgehog, 3, 8, ParamInit::Constructor),
            FeatureMap::hedgehog(&(&root / "lol"), 3, 8, 5, ParamInit::Constructor),
        ]
    }

    /// The vectorised map (the reflection folded into W_h) equals the per-head loop that reflects each
    /// row by an explicit Householder matrix; and its gradients reach W_h and û as the loop's do.
    #[test]
    fn feature_maps_match_per_head_loop() {
        let _rng = crate::testutil::seeded(1);
        let mut vs = nn::VarStore::new(Device::Cpu);
        let fms = maps(&vs);
        vs.double();
        let x = Tensor::randn([2, 3, 7, 8], (Kind::Double, Device::Cpu)) * 3.0;
        let w = Tensor::randn([2, 3, 7, 1], (Kind::Double, Device::Cpu));
        for fm in &fms {
            let (a, b) = (fm.forward(&x), phi_loop(fm, &x));
            assert_eq!(a.size(), [2, 3, 7, fm.dim()]);
            assert!(max_diff(&a, &b) < 1e-12, "{}", max_diff(&a, &b));
            let params = fm.parameters();
            let grads = |y: Tensor| Tensor::run_backward(&[(y * &w).sum(Kind::Double)], &params.iter().collect::<Vec<_>>(), false, false);
            for (ga, gb) in grads(a).iter().zip(&grads(b)) {
                assert!(max_diff(ga, gb) < 1e-10, "gradient: {}", max_diff(ga, gb));
            }
        }
    }

    /// The folded matrix is reused only while the parameters are unchanged: an in-place write, a step
    /// of the fused optimizer (which libtorch's version counters may not see) or another kind makes it
    /// afresh, and a pass that records gradients gets one with its graph.
    #[test]
    fn folded_matrix_follows_its_parameters() {
        let _rng = crate::testutil::seeded(5);
        let vs = nn::VarStore::new(Device::Cpu);
        let fm = FeatureMap::still(&vs.root(), FeatureMapKind::NpMap, 2, 8, ParamInit::Normal);
        let first = tch::no_grad(|| fm.folded_linear(Kind::Float));
        assert_eq!(tch::no_grad(|| fm.folded_linear(Kind::Float)).data_ptr(), first.data_ptr(), "unchanged parameters: the same matrix");
        assert!(max_diff(&first, &fm.fold(Kind::Float)) == 0.0);
        tch::no_grad(|| {
            let _ = fm.layer.shallow_clone().g_add_scalar_(0.25);
        });
        let moved = tch::no_grad(|| fm.folded_linear(Kind::Float));
        assert!(max_diff(&moved, &first) > 1e-3, "a write of W_h makes it afresh");
        assert!(max_diff(&moved, &fm.fold(Kind::Float)) == 0.0);
        // A training step by the fused AdamW (linearize's, finetune's), then an eval pass.
        let params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        let mut opt = crate::train::optim::AdamW::new(params, crate::train::optim::Hyper { betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.0 });
        let x = Tensor::randn([3, 2, 5, 8], (Kind::Float, Device::Cpu));
        fm.forward(&x).pow_tensor_scalar(3).sum(Kind::Float).backward();
        opt.step(0.05).unwrap();
        let stepped = tch::no_grad(|| fm.folded_linear(Kind::Float));
        assert!(max_diff(&stepped, &moved) > 1e-3, "the step moved W_h and u");
        assert!(max_diff(&stepped, &fm.fold(Kind::Float)) == 0.0, "after an optimizer step: made afresh");
        assert_eq!(tch::no_grad(|| fm.folded_linear(Kind::Double)).kind(), Kind::Double);
        let recorded = fm.folded_linear(Kind::Float);
        assert!(recorded.requires_grad(), "a training pass differentiates through the fold");
    }

    /// still.md §12.3: ‖u‖ = ‖x‖ (so ‖x‖ is the softmax's inverse temperature: u(αx) = α·u(x)); Σφ = 2,
    /// φ ≥ 1e-12; φ is unchanged when W_h is scaled; the reflection is orthogonal and an involution.
    #[test]
    fn np_map_keeps_the_norm_as_temperature() {
        let _rng = crate::testutil::seeded(2);
        let mut vs = nn::VarStore::new(Device::Cpu);
        let fm = FeatureMap::still(&vs.root(), FeatureMapKind::NpMap, 4, 16, ParamInit::Normal);
        vs.double();
        let x = Tensor::randn([2, 4, 9, 16], (Kind::Double, Device::Cpu)) * Tensor::from_slice(&[0.1f64, 1.0, 5.0, 30.0]).view([1, 4, 1, 1]);
        let norm = |t: &Tensor| t.norm_scalaropt_dim(2, -1, false);
        let u = fm.pre_softmax(&x);
        let rel = ((norm(&u) - norm(&x)).abs() / norm(&x)).max().double_value(&[]);
        assert!(rel < 1e-6, "‖u‖ vs ‖x‖: {rel}");
        // Temperature: scaling x scales u by the same factor (the direction depends on x̂ only).
        let u3 = fm.pre_softmax(&(&x * 3.0));
        assert!(max_diff(&u3, &(&u * 3.0)) < 1e-9);
        let phi = fm.forward(&x);
        let sum_err = (phi.sum_dim_intlist(-1, false, Kind::Double) - 2.0).abs().max().double_value(&[]);
        assert!(sum_err <= 32.0 * 1e-12 + 1e-13, "Σφ − 2 = {sum_err}");
        assert!(phi.min().double_value(&[]) >= 1e-12);
        // Sharper with larger ‖x‖: the largest feature of φ(αx) grows with α (softmax temperature 1/‖x‖).
        let peak = |a: f64| fm.forward(&(&x * a)).amax(-1, false).mean(Kind::Double).double_value(&[]);
        assert!(peak(0.5) < peak(1.0) && peak(1.0) < peak(4.0));
        // Scale invariance in W_h.
        let with_layer = |layer: Tensor, norm_reinject| FeatureMap::new(fm.householder.as_ref().map(|u| u.shallow_clone()), layer, norm_reinject);
        assert!(max_diff(&phi, &with_layer(&fm.layer * 7.5, true).forward(&x)) < 1e-12);
        // Without re-injection the same scaling changes φ (the check above can fail).
        let (hh, hh_scaled) = (with_layer(fm.layer.shallow_clone(), false), with_layer(&fm.layer * 7.5, false));
        assert!(max_diff(&hh.forward(&x), &hh_scaled.forward(&x)) > 1e-3);
        // The reflection alone (W = I): orthogonal (‖x'‖ = ‖x‖, x'·y' = x·y) and an involution.
        let refl = with_layer(Tensor::eye(16, (Kind::Double, Device::Cpu)).unsqueeze(0).repeat([4, 1, 1]), false);
        let xr = refl.pre_softmax(&x);
        assert!(max_diff(&refl.pre_softmax(&xr), &x) < 1e-12, "H² = I");
        let y = Tensor::randn([2, 4, 9, 16], (Kind::Double, Device::Cpu));
        let dot = |a: &Tensor, b: &Tensor| (a * b).sum_dim_intlist(-1, false, Kind::Double);
        assert!(max_diff(&dot(&xr, &refl.pre_softmax(&y)), &dot(&x, &y)) < 1e-10);
        assert!(max_diff(&xr, &x) > 1e-3, "the reflection is not the identity");
    }
}
