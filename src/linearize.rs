//! `attnlab linearize SPEC.yaml`: turn a softmax-attention Llama-family model (the teacher: Llama,
//! OLMo 2, or a DAR fine-tune of either) into a STILL or LoLCATs student (`student.rs`) in two stages (`../shared/specs/still.md` §8):
//! 1. attention transfer: teacher-forced, only the new attention parameters train, loss =
//!    1000 · mean over layers of MSE(student per-head output, teacher softmax output);
//! 2. LoRA on the attention projections with next-token cross-entropy, everything else frozen.
//!
//! Same run-directory contract as `train`: config.yaml (resolved spec; a different one is refused),
//! metrics.jsonl (rows carry `stage`), atomic checkpoints (`train::checkpoint`), exact resume, DONE.
//! At the end: `lora.safetensors` (adapters alone), `export/model.safetensors` (every weight, LoRA
//! merged) with `export/config.json` + `export/hybrid.yaml`, and `eval.json` (teacher vs student loss /
//! perplexity on held-out rows).
//!
//! Each stage evaluates its own loss on `val_rows` held-out rows every `eval_every` steps (rows
//! `stage: 1|2` with `val_loss` in metrics.jsonl) and, with `schedule: plateau`, steps
//! ReduceLROnPlateau on it (factor 0.1, patience 10, min 1e-5, as both reference codes).
//!
//! Simplifications: the last weights of each stage are kept (the references keep stage 2's best
//! validation checkpoint); held-out perplexity is over non-overlapping `seq_len` rows, not lm-eval's
//! rolling windows; no grad clipping (as the reference code).
pub mod student;

use crate::attention::Variant;
pub use crate::data::chat::read_alpaca;
use crate::data::tokenizer::{bos_id, eos_id};
use crate::data::Tok;
use crate::model::llama::Pass;
use crate::model::{Llama, LlamaConfig};
use crate::spec::{SourceSpec, TokenizerSpec};
use crate::lora::LoraConfig;
use crate::student_export::{teacher_tokenizer, EXPORT_DIR};
use crate::train::optim::Hyper;
use crate::train::schedule::Schedule;
use crate::train::stage_spec::StageDefaults;
use crate::train::stages::{self, StagedTask};
use crate::{Error, IoContext, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use tch::{nn::VarStore, Device, Kind, Tensor};

/// The linearize spec (YAML).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinearizeSpec {
    /// Human-readable run name (sweeps set it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A local HF Llama / OLMo 2 folder (DAR ones included), `hf:owner/name`, a llama `.gguf` file or
    /// `gguf:NAME`, or an attnlab run directory of a llama flavor or a finetune run.
    pub teacher: String,
    /// Default: the teacher folder's tokenizer.json, or the run directory's tokenizer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerSpec>,
    /// A registered hybrid with its options: `{kind: still, chunk: 64, …}`, `{kind: lolcats, window: 64, …}`, …
    pub attention: Variant,
    pub data: LinData,
    #[serde(default = "stage1_default")]
    pub stage1: StageSpec,
    #[serde(default = "stage2_default")]
    pub stage2: StageSpec,
    #[serde(default)]
    pub lora: LoraConfig,
    #[serde(default)]
    pub train: LinTrain,
    #[serde(default)]
    pub checkpoint: LinCheckpoint,
    pub output: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinData {
    pub train: TrainData,
    /// Held-out plain text for the final teacher-vs-student perplexity. Default: `val_rows` rows held
    /// out from the training rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<SourceSpec>,
    /// Tokens per training row (1024).
    #[serde(default = "default_seq")]
    pub seq_len: usize,
    /// Rows per optimizer step (8 = micro 1 × accumulation 8 of the reference).
    #[serde(default = "default_batch")]
    pub batch_size: usize,
    /// Rows per forward pass (default: batch_size); the gradients of batch_size / micro_batch
    /// passes accumulate into one step, equal to the whole batch's. Lower it where a step's
    /// activations do not fit (the reference runs 1; a 135M teacher at 8 × 1024 needs > 24 GB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch: Option<usize>,
    /// Use only the first N examples / documents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_examples: Option<usize>,
    /// Rows held out for the final evaluation when `eval` is not given.
    #[serde(default = "default_val_rows")]
    pub val_rows: usize,
    /// Cap on the evaluated rows.
    #[serde(default = "default_eval_rows")]
    pub eval_rows: usize,
}

/// Training data: Alpaca-format instructions (`{alpaca: PATH}`, JSON array or JSON lines with
/// instruction / input / output; `hf:owner/name[:file]` fetches a hub dataset file, default
/// `hf:yahma/alpaca-cleaned` = its `alpaca_data_cleaned.json`), any plain-text source of `crate::data`,
/// or a list of these (their examples together, e.g. prose plus Alpaca).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TrainData {
    Alpaca { alpaca: PathBuf },
    Text(SourceSpec),
    Mix(Vec<TrainData>),
}

