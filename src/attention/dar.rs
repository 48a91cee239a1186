//! DAR (dar.md §1.3): one joint softmax in which key j is read from its full-width version (k_l, v_l)
//! when the query is closer than `window`, and from its bottleneck version (k_g, v_g) otherwise;
//! `uniform` is DAR with window 0. The forward's fast paths (SDPA over concatenated keys; CUDA
//! split-merge, dar-kernels.md §3) sit beside the explicit masked reference, and tests hold them
//! together. The bottleneck's initialisation (small_init, orthogonal, PCA) is in `init`.
//!
//! DAR's decode cache (dar.md §3), one for every model family: full-width rotated keys / values of
//! the last `w` tokens only, and the d_down-wide latent h^D of every token. At each step the distant
//! keys / values are rebuilt from the latents by the model's own map (W_up absorbed into its k / v
//! projection, then whatever the full forward applies after it: OLMo 2's k_norm, RoPE at each key's
//! own position), so decoding computes exactly the full forward's function. Per layer, after T tokens:
//! (T·d_down + 2·min(w, T)·d_kv) elements, d_kv = kv_heads·head_dim.
pub mod init;

use super::cache::{attend_newest, distances, masked_parts, repeat_kv, tensor_bytes, CacheShape, KindCache, LayerCache, Padding, Recent, Slots, StepAt};
use super::kinds::{AttentionImpl, AttentionSpec, BenchInputs, LineStyle, Settings, SoftmaxKind, DEFAULT_WINDOW};
use super::layer::{AbsorbedKv, Heads, KvMap, LayerDims, LayerOp, Positions};
use super::masked_softmax_attention;
use super::vanilla::causal;
use super::{dar_masks, doc_dar_masks, masked, masked_sdpa};
use crate::error::Invalid;
use crate::kernels::{self, GlobalBackend};
use crate::Result;
use serde::{Deserialize, Serialize};
use tch::Tensor;
use tch::nn;

/// The activation of DAR's latent h^D = a·W_down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DarAct {
    #[default]
    Linear,
    Sigmoid,
}

/// The start of a pretraining run's DAR bottleneck (dar.md §7.4), drawn from its own seeded stream
/// so that every other weight equals the vanilla run's of the same seed (`init::pretraining_start`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AttentionInit {
    /// W_down and W_up each N(0, 2/(5d)), GPT-NeoX's small_init: the distant path starts at about
    /// 0.4·√(d_down/d) of the local path's norm.
    #[default]
    SmallInit,
    /// W_down with orthonormal rows, W_up = W_downᵀ: the distant path starts as the orthogonal
    /// projection onto a random d_down-dimensional subspace (norm-preserving on its span).
    Orthogonal,
    /// Fine-tuning only (`attnlab finetune`): W_down = Uᵀ, W_up = U with U the top-d_down principal
    /// directions of each layer's K/V input over calibration rows (`init`). A pretraining spec
    /// refuses it: a model being trained from scratch has no activations to read.
    Pca,
}

impl AttentionInit {
    /// The spec's spelling (`attention.init: small_init`).
    pub fn name(self) -> &'static str {
        match self {
            AttentionInit::SmallInit => "small_init",
            AttentionInit::Orthogonal => "orthogonal",
            AttentionInit::Pca => "pca",
        }
    }
}

/// `attention: {kind: dar, d_down, window, dar_act, impl, init}` (dar.md §4.1).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dar {
    /// Bottleneck width for distant keys (default d_model/4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub d_down: Option<i64>,
    /// Keys at distance < window use full width (default 128; 0 is uniform).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<i64>,
    #[serde(default)]
    pub dar_act: DarAct,
    #[serde(default, rename = "impl")]
    pub implementation: AttentionImpl,
    /// How pretraining starts the bottleneck (resolved to small_init).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<AttentionInit>,
    /// Set in the resolved config to explain how the kind was interpreted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// The seed of the bottleneck's own stream at the start of pretraining (the run's seed, set by
    /// the model's config; not an option).
    #[serde(skip)]
    pub init_seed: u64,
}

/// `attention: {kind: uniform, d_down}`: DAR with window 0, every key through the bottleneck.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Uniform(pub Dar);

impl Dar {
    /// d_down and the pretraining start, resolved (shared by DAR and uniform).
    fn resolve_bottleneck(&mut self, d_model: usize) -> std::result::Result<(), Invalid> {
        if self.init == Some(AttentionInit::Pca) {
            return Err(("init".into(), "pca starts a pretrained model's bottleneck from its own activations (attnlab finetune); pretraining starts it with small_init or orthogonal".into()));
        }
        self.init.get_or_insert_default();
        let d_down = *self.d_down.get_or_insert((d_model / 4) as i64);
        if d_down <= 0 || d_down as usize > d_model {
            return Err(("d_down".into(), format!("{d_down} is not in 1..={d_model} (d_model)")));
        }
        Ok(())
    }

    fn settings(&self) -> Settings {
        let size = |v: Option<i64>| v.filter(|&x| x >= 0).map(|x| x as usize);
        Settings { d_down: size(self.d_down), window: size(self.window), init: self.init, dar_act: self.dar_act, implementation: self.implementation }
    }

