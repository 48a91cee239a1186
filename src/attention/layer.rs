//! The one interface between a model and its layers' attention. A model computes a layer's rotated
//! queries and keys, its values and the tensor its k / v projections read, and hands them over as
//! [`Heads`]; the layer (a [`LayerOp`], one type per variant, each in its own file) does the rest:
//! the training / prefill forward (packed documents included), the decode cache (create, extend,
//! bytes) and the parameters the variant adds. [`Attention`] is the variant with its options as
//! configs and checkpoints record it: a softmax kind's [`AttentionSpec`] (`kinds.rs`: one type from
//! the spec to the model config) or a linearized operator's [`Variant`].
use super::cache::{repeat_kv, CacheShape, LayerCache, StepAt};
use super::dar::{Bottleneck, DarLayer};
use super::kinds::AttentionSpec;
use super::still::Still;
use super::Variant;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::{nn, Tensor};

/// Every attention variant with its options: what a model's layers run.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Attention {
    Softmax(AttentionSpec),
    Linearized(Variant),
}

impl Default for Attention {
    fn default() -> Self {
        Attention::Softmax(AttentionSpec::default())
    }
}

/// A `kind:` that names a registered hybrid reads a [`Variant`], any other kind an [`AttentionSpec`],
/// so that errors name the fields of the variant written (an untagged enum would only say that
/// nothing matched).
impl<'de> Deserialize<'de> for Attention {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let v = serde_yaml::Value::deserialize(d)?;
        match v.get("kind").and_then(|k| k.as_str()) {
            Some(k) if Variant::is_name(k) => serde_yaml::from_value(v).map(Attention::Linearized).map_err(D::Error::custom),
            _ => serde_yaml::from_value(v).map(Attention::Softmax).map_err(D::Error::custom),
        }
    }
}

impl Attention {
    /// The softmax kind's options (None for a linearized operator).
    pub fn softmax(&self) -> Option<&AttentionSpec> {
        match self {
            Attention::Softmax(a) => Some(a),
            Attention::Linearized(_) => None,
        }
    }

    pub fn has_bottleneck(&self) -> bool {
        self.softmax().is_some_and(AttentionSpec::has_bottleneck)
    }

    /// Plain softmax attention (a model config need not record it).
    pub fn is_vanilla(&self) -> bool {
        self.softmax().is_some_and(AttentionSpec::is_vanilla)
    }

    /// The name a report or bench line shows: a softmax kind's or a hybrid's (`kind:`).
    pub fn label(&self) -> &'static str {
        match self {
            Attention::Softmax(a) => a.kind().name(),
            Attention::Linearized(v) => v.name(),
        }
    }
}

/// Shapes of the layer an attention variant sits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerDims {
    /// Query heads H (GQA already expanded).
    pub heads: i64,
    pub head_dim: i64,
    /// Width of the layer input x (for W_g).
    pub d_model: i64,
    /// Layer index (keys `routing: random`).
    pub layer: i64,
}

/// Where the keys a model rebuilds sit: at the positions of the forward's own tokens (the first n of
/// them when the input holds n: DAR's distant keys stop at T − w), or from a start.
#[derive(Debug, Clone, Copy)]
pub enum Positions {
    Forward,
    From(i64),
}

/// The rows of a forward's RoPE table (positions on dim −2) for its first `n` tokens.
pub fn forward_prefix(table: &Tensor, n: i64) -> Tensor {
    if table.size()[table.dim() - 2] > n { table.narrow(-2, 0, n) } else { table.shallow_clone() }
}

/// What a model offers a variant that builds keys / values from another input (DAR's distant keys).
pub trait KvMap {
    /// Rotated keys and values `[B, H_kv, n, hd]` of `x` `[B, n, r]` through the layer's k / v
    /// projections composed with `w` `[d, r]` (k = x·(W_k·w)ᵀ (+ b_k), the same for v), then whatever
    /// the model applies to keys after the projection (OLMo 2's k_norm, RoPE at `pos`).
    fn kv(&self, w: &Tensor, x: &Tensor, pos: Positions) -> (Tensor, Tensor);

    /// The same map as per-head matrices (`w` folded in), for a one-token decode step that reads
    /// `x` without rebuilding its keys and values (`dar::DarCache::attend_at`). None (the default)
    /// where keys pass through more than a linear map and RoPE (OLMo 2's k_norm), or where the
    /// model has no such step.
    fn absorbed(&self, _w: &Tensor) -> Option<AbsorbedKv> {
        None
    }

    /// RoPE's (cos, sin) `[n, rotated/2]` (fp32) for key positions 0..n, in [`AbsorbedKv`]'s layout.
    fn rotary_tables(&self, _n: i64) -> Option<(Tensor, Tensor)> {
        None
    }
}

