//! Decode caches for every model family. A model computes the new tokens' rotated queries
//! `[B, H, n, hd]` and rotated keys / values `[B, H_kv, n, hd]` (per KV head, so grouped-query
//! attention keeps its saving) and hands them to its layer's cache, which keeps what later tokens need
//! and attends the new queries over cached + new keys with the explicit masked softmax (exact for any
//! number of new tokens). Caches per variant (each made by `Layer::new_cache`):
//! - vanilla: `Recent` holding every token; window: `Recent` holding the last w (`super::window`);
//! - DAR / uniform: `super::dar::DarCache` (last w tokens full width, a d_down latent for every token);
//! - STILL / LoLCATs: `super::still::HybridCache` (selected K/V, the window of chunks, S and z).
use super::dar::DarCache;
use super::masked_softmax_attention;
use super::still::HybridCache;
use tch::{Device, Kind, Tensor};

/// What a layer's cache is made of (the same in every family): batch, KV heads, head dim, dtype, device.
#[derive(Debug, Clone, Copy)]
pub struct CacheShape {
    pub batch: i64,
    pub kv_heads: i64,
    pub head_dim: i64,
    pub kind: Kind,
    pub device: Device,
}

impl CacheShape {
    /// An empty `[B, H_kv, 0, hd]` tensor.
    pub(crate) fn empty_kv(&self) -> Tensor {
        Tensor::zeros([self.batch, self.kv_heads, 0, self.head_dim], (self.kind, self.device))
    }
}

pub(crate) fn tensor_bytes(t: &Tensor) -> i64 {
    t.numel() as i64 * t.kind().elt_size_in_bytes() as i64
}

/// Rotated keys and values `[B, H_kv, S, hd]` of the most recent tokens: all of them (`keep: None`)
/// or the last `keep`.
pub struct Recent {
    pub k: Tensor,
    pub v: Tensor,
    keep: Option<i64>,
}

impl Recent {
    pub fn new(shape: &CacheShape, keep: Option<i64>) -> Self {
        Recent { k: shape.empty_kv(), v: shape.empty_kv(), keep }
    }

    pub fn bytes(&self) -> i64 {
        tensor_bytes(&self.k) + tensor_bytes(&self.v)
    }

    /// Append the new tokens' keys / values; returns every cached + new key and value, before the
    /// cache drops what it no longer keeps, and the position of the first of them (the last is at `end − 1`).
    pub(crate) fn append(&mut self, k: &Tensor, v: &Tensor, end: i64) -> (Tensor, Tensor, i64) {
        let (all_k, all_v) = (Tensor::cat(&[&self.k, k], 2), Tensor::cat(&[&self.v, v], 2));
        let total = all_k.size()[2];
        let keep = self.keep.map_or(total, |w| w.min(total));
        self.k = all_k.narrow(2, total - keep, keep);
        self.v = all_v.narrow(2, total - keep, keep);
        (all_k, all_v, end - total)
    }

    /// Attention of the new queries over every cached + new key at distance < `window` (None: all).
    pub(crate) fn attend(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, p0: i64) -> Tensor {
        let n = q.size()[2];
        let (ck, cv, start) = self.append(k, v, p0 + n);
        let d = distances(p0, n, start, ck.size()[2], q.device());
        let mask = match self.keep {
            None => d.ge(0),
            Some(w) => d.ge(0).logical_and(&d.lt(w)),
        };
        masked_softmax_attention(q, &[(&repeat_kv(&ck, q), &repeat_kv(&cv, q), &mask)])
    }
}

/// `[n, len]`: query position (p0 ..) − key position (start ..).
pub(crate) fn distances(p0: i64, n: i64, start: i64, len: i64, device: Device) -> Tensor {
    let qpos = Tensor::arange_start(p0, p0 + n, (Kind::Int64, device)).unsqueeze(1);
    qpos - Tensor::arange_start(start, start + len, (Kind::Int64, device)).unsqueeze(0)
}

/// Grouped-query attention: each KV head serves H / H_kv consecutive query heads (HF repeat_kv).
pub(crate) fn repeat_kv(x: &Tensor, q: &Tensor) -> Tensor {
    let rep = q.size()[1] / x.size()[1];
    if rep == 1 { x.shallow_clone() } else { x.repeat_interleave_self_int(rep, 1, None) }
}

/// The decode state of one layer.
pub enum LayerCache {
    /// Vanilla (every token) and window (the last w tokens).
    Recent(Recent),
    /// DAR / uniform.
    Dar(DarCache),
    /// STILL / LoLCATs.
    Linearized(HybridCache),
}

impl LayerCache {
    pub fn bytes(&self) -> i64 {
        match self {
            LayerCache::Recent(c) => c.bytes(),
            LayerCache::Dar(c) => c.bytes(),
            LayerCache::Linearized(c) => c.bytes(),
        }
    }
}

/// The decode cache of a whole model: one `LayerCache` per layer and the number of tokens seen.
pub struct DecodeCache {
    pub layers: Vec<LayerCache>,
    pub len: i64,
}

impl DecodeCache {
    pub fn new(layers: Vec<LayerCache>) -> Self {
        DecodeCache { layers, len: 0 }
    }

    /// Bytes held by the cache (all layers).
    pub fn bytes(&self) -> i64 {
        self.layers.iter().map(LayerCache::bytes).sum()
    }
}
