//! The trainer: resolved spec → run directory with config.yaml, metrics.jsonl, checkpoints/<step>/,
//! eval.json and DONE. Re-running on an unfinished directory resumes exactly from its newest
//! complete checkpoint; a finished run is never overwritten; a different config is refused.
pub mod checkpoint;
pub mod lora;
pub mod optim;
pub mod run;
pub mod stages;

use crate::data::{shards, Batcher, TokenStream};
use crate::eval::perplexity::{self, CorpusResult, EvalCorpus};
use crate::model::Model;
use crate::spec::{Precision, Spec};
use crate::{Error, IoContext, Result};
use optim::{AdamW, Hyper};
use run::RunDir;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use tch::{nn::VarStore, Device, Kind, Tensor};

#[derive(Default, Clone)]
pub struct TrainOptions {
    pub quiet: bool,
    /// Stop (as if interrupted) after this many optimizer steps in total: for resume tests.
    pub stop_after: Option<u64>,
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
    corpora
        .iter()
        .map(|c| {
            let batch = spec.eval.batch_size.unwrap_or(8) as usize;
            (c.name.clone(), perplexity::evaluate(model, c, spec.seq_len(), batch, spec.eval.max_tokens, spec.eval.protocol, device))
        })
        .collect()
}

/// Train the run a spec describes (or resume it, or report it finished).
pub fn train(spec: Spec, opts: &TrainOptions) -> Result<Outcome> {
    let tok = crate::data::Tok::load(spec.data.tokenizer.as_ref().expect("resolved"))?;
    let spec = run::with_vocab(spec, &tok);
    let dir = RunDir::prepare(&spec)?;
    if dir.is_done() {
        let eval = dir.read_eval().unwrap_or_default();
        return Ok(Outcome { dir: dir.path.clone(), step: spec.steps(), eval, already_done: true, tokens_per_s: 0.0 });
    }
    let device = crate::device::parse_device(spec.train.device.as_deref().unwrap_or("auto"))?;
    let autocast = use_autocast(&spec, device)?;
    tch::manual_seed(spec.seed() as i64);
    let vs = VarStore::new(device);
    let model = run::build_model(&spec, &vs);
    let params = named_parameters(&vs);
    let [b1, b2] = spec.train.betas.expect("resolved");
    let hyper = Hyper { betas: (b1, b2), eps: spec.train.eps.expect("resolved"), weight_decay: spec.train.weight_decay.expect("resolved") };
    let mut opt = AdamW::new(params, hyper);

    let mut state = checkpoint::State { step: 0, tokens: 0, elapsed_s: 0.0 };
    if let Some((step, path)) = checkpoint::list(&dir.path).pop() {
        state = checkpoint::load(&path, &vs, &mut opt)?;
        if !opts.quiet {
            eprintln!("resuming {} from step {step}", dir.path.display());
        }
    }

    let stream = Arc::new(TokenStream::open(&shards::ensure_prepared(&spec.data.train, &tok, spec.data.cache.as_ref().expect("resolved"), opts.quiet)?)?);
    let corpora = load_eval_corpora(&spec, &tok)?;
    let (steps, batch, accum, seq) = (spec.steps(), spec.batch_size(), spec.grad_accum(), spec.seq_len());
    let end = opts.stop_after.map_or(steps, |s| s.min(steps));
    let batches = prefetch(Batcher::new(stream, seq, spec.seed())?, state.step, end, batch, accum);

    let tokens_per_step = (batch * seq) as u64;
    let lr_max = spec.train.lr.expect("resolved");
    let lr_min = spec.train.min_lr.expect("resolved");
    let (warmup, decay) = (spec.warmup_steps(), spec.train.decay_steps.expect("resolved") as u64);
    let clip = spec.train.clip.expect("resolved");
    let log_every = spec.train.log_every.expect("resolved") as u64;
    let eval_every = spec.eval.every.expect("resolved") as u64;
    let ckpt_every = spec.checkpoint.every.expect("resolved") as u64;
    let keep = spec.checkpoint.keep.expect("resolved") as usize;

    let bar = crate::progress::bar(steps, "train", opts.quiet);
    bar.set_position(state.step);
    let session = Instant::now();
    let (mut last_log_t, mut last_log_step) = (Instant::now(), state.step);
    let elapsed = |state: &checkpoint::State| state.elapsed_s + session.elapsed().as_secs_f64();
    let mut last_tps = 0.0;
    for step in state.step..end {
        let lr = optim::learning_rate(step, lr_max, lr_min, warmup, decay);
        let micro = (0..accum).map(|_| batches.recv().map_err(|_| Error::Data("batch loader stopped".into())));
        let (loss_sum, norm) = step_once(&model, &mut opt, micro, autocast, clip, lr, device)?;
        let done = step + 1;
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
                let row = json!({"step": done, "tokens": state.tokens, "loss": loss, "lr": lr, "grad_norm": norm.double_value(&[]), "tokens_per_s": last_tps, "elapsed_s": elapsed(&state)});
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
    if end < steps {
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
/// the trainer, so data loading overlaps compute.
fn prefetch(mut batcher: Batcher, from: u64, to: u64, batch: usize, accum: usize) -> std::sync::mpsc::Receiver<(Tensor, Tensor)> {
    let (tx, rx) = std::sync::mpsc::sync_channel(2 * accum.max(2));
    std::thread::spawn(move || {
        for step in from..to {
            for micro in 0..accum {
                if tx.send(batcher.micro_batch(step, micro, batch, accum)).is_err() {
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

    /// Append one JSON object as a line of metrics.jsonl (flushed at once: nothing lost on a crash).
    pub fn append_metrics(&self, row: &Map<String, Value>) -> Result<()> {
        use std::io::Write;
        let p = self.metrics_path();
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&p).at(&p)?;
        writeln!(f, "{}", Value::Object(row.clone())).at(&p)
    }
}