/// A layer's k / v map composed with `w` `[d, r]`, per KV head: k = RoPE(x·wkᵀ + bk), v = x·wvᵀ +
/// bv, where RoPE rotates the first `rotated` dims of each head in the half-split layout
/// (`KvMap::rotary_tables`) and leaves the rest. Linear in x but for RoPE, so a query can be folded
/// into it: the unrotated dims' scores are (q·wk)·x, the values (p·x)·wvᵀ (as MLA reads its latents).
pub struct AbsorbedKv {
    /// `[H_kv, hd, r]`.
    pub wk: Tensor,
    /// `[H_kv, hd]`.
    pub bk: Option<Tensor>,
    /// `[H_kv, hd, r]`.
    pub wv: Tensor,
    /// `[H_kv, hd]`.
    pub bv: Option<Tensor>,
    pub rotated: i64,
    /// `[H_kv·rotated, r]`, contiguous: wk's rotated rows, the weight of the fused decode step's
    /// matmul for the rotated key dims (made once here: out of wk it is a copy where rotated < hd).
    pub wk_rot: Tensor,
}

impl AbsorbedKv {
    pub fn new(wk: Tensor, bk: Option<Tensor>, wv: Tensor, bv: Option<Tensor>, rotated: i64) -> Self {
        let (hkv, r) = (wk.size()[0], wk.size()[2]);
        let wk_rot = wk.narrow(1, 0, rotated).reshape([hkv * rotated, r]).contiguous();
        AbsorbedKv { wk, bk, wv, bv, rotated, wk_rot }
    }
}

/// One layer's attention inputs, from the model.
pub struct Heads<'a> {
    /// Rotated queries `[B, H, n, hd]`.
    pub q: Tensor,
    /// Rotated keys and values `[B, H_kv, n, hd]` (grouped-query heads not expanded).
    pub k: Tensor,
    pub v: Tensor,
    /// What the layer's k / v projections read `[B, n, d]` (DAR's latent and STILL's gate read it too).
    pub input: &'a Tensor,
    /// `input` times the layer's own [`LayerOp::input_projection`] `[B, n, rows]`, where the model
    /// multiplied it together with q / k / v (`model::stacked`); `None`: the layer multiplies itself.
    pub projected: Option<Tensor>,
    /// Document segments of packed rows (`super::doc_segments`).
    pub seg: Option<&'a Tensor>,
    pub kv: &'a dyn KvMap,
    /// Training pass (LoRA dropout on the gate's adapter).
    pub train: bool,
}

/// What every variant's layer answers (one implementation per variant, in the variant's file).
pub trait LayerOp: std::any::Any + Send {
    /// Training / prefill output `[B, H, n, hd]` of the model's heads.
    fn forward(&self, h: &Heads) -> Tensor;
    /// An empty decode cache for this layer (`shape`: the model's batch, KV heads, head dim, dtype).
    fn new_cache(&self, shape: &CacheShape) -> LayerCache;
    /// Outputs `[B, H, n, hd]` of the new tokens at positions p0.. after the cached ones; extends
    /// `cache` (made by this layer's `new_cache`). Equals `forward` on the whole sequence. The
    /// softmax variants prefill (p0 = 0) with the training forward's kernels and fill the cache from
    /// its keys, values and latents; `h.seg` there marks the filler of left-padded rows
    /// (`cache::Padding`).
    fn decode(&self, cache: &mut LayerCache, h: &Heads, p0: i64) -> Tensor;
    /// One new token per row at the device-side position `at.pos` (after a prefill into a cache
    /// reserved for `at.span` tokens or more): its output `[B, H, 1, hd]`, equal to `decode`'s; the
    /// cache written in place, nothing counted on the host (`LayerCache::advance`) and nothing read
    /// back from the device, so that a CUDA graph captures it. None (before touching the cache):
    /// the variant has no such step, and decodes through `decode`.
    fn decode_at(&self, _cache: &mut LayerCache, _h: &Heads, _at: &StepAt) -> Option<Tensor> {
        None
    }
    /// Before the device-side step at position `pos` (known on the host), outside any CUDA graph:
    /// what that step cannot do at fixed shapes (STILL / LoLCATs route a chunk where the next one
    /// starts). `reserved`: the tokens the cache is reserved for. Nothing for the softmax kinds.
    fn prepare_at(&self, _cache: &mut LayerCache, _pos: i64, _reserved: i64) {}
    /// Whether the device-side step would find the state it makes at its first call already made
    /// (DAR's absorbed map): until then a CUDA graph must not record the first call in place of an
    /// eager one, which would remake that state in every replay (`kernels::cuda::graph_warm_once`).
    fn step_state_made(&self, _cache: &mut LayerCache) -> bool {
        true
    }
    /// This layer with the options `a`, its parameters kept (another implementation or window,
    /// vanilla ↔ window, DAR ↔ uniform); None when `a` needs parameters the layer lacks or would
    /// drop ones it has.
    fn reconfigured(&self, a: &AttentionSpec) -> Option<Box<dyn LayerOp>>;
    /// The parameters the variant adds to the layer (handles on its variables; none for a softmax
    /// kind without parameters): what linearize's stage 1 trains in a hybrid's layers.
    fn parameters(&self) -> Vec<Tensor>;
    /// A weight `[rows, d]` the layer multiplies its input by and nothing else (no adapter): DAR's
    /// down-projection, STILL's gate projection. A model may multiply it together with its q / k / v
    /// at inference and hand the product over as [`Heads::projected`].
    fn input_projection(&self) -> Option<&Tensor> {
        None
    }
}

