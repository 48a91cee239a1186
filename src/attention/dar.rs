//! DAR's decode cache (dar.md §3), one for every model family: full-width rotated keys / values of
//! the last `w` tokens only, and the d_down-wide latent h^D of every token. At each step the distant
//! keys / values are rebuilt from the latents by the model's own map (W_up absorbed into its k / v
//! projection, then whatever the full forward applies after it: OLMo 2's k_norm, RoPE at each key's
//! own position), so decoding computes exactly the full forward's function. Per layer, after T tokens:
//! (T·d_down + 2·min(w, T)·d_kv) elements, d_kv = kv_heads·head_dim.
use super::cache::{distances, repeat_kv, tensor_bytes, CacheShape, Recent};
use super::masked_softmax_attention;
use tch::Tensor;

/// What a DAR cache needs from the model for the new tokens.
pub struct Distant<'a> {
    /// Latents of the new tokens `[B, n, d_down]`.
    pub latent: Tensor,
    /// Latents of positions 0..g `[B, g, d_down]` → rotated distant keys and values `[B, H_kv, g, hd]`.
    pub kv: &'a dyn Fn(&Tensor) -> (Tensor, Tensor),
}

pub struct DarCache {
    /// Full-width keys / values of the last `window` tokens.
    recent: Recent,
    /// The latent of every token `[B, T, d_down]`.
    latent: Tensor,
    window: i64,
}

impl DarCache {
    pub fn new(shape: &CacheShape, window: i64, d_down: i64) -> Self {
        let latent = Tensor::zeros([shape.batch, 0, d_down], (shape.kind, shape.device));
        DarCache { recent: Recent::new(shape, Some(window)), latent, window }
    }

    pub fn bytes(&self) -> i64 {
        self.recent.bytes() + tensor_bytes(&self.latent)
    }

    /// Attention of the new queries: keys at distance < w full width (from the cache), farther keys
    /// rebuilt from the latents, in one joint softmax.
    pub fn attend(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, p0: i64, distant: Distant) -> Tensor {
        let (n, w, device) = (q.size()[2], self.window, q.device());
        self.latent = Tensor::cat(&[&self.latent, &distant.latent], 1);
        let (lk, lv, start) = self.recent.append(k, v, p0 + n);
        let mut parts: Vec<(Tensor, Tensor, Tensor)> = Vec::new();
        if w > 0 {
            let d = distances(p0, n, start, lk.size()[2], device);
            parts.push((repeat_kv(&lk, q), repeat_kv(&lv, q), d.ge(0).logical_and(&d.lt(w))));
        }
        // Distant keys: every position the newest query sees at distance ≥ w.
        let g = (p0 + n - w).max(0);
        if g > 0 {
            let (kg, vg) = (distant.kv)(&self.latent.narrow(1, 0, g));
            parts.push((repeat_kv(&kg, q), repeat_kv(&vg, q), distances(p0, n, 0, g, device).ge(w)));
        }
        let refs: Vec<(&Tensor, &Tensor, &Tensor)> = parts.iter().map(|(k, v, m)| (k, v, m)).collect();
        masked_softmax_attention(q, &refs)
    }
}

