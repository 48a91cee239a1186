//! The trainer: resolved spec → run directory with config.yaml, metrics.jsonl, checkpoints/<step>/,
//! eval.json and DONE. Re-running on an unfinished directory resumes exactly from its newest
//! complete checkpoint; a finished run is never overwritten; a different config is refused.
pub mod checkpoint;
pub mod distributed;
pub mod fault;
pub mod launch;
pub mod lock;
/// LoRA sits below the models and attention that use it (`crate::lora`); this path stays for callers.
pub use crate::lora;
pub mod metrics;
pub mod optim;
pub mod run;
pub mod schedule;
pub mod stage_spec;
pub mod stages;
pub mod workers;

use crate::data::Batcher;
use crate::perplexity::{CorpusResult, EvalCorpus};
use crate::model::Model;
use crate::spec::{Precision, Spec};
use crate::{Error, Result};
use optim::{AdamW, Hyper};
use run::RunDir;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use tch::{nn::VarStore, Device, Kind, Tensor};

#[derive(Default, Clone)]
pub struct TrainOptions {
    pub quiet: bool,
    /// Run on the trained model before the run is marked done (rank 0): the command layer's scoring
    /// of `eval.ruler` (train knows nothing of eval). A spec with `eval.ruler` needs one.
    pub finish: Option<Finish>,
    /// Stop (as if interrupted) after this many optimizer steps in total: for resume tests.
    pub stop_after: Option<u64>,
    /// This process is one worker of a data-parallel job (distributed::DistEnv::from_env()).
    pub dist: Option<distributed::DistEnv>,
}

/// [`TrainOptions::finish`]: (model, tokenizer, spec, run directory, quiet).
pub type Finish = fn(&Model, &crate::data::Tok, &Spec, &std::path::Path, bool) -> Result<()>;

pub struct Outcome {
    pub dir: PathBuf,
    pub step: u64,
    /// Final evaluation (empty when stopped early).
    pub eval: BTreeMap<String, CorpusResult>,
    /// True when the directory already held a finished run.
    pub already_done: bool,
    pub tokens_per_s: f64,
}

/// Trainable parameters by Hugging Face name, sorted (a stable order for the optimizer and checkpoints).
pub fn named_parameters(vs: &VarStore) -> Vec<(String, Tensor)> {
    let mut p: Vec<(String, Tensor)> = vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
    p.sort_by(|a, b| a.0.cmp(&b.0));
    p
}

/// Whether to run under CUDA bf16 autocast.
pub fn use_autocast(spec: &Spec, device: Device) -> Result<bool> {
    match (spec.train.precision, device.is_cuda()) {
        (Precision::Fp32, _) | (Precision::Auto, false) => Ok(false),
        (Precision::Auto, true) | (Precision::Bf16, true) => {
            crate::kernels::set_autocast_bf16()?;
            Ok(true)
        }
        (Precision::Bf16, false) => Err(Error::Spec { file: "spec".into(), key: "train.precision".into(), line: None, msg: "bf16 needs a CUDA device; use fp32 or auto on CPU".into() }),
    }
}

/// Load every evaluation corpus of the spec.
pub fn load_eval_corpora(spec: &Spec, tok: &crate::data::Tok) -> Result<Vec<EvalCorpus>> {
    spec.data.eval.iter().map(|(name, src)| EvalCorpus::load(name, src, tok)).collect()
}

pub fn evaluate_all(model: &Model, corpora: &[EvalCorpus], spec: &Spec, device: Device) -> BTreeMap<String, CorpusResult> {
    crate::perplexity::evaluate_perplexity(model, corpora, spec, device, true).into_iter().map(|(name, (result, _))| (name, result)).collect()
}

