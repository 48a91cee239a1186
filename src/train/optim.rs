//! AdamW with Pythia's parameter groups (no weight decay on biases and LayerNorm), aten's fused
//! kernel (`_fused_adamw_`, CPU and CUDA), fp32 state, and the GPT-NeoX learning-rate schedule.
use crate::kernels::{self, AdamwGroup};
use crate::Result;
use tch::{Kind, Tensor};

pub struct Hyper {
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
}

/// One trainable parameter with its AdamW state.
pub struct Slot {
    pub name: String,
    pub param: Tensor,
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
    pub decay: bool,
}

pub struct AdamW {
    pub slots: Vec<Slot>,
    /// Completed updates, as an f32 scalar on the parameters' device (the fused kernel reads it).
    step: Tensor,
    pub hyper: Hyper,
}

impl AdamW {
    /// `params`: (name, tensor) sorted by name; names decide the weight-decay group.
    pub fn new(params: Vec<(String, Tensor)>, hyper: Hyper) -> AdamW {
        let device = params.first().map(|p| p.1.device()).unwrap_or(tch::Device::Cpu);
        let slots = params
            .into_iter()
            .map(|(name, param)| Slot {
                decay: !crate::model::neox::no_weight_decay(&name, &param),
                exp_avg: param.zeros_like().detach(),
                exp_avg_sq: param.zeros_like().detach(),
                name,
                param,
            })
            .collect();
        AdamW { slots, step: Tensor::zeros([], (Kind::Float, device)), hyper }
    }

    /// Completed updates (reads the device scalar: a host sync; call only when checkpointing).
    pub fn steps_done(&self) -> u64 {
        self.step.double_value(&[]) as u64
    }

    pub fn set_steps_done(&mut self, n: u64) {
        let _ = self.step.fill_(n as f64);
    }

    /// Apply one update with learning rate `lr` to every parameter that has a gradient.
    pub fn step(&mut self, lr: f64) -> Result<()> {
        let _ = self.step.g_add_scalar_(1.0);
        let grads: Vec<Tensor> = self.slots.iter().map(|s| s.param.grad()).collect();
        for decay in [true, false] {
            let idx: Vec<usize> = (0..self.slots.len()).filter(|&i| self.slots[i].decay == decay && grads[i].defined()).collect();
            let g = AdamwGroup {
                params: idx.iter().map(|&i| &self.slots[i].param).collect(),
                grads: idx.iter().map(|&i| &grads[i]).collect(),
                exp_avgs: idx.iter().map(|&i| &self.slots[i].exp_avg).collect(),
                exp_avg_sqs: idx.iter().map(|&i| &self.slots[i].exp_avg_sq).collect(),
                steps: idx.iter().map(|_| &self.step).collect(),
            };
            let wd = if decay { self.hyper.weight_decay } else { 0.0 };
            tch::no_grad(|| kernels::fused_adamw(&g, lr, self.hyper.betas, wd, self.hyper.eps))?;
        }
        crate::util::parameters_written();
        Ok(())
    }

    pub fn zero_grad(&mut self) {
        for s in &mut self.slots {
            s.param.zero_grad();
        }
    }

    /// Clip all gradients to global norm `max_norm` (0 = no clipping); returns the norm (no sync).
    pub fn clip(&self, max_norm: f64) -> Result<Tensor> {
        let grads: Vec<Tensor> = self.slots.iter().map(|s| s.param.grad()).filter(Tensor::defined).collect();
        kernels::clip_grad_norm(&grads.iter().collect::<Vec<_>>(), max_norm)
    }
}

/// GPT-NeoX learning rate for update counter n (0 for the first update): linear warmup over `warmup`
/// steps (`max(1, n)/W`), then cosine from lr_max to lr_min over `decay` steps, never below lr_min.
pub fn learning_rate(n: u64, lr_max: f64, lr_min: f64, warmup: u64, decay: u64) -> f64 {
    if warmup > 0 && n <= warmup {
        return lr_max * (n.max(1) as f64) / warmup as f64; // Megatron returns before the min_lr floor
    }
    let lr = if decay <= warmup || n >= decay {
        lr_min
    } else {
        let progress = (n - warmup) as f64 / (decay - warmup) as f64;
        lr_min + (lr_max - lr_min) / 2.0 * (1.0 + (std::f64::consts::PI * progress).cos())
    };
    lr.max(lr_min)
}

/// ReduceLROnPlateau as PyTorch's defaults for `mode='min'` (threshold 1e-4 relative, cooldown 0):
/// after more than `patience` evaluations without a relative improvement, lr ← max(lr·factor, min_lr).
/// Its state is a pure function of the evaluated losses, so a resumed run rebuilds it by replaying them.
#[derive(Debug, Clone, PartialEq)]
pub struct Plateau {
    pub lr: f64,
    pub factor: f64,
    pub patience: u32,
    pub min_lr: f64,
    best: f64,
    bad: u32,
}