    /// The comparable form: d_down, window (DAR at window 0 is uniform) and the bottleneck start.
    fn comparable_form(&self) -> AttentionSpec {
        let s = self.settings();
        let c = AttentionSpec::bottleneck(s.d_down.unwrap_or(0), s.window.unwrap_or(0));
        c.with_init(self.init.unwrap_or_default())
    }

    /// A layer: the bottleneck under `p`, started by the pretraining start of its own stream (seed,
    /// layer): every other weight draws exactly what it draws in a vanilla model of the same seed.
    fn dar_layer(&self, p: &nn::Path, dims: LayerDims, window: i64) -> Result<Box<dyn LayerOp>> {
        let d_down = self.d_down.unwrap_or(dims.d_model / 4).max(1);
        let bottleneck = Bottleneck::new(p, dims.d_model, d_down, self.dar_act, nn::Init::Const(0.0));
        // A fine-tuned model's config records `init: pca`, a start its weights (loaded over these, or
        // calibrated by `init::calibrate_pca`) replace: it builds with the default start.
        let start = match self.init.unwrap_or_default() {
            AttentionInit::Pca => AttentionInit::SmallInit,
            other => other,
        };
        let (down, up) = init::pretraining_start(start, self.init_seed, dims.layer as usize, dims.d_model as usize, d_down as usize);
        tch::no_grad(|| {
            bottleneck.down.shallow_clone().copy_(&down);
            bottleneck.up.shallow_clone().copy_(&up);
        });
        Ok(Box::new(DarLayer { bottleneck, window, imp: self.implementation }))
    }

    /// The local window, default 128 (0 is uniform's), resolved.
    fn resolve_window(&mut self) -> std::result::Result<i64, Invalid> {
        let w = *self.window.get_or_insert(DEFAULT_WINDOW);
        if w < 0 {
            return Err(("window".into(), format!("{w} is negative")));
        }
        Ok(w)
    }
}

impl SoftmaxKind for Dar {
    const NAME: &'static str = "dar";
    const TABLE_NAME: &'static str = "DAR";
    const LINE_STYLE: LineStyle = LineStyle::Solid;
    const DECODE_BENCH: &'static str = "GPT-NeoX, the spec's DAR: full K/V for the last w tokens, d_down-wide latents before";
    const HAS_BOTTLENECK: bool = true;
    const LOCAL_ONLY: bool = false;

    /// d_down, the activation, the start and the implementation carry over; the window only from DAR.
    fn adopt(other: &AttentionSpec) -> Self {
        let s = other.settings();
        let window = if other.kind() == super::AttentionKind::Dar { s.window.map(|w| w as i64) } else { None };
        Dar { d_down: s.d_down.map(|d| d as i64), window, dar_act: s.dar_act, implementation: s.implementation, init: s.init, note: None, init_seed: 0 }
    }

    fn resolve(&mut self, d_model: usize) -> std::result::Result<(), Invalid> {
        self.resolve_bottleneck(d_model)?;
        let w = self.resolve_window()?;
        self.note = Some(format!("dar: keys at distance < {w} (the current token included) full width, farther keys through the d_down bottleneck"));
        Ok(())
    }

    /// dar.md §4.2: d_down required, window default 128, small_init or pca, the linear bottleneck.
    fn resolve_finetune(&mut self) -> std::result::Result<(), Invalid> {
        self.note = None;
        match self.d_down {
            None => return Err(("d_down".into(), "is required for kind: dar (the bottleneck width)".into())),
            Some(d) if d <= 0 => return Err(("d_down".into(), format!("{d} must be > 0"))),
            Some(_) => {}
        }
        self.resolve_window()?;
        match *self.init.get_or_insert_default() {
            AttentionInit::SmallInit | AttentionInit::Pca => {}
            AttentionInit::Orthogonal => return Err(("init".into(), "orthogonal is a pretraining start; finetune starts the bottleneck with small_init or pca".into())),
        }
        if self.dar_act != DarAct::Linear {
            return Err(("dar_act".into(), "finetune adds the linear bottleneck (dar.md §4.2); sigmoid is a pretraining variant".into()));
        }
        Ok(())
    }

    fn comparable(&self) -> AttentionSpec {
        self.comparable_form()
    }

    fn label(&self) -> String {
        let c = self.comparable_form();
        let s = c.settings();
        match c {
            AttentionSpec::Dar(_) => match (s.d_down, s.window) {
                (Some(d), Some(w)) => format!("DAR (d_down {d}, w {w}{})", init_suffix(s.init)),
                _ => "dar".into(),
            },
            other => other.label(),
        }
    }

    fn settings(&self) -> Settings {
        Dar::settings(self)
    }

    fn set_implementation(&mut self, imp: AttentionImpl) {
        self.implementation = imp;
    }

    fn set_init_seed(&mut self, seed: u64) {
        self.init_seed = seed;
    }

    fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }

    fn layer(&self, p: &nn::Path, dims: LayerDims) -> Result<Box<dyn LayerOp>> {
        self.dar_layer(p, dims, self.window.unwrap_or(DEFAULT_WINDOW))
    }

    fn bench_op(x: &BenchInputs) -> Tensor {
        dar(x.q, x.k, x.v, x.kg, x.vg, x.window, x.imp)
    }
}

impl SoftmaxKind for Uniform {
    const NAME: &'static str = "uniform";
    const TABLE_NAME: &'static str = "Uniform";
    const LINE_STYLE: LineStyle = LineStyle::Dashed;
    const DECODE_BENCH: &'static str = "GPT-NeoX, DAR with w = 0";
    const HAS_BOTTLENECK: bool = true;
    const LOCAL_ONLY: bool = false;

