//! A staged training loop (used by `finetune`; `linearize`'s loop has the same shape and can move onto
//! it once an after-update hook carries its plateau schedule): stages run one after another over one
//! VarStore, each with its own trainable parameters, AdamW (fresh moments at every stage start)
//! and learning rate; metrics rows carry `stage`; checkpoints are written every `checkpoint_every`
//! updates and at every stage end; a re-run resumes exactly from the newest complete checkpoint.
use super::checkpoint::{self, State};
use super::optim::{AdamW, Hyper};
use super::run::RunDir;
use crate::{Error, Result};
use serde_json::{json, Map, Value};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{de::DeserializeOwned, Serialize};
use std::path::Path;
use tch::{nn::VarStore, Tensor};

/// What a staged run does; stages are numbered from 1.
pub trait StagedTask {
    /// Whether parameter `name` trains in `stage`.
    fn trains(&self, stage: usize, name: &str) -> bool;
    fn hyper(&self, stage: usize) -> Hyper;
    /// Learning rate of update `step` of `stage` (0-based within the stage).
    fn lr(&self, stage: usize, step: u64) -> f64;
    /// Forward and backward of update `step` of `stage` (gradients left on the parameters). Returns
    /// the detached loss and, when `log`, extra metrics for the row.
    fn step(&mut self, stage: usize, step: u64, log: bool) -> Result<(Tensor, Map<String, Value>)>;
    /// A metrics row to write at global step 0 (before any update, fresh runs only) and after the
    /// last update of each stage.
    fn at_boundary(&mut self, _global_step: u64) -> Result<Option<Map<String, Value>>> {
        Ok(None)
    }
}

pub struct Plan {
    /// Updates per stage.
    pub steps: Vec<u64>,
    /// Gradient-norm clipping (0 = none).
    pub clip: f64,
    pub log_every: u64,
    pub checkpoint_every: u64,
    pub keep: usize,
    pub tokens_per_step: u64,
    /// Command name for progress lines.
    pub label: &'static str,
    pub quiet: bool,
    /// Stop (as if interrupted) after this many updates in total: resume tests.
    pub stop_after: Option<u64>,
}

impl Plan {
    pub fn total(&self) -> u64 {
        self.steps.iter().sum()
    }

    /// (stage, first global step of the stage) of global update `g`; `None` past the end.
    fn stage_of(&self, g: u64) -> Option<(usize, u64)> {
        let mut start = 0;
        for (i, &n) in self.steps.iter().enumerate() {
            if g < start + n {
                return Some((i + 1, start));
            }
            start += n;
        }
        None
    }

    fn is_stage_end(&self, done: u64) -> bool {
        self.steps.iter().scan(0, |acc, &n| {
            *acc += n;
            Some(*acc)
        }).any(|end| end == done)
    }
}

/// Make exactly the parameters `trains` selects trainable; an AdamW over them (sorted by name).
pub fn optimizer_over(vs: &VarStore, trains: impl Fn(&str) -> bool, hyper: Hyper) -> Option<AdamW> {
    for (name, t) in vs.variables() {
        let _ = t.shallow_clone().set_requires_grad(trains(&name));
    }
    let params = super::named_parameters(vs);
    (!params.is_empty()).then(|| AdamW::new(params, hyper))
}

fn optimizer_for(vs: &VarStore, task: &impl StagedTask, stage: usize) -> Result<AdamW> {
    optimizer_over(vs, |n| task.trains(stage, n), task.hyper(stage)).ok_or_else(|| Error::Other(format!("stage {stage} has no trainable parameters")))
}

