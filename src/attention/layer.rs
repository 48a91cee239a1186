//! The one interface between a model and its layers' attention. A model computes a layer's rotated
//! queries and keys, its values and the tensor its k / v projections read, and hands them over as
//! [`Heads`]; the layer's [`Layer`] (one arm per variant, each written in its own file) does the rest:
//! the training / prefill forward (packed documents included), the decode cache (create, extend,
//! bytes), the parameters the variant adds, which of them a stage-1 run trains, and its label.
//! [`Attention`] is the variant with its options as configs and checkpoints record it.
use super::cache::{repeat_kv, CacheShape, LayerCache, Recent};
use super::dar::{Bottleneck, DarCache, Distant};
use super::lolcats::{Lolcats, LolcatsConfig};
use super::still::{Still, StillConfig};
use super::{dar, vanilla, window};
use crate::spec::{AttentionImpl, AttentionInit, AttentionKind, DarAct};
use crate::{kernels, Error, Result};
use serde::{Deserialize, Serialize};
use tch::{nn, Tensor};

/// The softmax variants (vanilla, DAR, uniform, window) with their resolved options, as a model's
/// config records them (config.json `attnlab_attention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DarConfig {
    pub kind: AttentionKind,
    /// Bottleneck width (DAR / uniform only).
    pub d_down: usize,
    /// Keys at distance < window are full width (uniform: 0; window: the band).
    pub window: usize,
    pub dar_act: DarAct,
    /// Not part of the model's function: which implementation computes it.
    #[serde(rename = "impl")]
    pub implementation: AttentionImpl,
    /// How a model built from scratch starts the bottleneck, and the seed of its own stream
    /// (dar::init::pretraining_start). Not part of a checkpoint's config.
    #[serde(default, skip_serializing)]
    pub init: AttentionInit,
    #[serde(default, skip_serializing)]
    pub init_seed: u64,
}

impl Default for DarConfig {
    fn default() -> Self {
        DarConfig { kind: AttentionKind::Vanilla, d_down: 0, window: 0, dar_act: DarAct::Linear, implementation: AttentionImpl::Auto, init: AttentionInit::SmallInit, init_seed: 0 }
    }
}

impl DarConfig {
    /// The `attention:` section of a resolved train spec.
    pub fn from_spec(spec: &crate::spec::Spec) -> Self {
        let a = &spec.attention;
        let (init, init_seed) = (a.init.unwrap_or_default(), spec.train.seed.unwrap_or(1234));
        DarConfig { kind: a.kind, d_down: spec.d_down(), window: spec.window(), dar_act: a.dar_act, implementation: a.implementation, init, init_seed }
    }

    pub fn has_bottleneck(&self) -> bool {
        self.kind.has_bottleneck()
    }
}

/// A linearized operator that replaces softmax attention (`attnlab linearize`), with its options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Variant {
    Still(StillConfig),
    Lolcats(LolcatsConfig),
}

/// Every attention variant with its options: what a model's layers run.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Attention {
    Softmax(DarConfig),
    Linearized(Variant),
}

impl Default for Attention {
    fn default() -> Self {
        Attention::Softmax(DarConfig::default())
    }
}

/// `kind: still | lolcats` reads a [`Variant`], any other kind a [`DarConfig`], so that errors name
/// the fields of the variant written (an untagged enum would only say that nothing matched).
impl<'de> Deserialize<'de> for Attention {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let v = serde_json::Value::deserialize(d)?;
        match v.get("kind").and_then(|k| k.as_str()) {
            Some("still" | "lolcats") => serde_json::from_value(v).map(Attention::Linearized).map_err(D::Error::custom),
            _ => serde_json::from_value(v).map(Attention::Softmax).map_err(D::Error::custom),
        }
    }
}

impl Attention {
    /// The softmax options (vanilla for a linearized operator, whose layers have no bottleneck).
    pub fn softmax(&self) -> DarConfig {
        match self {
            Attention::Softmax(c) => *c,
            Attention::Linearized(_) => DarConfig::default(),
        }
    }