    fn adopt(other: &AttentionSpec) -> Self {
        let mut d = Dar::adopt(other);
        d.window = None;
        Uniform(d)
    }

    fn resolve(&mut self, d_model: usize) -> std::result::Result<(), Invalid> {
        let d = &mut self.0;
        d.resolve_bottleneck(d_model)?;
        if let Some(w) = d.window.filter(|&w| w != 0) {
            return Err(("window".into(), format!("kind: uniform is DAR with window 0; got window {w}")));
        }
        d.window = Some(0);
        d.note = Some("uniform = DAR with window 0: every key, the current token's included, uses the d_down bottleneck".into());
        Ok(())
    }

    fn resolve_finetune(&mut self) -> std::result::Result<(), Invalid> {
        Err(("kind".into(), "finetune keeps vanilla or changes the attention to dar, not to uniform (uniform is dar with window: 0)".into()))
    }

    fn comparable(&self) -> AttentionSpec {
        let mut c = self.0.clone();
        c.window.get_or_insert(0);
        c.comparable_form()
    }

    fn label(&self) -> String {
        let s = self.0.settings();
        match s.d_down {
            Some(d) => format!("uniform (d_down {d}{})", init_suffix(s.init.or(Some(AttentionInit::SmallInit)))),
            None => "uniform".into(),
        }
    }

    fn settings(&self) -> Settings {
        self.0.settings()
    }

    fn set_implementation(&mut self, imp: AttentionImpl) {
        self.0.implementation = imp;
    }

    fn set_init_seed(&mut self, seed: u64) {
        self.0.init_seed = seed;
    }

    fn note(&self) -> Option<&str> {
        self.0.note.as_deref()
    }

    fn layer(&self, p: &nn::Path, dims: LayerDims) -> Result<Box<dyn LayerOp>> {
        self.0.dar_layer(p, dims, 0)
    }

    /// DAR's op at `op_window`'s window 0.
    fn bench_op(x: &BenchInputs) -> Tensor {
        Dar::bench_op(x)
    }

    /// Uniform's op is DAR's with window 0, whatever window the bench asks for.
    fn op_window(_window: i64) -> i64 {
        0
    }
}

/// ", orthogonal" after a label's sizes; nothing for the default start.
fn init_suffix(init: Option<AttentionInit>) -> String {
    match init {
        Some(AttentionInit::SmallInit) | None => String::new(),
        Some(i) => format!(", {}", i.name()),
    }
}

impl AttentionSpec {
    /// DAR with a bottleneck of `d_down` beyond `window` (small_init) in comparable form; window 0 is
    /// uniform (dar.md §1.1).
    pub fn bottleneck(d_down: usize, window: usize) -> AttentionSpec {
        let d = Dar { d_down: Some(d_down as i64), window: Some(window as i64), init: Some(AttentionInit::SmallInit), ..Dar::default() };
        if window == 0 { AttentionSpec::Uniform(Uniform(d)) } else { AttentionSpec::Dar(d) }
    }

    /// The same with another bottleneck start (kinds without a bottleneck: unchanged).
    pub fn with_init(self, init: AttentionInit) -> AttentionSpec {
        match self {
            AttentionSpec::Dar(d) => AttentionSpec::Dar(Dar { init: Some(init), ..d }),
            AttentionSpec::Uniform(Uniform(d)) => AttentionSpec::Uniform(Uniform(Dar { init: Some(init), ..d })),
            other => other,
        }
    }
}

/// A DAR layer (uniform: window 0): its bottleneck, window and implementation.
pub struct DarLayer {
    bottleneck: Bottleneck,
    window: i64,
    imp: AttentionImpl,
}

impl DarLayer {
    /// A layer around a bottleneck already made (`init`: a pretrained model given DAR).
    pub fn new(bottleneck: Bottleneck, window: i64, imp: AttentionImpl) -> Self {
        DarLayer { bottleneck, window, imp }
    }

    pub fn bottleneck(&self) -> &Bottleneck {
        &self.bottleneck
    }
}

impl LayerOp for DarLayer {
    fn forward(&self, h: &Heads) -> Tensor {
        let (k, v) = h.expanded_kv();
        // Named scopes: `attnlab bench --profile` files the kernels under them. Only the distant keys
        // the op reads are built (split-merge: positions ..T − w), so none get a zero gradient.
        let n = distant_positions(&h.q, self.window, h.seg, self.imp);
        let (kg, vg) = kernels::scope("dar.distant_kv", || self.bottleneck.distant(h.input, h.kv, n));
        let (kg, vg) = (repeat_kv(&kg, &h.q), repeat_kv(&vg, &h.q));
        kernels::scope("attn.op", || forward(&h.q, &k, &v, &kg, &vg, self.window, h.seg, self.imp))
    }

    fn new_cache(&self, shape: &CacheShape) -> LayerCache {
        LayerCache::new(DarCache::new(shape, self.window, self.bottleneck.d_down()))
    }