/// Train the run a spec describes (or resume it, or report it finished): one stage of the
/// trainer (`stages::run`) with the GPT-NeoX schedule, micro-batch accumulation and data parallelism.
pub fn train(spec: Spec, opts: &TrainOptions) -> Result<Outcome> {
    let tok = crate::data::Tok::load(spec.data.tokenizer.as_ref().expect("resolved"))?;
    let spec = run::with_vocab(spec, &tok);
    // Data parallelism: only rank 0 writes to the run directory; the others read checkpoints.
    let rank0 = opts.dist.as_ref().is_none_or(|d| d.rank == 0);
    let quiet = opts.quiet || !rank0;
    let dir = if rank0 {
        RunDir::prepare(&spec)?
    } else {
        RunDir { path: spec.output.clone().ok_or_else(|| Error::Other("no run directory (`output:`)".into()))? }
    };
    if let Some(eval) = stages::finished(&dir) {
        let eval = serde_json::from_value(eval["corpora"].clone()).unwrap_or_default();
        return Ok(Outcome { dir: dir.path.clone(), step: spec.steps(), eval, already_done: true, tokens_per_s: 0.0 });
    }
    // Rank 0 (holding the lock) clears leftovers and sets corrupt checkpoints aside before the
    // other ranks pass the barrier below and look for the same checkpoint.
    let resume = if rank0 { checkpoint::resume_point(&dir.path)? } else { None };
    let device = crate::device::parse_device(spec.train.device.as_deref().unwrap_or("auto"))?;
    let autocast = use_autocast(&spec, device)?;
    // eval.ruler's scorer and essay now, so that neither stops the run after it trained.
    if let Some(r) = &spec.eval.ruler {
        if opts.finish.is_none() {
            return Err(Error::Other("eval.ruler: this caller of train does not score RULER tasks (`attnlab train` and `attnlab sweep` do)".into()));
        }
        if let Some(essay) = &r.essay {
            crate::data::niah::read_essay(essay)?;
        }
    }
    let (mut comm, dog) = match &opts.dist {
        Some(env) => {
            let timeout = std::time::Duration::from_secs_f64(spec.train.dist_timeout_s.unwrap_or(600.0));
            let mut comm = distributed::connect(env, device, timeout)?;
            // Rank 0 checks (or writes) config.yaml and tokenizes the corpus into the cache alone;
            // the others wait for it, then find the cache ready.
            if env.rank == 0 {
                crate::data::prepare_train(&spec.data.train, &tok, spec.data.cache.as_ref().expect("resolved"), quiet)?;
            }
            comm.barrier()?;
            (Some(comm), Some(distributed::Watchdog::start(env.rank, timeout)))
        }
        None => (None, None),
    };
    tch::manual_seed(spec.seed() as i64);
    let vs = VarStore::new(device);
    let model = run::build_model(&spec, &vs);
    let trainable: std::collections::HashSet<String> = named_parameters(&vs).into_iter().map(|p| p.0).collect();
    let resume = if rank0 { resume } else { checkpoint::list(&dir.path).pop() };

    let corpora = load_eval_corpora(&spec, &tok)?;
    let (steps, batch, accum, seq) = (spec.steps(), spec.batch_size(), spec.grad_accum(), spec.seq_len());
    // This rank's share of every global batch (all of it without data parallelism).
    let (rank, world) = opts.dist.as_ref().map_or((0, 1), |d| (d.rank, d.world));
    let micros = distributed::rank_micro_batches(batch, accum, rank, world)?;
    let batcher = crate::data::train_batcher(&spec.data.train, &tok, spec.data.cache.as_ref().expect("resolved"), seq, spec.seed(), steps * batch as u64, quiet)?;
    let plan = stages::Plan {
        stages: vec![stages::StagePlan {
            steps,
            lr: schedule::Lr::Neox { max: spec.train.lr.expect("resolved"), min: spec.train.min_lr.expect("resolved"), warmup: spec.warmup_steps(), decay: spec.train.decay_steps.expect("resolved") as u64 },
            eval_every: spec.eval.every.expect("resolved") as u64,
        }],
        clip: spec.train.clip.expect("resolved"),
        log_every: spec.train.log_every.expect("resolved") as u64,
        checkpoint_every: spec.checkpoint.every.expect("resolved") as u64,
        keep: spec.checkpoint.keep.expect("resolved") as usize,
        tokens_per_step: (batch * seq) as u64,
        label: "train",
        quiet,
        stop_after: opts.stop_after,
        rows: stages::Rows::Throughput,
    };
    let mut task = TrainTask { spec: &spec, tok: &tok, model: &model, trainable, corpora: &corpora, batcher: Some(batcher), batch, micros, batches: None, autocast, device };
    let dp = comm.as_deref_mut().map(|comm| stages::DataParallel {
        comm,
        grad_kind: match spec.train.grad_reduce.unwrap_or_default() {
            crate::spec::GradReduce::Fp32 => Kind::Float,
            crate::spec::GradReduce::Bf16 => Kind::BFloat16,
        },
        bucket_bytes: (spec.train.bucket_mb.unwrap_or(25.0) * 1e6) as usize,
        watchdog: dog.as_ref(),
    });
    let ran = stages::run(&dir, &vs, &plan, &mut task, resume, dp)?;
    if let Some(dog) = &dog {
        dog.stop();
    }
    if ran.end < steps || !rank0 {
        return Ok(Outcome { dir: dir.path.clone(), step: ran.end, eval: BTreeMap::new(), already_done: false, tokens_per_s: ran.tokens_per_s });
    }
    let results = evaluate_all(&model, &corpora, &spec, device);
    let recall = crate::recall::evaluate_spec(&model, &tok, &spec, device)?;
    let mut row = eval_row(steps, ran.tokens, ran.elapsed_s, &results);
    row.extend(crate::recall::metrics(&recall).into_iter().map(|(k, v)| (k, json!(v))));
    dir.append_metrics(&row)?;
    dir.write_eval(steps, &results)?;
    if !recall.is_empty() {
        crate::recall::write(&dir.path, steps, &recall)?;
    }
    if let Some(finish) = opts.finish {
        finish(&model, &tok, &spec, &dir.path, quiet)?;
    }
    dir.mark_done()?;
    Ok(Outcome { dir: dir.path.clone(), step: steps, eval: results, already_done: false, tokens_per_s: ran.tokens_per_s })
}