    pub fn has_bottleneck(&self) -> bool {
        self.softmax().has_bottleneck()
    }

    /// Plain softmax attention (a model config need not record it).
    pub fn is_vanilla(&self) -> bool {
        matches!(self, Attention::Softmax(c) if c.kind == AttentionKind::Vanilla)
    }

    /// The name a report or bench line shows: vanilla, dar, uniform, window, still, lolcats.
    pub fn label(&self) -> &'static str {
        match self {
            Attention::Softmax(c) => match c.kind {
                AttentionKind::Vanilla => "vanilla",
                AttentionKind::Dar => "dar",
                AttentionKind::Uniform => "uniform",
                AttentionKind::Window => "window",
            },
            Attention::Linearized(Variant::Still(_)) => "still",
            Attention::Linearized(Variant::Lolcats(_)) => "lolcats",
        }
    }
}

/// Shapes of the layer an attention variant sits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerDims {
    /// Query heads H (GQA already expanded).
    pub heads: i64,
    pub head_dim: i64,
    /// Width of the layer input x (for W_g).
    pub d_model: i64,
    /// Layer index (keys `routing: random`).
    pub layer: i64,
}

/// Where the keys a model rebuilds sit: at the positions of the forward's own tokens, or from a start.
#[derive(Debug, Clone, Copy)]
pub enum Positions {
    Forward,
    From(i64),
}

/// What a model offers a variant that builds keys / values from another input (DAR's distant keys).
pub trait KvMap {
    /// Rotated keys and values `[B, H_kv, n, hd]` of `x` `[B, n, r]` through the layer's k / v
    /// projections composed with `w` `[d, r]` (k = x·(W_k·w)ᵀ (+ b_k), the same for v), then whatever
    /// the model applies to keys after the projection (OLMo 2's k_norm, RoPE at `pos`).
    fn kv(&self, w: &Tensor, x: &Tensor, pos: Positions) -> (Tensor, Tensor);
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
    /// Document segments of packed rows (`super::doc_segments`).
    pub seg: Option<&'a Tensor>,
    pub kv: &'a dyn KvMap,
    /// Training pass (LoRA dropout on the gate's adapter).
    pub train: bool,
}

/// One layer's attention: the variant's parameters and options.
pub enum Layer {
    Vanilla { imp: AttentionImpl },
    /// Sliding-window attention only (`window.rs`).
    Window { window: i64, imp: AttentionImpl },
    /// DAR; uniform is DAR with window 0 (`dar.rs`).
    Dar { bottleneck: Bottleneck, window: i64, imp: AttentionImpl },
    Still(Still),
    Lolcats(Lolcats),
}

impl Layer {
    /// The attention of one layer under the module path `p` (`…self_attn` / `…attention`). DAR's
    /// bottleneck draws nothing from the global generator (`dar::init::pretraining_start`).
    pub fn new(p: &nn::Path, attention: &Attention, dims: LayerDims) -> Result<Layer> {
        Ok(match attention {
            Attention::Softmax(c) => {
                let imp = c.implementation;
                match c.kind {
                    AttentionKind::Vanilla => Layer::Vanilla { imp },
                    AttentionKind::Window => Layer::Window { window: c.window as i64, imp },
                    AttentionKind::Dar | AttentionKind::Uniform => {
                        let bottleneck = Bottleneck::new(p, dims.d_model, c.d_down as i64, c.dar_act, nn::Init::Const(0.0));
                        // The pretraining start, from the bottleneck's own stream (seed, layer): every
                        // other weight draws exactly what it draws in a vanilla model of the same seed.
                        let (down, up) = dar::init::pretraining_start(c.init, c.init_seed, dims.layer as usize, dims.d_model as usize, c.d_down);
                        tch::no_grad(|| {
                            bottleneck.down.shallow_clone().copy_(&down);
                            bottleneck.up.shallow_clone().copy_(&up);
                        });
                        Layer::Dar { bottleneck, window: c.window as i64, imp }
                    }
                }
            }
            Attention::Linearized(Variant::Still(sc)) => Layer::Still(Still::new(p, sc, dims)?),
            Attention::Linearized(Variant::Lolcats(lc)) => Layer::Lolcats(Lolcats::new(p, lc, dims.heads, dims.head_dim)?),
        })
    }