/// A linearize stage (`stage1:` / `stage2:`): the trainer's stage keys (`train::stage_spec`) with
/// linearize's defaults: two epochs; `schedule: plateau` (ReduceLROnPlateau on the held-out stage
/// loss, factor 0.1, patience 10, min 1e-5, as both reference codes) or `constant` (or linear /
/// cosine after a `warmup`); lr stage 1 1e-2, stage 2 1e-4; weight decay STILL 0.01, LoLCATs 0;
/// held-out evaluation every `eval_every` updates: STILL 200, LoLCATs 100. `params` is finetune's.
pub type StageSpec = crate::train::stage_spec::StageSpec<LinStageDefaults>;

#[derive(Debug, Clone, PartialEq)]
pub struct LinStageDefaults;

impl StageDefaults for LinStageDefaults {
    fn epochs() -> f64 {
        2.0
    }
    fn warmup() -> f64 {
        0.0
    }
    fn schedule() -> Schedule {
        Schedule::Plateau
    }
    fn omit_warmup(w: &f64) -> bool {
        *w == 0.0
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinTrain {
    #[serde(default = "default_device")]
    pub device: String,
    #[serde(default)]
    pub seed: u64,
    #[serde(default = "default_log_every")]
    pub log_every: u64,
}

impl Default for LinTrain {
    fn default() -> Self {
        serde_yaml::from_str("{}").expect("defaults")
    }
}

/// `checkpoint:` (every 200 updates, keep 2).
pub type LinCheckpoint = crate::train::stage_spec::CheckpointSpec;

fn stage1_default() -> StageSpec {
    StageSpec::default()
}
fn stage2_default() -> StageSpec {
    stage1_default()
}
fn default_seq() -> usize {
    1024
}
fn default_batch() -> usize {
    8
}
fn default_val_rows() -> usize {
    8
}
fn default_eval_rows() -> usize {
    64
}
fn default_device() -> String {
    "auto".into()
}
fn default_log_every() -> u64 {
    10
}

impl LinearizeSpec {
    pub fn from_yaml(text: &str) -> Result<LinearizeSpec> {
        serde_yaml::from_str(&crate::run_kind::RunKind::Linearize.strip(text)).map_err(|e| Error::Other(format!("linearize spec: {e}")))
    }

    pub fn from_file(path: &Path) -> Result<LinearizeSpec> {
        Self::from_file_with(path, &[])
    }

    /// Read a spec and apply `--set key=value` overrides (values are YAML, as for `attnlab train`).
    pub fn from_file_with(path: &Path, sets: &[String]) -> Result<LinearizeSpec> {
        crate::spec::read_with_overrides(path, sets)
    }

    /// Fill in the per-stage defaults that depend on the stage / variant (lr, weight decay).
    pub fn resolved(mut self) -> LinearizeSpec {
        let wd = self.attention.weight_decay();
        self.stage1.lr.get_or_insert(1e-2);
        self.stage2.lr.get_or_insert(1e-4);
        self.stage1.weight_decay.get_or_insert(wd);
        self.stage2.weight_decay.get_or_insert(wd);
        let every = self.attention.eval_every();
        self.stage1.eval_every.get_or_insert(every);
        self.stage2.eval_every.get_or_insert(every);
        self
    }

    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).expect("serializes")
    }
}