    fn decode(&self, cache: &mut LayerCache, h: &Heads, p0: i64) -> Tensor {
        let c = cache.state::<DarCache>();
        let latent = self.bottleneck.decode_latent(h);
        if p0 == 0 {
            let (kg, vg) = h.kv.kv(self.bottleneck.up(), &latent, Positions::Forward);
            let r = |x: &Tensor| repeat_kv(x, &h.q);
            let out = forward(&h.q, &r(&h.k), &r(&h.v), &r(&kg), &r(&vg), self.window, h.seg, self.imp);
            c.push(&h.k, &h.v, &latent);
            return out;
        }
        // Distant keys of positions 0..g, rebuilt from the latents through the model's own map.
        let kv = |latent: &Tensor| h.kv.kv(self.bottleneck.up(), latent, Positions::From(0));
        c.attend(&h.q, &h.k, &h.v, p0, Distant { latent, kv: &kv })
    }

    fn decode_at(&self, cache: &mut LayerCache, h: &Heads, at: &StepAt) -> Option<Tensor> {
        let latent = self.bottleneck.decode_latent(h);
        Some(cache.state::<DarCache>().attend_at(h, at, &latent, self.bottleneck.up()))
    }

    /// The absorbed map, made by the first step that reads through it.
    fn step_state_made(&self, cache: &mut LayerCache) -> bool {
        cache.state::<DarCache>().absorbed.is_some()
    }

    /// DAR ↔ uniform, another window or implementation, the bottleneck kept (its width must agree).
    fn reconfigured(&self, a: &AttentionSpec) -> Option<Box<dyn LayerOp>> {
        let s = a.settings();
        if !a.has_bottleneck() || s.d_down.is_some_and(|d| d as i64 != self.bottleneck.d_down()) {
            return None;
        }
        let bottleneck = Bottleneck { down: self.bottleneck.down.shallow_clone(), up: self.bottleneck.up.shallow_clone(), act: s.dar_act };
        Some(Box::new(DarLayer { bottleneck, window: s.window.unwrap_or(0) as i64, imp: s.implementation }))
    }

    /// The bottleneck's two matrices.
    fn parameters(&self) -> Vec<Tensor> {
        vec![self.bottleneck.down.shallow_clone(), self.bottleneck.up.shallow_clone()]
    }

    /// W_down: the latent is the input times it.
    fn input_projection(&self) -> Option<&Tensor> {
        Some(&self.bottleneck.down)
    }

}

/// DAR attention. `window ≥ T` is vanilla over (k_l, v_l); `window = 0` is causal attention over (k_g, v_g).
/// `kg`, `vg` may stop at position T − w where [`distant_positions`] says so (split-merge).
pub fn dar(q: &Tensor, kl: &Tensor, vl: &Tensor, kg: &Tensor, vg: &Tensor, window: i64, imp: AttentionImpl) -> Tensor {
    let t = q.size()[2];
    let imp = match imp {
        // Training: cuDNN's distant part with the local band and the merge in our kernels (one H100:
        // 1.620 vs 1.657 ms split-merge-fused at T 2048, 4.128 vs 4.223 at T 4096; training 1.000–1.002×;
        // both pass bench --check), else with the merge fused (1.83 vs 1.99 ms unfused). Without a
        // gradient, flash needs no plan per shape.
        AttentionImpl::Auto if split_merge_supported(q) && super::needs_grad(&[q, kl, vl, kg, vg]) => {
            if kernels::cuda::band_available(&[q, kl, vl, kg, vg]) {
                AttentionImpl::SplitMergeBand
            } else {
                AttentionImpl::SplitMergeFused
            }
        }
        AttentionImpl::Auto if split_merge_supported(q) && super::cudnn_for_long_prefill(t) => AttentionImpl::SplitMergeCudnn,
        AttentionImpl::Auto if split_merge_supported(q) => AttentionImpl::SplitMerge,
        AttentionImpl::Auto if band_split_pays(q, window) => AttentionImpl::BandSplit,
        AttentionImpl::Auto => AttentionImpl::Sdpa,
        AttentionImpl::SplitMerge | AttentionImpl::SplitMergeCudnn | AttentionImpl::SplitMergeFused if !split_merge_supported(q) => AttentionImpl::Sdpa,
        AttentionImpl::BandSplit if !band_split_supported(q) => AttentionImpl::Sdpa,
        AttentionImpl::SplitMergeBand if !split_merge_supported(q) => AttentionImpl::Sdpa,
        AttentionImpl::SplitMergeBand if !kernels::cuda::band_available(&[q, kl, vl, kg, vg]) => AttentionImpl::SplitMergeFused,
        other => other,
    };
    if imp != AttentionImpl::Reference {
        // The edge cases are plain causal attention over one key version.
        if window >= t {
            return causal(q, kl, vl, imp);
        }
        if window == 0 {
            return causal(q, kg, vg, imp);
        }
    }
    assert!(is_split_merge(imp) || kg.size()[2] == t, "DAR {imp:?}: distant keys of {} positions, not T = {t}", kg.size()[2]);
    match imp {
        AttentionImpl::Reference => {
            let (local, global) = dar_masks(t, window, q.device());
            masked_softmax_attention(q, &[(kl, vl, &local), (kg, vg, &global)])
        }
        AttentionImpl::SplitMerge | AttentionImpl::SplitMergeCudnn | AttentionImpl::SplitMergeFused => {
            let backend = if imp == AttentionImpl::SplitMerge { GlobalBackend::Flash } else { GlobalBackend::Cudnn };
            split_merge(q, kl, vl, kg, vg, window, backend, imp == AttentionImpl::SplitMergeFused)
        }
        AttentionImpl::SplitMergeBand => split_merge(q, kl, vl, kg, vg, window, GlobalBackend::Band, true),
        AttentionImpl::BandSplit => kernels::dar_band_split(q, kl, vl, kg, vg, window).unwrap_or_else(|e| panic!("DAR band-split failed: {e}")),
        _ => dar_sdpa(q, kl, vl, kg, vg, window),
    }
}

