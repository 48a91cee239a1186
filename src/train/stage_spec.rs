//! The stage keys shared by the staged commands' specs (`stage1:` / `stage2:` of finetune and
//! linearize) and their `checkpoint:` block. One type; the defaults that differ between commands
//! (epochs, warmup, schedule) come from a marker type `D`.
use super::schedule::{Lr, Schedule};
use serde::{Deserialize, Serialize};
use std::marker::PhantomData;

/// The defaults of one command's stages. The `omit_*` hooks leave a key out of the serialized
/// spec while it has its default, for keys the command's config.yaml never had: a run's config.yaml
/// (and the report's recipe hashes of it) reads as before the stage types were shared.
pub trait StageDefaults {
    fn epochs() -> f64;
    fn warmup() -> f64;
    fn schedule() -> Schedule;
    fn omit_warmup(_w: &f64) -> bool {
        false
    }
    /// Whether to leave `factor`, `patience` and `min_lr` out while they are the defaults.
    fn omit_plateau_keys() -> bool {
        false
    }
}

fn omit_factor<D: StageDefaults>(f: &f64) -> bool {
    D::omit_plateau_keys() && *f == default_factor()
}
fn omit_patience<D: StageDefaults>(p: &u32) -> bool {
    D::omit_plateau_keys() && *p == default_patience()
}
fn omit_min_lr<D: StageDefaults>(m: &f64) -> bool {
    D::omit_plateau_keys() && *m == default_min_lr()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, bound = "")]
pub struct StageSpec<D: StageDefaults> {
    /// Passes over the training rows; ignored when `steps` is given.
    #[serde(default = "D::epochs")]
    pub epochs: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f64>,
    /// Fraction of the stage's updates spent warming up (linear, cosine, constant; not plateau).
    #[serde(default = "D::warmup", skip_serializing_if = "D::omit_warmup")]
    pub warmup: f64,
    /// `linear`, `cosine`, `constant` (after the warmup) or `plateau` (ReduceLROnPlateau on the
    /// held-out stage loss, evaluated every `eval_every` updates).
    #[serde(default = "D::schedule")]
    pub schedule: Schedule,
    /// Held-out evaluation (and plateau step) every N optimizer steps of the stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_every: Option<u64>,
    /// Plateau: lr ← max(lr·factor, min_lr) after more than `patience` evaluations without improvement.
    #[serde(default = "default_factor", skip_serializing_if = "omit_factor::<D>")]
    pub factor: f64,
    #[serde(default = "default_patience", skip_serializing_if = "omit_patience::<D>")]
    pub patience: u32,
    #[serde(default = "default_min_lr", skip_serializing_if = "omit_min_lr::<D>")]
    pub min_lr: f64,
    /// Trainable parameters (finetune): `bottleneck`, `all`, or a regex over parameter names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<String>,
    #[serde(skip)]
    pub defaults: PhantomData<D>,
}

impl<D: StageDefaults> Default for StageSpec<D> {
    fn default() -> Self {
        serde_yaml::from_str("{}").expect("defaults")
    }
}

impl<D: StageDefaults> StageSpec<D> {
    /// Updates of the stage: `steps`, else `epochs` passes over `rows` at `batch` rows per update.
    pub fn updates(&self, rows: usize, batch: usize) -> u64 {
        self.steps.unwrap_or_else(|| ((self.epochs * rows as f64) / batch as f64).ceil() as u64)
    }

    /// The stage's learning-rate rule (after `resolved`: `lr` is set).
    pub fn lr_rule(&self) -> Lr {
        Lr::of(self.schedule, self.lr.expect("resolved"), self.warmup, self.factor, self.patience, self.min_lr)
    }
}

fn default_factor() -> f64 {
    0.1
}
fn default_patience() -> u32 {
    10
}
fn default_min_lr() -> f64 {
    1e-5
}

/// `checkpoint:` of a staged command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSpec {
    #[serde(default = "default_ckpt_every")]
    pub every: u64,
    #[serde(default = "default_keep")]
    pub keep: usize,
}

impl Default for CheckpointSpec {
    fn default() -> Self {
        serde_yaml::from_str("{}").expect("defaults")
    }
}

fn default_ckpt_every() -> u64 {
    200
}
fn default_keep() -> usize {
    2
}

#[cfg(test)]
mod tests {
    /// The keys of a stage's YAML: finetune's and linearize's as each wrote them before the type
    /// was shared (config.yaml and the report's recipe hashes unchanged); a key set away from its
    /// default is written.
    #[test]
    fn stage_keys_serialize_as_each_command_wrote_them() {
        fn keys<T: serde::Serialize>(v: &T) -> Vec<String> {
            let y: serde_yaml::Mapping = serde_yaml::from_str(&serde_yaml::to_string(v).unwrap()).unwrap();
            y.keys().map(|k| k.as_str().unwrap().to_string()).collect()
        }
        let mut ft = crate::finetune::FtStage::default();
        assert_eq!(keys(&ft), ["epochs", "warmup", "schedule"]);
        ft.factor = 0.5;
        assert_eq!(keys(&ft), ["epochs", "warmup", "schedule", "factor"]);
        let mut lin = crate::linearize::StageSpec::default();
        assert_eq!(keys(&lin), ["epochs", "schedule", "factor", "patience", "min_lr"]);
        lin.warmup = 0.1;
        assert_eq!(keys(&lin), ["epochs", "warmup", "schedule", "factor", "patience", "min_lr"]);
        let back: crate::linearize::StageSpec = serde_yaml::from_str(&serde_yaml::to_string(&lin).unwrap()).unwrap();
        assert_eq!(back, lin);
    }
}
