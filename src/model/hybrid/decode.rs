//! Decoding with a hybrid (STILL / LoLCATs) model: one bounded operator cache per layer
//! (`../shared/specs/still.md` §6: selected K/V, the window of chunks c−1 and c with its pending
//! routing scores, S and z), so memory grows only with the selected tokens, never with the context.
use super::{Hybrid, HybridAttention};
use crate::attention::still::HybridCache;
use tch::{Device, Kind, Tensor};

/// The decode state of every layer and the number of tokens seen.
pub struct HybridModelCache {
    pub layers: Vec<HybridCache>,
    pub len: i64,
}

impl HybridModelCache {
    pub fn bytes(&self) -> i64 {
        self.layers.iter().map(HybridCache::bytes).sum()
    }
}

impl HybridAttention {
    /// An empty operator cache whose K/V are stored in `kind`.
    pub fn new_cache(&self, batch: i64, kind: Kind, device: Device) -> HybridCache {
        match self {
            HybridAttention::Still(s) => s.new_cache(batch, kind, device),
            HybridAttention::Lolcats(l) => l.new_cache(batch, kind, device),
        }
    }

    /// Outputs `[B, H, n, hd]` of n new tokens after the cached ones; extends the cache.
    pub fn extend(&self, cache: &mut HybridCache, q: &Tensor, k: &Tensor, v: &Tensor, gate: Option<&Tensor>) -> Tensor {
        match self {
            HybridAttention::Still(s) => s.extend(cache, q, k, v, gate),
            HybridAttention::Lolcats(l) => l.extend(cache, q, k, v),
        }
    }
}

impl Hybrid {
    /// An empty cache for `batch` sequences (K/V in `kind`, the model dtype; S and z in fp32).
    pub fn new_cache(&self, batch: i64, kind: Kind, device: Device) -> HybridModelCache {
        HybridModelCache { layers: self.attn.iter().map(|a| a.new_cache(batch, kind, device)).collect(), len: 0 }
    }