/// Whether the CPU band-split path takes these inputs (csrc/dar_band.cpp: CPU, fp32 / fp64).
pub fn band_split_supported(q: &Tensor) -> bool {
    q.device() == tch::Device::Cpu && matches!(q.kind(), tch::Kind::Float | tch::Kind::Double)
}

/// Whether `auto` takes band-split on the CPU: T ≥ 256 and w ≤ T/16, where it measured faster than
/// masked SDPA, forward + backward, fp32, 2 threads of a quiet 2-core machine (BENCHMARKS.md "DAR on
/// the CPU"): 1.41× at T 256 / w 16, 1.5–1.8× at T 512 (w 8, 32), 1.85× at T 1024 / w 64, 2.1× at
/// T 2048 / w 128; at T 128 (the smoke sweep's w 8) it is 0.95× and with w ≥ T/4 0.8×, where the
/// band's blocks cost more than the masked keys they skip.
pub(crate) fn band_split_pays(q: &Tensor, window: i64) -> bool {
    let t = q.size()[2];
    band_split_supported(q) && t >= 256 && window > 0 && window * 16 <= t
}

/// How many positions' distant keys [`forward`] reads: T − w where a split-merge kernel takes the
/// inputs (its distant part: the queries at w.. against the keys ..T − w), else T.
/// (`auto` takes a split-merge kernel wherever they take the inputs.)
pub(crate) fn distant_positions(q: &Tensor, window: i64, seg: Option<&Tensor>, imp: AttentionImpl) -> i64 {
    let t = q.size()[2];
    let split = (imp == AttentionImpl::Auto || is_split_merge(imp)) && split_merge_supported(q);
    if seg.is_none() && 0 < window && window < t && split { t - window } else { t }
}

/// The implementations that run csrc/dar_attention.cpp's split-merge op.
fn is_split_merge(imp: AttentionImpl) -> bool {
    matches!(imp, AttentionImpl::SplitMerge | AttentionImpl::SplitMergeCudnn | AttentionImpl::SplitMergeFused | AttentionImpl::SplitMergeBand)
}

/// `kernels::dar_split_merge` on heads `[B, H, T, hd]` (the kernels take `[B, T, H, hd]`; the
/// transposes are views), `0 < window < T`.
#[allow(clippy::too_many_arguments)]
fn split_merge(q: &Tensor, kl: &Tensor, vl: &Tensor, kg: &Tensor, vg: &Tensor, window: i64, backend: GlobalBackend, fused: bool) -> Tensor {
    let bthd = |x: &Tensor| x.transpose(1, 2);
    kernels::dar_split_merge(&bthd(q), &bthd(kl), &bthd(vl), &bthd(kg), &bthd(vg), window, backend, fused)
        .unwrap_or_else(|e| panic!("DAR split-merge kernel failed: {e}"))
        .transpose(1, 2)
}

/// Whether the CUDA split-merge path can take these inputs (flash kernels: fp16/bf16, head dim a
/// multiple of 8 and at most 256).
pub fn split_merge_supported(q: &Tensor) -> bool {
    kernels::flash_supported(q)
}

/// dar-kernels.md §2: SDPA over the concatenated keys `[K_l; K_g]` with a `[T, 2T]` boolean mask.
pub fn dar_sdpa(q: &Tensor, kl: &Tensor, vl: &Tensor, kg: &Tensor, vg: &Tensor, window: i64) -> Tensor {
    let t = q.size()[2];
    let (local, global) = dar_masks(t, window, q.device());
    masked_sdpa(q, &[(kl, vl, &local), (kg, vg, &global)])
}


/// A layer's bottleneck: `bottleneck_down.weight` `[d_down, d]` and `bottleneck_up.weight` `[d, d_down]`
/// under the layer's attention path. The distant keys / values are the layer's k / v projections of
/// `h' = a·W_down·W_up`, computed in the absorbed form `(a·W_down)·(W_kv·W_up)ᵀ` (dar.md §2: the same
/// function, 2·d_kv·d_down instead of 2·d_kv·d FLOPs per token after the latent).
pub struct Bottleneck {
    pub down: Tensor,
    pub up: Tensor,
    pub act: DarAct,
}

impl Bottleneck {
    pub fn new(attn: &nn::Path, d: i64, d_down: i64, act: DarAct, init: nn::Init) -> Self {
        let down = (attn / "bottleneck_down").var("weight", &[d_down, d], init);
        let up = (attn / "bottleneck_up").var("weight", &[d, d_down], init);
        Bottleneck { down, up, act }
    }

    pub fn d_down(&self) -> i64 {
        self.down.size()[0]
    }

    pub fn up(&self) -> &Tensor {
        &self.up
    }

    /// h^D = a·W_down (σ of it for `dar_act: sigmoid`): what DAR's decode cache keeps per token.
    pub fn latent(&self, a: &Tensor) -> Tensor {
        self.activated(a.linear::<Tensor>(&self.down, None))
    }