/// Run the stages from the newest complete checkpoint in `dir` (or from the start) to the end, or to
/// `plan.stop_after`. Returns the number of updates done in total.
pub fn run(dir: &RunDir, vs: &VarStore, plan: &Plan, task: &mut impl StagedTask) -> Result<u64> {
    let total = plan.total();
    let mut state = State { step: 0, tokens: 0, elapsed_s: 0.0 };
    let mut current: Option<(usize, AdamW)> = None;
    match checkpoint::resume_point(&dir.path)? {
        Some((step, path)) => {
            match plan.stage_of(step) {
                // Mid-stage: weights, this stage's moments and its own update count.
                Some((stage, start)) if step > start => {
                    let mut opt = optimizer_for(vs, task, stage)?;
                    state = checkpoint::load(&path, vs, &mut opt)?;
                    opt.set_steps_done(state.step - start);
                    current = Some((stage, opt));
                }
                // At a stage boundary (or the end): the next stage starts with fresh moments.
                _ => {
                    checkpoint::load_weights(vs, &path.join("model.safetensors"))?;
                    let sp = path.join("state.json");
                    state = serde_json::from_str(&std::fs::read_to_string(&sp).map_err(|e| Error::io(&sp, e))?)?;
                }
            }
            if !plan.quiet {
                eprintln!("resuming {} from step {step}", dir.path.display());
            }
        }
        None => {
            if let Some(row) = task.at_boundary(0)? {
                dir.append_metrics(&with_step(row, 0, "start"))?;
            }
        }
    }
    let end = plan.stop_after.map_or(total, |s| s.min(total));
    let session = std::time::Instant::now();
    for g in state.step..end {
        let (stage, start) = plan.stage_of(g).expect("g < total");
        if current.as_ref().is_none_or(|c| c.0 != stage) {
            current = Some((stage, optimizer_for(vs, task, stage)?));
        }
        let opt = &mut current.as_mut().expect("set above").1;
        let done = g + 1;
        let log = done % plan.log_every.max(1) == 0 || plan.is_stage_end(done) || done == end;
        let lr = task.lr(stage, g - start);
        opt.zero_grad();
        let (loss, extra) = task.step(stage, g - start, log)?;
        if plan.clip > 0.0 {
            let _ = opt.clip(plan.clip)?;
        }
        opt.step(lr)?;
        state.step = done;
        state.tokens += plan.tokens_per_step;
        if log {
            let l = loss.double_value(&[]);
            if !l.is_finite() {
                return Err(Error::Diverged { step: done, msg: format!("stage {stage} loss is {l}") });
            }
            let mut row = json!({"step": done, "stage": stage, "loss": l, "lr": lr, "tokens": state.tokens, "elapsed_s": state.elapsed_s + session.elapsed().as_secs_f64()});
            row.as_object_mut().expect("object").extend(extra);
            dir.append_metrics(row.as_object().expect("object"))?;
            if !plan.quiet {
                eprintln!("{} step {done}/{total} stage {stage} loss {l:.5}", plan.label);
            }
        }
        if plan.is_stage_end(done) {
            if let Some(row) = task.at_boundary(done)? {
                dir.append_metrics(&with_step(row, done, &format!("end of stage {stage}")))?;
            }
        }
        if plan.is_stage_end(done) || (plan.checkpoint_every > 0 && done % plan.checkpoint_every == 0) {
            let st = State { step: done, tokens: state.tokens, elapsed_s: state.elapsed_s + session.elapsed().as_secs_f64() };
            checkpoint::save(&dir.path, vs, opt, &st, plan.keep.max(1))?;
        }
    }
    Ok(end)
}

fn with_step(mut row: Map<String, Value>, step: u64, at: &str) -> Map<String, Value> {
    row.insert("step".into(), json!(step));
    row.insert("at".into(), json!(at));
    row
}

/// Items of update `step` of a stage: epochs over `items`, each shuffled by (seed, stage, epoch), `b`
/// per update.
pub fn step_items<T>(items: &[T], step: u64, b: usize, seed: u64, stage: u64) -> Vec<&T> {
    let n = items.len();
    (0..b)
        .map(|j| {
            let k = step as usize * b + j;
            let (epoch, i) = (k / n, k % n);
            let mut order: Vec<usize> = (0..n).collect();
            order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ (stage << 32) ^ epoch as u64));
            &items[order[i]]
        })
        .collect()
}

/// Create the run directory `path` for `spec` (or reopen it): config.yaml is written once; a recorded
/// config that differs after `normalize` (which blanks what may change between sessions, e.g. the
/// device) is refused.
pub fn prepare_dir<S: PartialEq + Clone + Serialize + DeserializeOwned>(path: &Path, spec: &S, normalize: impl Fn(&mut S), what: &str) -> Result<RunDir> {
    std::fs::create_dir_all(path).map_err(|e| Error::io(path, e))?;
    // One writer at a time, from before the first write to the end of the process.
    super::lock::hold(path)?;
    let cfg = path.join("config.yaml");
    // config.yaml records the command (crate::run_kind).
    let kind = crate::run_kind::RunKind::named(what);
    if cfg.is_file() {
        let text = std::fs::read_to_string(&cfg).map_err(|e| Error::io(&cfg, e))?;
        let old: S = serde_yaml::from_str(&kind.map_or(text.clone(), |k| k.strip(&text))).map_err(|e| Error::Other(format!("{}: {e}", cfg.display())))?;
        let norm = |s: &S| {
            let mut s = s.clone();
            normalize(&mut s);
            s
        };
        if norm(&old) != norm(spec) {
            return Err(Error::Run { dir: path.into(), msg: format!("holds a {what} run with a different config; choose another output directory") });
        }
    } else {
        let yaml = serde_yaml::to_string(spec).expect("serializes");
        std::fs::write(&cfg, kind.map_or(yaml.clone(), |k| k.record(&yaml))).map_err(|e| Error::io(&cfg, e))?;
    }
    Ok(RunDir { path: path.into() })
}
