//! Learning-rate schedules of the trainer (`stages::run`): GPT-NeoX cosine (`train`), HF-style
//! linear / cosine / constant after a warmup fraction (`finetune`), and ReduceLROnPlateau on the
//! held-out loss (`linearize`), plus the spec-level name of a stage's schedule.
use super::optim::{learning_rate, Plateau};
use serde::{Deserialize, Serialize};

/// A stage's schedule as a spec names it (`schedule:` of a finetune or linearize stage).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    /// Linear warmup, then linear decay to 0 (HF `get_linear_schedule_with_warmup`).
    Linear,
    /// Linear warmup, then cosine to 0.
    Cosine,
    /// Linear warmup, then constant.
    Constant,
    /// ReduceLROnPlateau on the stage's held-out loss, stepped at every evaluation.
    Plateau,
}

/// How a stage computes its learning rate.
#[derive(Debug, Clone, PartialEq)]
pub enum Lr {
    /// GPT-NeoX / Megatron: `optim::learning_rate(step, max, min, warmup, decay)`.
    Neox { max: f64, min: f64, warmup: u64, decay: u64 },
    /// `stage_lr`: warmup over `warmup` (a fraction of the stage's updates), then `shape`
    /// (linear, cosine or constant; not plateau).
    Warmup { lr: f64, shape: Schedule, warmup: f64 },
    /// ReduceLROnPlateau (factor, patience, floor) on the stage's held-out loss.
    Plateau { lr: f64, factor: f64, patience: u32, min_lr: f64 },
}

impl Lr {
    /// A spec's stage schedule as a rule (`warmup` is ignored by plateau).
    pub fn of(schedule: Schedule, lr: f64, warmup: f64, factor: f64, patience: u32, min_lr: f64) -> Lr {
        match schedule {
            Schedule::Plateau => Lr::Plateau { lr, factor, patience, min_lr },
            shape => Lr::Warmup { lr, shape, warmup },
        }
    }
}

/// Learning rate of update `step` (0-based) of a stage of `n` updates, as HF's schedulers (the
/// first warmup update has lr 0).
pub fn stage_lr(lr: f64, schedule: Schedule, warmup: f64, step: u64, n: u64) -> f64 {
    let w = (warmup * n as f64).ceil() as u64;
    if step < w {
        return lr * step as f64 / w as f64;
    }
    let progress = (step - w) as f64 / (n - w).max(1) as f64;
    match schedule {
        Schedule::Linear => lr * (1.0 - progress).max(0.0),
        Schedule::Cosine => lr * 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos()),
        Schedule::Constant | Schedule::Plateau => lr,
    }
}

/// A stage's schedule while it runs: a pure function of the update, or a plateau state that
/// evaluations move (rebuilt on resume by replaying the logged held-out losses).
#[derive(Debug, Clone)]
pub struct LrState {
    rule: Lr,
    /// Updates in the stage.
    n: u64,
    plateau: Option<Plateau>,
}

impl LrState {
    pub fn new(rule: &Lr, n: u64) -> LrState {
        let plateau = match *rule {
            Lr::Plateau { lr, factor, patience, min_lr } => Some(Plateau::new(lr, factor, patience, min_lr)),
            _ => None,
        };
        LrState { rule: rule.clone(), n, plateau }
    }

    pub fn is_plateau(&self) -> bool {
        self.plateau.is_some()
    }

    /// Learning rate of update `step` (0-based within the stage).
    pub fn lr(&self, step: u64) -> f64 {
        match (&self.rule, &self.plateau) {
            (_, Some(p)) => p.lr,
            (Lr::Neox { max, min, warmup, decay }, _) => learning_rate(step, *max, *min, *warmup, *decay),
            (Lr::Warmup { lr, shape, warmup }, _) => stage_lr(*lr, *shape, *warmup, step, self.n),
            (Lr::Plateau { lr, .. }, None) => *lr,
        }
    }

    /// Record a held-out loss; returns the learning rate from now on (`current` unless plateau).
    pub fn observe(&mut self, loss: f64, current: f64) -> f64 {
        match &mut self.plateau {
            Some(p) => p.observe(loss),
            None => current,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each rule by hand-computed values: NeoX warmup/cosine/floor, HF linear / cosine / constant
    /// after a 10% warmup, and a plateau that halves after one bad evaluation (patience 0).
    #[test]
    fn every_schedule_by_hand_computed_values() {
        let neox = LrState::new(&Lr::Neox { max: 1.0, min: 0.1, warmup: 2, decay: 6 }, 6);
        // Warmup max(1, n)/W; then 0.1 + 0.45 (1 + cos(π (n − 2)/4)); the floor past `decay`.
        let want = [0.5, 0.5, 1.0, 0.1 + 0.45 * (1.0 + (std::f64::consts::PI / 4.0).cos()), 0.55, 0.1 + 0.45 * (1.0 + (3.0 * std::f64::consts::PI / 4.0).cos()), 0.1, 0.1];
        for (n, w) in want.iter().enumerate() {
            assert!((neox.lr(n as u64) - w).abs() < 1e-12, "neox {n}: {} vs {w}", neox.lr(n as u64));
        }
        // 10 updates, warmup 10% = 1 update (lr 0), then 9 updates of decay.
        let hf = |shape| LrState::new(&Lr::Warmup { lr: 2.0, shape, warmup: 0.1 }, 10);
        let (lin, cos, con) = (hf(Schedule::Linear), hf(Schedule::Cosine), hf(Schedule::Constant));
        assert_eq!([lin.lr(0), cos.lr(0), con.lr(0)], [0.0, 0.0, 0.0]);
        assert_eq!([lin.lr(1), cos.lr(1), con.lr(1)], [2.0, 2.0, 2.0]);
        assert!((lin.lr(4) - 2.0 * 6.0 / 9.0).abs() < 1e-12);
        assert!((cos.lr(4) - (1.0 + (std::f64::consts::PI / 3.0).cos())).abs() < 1e-12);
        assert_eq!(con.lr(9), 2.0);
        let mut p = LrState::new(&Lr::of(Schedule::Plateau, 1.0, 0.5, 0.5, 0, 0.2), 10);
        assert!(p.is_plateau() && !lin.is_plateau());
        assert_eq!(p.lr(7), 1.0);
        let lrs: Vec<f64> = [3.0, 2.0, 2.5, 2.5, 1.0, 1.5, 1.5].iter().map(|&l| p.observe(l, -1.0)).collect();
        assert_eq!(lrs, [1.0, 1.0, 0.5, 0.25, 0.25, 0.2, 0.2]);
        assert_eq!(p.lr(0), 0.2);
        // Not plateau: an evaluation leaves the rate as it is.
        assert_eq!(hf(Schedule::Linear).observe(0.1, 0.7), 0.7);
    }
}