    /// [`Bottleneck::latent`] of a decode pass: from the model's product of the input with W_down
    /// where it made one (`Heads::projected`).
    fn decode_latent(&self, h: &Heads) -> Tensor {
        match &h.projected {
            Some(low) => self.activated(low.shallow_clone()),
            None => self.latent(h.input),
        }
    }

    fn activated(&self, low: Tensor) -> Tensor {
        if self.act == DarAct::Sigmoid { low.sigmoid() } else { low }
    }

    /// Distant keys (rotated) and values `[B, H_kv, n, hd]` of positions 0..n of the K/V input `a`
    /// `[B, T, d]` through the model's map (`n` ≤ T; the latent is narrowed before the up-projection,
    /// and made contiguous: a strided input sends `linear` to a copy, a matmul and a separate bias add
    /// over the 2·d-wide output, 2.3 ms of the 70M DAR step on an H100, where this copy is r wide).
    pub fn distant(&self, a: &Tensor, kv: &dyn KvMap, n: i64) -> (Tensor, Tensor) {
        let latent = self.latent(a);
        let latent = if n < latent.size()[1] { latent.narrow(1, 0, n).contiguous() } else { latent };
        kv.kv(&self.up, &latent, Positions::Forward)
    }
}

/// DAR over heads `[B, H, T, hd]` (distant keys already rebuilt); `seg`: the document segments of
/// packed rows, so that no key is read across a document boundary.
#[allow(clippy::too_many_arguments)]
pub fn forward(q: &Tensor, kl: &Tensor, vl: &Tensor, kg: &Tensor, vg: &Tensor, window: i64, seg: Option<&Tensor>, imp: AttentionImpl) -> Tensor {
    match seg {
        None => dar(q, kl, vl, kg, vg, window, imp),
        Some(seg) => {
            let (local, far) = doc_dar_masks(seg, window);
            masked(q, &[(kl, vl, &local), (kg, vg, &far)], imp)
        }
    }
}

/// What a DAR cache needs from the model for the new tokens.
pub struct Distant<'a> {
    /// Latents of the new tokens `[B, n, d_down]`.
    pub latent: Tensor,
    /// Latents of positions 0..g `[B, g, d_down]` → rotated distant keys and values `[B, H_kv, g, hd]`
    /// (one matmul through the layer's k / v map with W_up absorbed, then RoPE).
    pub kv: &'a dyn Fn(&Tensor) -> (Tensor, Tensor),
}

/// DAR's decode cache: a ring of the last `window` tokens' full-width keys / values and the latent of
/// every token in a buffer written in place (`cache::Slots`).
pub struct DarCache {
    recent: Recent,
    /// The latent of every token `[B, T, d_down]`.
    latent: Slots,
    seen: i64,
    window: i64,
    pad: Option<Padding>,
    /// The model's k / v map composed with the up-projection (`KvMap::absorbed`), made at the first
    /// step that reads through it: 2·H_kv·hd·d_down numbers per layer, whatever the length.
    absorbed: Option<Option<AbsorbedKv>>,
    /// From how many slots steps read through it (`absorb_from_slots`).
    absorb_from: i64,
}

/// From how many cache slots a decode step reads DAR's latents through the absorbed map rather than
/// rebuilding their keys and values: ABSORB_FROM_SLOTS, or `ATTNLAB_DAR_ABSORB` = 0 (never), 1
/// (always) to time or check one against the other.
fn absorb_from_slots() -> i64 {
    match std::env::var("ATTNLAB_DAR_ABSORB").as_deref() {
        Ok("0") => i64::MAX,
        Ok("1") => 0,
        _ => ABSORB_FROM_SLOTS,
    }
}

/// Measured on one H200 (Pythia-70M shape, bf16, batch 1, graphed; BENCHMARKS.md): the absorbed
/// read runs more kernels per step and is slower up to 4K slots, even at 16K, faster at 64K.
const ABSORB_FROM_SLOTS: i64 = 32768;

