//! The trainer: resolved spec → run directory with config.yaml, metrics.jsonl, checkpoints/<step>/,
//! eval.json and DONE. Re-running on an unfinished directory resumes exactly from its newest
//! complete checkpoint; a finished run is never overwritten; a different config is refused.
pub mod checkpoint;
pub mod distributed;
pub mod fault;
pub mod launch;
pub mod lock;
pub mod lora;
pub mod metrics;
pub mod optim;
pub mod run;
pub mod stages;
pub mod workers;

use crate::data::Batcher;
use crate::eval::perplexity::{CorpusResult, EvalCorpus};
use crate::model::Model;
use crate::spec::{Precision, Spec};
use crate::{Error, Result};
use optim::{AdamW, Hyper};
use run::RunDir;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;
use tch::{nn::VarStore, Device, Kind, Tensor};

#[derive(Default, Clone)]
pub struct TrainOptions {
    pub quiet: bool,
    /// Stop (as if interrupted) after this many optimizer steps in total: for resume tests.
    pub stop_after: Option<u64>,
    /// This process is one worker of a data-parallel job (distributed::DistEnv::from_env()).
    pub dist: Option<distributed::DistEnv>,
}

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
    crate::eval::lm_eval::evaluate_perplexity(model, corpora, spec, device).into_iter().map(|(name, (result, _))| (name, result)).collect()
}

/// Train the run a spec describes (or resume it, or report it finished).
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
    if dir.is_done() {
        let eval = dir.read_eval().unwrap_or_default();
        return Ok(Outcome { dir: dir.path.clone(), step: spec.steps(), eval, already_done: true, tokens_per_s: 0.0 });
    }
    // Rank 0 (holding the lock) clears leftovers and sets corrupt checkpoints aside before the
    // other ranks pass the barrier below and look for the same checkpoint.
    let resume = if rank0 { checkpoint::resume_point(&dir.path)? } else { None };
    let device = crate::device::parse_device(spec.train.device.as_deref().unwrap_or("auto"))?;
    let autocast = use_autocast(&spec, device)?;
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
    let params = named_parameters(&vs);
    let [b1, b2] = spec.train.betas.expect("resolved");
    let hyper = Hyper { betas: (b1, b2), eps: spec.train.eps.expect("resolved"), weight_decay: spec.train.weight_decay.expect("resolved") };
    let sync = comm.as_ref().map(|_| {
        let kind = match spec.train.grad_reduce.unwrap_or_default() {
            crate::spec::GradReduce::Fp32 => Kind::Float,
            crate::spec::GradReduce::Bf16 => Kind::BFloat16,
        };
        let tensors: Vec<Tensor> = params.iter().map(|p| p.1.shallow_clone()).collect();
        (distributed::GradSync::new(&tensors, (spec.train.bucket_mb.unwrap_or(25.0) * 1e6) as usize, kind), tensors)
    });
    let mut opt = AdamW::new(params, hyper);

    let mut state = checkpoint::State { step: 0, tokens: 0, elapsed_s: 0.0 };
    let resume = if rank0 { resume } else { checkpoint::list(&dir.path).pop() };
    if let Some((step, path)) = resume {
        state = checkpoint::load(&path, &vs, &mut opt)?;
        if !quiet {
            eprintln!("resuming {} from step {step}", dir.path.display());
        }
    }

    if let (Some(comm), Some((_, tensors))) = (comm.as_mut(), sync.as_ref()) {
        // Same seed and checkpoint give the same weights everywhere; the broadcast makes sure.
        for t in tensors {
            tch::no_grad(|| comm.broadcast(&mut t.shallow_clone(), 0))?;
        }
    }
    let corpora = load_eval_corpora(&spec, &tok)?;
    let (steps, batch, accum, seq) = (spec.steps(), spec.batch_size(), spec.grad_accum(), spec.seq_len());
    let end = opts.stop_after.map_or(steps, |s| s.min(steps));
    // This rank's share of every global batch (all of it without data parallelism).
    let (rank, world) = opts.dist.as_ref().map_or((0, 1), |d| (d.rank, d.world));
    let micros = distributed::rank_micro_batches(batch, accum, rank, world)?;
    let per_step = micros.len();
    let batcher = crate::data::train_batcher(&spec.data.train, &tok, spec.data.cache.as_ref().expect("resolved"), seq, spec.seed(), steps * batch as u64, quiet)?;
    let batches = prefetch(batcher, state.step, end, batch, micros);

    let tokens_per_step = (batch * seq) as u64;
    let lr_max = spec.train.lr.expect("resolved");
    let lr_min = spec.train.min_lr.expect("resolved");
    let (warmup, decay) = (spec.warmup_steps(), spec.train.decay_steps.expect("resolved") as u64);
    let clip = spec.train.clip.expect("resolved");
    let log_every = spec.train.log_every.expect("resolved") as u64;
    let eval_every = spec.eval.every.expect("resolved") as u64;
    let ckpt_every = spec.checkpoint.every.expect("resolved") as u64;
    let keep = spec.checkpoint.keep.expect("resolved") as usize;

    let bar = crate::progress::bar(steps, "train", quiet);
    bar.set_position(state.step);
    let session = Instant::now();
    let (mut last_log_t, mut last_log_step) = (Instant::now(), state.step);
    let elapsed = |state: &checkpoint::State| state.elapsed_s + session.elapsed().as_secs_f64();
    let mut last_tps = 0.0;
    for step in state.step..end {
        let lr = optim::learning_rate(step, lr_max, lr_min, warmup, decay);
        let micro = (0..per_step).map(|_| batches.recv().map_err(|_| Error::Data("batch loader stopped".into())));
        let reduce = match (comm.as_deref_mut(), sync.as_ref()) {
            (Some(comm), Some((sync, tensors))) => Some((comm as &mut dyn distributed::Communicator, sync, tensors.as_slice())),
            _ => None,
        };
        let (loss_sum, norm) = step_data_parallel(&model, &mut opt, micro, autocast, clip, lr, device, reduce)?;
        if let Some(dog) = &dog {
            dog.beat();
        }
        let done = step + 1;
        if !rank0 {
            // Only rank 0 logs, evaluates and checkpoints.
            state.step = done;
            continue;
        }
        state.step = done;
        state.tokens = done * tokens_per_step;
        bar.set_position(done);

        let log_now = done % log_every == 0 || done == end;
        let ckpt_now = done == steps || (ckpt_every > 0 && done % ckpt_every == 0);
        if log_now || ckpt_now {
            // The only host synchronisation of a step, and only on logging/checkpoint steps.
            let loss = loss_sum.double_value(&[]);
            if !loss.is_finite() {
                let last = checkpoint::list(&dir.path).pop().map(|(s, _)| format!("step {s}")).unwrap_or_else(|| "none".into());
                return Err(Error::Diverged { step: done, msg: format!("loss is {loss}; last good checkpoint: {last} in {}", dir.path.display()) });
            }
            if log_now {
                let secs = last_log_t.elapsed().as_secs_f64().max(1e-9);
                last_tps = ((done - last_log_step) * tokens_per_step) as f64 / secs;
                (last_log_t, last_log_step) = (Instant::now(), done);
                let mut row = json!({"step": done, "tokens": state.tokens, "loss": loss, "lr": lr, "grad_norm": norm.double_value(&[]), "tokens_per_s": last_tps, "elapsed_s": elapsed(&state)});
                if world > 1 {
                    row["world_size"] = json!(world);
                }
                dir.append_metrics(row.as_object().expect("object"))?;
                bar.set_message(format!("loss {loss:.4} · {:.0} tok/s", last_tps));
            }
        }
        if eval_every > 0 && done % eval_every == 0 && done != steps && !corpora.is_empty() {
            let results = evaluate_all(&model, &corpora, &spec, device);
            dir.append_metrics(&eval_row(done, state.tokens, elapsed(&state), &results))?;
        }
        if ckpt_now {
            checkpoint::save(&dir.path, &vs, &opt, &checkpoint::State { step: done, tokens: state.tokens, elapsed_s: elapsed(&state) }, keep)?;
        }
    }
    bar.finish_and_clear();
    if let Some(dog) = &dog {
        dog.stop();
    }
    if end < steps || !rank0 {
        return Ok(Outcome { dir: dir.path.clone(), step: end, eval: BTreeMap::new(), already_done: false, tokens_per_s: last_tps });
    }
    let results = evaluate_all(&model, &corpora, &spec, device);
    dir.append_metrics(&eval_row(steps, state.tokens, elapsed(&state), &results))?;
    dir.write_eval(steps, &results)?;
    dir.mark_done()?;
    Ok(Outcome { dir: dir.path.clone(), step: steps, eval: results, already_done: false, tokens_per_s: last_tps })
}