/// What is specific to `train`: every parameter of the model trains; an update is the mean loss
/// over this rank's micro-batches of the global batch (from the prefetch thread); evaluation is
/// perplexity on the spec's corpora and the recall test of `eval.recall` (the last step's is the
/// final evaluation, done after the loop).
struct TrainTask<'a> {
    spec: &'a Spec,
    tok: &'a crate::data::Tok,
    model: &'a Model,
    /// The parameters the model created as trainable.
    trainable: std::collections::HashSet<String>,
    corpora: &'a [EvalCorpus],
    batcher: Option<Batcher>,
    batch: usize,
    micros: Vec<(usize, usize)>,
    batches: Option<std::sync::mpsc::Receiver<(Tensor, Tensor)>>,
    autocast: bool,
    device: Device,
}

impl stages::StagedTask for TrainTask<'_> {
    fn trains(&self, _stage: usize, name: &str) -> bool {
        self.trainable.contains(name)
    }

    fn hyper(&self, _stage: usize) -> Hyper {
        let [b1, b2] = self.spec.train.betas.expect("resolved");
        Hyper { betas: (b1, b2), eps: self.spec.train.eps.expect("resolved"), weight_decay: self.spec.train.weight_decay.expect("resolved") }
    }

    fn begin(&mut self, from: u64, to: u64) -> Result<()> {
        if let Some(b) = self.batcher.take() {
            self.batches = Some(prefetch(b, from, to, self.batch, self.micros.clone()));
        }
        Ok(())
    }

    fn step(&mut self, _stage: usize, _step: u64, _log: bool) -> Result<(Tensor, Map<String, Value>)> {
        let rx = self.batches.as_ref().expect("begin starts the prefetch");
        let micro = (0..self.micros.len()).map(|_| rx.recv().map_err(|_| Error::Data("batch loader stopped".into())));
        Ok((accumulate(self.model, micro, self.autocast, self.device)?, Map::new()))
    }

    fn evaluate(&mut self, _stage: usize, at: &stages::Progress) -> Result<Option<stages::Evaluation>> {
        if at.done == self.spec.steps() || (self.corpora.is_empty() && self.spec.eval.recall.is_none()) {
            return Ok(None);
        }
        let results = evaluate_all(self.model, self.corpora, self.spec, self.device);
        let mut row = eval_row(at.done, at.tokens, at.elapsed_s, &results);
        let recall = crate::recall::evaluate_spec(self.model, self.tok, self.spec, self.device)?;
        row.extend(crate::recall::metrics(&recall).into_iter().map(|(k, v)| (k, json!(v))));
        Ok(Some(stages::Evaluation { val_loss: None, row }))
    }
}