/// One new query `[B, H, 1, hd]` over the ring (keys, values, mask) and the latents `c` `[B, S, r]`
/// (mask `far`, `[.., 1, S]`), the latents read through the absorbed k / v map `a` without building
/// their `[S, hd]` keys and values per head: a distant key's unrotated dims score as (q·wk)·c, its
/// rotated dims are rebuilt (`a.rotated` per head: a quarter of Pythia's keys, all of Llama's), and
/// the distant output is (p·c)·wvᵀ + (Σp)·bv. Equal to rebuilding (tested), with per-step work
/// S·r per head instead of S·r·hd.
pub(crate) fn read_latents(q: &Tensor, ring: Option<&(Tensor, Tensor, Tensor)>, c: &Tensor, far: &Tensor, a: &AbsorbedKv, cos: &Tensor, sin: &Tensor) -> Tensor {
    let (b, h, _, hd) = q.size4().expect("q is [B, H, 1, hd]");
    let hkv = a.wk.size()[0];
    let (g, rot, kind) = (h / hkv, a.rotated, q.kind());
    let soft = if matches!(kind, tch::Kind::BFloat16 | tch::Kind::Half) { tch::Kind::Float } else { kind };
    let scale = 1.0 / (hd as f64).sqrt();
    let q = q.reshape([b, hkv, g, hd]);
    let c4 = c.unsqueeze(1); // [B, 1, S, r]
    // Distant scores [B, H_kv, g, S]: the unrotated dims through q·wk, the rotated ones rebuilt.
    let mut far_scores: Option<Tensor> = None;
    let mut add = |s: Tensor| far_scores = Some(match far_scores.take() { Some(x) => x + s, None => s });
    if rot < hd {
        let qp = q.narrow(3, rot, hd - rot);
        add((qp.matmul(&a.wk.narrow(1, rot, hd - rot))).matmul(&c4.transpose(-2, -1)));
        if let Some(bk) = &a.bk {
            add(qp.matmul(&bk.narrow(1, rot, hd - rot).unsqueeze(-1).unsqueeze(0)));
        }
    }
    if rot > 0 {
        let mut kr = c4.matmul(&a.wk.narrow(1, 0, rot).transpose(1, 2)); // [B, H_kv, S, rot]
        if let Some(bk) = &a.bk {
            kr = kr + bk.narrow(1, 0, rot).unsqueeze(1);
        }
        let half = rot / 2;
        let (cos, sin) = (cos.to_kind(kind), sin.to_kind(kind));
        let (k1, k2) = (kr.narrow(3, 0, half), kr.narrow(3, half, half));
        let kr = Tensor::cat(&[&k1 * &cos - &k2 * &sin, &k2 * &cos + &k1 * &sin], 3);
        add(q.narrow(3, 0, rot).matmul(&kr.transpose(-2, -1)));
    }
    let far_scores = (far_scores.expect("a head has dims") * scale).masked_fill(&far.logical_not(), f64::NEG_INFINITY);
    let mut scores = vec![];
    if let Some((k, _, m)) = ring {
        scores.push((q.matmul(&k.transpose(-2, -1)) * scale).masked_fill(&m.logical_not(), f64::NEG_INFINITY));
    }
    scores.push(far_scores);
    let mut p = super::joint_softmax(&scores, soft, kind);
    let pf = p.pop().expect("the distant part");
    // (p·c)·wvᵀ: [B, H_kv, g, r] · [H_kv, r, hd].
    let mut out = pf.matmul(&c4).matmul(&a.wv.transpose(1, 2));
    if let Some(bv) = &a.bv {
        out = out + pf.sum_dim_intlist(&[-1i64][..], true, kind) * bv.unsqueeze(1);
    }
    if let (Some((_, v, _)), Some(pn)) = (ring, p.first()) {
        out = out + pn.matmul(v);
    }
    out.reshape([b, h, 1, hd])
}

impl KindCache for DarCache {
    fn bytes(&self) -> i64 {
        DarCache::bytes(self)
    }
    /// dar.md §3: T·d_down latent elements + 2·min(w, T)·d_kv full-width ones per sequence.
    fn bound(&self, tokens: i64) -> Option<i64> {
        let s = self.latent.storage().size();
        Some(self.recent.bound(tokens) + tokens * s[0] * s[2] * self.latent.storage().kind().elt_size_in_bytes() as i64)
    }
    fn reserve(&mut self, tokens: i64) {
        DarCache::reserve(self, tokens)
    }
    fn set_padding(&mut self, pad: &Padding) {
        DarCache::set_padding(self, pad)
    }
    fn advance(&mut self, n: i64) {
        self.seen += n;
        self.recent.advance(n);
    }
}

impl DarCache {
    pub fn new(shape: &CacheShape, window: i64, d_down: i64) -> Self {
        let latent = Slots::new(&[shape.batch, 0, d_down], 1, None, shape.kind, shape.device);
        DarCache { recent: Recent::new(shape, Some(window)), latent, seen: 0, window, pad: None, absorbed: None, absorb_from: absorb_from_slots() }
    }

    pub fn bytes(&self) -> i64 {
        let per_token = tensor_bytes(self.latent.storage()) / self.latent.capacity().max(1);
        self.recent.bytes() + self.seen * per_token
    }

    /// Room for `tokens` tokens in all.
    pub fn reserve(&mut self, tokens: i64) {
        self.recent.reserve(tokens);
        self.latent.reserve(tokens);
    }

    pub fn set_padding(&mut self, pad: &Padding) {
        self.recent.set_padding(pad);
        self.pad = Some(pad.clone());
    }

    /// The ring of recent keys / values and the latent buffer (tests).
    pub fn parts(&self) -> (&Recent, &Slots) {
        (&self.recent, &self.latent)
    }

    /// Store the next tokens' keys / values (the last `window` of them) and latents `[B, n, d_down]`.
    pub fn push(&mut self, k: &Tensor, v: &Tensor, latent: &Tensor) {
        let n = latent.size()[1];
        self.latent.reserve(self.seen + n);
        self.latent.write(self.seen, latent);
        self.seen += n;
        self.recent.push(k, v);
    }