// ---------------------------------------------------------------------------------------------
// Data
// ---------------------------------------------------------------------------------------------

/// One packed row: `inputs` and `targets` (`-100` = not scored), both `seq_len` long.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub inputs: Vec<i64>,
    pub targets: Vec<i64>,
}

pub const IGNORE: i64 = -100;

/// The Alpaca prompt (§8).
pub fn alpaca_prompt(instruction: &str, input: &str) -> String {
    if input.is_empty() {
        format!("Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
    } else {
        format!("Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
    }
}

/// (tokens, labels) of one example: [BOS] prompt answer EOS, labels −100 on BOS and the prompt.
pub fn alpaca_example(prompt: &[u32], answer: &[u32], bos: Option<u32>, eos: u32) -> (Vec<i64>, Vec<i64>) {
    let mut toks: Vec<i64> = bos.into_iter().chain(prompt.iter().copied()).map(|t| t as i64).collect();
    let mut labels = vec![IGNORE; toks.len()];
    for &t in answer.iter().chain(std::iter::once(&eos)) {
        toks.push(t as i64);
        labels.push(t as i64);
    }
    (toks, labels)
}

/// Concatenate examples and cut into rows of `seq_len + 1` tokens (no attention reset); each row gives
/// inputs = tokens[..seq_len] and targets = labels[1..]. The tail is dropped, as are rows with no
/// scored target.
pub fn pack(examples: &[(Vec<i64>, Vec<i64>)], seq_len: usize) -> Vec<Row> {
    let toks: Vec<i64> = examples.iter().flat_map(|e| e.0.iter().copied()).collect();
    let labels: Vec<i64> = examples.iter().flat_map(|e| e.1.iter().copied()).collect();
    let n = seq_len + 1;
    (0..toks.len() / n)
        .map(|r| Row { inputs: toks[r * n..r * n + seq_len].to_vec(), targets: labels[r * n + 1..(r + 1) * n].to_vec() })
        .filter(|row| row.targets.iter().any(|&t| t != IGNORE))
        .collect()
}

/// The local file of an Alpaca source: the path itself, or a hub dataset file for `hf:owner/name[:file]`.
pub fn alpaca_file(path: &Path) -> Result<PathBuf> {
    let text = path.to_string_lossy();
    let Some(repo) = text.strip_prefix("hf:") else {
        return Ok(path.to_path_buf());
    };
    let (repo, file) = match repo.split_once(':') {
        Some((r, f)) => (r, f),
        None if repo == "yahma/alpaca-cleaned" => (repo, "alpaca_data_cleaned.json"),
        None => return Err(Error::Data(format!("`{text}`: name the file in the dataset repo, as hf:{repo}:FILE"))),
    };
    crate::hub::dataset_file(repo, None, file)
}

/// Tokenised (tokens, labels) examples of the training data.
pub fn examples(data: &TrainData, tok: &Tok, max: Option<usize>) -> Result<Vec<(Vec<i64>, Vec<i64>)>> {
    let eos = eos_id(tok);
    let max = max.unwrap_or(usize::MAX);
    match data {
        TrainData::Alpaca { alpaca } => read_alpaca(&alpaca_file(alpaca)?)?
            .iter()
            .take(max)
            .map(|(ins, inp, out)| Ok(alpaca_example(&tok.encode(&alpaca_prompt(ins, inp))?, &tok.encode(out)?, bos_id(tok), eos)))
            .collect(),
        TrainData::Text(src) => text_examples(src, tok, max),
        // `max` bounds each part (a smoke run keeps some of every kind); the parts' examples alternate,
        // so that every packed row range holds all of them.
        TrainData::Mix(parts) => {
            let mut each: Vec<std::vec::IntoIter<_>> = parts.iter().map(|p| examples(p, tok, Some(max)).map(Vec::into_iter)).collect::<Result<_>>()?;
            let mut out = Vec::new();
            while each.iter().any(|e| e.len() > 0) {
                out.extend(each.iter_mut().filter_map(Iterator::next));
            }
            Ok(out)
        }
    }
}

/// Plain documents + EOS, every token scored.
fn text_examples(src: &SourceSpec, tok: &Tok, max: usize) -> Result<Vec<(Vec<i64>, Vec<i64>)>> {
    let eos = eos_id(tok) as i64;
    crate::data::sources::read_documents(src)?
        .iter()
        .take(max)
        .map(|d| {
            let mut t: Vec<i64> = tok.encode(&d.text)?.into_iter().map(|x| x as i64).collect();
            t.push(eos);
            Ok((t.clone(), t))
        })
        .collect()
}

fn batch(rows: &[&Row], device: Device) -> (Tensor, Tensor) {
    let t = rows[0].inputs.len() as i64;
    let x: Vec<i64> = rows.iter().flat_map(|r| r.inputs.iter().copied()).collect();
    let y: Vec<i64> = rows.iter().flat_map(|r| r.targets.iter().copied()).collect();
    (Tensor::from_slice(&x).view([-1, t]).to_device(device), Tensor::from_slice(&y).view([-1, t]).to_device(device))
}

// ---------------------------------------------------------------------------------------------
// Teacher
// ---------------------------------------------------------------------------------------------

/// The teacher's VarStore, config and tokenizer.
pub fn load_teacher(teacher: &str, tokenizer: Option<&TokenizerSpec>, device: Device) -> Result<(VarStore, LlamaConfig, Tok)> {
    let local = Path::new(teacher);
    let (vs, cfg) = if local.join("config.yaml").is_file() && crate::run_kind::RunKind::of(local)? == crate::run_kind::RunKind::Finetune {
        // A fine-tuned model (DAR or not): its export folder.
        let (vs, m) = crate::model::hf::load_llama(&local.join("export"), device)?;
        (vs, m.cfg.clone())
    } else if local.join("config.yaml").is_file() {
        let loaded = crate::train::run::load(local, None, Some(if device.is_cuda() { "cuda" } else { "cpu" }))?;
        let crate::model::Model::Llama(m) = loaded.model else {
            return Err(Error::Other(format!("{teacher}: the teacher must be a llama-flavor run")));
        };
        (loaded.vs, m.cfg.clone())
    } else {
        let (vs, m) = crate::model::load_pretrained(teacher, device)?;
        (vs, m.cfg.clone())
    };
    Ok((vs, cfg, teacher_tokenizer(teacher, tokenizer)?))
}

/// The teacher's tokenizer_config.json (chat template, special tokens) when it has one: a GGUF's
/// metadata, or the file beside a Hugging Face folder's weights or a finetune run's export.
fn teacher_tokenizer_config(teacher: &str) -> Result<Option<Value>> {
    if crate::model::gguf::is_gguf(teacher) {
        let g = crate::model::gguf::Gguf::open(&crate::model::gguf::resolve(teacher)?)?;
        return crate::model::gguf::tokenizer::tokenizer_config(&g).map(Some);
    }
    let local = Path::new(teacher);
    let candidates = [local.join("export").join("tokenizer_config.json"), local.join("tokenizer_config.json")];
    let Some(path) = candidates.into_iter().find(|p| p.is_file()) else { return Ok(None) };
    let text = std::fs::read_to_string(&path).at(&path)?;
    serde_json::from_str(&text).map(Some).map_err(|e| Error::Data(format!("{}: {e}", path.display())))
}

// ---------------------------------------------------------------------------------------------
// The two stages
// ---------------------------------------------------------------------------------------------

#[derive(Default, Clone)]
pub struct LinearizeOptions {
    pub quiet: bool,
    /// Stop (as if interrupted) after this many optimizer steps in total (both stages): resume tests.
    pub stop_after: Option<u64>,
}

#[derive(Debug)]
pub struct LinearizeOutcome {
    pub dir: PathBuf,
    /// Optimizer steps done, both stages.
    pub step: u64,
    pub already_done: bool,
    /// Final evaluation (null when stopped early).
    pub eval: serde_json::Value,
}

fn is_lora(name: &str) -> bool {
    name.ends_with(".lora_A") || name.ends_with(".lora_B")
}

// ---------------------------------------------------------------------------------------------
// Every call into the student (`student.rs`) that training makes is in this block (the
// parameters each stage trains, the loss of an update, the held-out losses).
// ---------------------------------------------------------------------------------------------

/// Whether parameter `name` trains in `stage`: the operators' own parameters in stage 1 (`added`:
/// what each layer's operator declares, `Llama::operator_params`), the LoRA adapters in stage 2.
fn trains(stage: u64, name: &str, added: &BTreeSet<String>) -> bool {
    if stage == 1 { added.contains(name) } else { is_lora(name) }
}

/// Make exactly the parameters of `stage` trainable; an optimizer over them (sorted by name).
#[cfg(test)]
fn optimizer_for(vs: &VarStore, student: &Llama, stage: u64, wd: f64) -> crate::train::optim::AdamW {
    let hyper = || Hyper { betas: (0.9, 0.999), eps: 1e-8, weight_decay: wd };
    let added = student.operator_params(vs);
    stages::optimizer_over(vs, |n| trains(stage, n, &added), hyper()).unwrap_or_else(|| crate::train::optim::AdamW::new(Vec::new(), hyper()))
}

/// Mean loss of teacher and student over rows (no grad): (teacher, student).
pub fn held_out_loss(h: &Llama, rows: &[Row], device: Device) -> (f64, f64) {
    tch::no_grad(|| {
        let (mut lt, mut ls, mut n) = (0.0, 0.0, 0.0);
        for r in rows {
            let (x, y) = batch(&[r], device);
            let w = y.ne(IGNORE).sum(Kind::Float).double_value(&[]);
            lt += h.masked_loss(&x, &y, Pass::Teacher).double_value(&[]) * w;
            ls += h.masked_loss(&x, &y, Pass::Eval).double_value(&[]) * w;
            n += w;
        }
        (lt / n.max(1.0), ls / n.max(1.0))
    })
}

/// Held-out loss of a stage (no grad): stage 1 the attention-transfer loss, stage 2 cross-entropy.
fn stage_loss(h: &Llama, rows: &[Row], stage: u64, device: Device) -> f64 {
    tch::no_grad(|| {
        let total: f64 = rows
            .iter()
            .map(|r| {
                let (x, y) = batch(&[r], device);
                if stage == 1 { h.attention_transfer_loss(&x).0 } else { h.masked_loss(&x, &y, Pass::Eval) }.double_value(&[])
            })
            .sum();
        total / rows.len().max(1) as f64
    })
}

/// What is specific to `linearize` in the trainer: stage 1 is attention transfer (teacher-forced
/// MSE of every layer's attention output), stage 2 next-token cross-entropy through the LoRA
/// adapters; evaluation is the stage's loss on the held-out rows (the plateau schedule steps on it).
struct LinearizeTask<'a> {
    spec: &'a LinearizeSpec,
    hybrid: &'a Llama,
    /// The names of the operators' parameters (stage 1's).
    added: BTreeSet<String>,
    rows: &'a [Row],
    val_rows: &'a [Row],
    device: Device,
}

impl StagedTask for LinearizeTask<'_> {
    fn trains(&self, stage: usize, name: &str) -> bool {
        trains(stage as u64, name, &self.added)
    }

    fn hyper(&self, stage: usize) -> Hyper {
        let s = if stage == 1 { &self.spec.stage1 } else { &self.spec.stage2 };
        Hyper { betas: (0.9, 0.999), eps: 1e-8, weight_decay: s.weight_decay.expect("resolved") }
    }

    fn step(&mut self, stage: usize, step: u64, log: bool) -> Result<(Tensor, Map<String, Value>)> {
        let b = self.spec.data.batch_size.max(1);
        let items = stages::step_items(self.rows, step, b, self.spec.train.seed, stage as u64);
        // Each micro-batch's mean loss weighted by its share of the batch (rows in stage 1, whose
        // loss is a mean over equal-sized rows; scored tokens in stage 2), so that the summed
        // gradient is the whole batch's.
        let scored = |rows: &[&Row]| rows.iter().map(|r| r.targets.iter().filter(|&&t| t != IGNORE).count()).sum::<usize>() as f64;
        let total = if stage == 1 { items.len() as f64 } else { scored(&items).max(1.0) };
        let (mut loss, mut per_layer) = (Tensor::zeros([], (Kind::Float, self.device)), None::<Tensor>);
        for micro in items.chunks(self.spec.data.micro_batch.unwrap_or(b).max(1)) {
            let (x, y) = batch(micro, self.device);
            let share = if stage == 1 { micro.len() as f64 } else { scored(micro) } / total;
            let l = if stage == 1 {
                let (l, per) = self.hybrid.attention_transfer_loss(&x);
                per_layer = Some(per_layer.map_or_else(|| &per * share, |acc| acc + &per * share));
                l
            } else {
                self.hybrid.masked_loss(&x, &y, Pass::Train)
            } * share;
            l.backward();
            loss += l.detach().to_kind(Kind::Float);
        }
        let mut extra = Map::new();
        if let (true, Some(per_layer)) = (log, per_layer) {
            let per: Vec<f64> = Vec::<f64>::try_from(&per_layer.to_kind(Kind::Double)).unwrap_or_default();
            extra.insert("attn_mse".into(), json!(per.iter().sum::<f64>() / per.len().max(1) as f64));
            extra.insert("attn_mse_per_layer".into(), json!(per));
        }
        Ok((loss, extra))
    }

    fn evaluate(&mut self, stage: usize, _at: &stages::Progress) -> Result<Option<stages::Evaluation>> {
        if self.val_rows.is_empty() {
            return Ok(None);
        }
        let val = stage_loss(self.hybrid, self.val_rows, stage as u64, self.device);
        Ok(Some(stages::Evaluation { val_loss: Some(val), row: Map::new() }))
    }
}