/// One optimizer step over the given micro-batches: forward/backward each (loss scaled by 1/n),
/// clip, AdamW. Returns (mean loss, pre-clip grad norm) as device scalars: nothing waits for the GPU.
pub fn step_once(
    model: &Model,
    opt: &mut AdamW,
    micro_batches: impl ExactSizeIterator<Item = Result<(Tensor, Tensor)>>,
    autocast: bool,
    clip: f64,
    lr: f64,
    device: Device,
) -> Result<(Tensor, Tensor)> {
    step_data_parallel(model, opt, micro_batches, autocast, clip, lr, device, None)
}

/// `step_once` as one rank of a data-parallel job: between backward and clipping, gradients (of
/// `params`, in `sync`'s buckets) and the loss are averaged over the ranks, so clipping and AdamW
/// see the global batch's gradient on every rank.
#[allow(clippy::too_many_arguments)]
pub fn step_data_parallel(
    model: &Model,
    opt: &mut AdamW,
    micro_batches: impl ExactSizeIterator<Item = Result<(Tensor, Tensor)>>,
    autocast: bool,
    clip: f64,
    lr: f64,
    device: Device,
    reduce: Option<(&mut dyn distributed::Communicator, &distributed::GradSync, &[Tensor])>,
) -> Result<(Tensor, Tensor)> {
    opt.zero_grad();
    let n = micro_batches.len() as f64;
    let mut loss_sum = Tensor::zeros([], (Kind::Float, device));
    for mb in micro_batches {
        let (x, y) = mb?;
        let (x, y) = (x.to_device(device), y.to_device(device));
        let loss = crate::kernels::autocast(autocast, || model.loss(&x, &y)) / n;
        loss.backward();
        loss_sum += loss.detach().to_kind(Kind::Float);
    }
    if let Some((comm, sync, params)) = reduce {
        sync.average(comm, params)?;
        let mut l = loss_sum.reshape([1]);
        comm.all_reduce_sum(&mut l)?;
        loss_sum = l.reshape([]) / comm.world() as f64;
    }
    let norm = opt.clip(clip)?;
    opt.step(lr)?;
    Ok((loss_sum, norm))
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
        crate::tensorboard::log_row(&self.path, row);
        metrics::append(&self.metrics_path(), row)
    }
}