    /// `attend` of one new token (`h`: its heads, `latent` `[B, 1, d_down]`) at the device-side
    /// position `at.pos` (`LayerOp::decode_at`): its latent and ring slot written in place, then one
    /// joint softmax over the ring and the first `at.span` latents (those at distance < w masked):
    /// from `absorb_from` slots on read through the model's absorbed k / v map (composed with the
    /// up-projection `up` once per cache; `read_latents`), below it with their keys and values
    /// rebuilt (fewer kernels: faster at short spans, measured).
    pub fn attend_at(&mut self, h: &Heads, at: &StepAt, latent: &Tensor, up: &Tensor) -> Tensor {
        assert!(at.span <= self.latent.capacity(), "decode step: span {} beyond the latent cache's {} slots (reserve first)", at.span, self.latent.capacity());
        if let Some(out) = self.fused_step(h, at, latent, up) {
            return out;
        }
        let q = &h.q;
        self.latent.write_at(&at.pos, latent);
        let ring = self.recent.write_at(&h.k, &h.v, at);
        let latents = self.latent.view(at.span);
        let pos = Tensor::arange(at.span, (tch::Kind::Int64, q.device()));
        let far = StepAt::mask(&self.pad, (&at.pos - &pos).ge(self.window), &pos);
        if at.span >= self.absorb_from {
            let absorbed = self.absorbed.get_or_insert_with(|| h.kv.absorbed(up));
            if let (Some(a), Some((cos, sin))) = (absorbed.as_ref(), h.kv.rotary_tables(at.span)) {
                return read_latents(q, ring.as_ref(), &latents, &far, a, &cos, &sin);
            }
        }
        let (kg, vg) = h.kv.kv(up, &latents, Positions::From(0));
        let mut parts: Vec<(&Tensor, &Tensor, Option<Tensor>)> = Vec::new();
        if let Some((k, v, m)) = &ring {
            parts.push((k, v, Some(m.shallow_clone())));
        }
        parts.push((&kg, &vg, Some(far)));
        attend_newest(q, &parts)
    }

    /// The step as csrc/cuda/attend_step.cu's two kernels (`kernels::cuda::step_enabled`): the ring
    /// and the latents, read through the absorbed map, in one softmax, no mask made by aten ops.
    /// `None`: the aten step.
    fn fused_step(&mut self, h: &Heads, at: &StepAt, latent: &Tensor, up: &Tensor) -> Option<Tensor> {
        use crate::kernels::cuda;
        if !cuda::step_enabled(&h.q, h.k.size()[1], latent.size()[2]) {
            return None;
        }
        let a = self.absorbed.get_or_insert_with(|| h.kv.absorbed(up)).as_ref()?;
        let (cos, sin) = h.kv.rotary_tables(at.span)?;
        let (cos, sin) = (cos.to_kind(tch::Kind::Float), sin.to_kind(tch::Kind::Float));
        // Fresh: the kernels read the new key, value and latent from here and write them into the
        // caches themselves; else they are written first (see `fresh_enabled` for the numbers).
        let fresh = cuda::fresh_enabled();
        let full = if fresh {
            self.recent.slot_views_at(at)
        } else {
            self.latent.write_at(&at.pos, latent);
            self.recent.write_slot_at(&h.k, &h.v, at)
        };
        let latents = self.latent.view(at.span);
        let distant = cuda::Distant { latents: &latents, wk: &a.wk, wk_rot: &a.wk_rot, wv: &a.wv, bk: a.bk.as_ref(), bv: a.bv.as_ref(), cos: &cos, sin: &sin, rotated: a.rotated, window: self.window };
        let step = cuda::Step {
            q: &h.q,
            pos: &at.pos,
            pad: self.pad.as_ref().map(|p| p.rows()),
            full: full.as_ref().map(|(k, v, keep)| cuda::FullWidth { k, v, keep: *keep }),
            distant: Some(distant),
            fresh: fresh.then(|| cuda::Fresh { kv: full.is_some().then_some((&h.k, &h.v)), latent: Some(latent) }),
        };
        Some(cuda::attend_step(&step)?.unwrap_or_else(|e| panic!("fused decode step failed: {e}")))
    }

    /// Read the latents through the absorbed map from `span` slots on (tests: 0, every step).
    pub fn set_absorb_from(&mut self, span: i64) {
        self.absorb_from = span;
    }

    /// Attention of the new queries at p0..: keys at distance < w full width (from the ring), farther
    /// keys rebuilt from the latents, in one joint softmax; stores the new tokens.
    pub fn attend(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, p0: i64, distant: Distant) -> Tensor {
        let (n, w) = (q.size()[2], self.window);
        self.latent.reserve(self.seen + n);
        self.latent.write(self.seen, &distant.latent);
        self.seen += n;
        // Distant keys: every position the newest query sees at distance ≥ w.
        let g = (p0 + n - w).max(0);
        let far = (g > 0).then(|| (distant.kv)(&self.latent.view(g)));
        let far_pos = Tensor::arange(g, (tch::Kind::Int64, q.device()));
        if n == 1 {
            self.recent.push(k, v);
            let held = self.recent.held();
            let mut parts: Vec<(&Tensor, &Tensor, Option<Tensor>)> = Vec::new();
            if self.recent.filled() > 0 {
                parts.push((&held.0, &held.1, self.pad.as_ref().map(|p| p.keys(&self.recent.positions(q.device())))));
            }
            if let Some((kg, vg)) = &far {
                parts.push((kg, vg, self.pad.as_ref().map(|p| p.keys(&far_pos))));
            }
            return attend_newest(q, &parts);
        }
        let mut parts = if w > 0 { self.recent.parts_before_push(k, v, p0) } else { Vec::new() };
        if let Some((kg, vg)) = far {
            parts.push((kg, vg, Padding::and(&self.pad, distances(p0, n, 0, g, q.device()).ge(w), &far_pos)));
        }
        let out = masked_parts(q, &parts);
        self.recent.push(k, v);
        out
    }
}