/// `LayerOp::reconfigured` of a layer without parameters: any kind without parameters, built anew.
pub(crate) fn rebuilt_without_parameters(a: &AttentionSpec) -> Option<Box<dyn LayerOp>> {
    if a.has_bottleneck() {
        return None;
    }
    // Such a kind creates no variable: the throwaway store stays empty.
    let vs = nn::VarStore::new(tch::Device::Cpu);
    a.layer(&vs.root(), LayerDims::default()).ok()
}

/// One layer's attention: the variant's parameters and options.
pub struct Layer(Box<dyn LayerOp>);

impl Layer {
    /// The attention of one layer under the module path `p` (`…self_attn` / `…attention`). DAR's
    /// bottleneck draws nothing from the global generator (`dar::init::pretraining_start`).
    pub fn new(p: &nn::Path, attention: &Attention, dims: LayerDims) -> Result<Layer> {
        Ok(Layer(match attention {
            Attention::Softmax(a) => a.layer(p, dims)?,
            Attention::Linearized(v) => v.layer(p, dims)?,
        }))
    }

    /// A layer of a variant's own type (`finetune::dar_start` gives a pretrained model bottlenecks).
    pub fn from_op(op: Box<dyn LayerOp>) -> Layer {
        Layer(op)
    }

    /// This layer with `a`'s options, its parameters kept (`LayerOp::reconfigured`), or an error.
    pub fn reconfigured(&self, a: &AttentionSpec) -> Result<Layer> {
        self.0.reconfigured(a).map(Layer).ok_or_else(|| Error::Other(format!("cannot switch this layer to {} in place (a bottleneck would be needed or dropped)", a.label())))
    }

    /// The bottleneck of a DAR layer (PCA calibration reads and sets it).
    pub fn bottleneck(&self) -> Option<&Bottleneck> {
        self.get::<DarLayer>().map(DarLayer::bottleneck)
    }

    pub fn forward(&self, h: &Heads) -> Tensor {
        self.0.forward(h)
    }

    pub fn new_cache(&self, shape: &CacheShape) -> LayerCache {
        self.0.new_cache(shape)
    }

    pub fn decode(&self, cache: &mut LayerCache, h: &Heads, p0: i64) -> Tensor {
        self.0.decode(cache, h, p0)
    }

    pub fn decode_at(&self, cache: &mut LayerCache, h: &Heads, at: &StepAt) -> Option<Tensor> {
        self.0.decode_at(cache, h, at)
    }

    pub fn prepare_at(&self, cache: &mut LayerCache, pos: i64, reserved: i64) {
        self.0.prepare_at(cache, pos, reserved)
    }

    pub fn step_state_made(&self, cache: &mut LayerCache) -> bool {
        self.0.step_state_made(cache)
    }

    /// The parameters the variant adds to the layer (`LayerOp::parameters`).
    pub fn parameters(&self) -> Vec<Tensor> {
        self.0.parameters()
    }

    /// The weight the layer multiplies its input by (`LayerOp::input_projection`).
    pub fn input_projection(&self) -> Option<&Tensor> {
        self.0.input_projection()
    }

    /// The STILL operator of this layer (probes and oracle routing).
    pub fn still(&self) -> Option<&Still> {
        self.get::<Still>()
    }

    /// The same, to add its gate's LoRA adapter (`linearize`).
    pub fn still_mut(&mut self) -> Option<&mut Still> {
        (self.0.as_mut() as &mut dyn std::any::Any).downcast_mut()
    }

    /// The variant's own layer type, if it is `T` (tests, probes).
    pub fn get<T: LayerOp>(&self) -> Option<&T> {
        (self.0.as_ref() as &dyn std::any::Any).downcast_ref()
    }
}

impl Heads<'_> {
    /// Keys and values with grouped-query heads expanded to the query heads.
    pub fn expanded_kv(&self) -> (Tensor, Tensor) {
        (repeat_kv(&self.k, &self.q), repeat_kv(&self.v, &self.q))
    }
}

/// DAR's bottleneck matrices (`….bottleneck_down.weight` / `….bottleneck_up.weight`, GPT-NeoX
/// `attention.` and Llama / OLMo 2 `self_attn.` alike).
pub fn is_bottleneck_param(name: &str) -> bool {
    name.ends_with(".bottleneck_down.weight") || name.ends_with(".bottleneck_up.weight")
}

/// A model config's `attention` checked for a family: a linearized operator needs a Llama-family model.
pub fn check_family(attention: &Attention, llama_family: bool) -> Result<()> {
    if matches!(attention, Attention::Linearized(_)) && !llama_family {
        return Err(Error::Other(format!("attention kind {} is available for llama-family models only", attention.label())));
    }
    Ok(())
}
