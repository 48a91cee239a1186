//! Vanilla attention: the causal softmax over every earlier key. Reference: the explicit masked
//! softmax (`super::masked_softmax_attention`); fast path: SDPA (flash / cuDNN on CUDA). Packed rows
//! get the block-diagonal causal mask. Decode keeps every token's keys and values (`cache::Recent`).
use super::cache::{decode_recent, decode_recent_at, CacheShape, LayerCache, Recent, StepAt};
use super::dar::DarAct;
use super::kinds::{drop_legacy, AttentionImpl, AttentionSpec, BenchInputs, LineStyle, Settings, SoftmaxKind};
use super::layer::{rebuilt_without_parameters, Heads, LayerDims, LayerOp};
use super::{dar_masks, doc_dar_masks, masked, masked_softmax_attention};
use crate::error::Invalid;
use crate::{kernels, Result};
use serde::{Deserialize, Serialize};
use tch::{nn, Tensor};

/// `attention: {kind: vanilla}`: full-width keys everywhere.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Vanilla {
    /// Not an option of vanilla: older versions recorded the spec's `dar_act` for every kind, and
    /// config.yaml still writes it so that existing run directories keep their config hash (names).
    #[serde(default)]
    pub dar_act: DarAct,
    #[serde(default, rename = "impl")]
    pub implementation: AttentionImpl,
}

impl SoftmaxKind for Vanilla {
    const NAME: &'static str = "vanilla";
    const TABLE_NAME: &'static str = "Vanilla";
    const LINE_STYLE: LineStyle = LineStyle::Solid;
    const DECODE_BENCH: &'static str = "GPT-NeoX, softmax attention: K/V of every token";
    const HAS_BOTTLENECK: bool = false;
    const LOCAL_ONLY: bool = false;

    fn adopt(other: &AttentionSpec) -> Self {
        let s = other.settings();
        Vanilla { dar_act: s.dar_act, implementation: s.implementation }
    }

    fn resolve(&mut self, _d_model: usize) -> std::result::Result<(), Invalid> {
        Ok(())
    }

    /// The fine-tuned model keeps the base model's attention.
    fn resolve_finetune(&mut self) -> std::result::Result<(), Invalid> {
        let set = [("dar_act", self.dar_act != DarAct::Linear), ("impl", self.implementation != AttentionImpl::Auto)];
        match set.into_iter().find(|s| s.1) {
            Some((k, _)) => Err((k.into(), "is meaningless for kind: vanilla (the fine-tuned model keeps the base model's attention; use kind: dar)".into())),
            None => Ok(()),
        }
    }

    fn comparable(&self) -> AttentionSpec {
        AttentionSpec::vanilla()
    }

    fn label(&self) -> String {
        "vanilla".into()
    }

    fn settings(&self) -> Settings {
        Settings { implementation: self.implementation, ..Settings::default() }
    }

    fn set_implementation(&mut self, imp: AttentionImpl) {
        self.implementation = imp;
    }

    fn note(&self) -> Option<&str> {
        None
    }

    fn layer(&self, _p: &nn::Path, _dims: LayerDims) -> Result<Box<dyn LayerOp>> {
        Ok(Box::new(VanillaLayer { imp: self.implementation }))
    }

    fn bench_op(x: &BenchInputs) -> Tensor {
        causal(x.q, x.k, x.v, x.imp)
    }

    /// Model configs before issue 25 (`DarConfig`) wrote `d_down: 0, window: 0` for vanilla.
    fn upgrade_legacy(map: &mut serde_yaml::Mapping) {
        drop_legacy(map, "d_down", Some(0.into()));
        drop_legacy(map, "window", Some(0.into()));
    }
}

/// A vanilla layer: no parameters of its own; decode keeps every token's keys and values.
pub struct VanillaLayer {
    imp: AttentionImpl,
}

impl LayerOp for VanillaLayer {
    fn forward(&self, h: &Heads) -> Tensor {
        let (k, v) = h.expanded_kv();
        kernels::scope("attn.op", || forward(&h.q, &k, &v, h.seg, self.imp))
    }

    fn new_cache(&self, shape: &CacheShape) -> LayerCache {
        LayerCache::new(Recent::new(shape, None))
    }

    fn decode(&self, cache: &mut LayerCache, h: &Heads, p0: i64) -> Tensor {
        decode_recent(|| self.forward(h), cache, h, p0)
    }

    fn decode_at(&self, cache: &mut LayerCache, h: &Heads, at: &StepAt) -> Option<Tensor> {
        Some(decode_recent_at(cache, h, at))
    }

    fn reconfigured(&self, a: &AttentionSpec) -> Option<Box<dyn LayerOp>> {
        rebuilt_without_parameters(a)
    }

    fn parameters(&self) -> Vec<Tensor> {
        Vec::new()
    }
}

/// Plain causal attention. `Reference` is the explicit masked softmax; everything else uses SDPA
/// (cuDNN on CUDA), except inference on CUDA: the flash kernel, which needs no execution plan per
/// new shape as cuDNN does (about 0.05 s: the prefill's fixed cost). Measured on one H200 at 1K–64K
/// (results/bench/2026-12-02-speed): flash's prefill is faster at every length, 64K included (0.10 s
/// vs cuDNN's 0.16 s for a first call).
pub fn causal(q: &Tensor, k: &Tensor, v: &Tensor, imp: AttentionImpl) -> Tensor {
    match imp {
        AttentionImpl::Reference => {
            let t = q.size()[2];
            let (local, _) = dar_masks(t, t, q.device());
            masked_softmax_attention(q, &[(k, v, &local)])
        }
        AttentionImpl::Sdpa => Tensor::scaled_dot_product_attention::<Tensor>(q, k, v, None, 0.0, true, None, false),
        _ if kernels::flash_supported(q) && !super::needs_grad(&[q, k, v]) && !super::cudnn_for_long_prefill(q.size()[2]) => super::flash_heads(q, k, v, -1),
        _ => Tensor::scaled_dot_product_attention::<Tensor>(q, k, v, None, 0.0, true, None, false),
    }
}

/// Causal attention over heads `[B, H, T, hd]`; `seg`: the document segments of packed rows
/// (`super::doc_segments`), so that no key is read across a document boundary.
pub fn forward(q: &Tensor, k: &Tensor, v: &Tensor, seg: Option<&Tensor>, imp: AttentionImpl) -> Tensor {
    match seg {
        None => causal(q, k, v, imp),
        Some(seg) => {
            let (local, _) = doc_dar_masks(seg, q.size()[2]);
            masked(q, &[(k, v, &local)], imp)
        }
    }
}
