//! Partial rotary position embedding, GPT-NeoX style (pythia.md §1.3): only the first `r` dims of
//! each head rotate, in the half-split ("rotate_half") layout; cos/sin tables in fp32.
use tch::{Device, Kind, Tensor};

#[derive(Debug)]
pub struct Rope {
    /// Rotary dims per head (even).
    pub dims: i64,
    pub base: f64,
}

impl Rope {
    pub fn new(head_dim: usize, pct: f64, base: f64) -> Self {
        Rope { dims: (head_dim as f64 * pct) as i64, base }
    }

    /// (cos, sin), each `[T, r/2]` fp32, for positions `start .. start + t`.
    pub fn tables(&self, start: i64, t: i64, device: Device) -> (Tensor, Tensor) {
        self.tables_of(&Tensor::arange_start(start, start + t, (Kind::Float, device)))
    }

    /// [`Rope::tables`] at the positions held by `pos` (any integer dtype, on the device): a decode
    /// step whose position is a device tensor (`attention::cache::StepAt`). Bitwise the same numbers.
    pub fn tables_at(&self, pos: &Tensor) -> (Tensor, Tensor) {
        self.tables_of(&pos.view([-1]).to_kind(Kind::Float))
    }

    fn tables_of(&self, pos: &Tensor) -> (Tensor, Tensor) {
        let half = self.dims / 2;
        let k = Tensor::arange(half, (Kind::Float, pos.device()));
        // inv_freq[k] = base^(−2k/r): the exponent divides by r, not by the head dim.
        let inv_freq = (k * (-2.0 * self.base.ln() / self.dims as f64)).exp();
        let theta = pos.unsqueeze(1) * inv_freq.unsqueeze(0);
        (theta.cos(), theta.sin())
    }

    /// Rotate `x` (`[B, H, T, hd]`) with tables for its T positions; dims ≥ r pass through.
    /// The tables are computed in fp32 and applied in x's dtype, as Hugging Face does. The explicit
    /// form: the model applies RoPE inside `kernels::split_rotate`, tested against this.
    #[cfg(test)]
    pub fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        if self.dims == 0 {
            return x.shallow_clone();
        }
        let hd = x.size()[3];
        let half = self.dims / 2;
        let (cos, sin) = (cos.to_kind(x.kind()), sin.to_kind(x.kind()));
        let (x1, x2) = (x.narrow(3, 0, half), x.narrow(3, half, half));
        let y = Tensor::cat(&[&x1 * &cos - &x2 * &sin, &x2 * &cos + &x1 * &sin], 3);
        if self.dims == hd {
            y
        } else {
            Tensor::cat(&[y, x.narrow(3, self.dims, hd - self.dims)], 3)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-hot vector at position p rotates only dims k and k + r/2 by angle p·base^(−2k/r).
    #[test]
    fn one_hot_rotates_one_pair_by_the_expected_angle() {
        let _rng = crate::testutil::rng();
        let (hd, r, p) = (16i64, 4i64, 5i64);
        let rope = Rope::new(hd as usize, 0.25, 10000.0);
        assert_eq!(rope.dims, r);
        let (cos, sin) = rope.tables(0, p + 1, Device::Cpu);
        for k in 0..r / 2 {
            let x = Tensor::zeros([1, 1, p + 1, hd], (Kind::Float, Device::Cpu));
            let _ = x.get(0).get(0).get(p).get(k).fill_(1.0);
            let y = rope.apply(&x, &cos, &sin).get(0).get(0).get(p);
            let angle = p as f64 * 10000f64.powf(-2.0 * k as f64 / r as f64);
            let y: Vec<f64> = Vec::<f64>::try_from(&y.to_kind(Kind::Double)).unwrap();
            for (i, v) in y.iter().enumerate() {
                let want = if i as i64 == k { angle.cos() } else if i as i64 == k + r / 2 { angle.sin() } else { 0.0 };
                assert!((v - want).abs() < 1e-6, "k={k} dim {i}: {v} vs {want}");
            }
        }
    }
}