/// Run (or resume, or report finished) the linearization a spec describes.
pub fn linearize(spec: LinearizeSpec, opts: &LinearizeOptions) -> Result<LinearizeOutcome> {
    let device = crate::device::parse_device(&spec.train.device)?;
    let spec = spec.resolved();
    // Checked before the teacher loads (a GGUF takes a minute on a CPU).
    if spec.data.micro_batch == Some(0) {
        return Err(Error::Spec { file: "linearize spec".into(), key: "data.micro_batch".into(), line: None, msg: "rows per forward pass must be at least 1".into() });
    }
    for (key, s) in [("stage1", &spec.stage1), ("stage2", &spec.stage2)] {
        if s.params.is_some() {
            return Err(Error::Spec { file: "linearize spec".into(), key: format!("{key}.params"), line: None, msg: "linearize stages train fixed parameters (stage 1 the new attention, stage 2 the LoRA adapters)".into() });
        }
        if s.schedule == Schedule::Plateau && s.eval_every == Some(0) {
            return Err(Error::Spec { file: "linearize spec".into(), key: format!("{key}.eval_every"), line: None, msg: "`schedule: plateau` (the default) steps on the held-out loss: eval_every must be at least 1".into() });
        }
    }
    let (teacher_vs, cfg, tok) = load_teacher(&spec.teacher, spec.tokenizer.as_ref(), device)?;

    // Data: rows, a held-out part, and the steps per stage.
    let mut rows = pack(&examples(&spec.data.train, &tok, spec.data.max_examples)?, spec.data.seq_len);
    let eval_rows: Vec<Row> = match &spec.data.eval {
        Some(src) => pack(&text_examples(src, &tok, usize::MAX)?, spec.data.seq_len),
        None => rows.split_off(rows.len().saturating_sub(spec.data.val_rows.min(rows.len() / 2))),
    };
    let eval_rows = &eval_rows[..eval_rows.len().min(spec.data.eval_rows)];
    if rows.is_empty() {
        return Err(Error::Data(format!("not enough training data for one row of {} tokens", spec.data.seq_len)));
    }
    let too_big = rows.iter().chain(eval_rows).flat_map(|r| r.inputs.iter()).any(|&t| t as usize >= cfg.vocab_size);
    if too_big {
        return Err(Error::Data(format!("the tokenizer produces ids ≥ the teacher's vocabulary ({})", cfg.vocab_size)));
    }
    let b = spec.data.batch_size.max(1);
    let (s1, s2) = (spec.stage1.updates(rows.len(), b), spec.stage2.updates(rows.len(), b));
    let total = s1 + s2;

    // The device may change between sessions (a run started on one GPU resumes on another).
    let dir = stages::prepare_dir(&spec.output, &spec, |s| s.train.device = String::new(), "linearize")?;
    if let Some(eval) = stages::finished(&dir) {
        return Ok(LinearizeOutcome { dir: dir.path, step: total, already_done: true, eval });
    }

    tch::manual_seed(spec.train.seed as i64);
    let vs = VarStore::new(device);
    let hybrid = Llama::linearized(&vs, &teacher_vs, cfg.clone(), &spec.attention, &spec.lora)?;
    drop(teacher_vs);

    let val_rows = &eval_rows[..eval_rows.len().min(spec.data.val_rows.max(1))];
    // eval_every 0 (a schedule other than plateau): no held-out evaluation inside the stage.
    let stage_plan = |s: &StageSpec, steps: u64| stages::StagePlan { steps, lr: s.lr_rule(), eval_every: s.eval_every.expect("resolved") };
    let plan = stages::Plan {
        stages: vec![stage_plan(&spec.stage1, s1), stage_plan(&spec.stage2, s2)],
        // No gradient clipping, as the reference code.
        clip: 0.0,
        log_every: spec.train.log_every,
        checkpoint_every: spec.checkpoint.every,
        keep: spec.checkpoint.keep,
        tokens_per_step: (b * spec.data.seq_len) as u64,
        label: "linearize",
        quiet: opts.quiet,
        stop_after: opts.stop_after,
        rows: stages::Rows::Staged,
    };
    let mut task = LinearizeTask { spec: &spec, added: hybrid.operator_params(&vs), hybrid: &hybrid, rows: &rows, val_rows, device };
    let resume = crate::train::checkpoint::resume_point(&dir.path)?;
    let end = stages::run(&dir, &vs, &plan, &mut task, resume, None)?.end;
    if end < total {
        return Ok(LinearizeOutcome { dir: dir.path, step: end, already_done: false, eval: Value::Null });
    }

    // Outputs: adapters alone, the merged export, and the held-out evaluation.
    Tensor::write_safetensors(&hybrid.lora_weights(), dir.path.join("lora.safetensors"))?;
    let export = dir.path.join(EXPORT_DIR);
    hybrid.save_export(&vs, &export)?;
    // The tokenizer too, so that the folder alone can be loaded for generation.
    let tp = export.join("tokenizer.json");
    std::fs::write(&tp, tok.inner.to_string(false).map_err(|e| Error::Other(format!("tokenizer: {e}")))?).at(&tp)?;
    // And the teacher's chat template and special tokens, so that RULER / BABILong prompt the student
    // as they prompt the teacher (a chat model evaluated without its template is not comparable).
    if let Some(config) = teacher_tokenizer_config(&spec.teacher)? {
        let cp = export.join("tokenizer_config.json");
        std::fs::write(&cp, serde_json::to_string_pretty(&config)?).at(&cp)?;
    }
    let (lt, ls) = held_out_loss(&hybrid, eval_rows, device);
    let eval = json!({"step": total, "rows": eval_rows.len(), "seq_len": spec.data.seq_len,
        "teacher": {"loss": lt, "ppl": lt.exp()}, "student": {"loss": ls, "ppl": ls.exp()}});
    let mut row = Map::new();
    row.insert("step".into(), json!(total));
    row.insert("stage".into(), json!("eval"));
    for (k, v) in [("teacher_loss", lt), ("teacher_ppl", lt.exp()), ("student_loss", ls), ("student_ppl", ls.exp())] {
        row.insert(k.into(), json!(v));
    }
    dir.append_metrics(&row)?;
    let ep = dir.path.join("eval.json");
    std::fs::write(&ep, serde_json::to_string_pretty(&eval)?).at(&ep)?;
    dir.mark_done()?;
    Ok(LinearizeOutcome { dir: dir.path, step: total, already_done: false, eval })
}

#[cfg(test)]
mod tests;
