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

use super::layer::{KvMap, Positions};
use super::vanilla::causal;
use super::{dar_masks, doc_dar_masks, masked, masked_sdpa};
use crate::kernels::{self, GlobalBackend};
use crate::spec::{AttentionImpl, DarAct};
use tch::{nn, Kind};
use super::cache::{attend_newest, distances, masked_parts, tensor_bytes, CacheShape, Padding, Recent, Slots};
use super::masked_softmax_attention;
use tch::Tensor;

/// DAR attention. `window ≥ T` is vanilla over (k_l, v_l); `window = 0` is causal attention over (k_g, v_g).
pub fn dar(q: &Tensor, kl: &Tensor, vl: &Tensor, kg: &Tensor, vg: &Tensor, window: i64, imp: AttentionImpl) -> Tensor {
    let t = q.size()[2];
    let imp = match imp {
        AttentionImpl::Auto if split_merge_supported(q) => AttentionImpl::SplitMergeCudnn,
        AttentionImpl::Auto => AttentionImpl::Sdpa,
        AttentionImpl::SplitMerge | AttentionImpl::SplitMergeCudnn | AttentionImpl::SplitMergeFused if !split_merge_supported(q) => AttentionImpl::Sdpa,
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
    match imp {
        AttentionImpl::Reference => {
            let (local, global) = dar_masks(t, window, q.device());
            masked_softmax_attention(q, &[(kl, vl, &local), (kg, vg, &global)])
        }
        AttentionImpl::SplitMerge | AttentionImpl::SplitMergeCudnn | AttentionImpl::SplitMergeFused => {
            let backend = if imp == AttentionImpl::SplitMerge { GlobalBackend::Flash } else { GlobalBackend::Cudnn };
            split_merge(q, kl, vl, kg, vg, window, backend, imp == AttentionImpl::SplitMergeFused)
        }
        _ => dar_sdpa(q, kl, vl, kg, vg, window),
    }
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
    let hd = q.size()[3];
    q.device().is_cuda() && matches!(q.kind(), Kind::BFloat16 | Kind::Half) && hd % 8 == 0 && hd <= 256
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
        let low = a.linear::<Tensor>(&self.down, None);
        if self.act == DarAct::Sigmoid { low.sigmoid() } else { low }
    }

    /// Distant keys (rotated) and values `[B, H_kv, n, hd]` of the K/V input `a` through the model's map.
    pub fn distant(&self, a: &Tensor, kv: &dyn KvMap, pos: Positions) -> (Tensor, Tensor) {
        kv.kv(&self.up, &self.latent(a), pos)
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
}

impl DarCache {
    pub fn new(shape: &CacheShape, window: i64, d_down: i64) -> Self {
        let latent = Slots::new(&[shape.batch, 0, d_down], 1, None, shape.kind, shape.device);
        DarCache { recent: Recent::new(shape, Some(window)), latent, seen: 0, window, pad: None }
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