impl Plateau {
    pub fn new(lr: f64, factor: f64, patience: u32, min_lr: f64) -> Plateau {
        Plateau { lr, factor, patience, min_lr, best: f64::INFINITY, bad: 0 }
    }

    /// Record one evaluation; returns the learning rate to use from now on.
    pub fn observe(&mut self, loss: f64) -> f64 {
        if loss < self.best * (1.0 - 1e-4) {
            self.best = loss;
            self.bad = 0;
        } else {
            self.bad += 1;
        }
        if self.bad > self.patience {
            let reduced = (self.lr * self.factor).max(self.min_lr);
            // PyTorch skips reductions smaller than eps = 1e-8.
            if self.lr - reduced > 1e-8 {
                self.lr = reduced;
            }
            self.bad = 0;
        }
        self.lr
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// pythia.md §7.5: values at n = 0, 1, W, W+1, S/2, S, S+10 (W = 1430, S = 143000).
    #[test]
    fn schedule_matches_the_gpt_neox_formula() {
        let (hi, lo, w, s) = (1e-3, 1e-4, 1430u64, 143_000u64);
        let lr = |n| learning_rate(n, hi, lo, w, s);
        let cosine = |n: u64| lo + (hi - lo) / 2.0 * (1.0 + (std::f64::consts::PI * (n - w) as f64 / (s - w) as f64).cos());
        assert_eq!(lr(0), hi / w as f64);
        assert_eq!(lr(1), hi / w as f64);
        assert!((lr(w) - hi).abs() < 1e-15);
        assert!((lr(w + 1) - cosine(w + 1)).abs() < 1e-15 && lr(w + 1) < hi);
        assert!((lr(s / 2) - cosine(s / 2)).abs() < 1e-15);
        assert!((lr(s) - lo).abs() < 1e-15);
        assert_eq!(lr(s + 10), lo);
    }

    /// The fused kernel equals AdamW written out by hand, over three steps, both weight-decay groups.
    #[test]
    fn fused_adamw_matches_the_formula() {
        let _rng = crate::testutil::seeded(0);
        let w = Tensor::randn([5, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let b = Tensor::randn([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let hyper = Hyper { betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1 };
        let mut opt = AdamW::new(vec![("l.bias".into(), b.shallow_clone()), ("l.weight".into(), w.shallow_clone())], hyper);
        let (mut wr, mut br) = (w.detach().copy(), b.detach().copy());
        let (mut m, mut v) = ([wr.zeros_like(), br.zeros_like()], [wr.zeros_like(), br.zeros_like()]);
        let x = Tensor::randn([4, 5], (Kind::Float, Device::Cpu));
        for t in 1..=3 {
            let lr = 0.01 * t as f64;
            opt.zero_grad();
            (x.matmul(&w) + &b).pow_tensor_scalar(2).sum(Kind::Float).backward();
            let grads = [w.grad().detach().copy(), b.grad().detach().copy()];
            opt.step(lr).unwrap();
            for (i, (p, wd)) in [(&mut wr, 0.1), (&mut br, 0.0)].into_iter().enumerate() {
                let g = &grads[i];
                m[i] = &m[i] * 0.9 + g * 0.1;
                v[i] = &v[i] * 0.95 + g * g * 0.05;
                let mh = &m[i] / (1.0 - 0.9f64.powi(t));
                let vh = &v[i] / (1.0 - 0.95f64.powi(t));
                *p = &*p * (1.0 - lr * wd) - mh * lr / (vh.sqrt() + 1e-8);
            }
            let err = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
            assert!(err(&w.detach(), &wr) < 1e-6 && err(&b.detach(), &br) < 1e-6, "step {t}");
        }
        assert_eq!(opt.steps_done(), 3);
    }

    /// Hand-traced ReduceLROnPlateau(factor 0.1, patience 2, min_lr 1e-3): the 3rd evaluation in a
    /// row without a 1e-4 relative improvement reduces, the count restarts, the floor holds.
    #[test]
    fn plateau_reduces_after_patience_and_stops_at_min_lr() {
        let mut p = Plateau::new(0.1, 0.1, 2, 1e-3);
        let losses = [1.0, 0.9, 0.9, 0.95, 0.91, 0.89995, 0.91, 0.95, 0.92, 0.8, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9];
        let lrs: Vec<f64> = losses.iter().map(|&l| p.observe(l)).collect();
        // 0.89995 is not a 1e-4 relative improvement on 0.9, so it counts as bad.
        let want = [0.1, 0.1, 0.1, 0.1, 0.01, 0.01, 0.01, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001];
        for (i, (a, b)) in lrs.iter().zip(want).enumerate() {
            assert!((a - b).abs() < 1e-12, "eval {i}: lr {a}, want {b} ({lrs:?})");
        }
    }
}