/// Forward and backward of each micro-batch (loss scaled by 1/n, gradients accumulating on the
/// parameters). Returns the mean loss as a device scalar: nothing waits for the GPU.
fn accumulate(model: &Model, micro_batches: impl ExactSizeIterator<Item = Result<(Tensor, Tensor)>>, autocast: bool, device: Device) -> Result<Tensor> {
    let n = micro_batches.len() as f64;
    let mut loss_sum = Tensor::zeros([], (Kind::Float, device));
    for mb in micro_batches {
        let (x, y) = mb?;
        let (x, y) = (x.to_device(device), y.to_device(device));
        let loss = crate::kernels::autocast(autocast, || model.loss(&x, &y)) / n;
        loss.backward();
        loss_sum += loss.detach().to_kind(Kind::Float);
    }
    Ok(loss_sum)
}

/// One optimizer step over the given micro-batches as the trainer does it (accumulate, clip,
/// AdamW), for `bench`. Returns (mean loss, pre-clip grad norm) as device scalars.
pub fn step_once(
    model: &Model,
    opt: &mut AdamW,
    micro_batches: impl ExactSizeIterator<Item = Result<(Tensor, Tensor)>>,
    autocast: bool,
    clip: f64,
    lr: f64,
    device: Device,
) -> Result<(Tensor, Tensor)> {
    opt.zero_grad();
    let loss = accumulate(model, micro_batches, autocast, device)?;
    let norm = opt.clip(clip)?;
    opt.step(lr)?;
    Ok((loss, norm))
}

fn eval_row(step: u64, tokens: u64, elapsed_s: f64, results: &BTreeMap<String, CorpusResult>) -> Map<String, Value> {
    let mut row = Map::new();
    row.insert("step".into(), json!(step));
    row.insert("tokens".into(), json!(tokens));
    row.insert("elapsed_s".into(), json!(elapsed_s));
    for (name, r) in results {
        for (k, v) in r.metrics(name) {
            row.insert(k, json!(v));
        }
    }
    row
}

/// A background thread producing the micro-batches of steps `from..to` in order, a few ahead of
/// the trainer, so data loading overlaps compute. `micros`: (first row, rows) of each micro-batch
/// within a global batch of `batch` sequences.
fn prefetch(mut batcher: Batcher, from: u64, to: u64, batch: usize, micros: Vec<(usize, usize)>) -> std::sync::mpsc::Receiver<(Tensor, Tensor)> {
    let (tx, rx) = std::sync::mpsc::sync_channel(2 * micros.len().max(2));
    std::thread::spawn(move || {
        for step in from..to {
            for &(first, rows) in &micros {
                if tx.send(batcher.samples(step * batch as u64 + first as u64, rows)).is_err() {
                    return;
                }
            }
        }
    });
    rx
}

impl RunDir {
    fn metrics_path(&self) -> PathBuf {
        self.path.join("metrics.jsonl")
    }

    /// Append one JSON object as a line of metrics.jsonl (one write: see `metrics::append`), and its
    /// scalars to the run's TensorBoard event file (crate::tensorboard; before the line, so that a
    /// resumed process rebuilds the file from the rows of earlier sessions only).
    pub fn append_metrics(&self, row: &Map<String, Value>) -> Result<()> {
        crate::tensorboard::log_row(&self.path, row, || checkpoint::list(&self.path).last().map(|c| c.0));
        metrics::append(&self.metrics_path(), row)
    }
}