    /// Logits `[B, n, V]` of `ids` (`[B, n]`) following the cached tokens; extends the cache. LoRA
    /// adapters, if any, are applied (inference mode).
    pub fn extend(&self, cache: &mut HybridModelCache, ids: &Tensor) -> Tensor {
        let _guard = tch::no_grad_guard();
        let n = ids.size()[1];
        let (cos, sin) = self.llama.rope(cache.len, n, ids.device());
        let mut x = self.llama.embed(ids);
        for (i, layer_cache) in cache.layers.iter_mut().enumerate() {
            let (q, k, v, g) = self.layer_qkvg(i, &x, &cos, &sin, false);
            let o = self.attn[i].extend(layer_cache, &q, &k, &v, g.as_ref());
            x = self.layer_out(i, &x, &o, false);
        }
        cache.len += n;
        self.llama.logits(&self.llama.final_norm(&x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::hybrid::Variant;
    use crate::model::{hf, LlamaConfig};
    use crate::train::lora::LoraConfig;
    use std::path::Path;
    use tch::nn;

    /// The tiny Llama fixture (2 layers, d = 64, 4 heads of 16, 2 KV heads) with random operators.
    fn hybrid(yaml: &str, seed: i64) -> (nn::VarStore, Hybrid, LlamaConfig) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama_tiny");
        let (tvs, teacher) = hf::load_llama(&dir, Device::Cpu).unwrap();
        tch::manual_seed(seed);
        let vs = nn::VarStore::new(Device::Cpu);
        let variant: Variant = serde_yaml::from_str(yaml).unwrap();
        let h = Hybrid::from_teacher(&vs, &tvs, teacher.cfg.clone(), &variant, &LoraConfig { targets: vec![], ..LoraConfig::default() }).unwrap();
        (vs, h, teacher.cfg.clone())
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    const VARIANTS: [&str; 3] = [
        "{kind: still, chunk: 4, tokens_per_chunk: 1}",
        "{kind: still, chunk: 4, budget: {m: 12, max_len: 16}, routing: key_norm}",
        "{kind: lolcats, window: 4, feature_dim: 8}",
    ];

    /// Token-by-token decoding, and extending in uneven blocks (a prefill block, then blocks that cross
    /// chunk boundaries), give the full forward's logits on every prefix, for STILL and LoLCATs. The
    /// hybrid must also differ from its teacher there (routing and the linear state matter at T = 30).
    #[test]
    fn cached_decoding_matches_the_full_forward() {
        for (n, yaml) in VARIANTS.iter().enumerate() {
            let (_, h, _) = hybrid(yaml, n as i64);
            tch::manual_seed(10 + n as i64);
            let ids = Tensor::randint(128, [2, 30], (Kind::Int64, Device::Cpu));
            let full = tch::no_grad(|| h.logits(&ids, false));
            let teacher = tch::no_grad(|| h.llama.logits(&h.llama.hidden(&ids)));
            assert!(max_diff(&full, &teacher) > 1e-3, "{yaml}: the hybrid equals its teacher; the test would prove nothing");
            for blocks in [vec![1i64; 30], vec![7, 1, 5, 9, 1, 7], vec![30]] {
                let mut cache = h.new_cache(2, Kind::Float, Device::Cpu);
                let mut at = 0;
                for &len in &blocks {
                    let got = h.extend(&mut cache, &ids.narrow(1, at, len));
                    let want = full.narrow(1, at, len);
                    let err = max_diff(&got, &want);
                    assert!(err < 1e-4 * (1.0 + want.abs().max().double_value(&[])), "{yaml} blocks {blocks:?} at {at}: logits differ by {err}");
                    at += len;
                }
                assert_eq!(cache.len, 30);
            }
        }
    }

    /// still.md §6's memory formula, per layer: H·[2·(n_sel + n_win)·D·b_kv + (F·D + F)·4 + n_win·4]
    /// with n_win = tokens of chunks c−1 and c, n_sel = κ per routed chunk (capped by the budget). The
    /// cache matches it after every decoded token, and with a budget (or κ = 0) it stops growing.
    #[test]
    fn cache_bytes_follow_the_bounded_formula() {
        for (n, yaml) in VARIANTS.iter().enumerate() {
            let (_, h, cfg) = hybrid(yaml, n as i64);
            let (heads, d) = (cfg.num_attention_heads as i64, cfg.head_dim() as i64);
            let (c, f, per_chunk, cap) = match &h.attn[0] {
                HybridAttention::Still(s) => (s.cfg.chunk, s.feature_map_k.dim(), s.selection.kappa, s.selection.max_chunks.saturating_mul(s.selection.kappa)),
                HybridAttention::Lolcats(l) => (l.cfg.window, l.feature_map_k.dim(), 0, 0),
            };
            let formula = |p: i64| {
                let routed = ((p - 1) / c - 1).max(0); // chunks ≤ c(p−1)−2
                let n_sel = (routed * per_chunk).min(cap);
                let n_win = p - routed * c;
                assert!(n_win <= 2 * c);
                cfg.num_hidden_layers as i64 * heads * (2 * (n_sel + n_win) * d * 4 + (f * d + f) * 4 + n_win * 4)
            };
            tch::manual_seed(20);
            let ids = Tensor::randint(128, [1, 60], (Kind::Int64, Device::Cpu));
            let mut cache = h.new_cache(1, Kind::Float, Device::Cpu);
            let mut bytes = vec![];
            for p in 0..60 {
                let _ = h.extend(&mut cache, &ids.narrow(1, p, 1));
                assert_eq!(cache.bytes(), formula(p + 1), "{yaml} after {} tokens", p + 1);
                bytes.push(cache.bytes());
            }
            // Once the selections stop (budget, κ = 0) the size is periodic in the chunk: no growth with
            // context. Uncapped STILL grows by κ tokens per chunk.
            let (now, chunk_ago) = (bytes[59], bytes[59 - c as usize]);
            if per_chunk == 0 || cap < i64::MAX {
                assert_eq!(now, chunk_ago, "{yaml}: the cache kept growing");
            } else {
                assert_eq!(now - chunk_ago, cfg.num_hidden_layers as i64 * heads * 2 * per_chunk * d * 4, "{yaml}");
            }
        }
    }
}