    /// This softmax layer with `a`'s options, its parameters kept: the implementation, the window,
    /// vanilla ↔ window, DAR ↔ uniform. An error when `a` needs a bottleneck the layer lacks or would
    /// drop the one it has, or for a linearized layer.
    pub fn reconfigured(self, a: &DarConfig) -> Result<Layer> {
        let (window, imp) = (a.window as i64, a.implementation);
        let refused = || Err(Error::Other(format!("cannot switch this layer to {:?} in place (a bottleneck would be needed or dropped)", a.kind)));
        Ok(match self {
            Layer::Dar { mut bottleneck, .. } => match a.kind {
                AttentionKind::Dar | AttentionKind::Uniform => {
                    bottleneck.act = a.dar_act;
                    Layer::Dar { bottleneck, window, imp }
                }
                AttentionKind::Vanilla | AttentionKind::Window => return refused(),
            },
            Layer::Vanilla { .. } | Layer::Window { .. } => match a.kind {
                AttentionKind::Vanilla => Layer::Vanilla { imp },
                AttentionKind::Window => Layer::Window { window, imp },
                AttentionKind::Dar | AttentionKind::Uniform => return refused(),
            },
            Layer::Still(_) | Layer::Lolcats(_) => return refused(),
        })
    }

    /// Whether [`Layer::reconfigured`] can switch this layer to `a` in place: a bottleneck is neither
    /// needed nor dropped (a linearized layer never).
    pub fn reconfigurable(&self, a: &DarConfig) -> bool {
        match self {
            Layer::Dar { .. } => a.has_bottleneck(),
            Layer::Vanilla { .. } | Layer::Window { .. } => !a.has_bottleneck(),
            Layer::Still(_) | Layer::Lolcats(_) => false,
        }
    }

    /// The bottleneck of a DAR layer.
    pub fn bottleneck(&self) -> Option<&Bottleneck> {
        match self {
            Layer::Dar { bottleneck, .. } => Some(bottleneck),
            _ => None,
        }
    }

    /// Training / prefill output `[B, H, n, hd]` of the model's heads.
    pub fn forward(&self, h: &Heads) -> Tensor {
        let (k, v) = (repeat_kv(&h.k, &h.q), repeat_kv(&h.v, &h.q));
        match self {
            Layer::Vanilla { imp } => kernels::scope("attn.op", || vanilla::forward(&h.q, &k, &v, h.seg, *imp)),
            Layer::Window { window, imp } => window::forward(&h.q, &k, &v, *window, h.seg, *imp),
            Layer::Dar { bottleneck, window, imp } => {
                // Named scopes: `attnlab bench --profile` files the kernels under them.
                let (kg, vg) = kernels::scope("dar.distant_kv", || bottleneck.distant(h.input, h.kv, Positions::Forward));
                let (kg, vg) = (repeat_kv(&kg, &h.q), repeat_kv(&vg, &h.q));
                kernels::scope("attn.op", || dar::forward(&h.q, &k, &v, &kg, &vg, *window, h.seg, *imp))
            }
            Layer::Still(s) => {
                assert!(h.seg.is_none(), "STILL layers take no packed rows");
                s.forward(&h.q, &k, &v, s.gate_for(h.input, h.train).as_ref())
            }
            Layer::Lolcats(l) => {
                assert!(h.seg.is_none(), "LoLCATs layers take no packed rows");
                l.forward(&h.q, &k, &v)
            }
        }
    }

