//! Deterministic training batches: sample g = step·batch + i is block `perm_e[g mod n]` of epoch
//! `e = g div n`, where the stream is cut into n non-overlapping blocks of T+1 tokens (stride T, as
//! Pythia's 2049-token samples) and `perm_e` is a seeded shuffle. A batch is a pure function of
//! (seed, step), so a resumed run sees exactly the data the uninterrupted run would have seen.
//!
//! Pre-shuffled token data (Megatron `.bin`, Pythia's order) is read in order instead: sample g is
//! tokens [(start + g)·(T+1), (start + g + 1)·(T+1)), non-overlapping, no shuffle, no wrap-around.
use rand::{seq::SliceRandom, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use tch::Tensor;

/// Tokens addressable by position: prepared shards or a Megatron `.bin`.
pub trait TokenSource: Send + Sync {
    fn len(&self) -> usize;
    /// Append tokens `[start, start + n)` to `out` as i64.
    fn read(&self, start: usize, n: usize, out: &mut Vec<i64>);
}

pub struct Batcher {
    stream: Arc<dyn TokenSource>,
    seq_len: usize,
    seed: u64,
    blocks: usize,
    epoch_cache: Option<(u64, Vec<u32>)>,
    /// In-order reading (`sequential`): the first sample's index.
    sequential_from: Option<u64>,
}

impl Batcher {
    pub fn new(stream: Arc<dyn TokenSource>, seq_len: usize, seed: u64) -> crate::Result<Batcher> {
        let blocks = stream.len().saturating_sub(1) / seq_len;
        if blocks == 0 {
            return Err(crate::Error::Data(format!("corpus has {} tokens, fewer than one sample of seq_len + 1 = {}", stream.len(), seq_len + 1)));
        }
        Ok(Batcher { stream, seq_len, seed, blocks, epoch_cache: None, sequential_from: None })
    }

    /// Samples in stream order from sample `start` on; `needed` samples must fit in the stream.
    pub fn sequential(stream: Arc<dyn TokenSource>, seq_len: usize, start: u64, needed: u64) -> crate::Result<Batcher> {
        let blocks = stream.len() / (seq_len + 1);
        if start + needed > blocks as u64 {
            return Err(crate::Error::Data(format!(
                "the token stream holds {blocks} samples of seq_len + 1 = {} tokens ({} tokens); the run needs start_sample {start} + {needed}",
                seq_len + 1,
                stream.len()
            )));
        }
        Ok(Batcher { stream, seq_len, seed: 0, blocks, epoch_cache: None, sequential_from: Some(start) })
    }

    fn block_of(&mut self, sample: u64) -> usize {
        if let Some(start) = self.sequential_from {
            return (start + sample) as usize;
        }
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
        // Shuffled blocks overlap by one token (stride T); in-order samples do not (stride T + 1).
        let stride = if self.sequential_from.is_some() { t + 1 } else { t };
        for s in first..first + n as u64 {
            let b = self.block_of(s);
            self.stream.read(b * stride, t + 1, &mut buf);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Positions as tokens: sample contents name exactly where they were read from.
    struct Counting(usize);
    impl TokenSource for Counting {
        fn len(&self) -> usize {
            self.0
        }
        fn read(&self, start: usize, n: usize, out: &mut Vec<i64>) {
            out.extend((start..start + n).map(|i| i as i64));
        }
    }

    #[test]
    fn sequential_samples_follow_pythia_order() {
        // T = 4: sample i is tokens [5i, 5i + 5); start_sample 3 skips three.
        let mut b = Batcher::sequential(Arc::new(Counting(100)), 4, 3, 8).unwrap();
        let (x, y) = b.micro_batch(1, 1, 4, 2);
        // Step 1 of batch 4, second micro-batch of 2: global samples 6, 7 → stream samples 9, 10.
        assert_eq!(Vec::<i64>::try_from(&x.flatten(0, -1)).unwrap(), [45, 46, 47, 48, 50, 51, 52, 53]);
        assert_eq!(Vec::<i64>::try_from(&y.flatten(0, -1)).unwrap(), [46, 47, 48, 49, 51, 52, 53, 54]);
        let e = Batcher::sequential(Arc::new(Counting(100)), 4, 3, 18).err().unwrap().to_string();
        assert!(e.contains("holds 20 samples") && e.contains("start_sample 3 + 18"), "{e}");
    }
}
