//! Deterministic training batches: sample g = step·batch + i is block `perm_e[g mod n]` of epoch
//! `e = g div n`, where the stream is cut into n non-overlapping blocks of T+1 tokens (stride T, as
//! Pythia's 2049-token samples) and `perm_e` is a seeded shuffle. A batch is a pure function of
//! (seed, step), so a resumed run sees exactly the data the uninterrupted run would have seen.
use super::TokenStream;
use rand::{seq::SliceRandom, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use tch::Tensor;

pub struct Batcher {
    stream: Arc<TokenStream>,
    seq_len: usize,
    seed: u64,
    blocks: usize,
    epoch_cache: Option<(u64, Vec<u32>)>,
}

impl Batcher {
    pub fn new(stream: Arc<TokenStream>, seq_len: usize, seed: u64) -> crate::Result<Batcher> {
        let blocks = stream.len().saturating_sub(1) / seq_len;
        if blocks == 0 {
            return Err(crate::Error::Data(format!("corpus has {} tokens, fewer than one sample of seq_len + 1 = {}", stream.len(), seq_len + 1)));
        }
        Ok(Batcher { stream, seq_len, seed, blocks, epoch_cache: None })
    }

    fn block_of(&mut self, sample: u64) -> usize {
        let epoch = sample / self.blocks as u64;
        if self.epoch_cache.as_ref().map(|c| c.0) != Some(epoch) {
            let mut perm: Vec<u32> = (0..self.blocks as u32).collect();
            perm.shuffle(&mut ChaCha8Rng::seed_from_u64(self.seed ^ epoch.wrapping_mul(0xA24B_AED4_963E_E407)));
            self.epoch_cache = Some((epoch, perm));
        }
        self.epoch_cache.as_ref().unwrap().1[(sample % self.blocks as u64) as usize] as usize
    }

    /// Inputs and targets (`[n, T]` int64, CPU) for samples `first .. first + n`.
    pub fn samples(&mut self, first: u64, n: usize) -> (Tensor, Tensor) {
        let t = self.seq_len;
        let mut buf = Vec::with_capacity(n * (t + 1));
        for s in first..first + n as u64 {
            let b = self.block_of(s);
            self.stream.read(b * t, t + 1, &mut buf);
        }
        let all = Tensor::from_slice(&buf).view([n as i64, t as i64 + 1]);
        (all.narrow(1, 0, t as i64), all.narrow(1, 1, t as i64))
    }

    /// Micro-batch `micro` (of `accum`) of optimizer step `step` (0-based) with `batch` sequences per step.
    pub fn micro_batch(&mut self, step: u64, micro: usize, batch: usize, accum: usize) -> (Tensor, Tensor) {
        let per = batch / accum;
        self.samples(step * batch as u64 + (micro * per) as u64, per)
    }
}