    /// An empty decode cache for this layer (`shape`: the model's batch, KV heads, head dim, dtype).
    pub fn new_cache(&self, shape: &CacheShape) -> LayerCache {
        match self {
            Layer::Vanilla { .. } => LayerCache::Recent(Recent::new(shape, None)),
            Layer::Window { window, .. } => LayerCache::Recent(window::new_cache(shape, *window)),
            Layer::Dar { bottleneck, window, .. } => LayerCache::Dar(DarCache::new(shape, *window, bottleneck.d_down())),
            Layer::Still(s) => LayerCache::Linearized(s.new_cache(shape.batch, shape.kind, shape.device)),
            Layer::Lolcats(l) => LayerCache::Linearized(l.new_cache(shape.batch, shape.kind, shape.device)),
        }
    }

    /// Outputs `[B, H, n, hd]` of the new tokens at positions p0.. after the cached ones; extends
    /// `cache` (made by [`Layer::new_cache`]). Equals [`Layer::forward`] on the whole sequence. The
    /// softmax variants prefill (p0 = 0) with the training forward's kernels and fill the cache from
    /// its keys, values and latents; `h.seg` there marks the filler of left-padded rows
    /// (`cache::Padding`).
    pub fn decode(&self, cache: &mut LayerCache, h: &Heads, p0: i64) -> Tensor {
        match (self, cache) {
            (Layer::Vanilla { .. } | Layer::Window { .. }, LayerCache::Recent(c)) if p0 == 0 => {
                let out = self.forward(h);
                c.push(&h.k, &h.v);
                out
            }
            (Layer::Vanilla { .. } | Layer::Window { .. }, LayerCache::Recent(c)) => c.attend(&h.q, &h.k, &h.v, p0),
            (Layer::Dar { bottleneck, window, imp }, LayerCache::Dar(c)) => {
                let latent = bottleneck.latent(h.input);
                if p0 == 0 {
                    let (kg, vg) = h.kv.kv(bottleneck.up(), &latent, Positions::Forward);
                    let r = |x: &Tensor| repeat_kv(x, &h.q);
                    let out = dar::forward(&h.q, &r(&h.k), &r(&h.v), &r(&kg), &r(&vg), *window, h.seg, *imp);
                    c.push(&h.k, &h.v, &latent);
                    return out;
                }
                // Distant keys of positions 0..g, rebuilt from the latents through the model's own map.
                let kv = |latent: &Tensor| h.kv.kv(bottleneck.up(), latent, Positions::From(0));
                c.attend(&h.q, &h.k, &h.v, p0, Distant { latent, kv: &kv })
            }
            (Layer::Still(s), LayerCache::Linearized(c)) => {
                let (k, v) = (repeat_kv(&h.k, &h.q), repeat_kv(&h.v, &h.q));
                s.extend(c, &h.q, &k, &v, s.gate_for(h.input, false).as_ref())
            }
            (Layer::Lolcats(l), LayerCache::Linearized(c)) => l.extend(c, &h.q, &repeat_kv(&h.k, &h.q), &repeat_kv(&h.v, &h.q)),
            _ => panic!("decode: the cache was made for another attention variant"),
        }
    }

    /// The STILL operator of this layer, if it is one (probes and oracle routing).
    pub fn still(&self) -> Option<&Still> {
        match self {
            Layer::Still(s) => Some(s),
            _ => None,
        }
    }
}

/// Whether a parameter is one a variant adds to a pretrained model's layer: STILL's / LoLCATs'
/// feature maps, gate and window factors (linearize's stage 1 trains these) or DAR's bottleneck
/// (finetune's stage 1). Names as in `Layer::new`'s parameters under the layer's attention path.
pub fn is_added_param(name: &str) -> bool {
    is_linearized_param(name) || is_bottleneck_param(name)
}

/// STILL's / LoLCATs' own parameters (`…self_attn.feature_map_*`, `g_proj`, `window_factors`).
pub fn is_linearized_param(name: &str) -> bool {
    name.contains(".self_attn.feature_map_") || name.contains(".self_attn.g_proj.") || name.ends_with(".self_attn.window_factors")
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
