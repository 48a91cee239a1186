//! `attnlab finetune SPEC.yaml`: supervised fine-tuning of a pretrained Llama-family model on chat
//! data, optionally changing its attention to DAR, in two stages (`../shared/specs/dar.md` §4.2):
//! 1. only the bottleneck parameters (`W_down`, `W_up`) train, lr 3e-4, one epoch;
//! 2. every parameter trains, lr 3e-5, one epoch.
//!
//! Not given by the paper, chosen as dar.md's [C]: AdamW (0.9, 0.999), weight decay 0, linear
//! warmup over 3% of a stage's updates then linear decay to 0 (HF `get_linear_schedule_with_warmup`),
//! max length 4096, the model's own chat template, loss on assistant tokens only (`data::chat`).
//!
//! Same run-directory contract as `train` / `linearize` (`train::stages`): config.yaml (a different
//! config is refused), metrics.jsonl (rows carry `stage`; held-out loss before any update and after
//! each stage, rows with `at`), atomic checkpoints, exact resume, DONE. At the end: `eval.json` (base
//! vs fine-tuned held-out loss / perplexity on assistant tokens) and `export/` (an HF folder with
//! the tokenizer and the chat template).
pub mod dar_start;

use dar_start::BottleneckInit;
use crate::data::chat::{self, ChatSource, ChatTemplate, PackedRow, IGNORE};
use crate::data::Tok;
use crate::model::{Llama, LlamaConfig};
use crate::spec::{AttentionInit, AttentionSpec, Precision, TokenizerSpec};
use crate::train::optim::Hyper;
use crate::train::stage_spec::{CheckpointSpec, StageDefaults, StageSpec};
use crate::train::stages;
use crate::{Error, IoContext, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use tch::{nn::VarStore, Device, Kind, Tensor};

/// The finetune spec (YAML).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FinetuneSpec {
    /// A local HF Llama folder, `hf:owner/name`, a llama `.gguf` file or `gguf:NAME`, or an attnlab run
    /// directory of a llama flavor.
    pub base: String,
    /// Default: the base folder's tokenizer.json (a GGUF's own), or the run directory's tokenizer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerSpec>,
    /// `builtin` (Tülu format), a tokenizer_config.json, or a Jinja file. Default: the base folder's
    /// tokenizer_config.json `chat_template` (a GGUF's `tokenizer.chat_template`), else `builtin`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    /// The attention of the fine-tuned model, as the train spec writes it: `{kind: vanilla}` (the
    /// base model's, unchanged; the default) or DAR (dar.md §1) `{kind: dar, d_down, window: 128,
    /// init: small_init | pca, impl: auto}` (`AttentionSpec::resolve_finetune`).
    #[serde(default, with = "crate::spec::finetune_attention")]
    pub attention: AttentionSpec,
    pub data: FtData,
    #[serde(default = "stage1_default")]
    pub stage1: FtStage,
    #[serde(default = "stage2_default")]
    pub stage2: FtStage,
    #[serde(default)]
    pub train: FtTrain,
    #[serde(default)]
    pub checkpoint: CheckpointSpec,
    pub output: PathBuf,
}

/// What fine-tuning reads: conversations (loss on the assistant's tokens), plain text (`{text:
/// SOURCE}`, any text source of `crate::data`, e.g. `{text: {path: valid.jsonl.zst}}`: every token
/// scored, no chat template), or a list of these whose examples alternate (each part capped by
/// `max_examples`), so that every stretch of packed rows holds all of them.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum FtSource {
    Chat(ChatSource),
    Text { text: crate::spec::SourceSpec },
    Mix(Vec<FtSource>),
}

/// By its shape (a list, a mapping with `text`, any other mapping), so that a wrong entry is told
/// which forms there are and which keys it has, not "did not match any variant".
impl<'de> Deserialize<'de> for FtSource {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        const FORMS: &str = "a data source is conversations ({path: FILE, field: messages}, {hf: {repo, files}} or {alpaca: FILE}), plain text ({text: SOURCE}, e.g. {text: {path: FILE}}) or a list of these";
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Text {
            text: crate::spec::SourceSpec,
        }
        let v = serde_yaml::Value::deserialize(d)?;
        match v {
            serde_yaml::Value::Sequence(items) => items.into_iter().map(serde_yaml::from_value).collect::<std::result::Result<Vec<_>, _>>().map(FtSource::Mix).map_err(D::Error::custom),
            serde_yaml::Value::Mapping(ref m) => {
                let keys: Vec<String> = m.keys().map(|k| k.as_str().map_or_else(|| format!("{k:?}"), str::to_string)).collect();
                let bad = |e: serde_yaml::Error| {
                    // serde's own words for an untagged enum name no key; say which ones there are.
                    let e = e.to_string();
                    let what = if e.contains("did not match any variant") { "not a data source".to_string() } else { e };
                    D::Error::custom(format!("{what} (keys: {}); {FORMS}", keys.join(", ")))
                };
                if m.contains_key("text") {
                    serde_yaml::from_value::<Text>(v).map(|t| FtSource::Text { text: t.text }).map_err(bad)
                } else {
                    serde_yaml::from_value::<ChatSource>(v).map(FtSource::Chat).map_err(bad)
                }
            }
            other => Err(D::Error::custom(format!("{other:?}: {FORMS}"))),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FtData {
    /// Conversations: `{path: FILE|DIR, field: messages}`, `{hf: {repo, files, revision, field}}` or
    /// `{alpaca: FILE}`; plain text `{text: SOURCE}`; or a list of these (`FtSource`).
    pub train: FtSource,
    /// Held-out data, as `train`. Default: `val_rows` packed rows held out from the training rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<FtSource>,
    /// Tokens per packed row (4096).
    #[serde(default = "default_seq")]
    pub seq_len: usize,
    /// Rows per optimizer step (8).
    #[serde(default = "default_batch")]
    pub batch_size: usize,
    /// Rows per forward pass (default: batch_size); gradients accumulate over batch_size / micro_batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch: Option<usize>,
    /// Use only the first N conversations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_examples: Option<usize>,
    #[serde(default = "default_val_rows")]
    pub val_rows: usize,
    /// Cap on the evaluated rows.
    #[serde(default = "default_eval_rows")]
    pub eval_rows: usize,
    /// Training rows the `pca` bottleneck initialisation reads.
    #[serde(default = "default_calibration_rows")]
    pub calibration_rows: usize,
}

pub use crate::train::schedule::{stage_lr, Schedule};

/// A finetune stage (`stage1:` / `stage2:`): the trainer's stage keys (`train::stage_spec`) with
/// finetune's defaults: one epoch, warmup over 3% of the updates, then linear decay to 0 (dar.md
/// [C]); lr stage 1 3e-4, stage 2 3e-5; weight decay 0; trainable parameters (`params`):
/// `bottleneck` (stage 1), `all` (stage 2), or a regex over parameter names (e.g. `self_attn`).
pub type FtStage = StageSpec<FtStageDefaults>;

#[derive(Debug, Clone, PartialEq)]
pub struct FtStageDefaults;

impl StageDefaults for FtStageDefaults {
    fn epochs() -> f64 {
        1.0
    }
    fn warmup() -> f64 {
        0.03
    }
    fn schedule() -> Schedule {
        Schedule::Linear
    }
    fn omit_plateau_keys() -> bool {
        true
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FtTrain {
    #[serde(default = "default_device")]
    pub device: String,
    #[serde(default)]
    pub seed: u64,
    #[serde(default = "default_log_every")]
    pub log_every: u64,
    /// Gradient-norm clipping (1.0; 0 = none).
    #[serde(default = "default_clip")]
    pub clip: f64,
    /// bf16 autocast on CUDA (`auto`), or fp32.
    #[serde(default)]
    pub precision: Precision,
}

impl Default for FtTrain {
    fn default() -> Self {
        serde_yaml::from_str("{}").expect("defaults")
    }
}

fn stage1_default() -> FtStage {
    FtStage::default()
}
fn stage2_default() -> FtStage {
    FtStage::default()
}
fn default_seq() -> usize {
    4096
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
fn default_calibration_rows() -> usize {
    8
}
fn default_device() -> String {
    "auto".into()
}
fn default_log_every() -> u64 {
    10
}
fn default_clip() -> f64 {
    1.0
}

impl FinetuneSpec {
    pub fn from_yaml(text: &str) -> Result<FinetuneSpec> {
        serde_yaml::from_str(&crate::run_kind::RunKind::Finetune.strip(text)).map_err(|e| Error::Other(format!("finetune spec: {e}")))
    }

    /// Read a spec file with `--set key.path=value` overrides applied.
    pub fn from_file(path: &Path, sets: &[String]) -> Result<FinetuneSpec> {
        crate::spec::read_with_overrides(path, sets)
    }

    /// Fill in the per-stage defaults (lr, trainable parameters).
    pub fn resolved(mut self) -> FinetuneSpec {
        self.stage1.lr.get_or_insert(3e-4);
        self.stage2.lr.get_or_insert(3e-5);
        self.stage1.params.get_or_insert_with(|| "bottleneck".into());
        self.stage2.params.get_or_insert_with(|| "all".into());
        self.stage1.weight_decay.get_or_insert(0.0);
        self.stage2.weight_decay.get_or_insert(0.0);
        self
    }

    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).expect("serializes")
    }
}

/// Parameter selection of a stage: `bottleneck`, `all`, or a regex.
enum Params {
    Bottleneck,
    All,
    Regex(regex::Regex),
}

impl Params {
    fn parse(s: &str, key: &str) -> Result<Params> {
        Ok(match s {
            "bottleneck" => Params::Bottleneck,
            "all" => Params::All,
            r => Params::Regex(regex::Regex::new(r).map_err(|e| Error::Spec { file: "finetune spec".into(), key: key.into(), line: None, msg: e.to_string() })?),
        })
    }

    fn matches(&self, name: &str) -> bool {
        match self {
            Params::Bottleneck => is_bottleneck_param(name),
            Params::All => true,
            Params::Regex(r) => r.is_match(name),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Swap point: the DAR pieces the olmo branch adds to `crate::model`. Everything DAR-specific that
// finetune needs goes through these three functions.
// ---------------------------------------------------------------------------------------------

fn is_bottleneck_param(name: &str) -> bool {
    crate::attention::is_bottleneck_param(name)
}

/// The model to fine-tune, under `vs`, from the base weights, with the attention (resolved by
/// `AttentionSpec::resolve_finetune`) applied (DAR: bottlenecks initialised by `init`, `pca` over
/// the calibration rows).
fn build_model(vs: &VarStore, base: &VarStore, cfg: &LlamaConfig, attention: &AttentionSpec, calibration: &[&PackedRow]) -> Result<Llama> {
    let mut m = Llama::new(&vs.root(), cfg.clone());
    crate::model::weights::copy_into(vs, base.variables(), Path::new("base model"))?;
    if attention.has_bottleneck() {
        let init = match attention.init().unwrap_or_default() {
            AttentionInit::SmallInit => BottleneckInit::SmallInit,
            AttentionInit::Pca => BottleneckInit::Pca,
            other => return Err(Error::Other(format!("attention.init: {} cannot start a pretrained model's bottleneck (small_init or pca)", other.name()))),
        };
        let device = vs.device();
        let calib = (!calibration.is_empty()).then(|| batch(calibration, device));
        let discarded = dar_start::add_dar_to_pretrained(&mut m, &vs.root(), attention.clone(), init, calib.as_ref().map(|c| &c[0]), calib.as_ref().map(|c| &c[2]))?;
        if !discarded.is_empty() {
            eprintln!("pca: discarded second-moment fraction per layer {discarded:?}");
        }
    }
    Ok(m)
}

fn hidden(model: &Llama, ids: &Tensor, doc_ids: &Tensor, positions: &Tensor) -> Tensor {
    let _ = positions;
    model.hidden_docs(ids, Some(doc_ids))
}

// ---------------------------------------------------------------------------------------------
// Loss and evaluation
// ---------------------------------------------------------------------------------------------

/// (inputs, targets, doc_ids, positions) `[B, T]` of rows.
fn batch(rows: &[&PackedRow], device: Device) -> [Tensor; 4] {
    let t = rows[0].inputs.len() as i64;
    let cat = |f: fn(&PackedRow) -> &Vec<i64>| Tensor::from_slice(&rows.iter().flat_map(|r| f(r).iter().copied()).collect::<Vec<_>>()).view([-1, t]).to_device(device);
    [cat(|r| &r.inputs), cat(|r| &r.targets), cat(|r| &r.doc_ids), cat(|r| &r.positions)]
}

fn scored(rows: &[&PackedRow]) -> usize {
    rows.iter().map(|r| r.targets.iter().filter(|&&t| t != IGNORE).count()).sum()
}

/// Mean cross-entropy over the scored (assistant) targets of `rows`.
fn loss(model: &Llama, rows: &[&PackedRow], device: Device) -> Tensor {
    let [x, y, doc, pos] = batch(rows, device);
    let h = hidden(model, &x, &doc, &pos).flatten(0, 1);
    let y = y.reshape([-1]);
    let keep = y.ne(IGNORE).nonzero().squeeze_dim(1);
    crate::model::loss::chunked_cross_entropy(&h.index_select(0, &keep), model.head_weight(), &y.index_select(0, &keep), crate::model::loss::LOSS_CHUNK)
}

/// Mean loss per scored token over `rows` (no grad), one row at a time.
pub fn held_out_loss(model: &Llama, rows: &[PackedRow], device: Device, autocast: bool) -> f64 {
    tch::no_grad(|| {
        let (mut sum, mut n) = (0.0, 0usize);
        for r in rows {
            let k = scored(&[r]);
            if k > 0 {
                sum += crate::kernels::autocast(autocast, || loss(model, &[r], device)).double_value(&[]) * k as f64;
                n += k;
            }
        }
        sum / n.max(1) as f64
    })
}

// ---------------------------------------------------------------------------------------------
// Base model, tokenizer, template
// ---------------------------------------------------------------------------------------------

/// The chat template a spec asks for (see `FinetuneSpec::chat_template`).
pub fn chat_template(spec: &FinetuneSpec, tok: &Tok) -> Result<ChatTemplate> {
    let eos = tok.inner.id_to_token(crate::data::tokenizer::eos_id(tok)).unwrap_or_default();
    match spec.chat_template.as_deref() {
        Some("builtin") => Ok(ChatTemplate::builtin(&eos)),
        Some(p) if p.ends_with(".json") => {
            ChatTemplate::from_tokenizer_config(Path::new(p))?.ok_or_else(|| Error::Data(format!("{p}: no chat_template")))
        }
        Some(p) => ChatTemplate::new(&std::fs::read_to_string(p).at(p)?, "", &eos),
        None => {
            if crate::model::gguf::is_gguf(&spec.base) {
                let g = crate::model::gguf::Gguf::open(&crate::model::gguf::resolve(&spec.base)?)?;
                return Ok(crate::model::gguf::tokenizer::chat_template(&g)?.unwrap_or_else(|| ChatTemplate::builtin(&eos)));
            }
            let config = if Path::new(&spec.base).join("config.yaml").is_file() {
                None
            } else if let Some(repo) = spec.base.strip_prefix("hf:") {
                crate::hub::model_file(repo, "tokenizer_config.json").ok()
            } else {
                Some(Path::new(&spec.base).join("tokenizer_config.json")).filter(|p| p.is_file())
            };
            match config {
                Some(p) => Ok(ChatTemplate::from_tokenizer_config(&p)?.unwrap_or_else(|| ChatTemplate::builtin(&eos))),
                None => Ok(ChatTemplate::builtin(&eos)),
            }
        }
    }
}

/// Packed rows of a source.
fn rows_of(src: &FtSource, max: Option<usize>, template: &ChatTemplate, tok: &Tok, eos: u32, seq_len: usize) -> Result<(Vec<PackedRow>, chat::PackStats)> {
    Ok(chat::pack(&encoded(src, max.unwrap_or(usize::MAX), template, tok, eos)?, seq_len, eos as i64))
}

/// The tokenised examples of a source, at most `max` of each part.
fn encoded(src: &FtSource, max: usize, template: &ChatTemplate, tok: &Tok, eos: u32) -> Result<Vec<chat::Encoded>> {
    match src {
        FtSource::Chat(c) => chat::read_conversations(c)?.iter().take(max).map(|c| chat::encode(c, template, tok, eos)).collect(),
        FtSource::Text { text } => crate::data::sources::read_documents(text)?
            .iter()
            .take(max)
            .map(|d| {
                let mut tokens: Vec<i64> = tok.encode(&d.text)?.into_iter().map(i64::from).collect();
                tokens.push(eos as i64);
                Ok(chat::Encoded { labels: tokens.clone(), tokens })
            })
            .collect(),
        FtSource::Mix(parts) => {
            let mut each: Vec<std::vec::IntoIter<chat::Encoded>> = parts.iter().map(|p| encoded(p, max, template, tok, eos).map(Vec::into_iter)).collect::<Result<_>>()?;
            let mut out = Vec::new();
            while each.iter().any(|e| e.len() > 0) {
                out.extend(each.iter_mut().filter_map(Iterator::next));
            }
            Ok(out)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------------------------

#[derive(Default, Clone)]
pub struct FinetuneOptions {
    pub quiet: bool,
    /// Stop (as if interrupted) after this many optimizer steps in total (both stages): resume tests.
    pub stop_after: Option<u64>,
}

#[derive(Debug)]
pub struct FinetuneOutcome {
    pub dir: PathBuf,
    pub step: u64,
    pub already_done: bool,
    /// Final evaluation (null when stopped early).
    pub eval: Value,
}

struct Task<'a> {
    spec: &'a FinetuneSpec,
    model: &'a Llama,
    rows: &'a [PackedRow],
    eval_rows: &'a [PackedRow],
    params: [Params; 2],
    autocast: bool,
    device: Device,
}

impl Task<'_> {
    fn stage(&self, stage: usize) -> &FtStage {
        if stage == 1 { &self.spec.stage1 } else { &self.spec.stage2 }
    }
}

impl stages::StagedTask for Task<'_> {
    fn trains(&self, stage: usize, name: &str) -> bool {
        self.params[stage - 1].matches(name)
    }

    fn hyper(&self, stage: usize) -> Hyper {
        Hyper { betas: (0.9, 0.999), eps: 1e-8, weight_decay: self.stage(stage).weight_decay.expect("resolved") }
    }

    /// One update: micro-batches weighted by their share of the scored tokens, so the gradient is
    /// that of the mean over every scored token of the batch.
    fn step(&mut self, stage: usize, step: u64, _log: bool) -> Result<(Tensor, Map<String, Value>)> {
        let b = self.spec.data.batch_size.max(1);
        let rows = stages::step_items(self.rows, step, b, self.spec.train.seed, stage as u64);
        let total = scored(&rows).max(1) as f64;
        let mut sum = Tensor::zeros([], (Kind::Float, self.device));
        for micro in rows.chunks(self.spec.data.micro_batch.unwrap_or(b).max(1)) {
            let share = scored(micro) as f64 / total;
            if share == 0.0 {
                continue;
            }
            let l = crate::kernels::autocast(self.autocast, || loss(self.model, micro, self.device)) * share;
            l.backward();
            sum += l.detach().to_kind(Kind::Float);
        }
        Ok((sum, Map::new()))
    }

    /// With `schedule: plateau`: the held-out loss every `eval_every` updates.
    fn evaluate(&mut self, _stage: usize, _at: &stages::Progress) -> Result<Option<stages::Evaluation>> {
        let l = held_out_loss(self.model, self.eval_rows, self.device, self.autocast);
        Ok(Some(stages::Evaluation { val_loss: Some(l), row: Map::new() }))
    }

    fn at_boundary(&mut self, _step: u64) -> Result<Option<Map<String, Value>>> {
        let l = held_out_loss(self.model, self.eval_rows, self.device, self.autocast);
        let row = json!({"stage": "eval", "eval_loss": l, "eval_ppl": l.exp()});
        Ok(row.as_object().cloned())
    }
}

/// Held-out rows logged with `at` (before training, after each stage), last row per `at` wins.
fn boundary_losses(dir: &Path) -> Value {
    let mut out = Map::new();
    for (_, row) in crate::train::metrics::read(&dir.join("metrics.jsonl")).map(|r| r.rows).unwrap_or_default() {
        let v = Value::Object(row);
        if let (Some(at), Some(l)) = (v.get("at").and_then(|a| a.as_str()), v.get("eval_loss").and_then(|l| l.as_f64())) {
            out.insert(at.to_string(), json!({"step": v["step"], "loss": l, "ppl": l.exp()}));
        }
    }
    Value::Object(out)
}

/// Run (or resume, or report finished) the fine-tuning a spec describes.
pub fn finetune(spec: FinetuneSpec, opts: &FinetuneOptions) -> Result<FinetuneOutcome> {
    let spec = spec.resolved();
    let device = crate::device::parse_device(&spec.train.device)?;
    let autocast = match (spec.train.precision, device.is_cuda()) {
        (Precision::Fp32, _) | (Precision::Auto, false) => false,
        (_, true) => {
            crate::kernels::set_autocast_bf16()?;
            true
        }
        (Precision::Bf16, false) => return Err(Error::Other("train.precision bf16 needs a CUDA device".into())),
    };
    let params = [Params::parse(spec.stage1.params.as_deref().expect("resolved"), "stage1.params")?, Params::parse(spec.stage2.params.as_deref().expect("resolved"), "stage2.params")?];
    let (base_vs, cfg, tok) = crate::linearize::load_teacher(&spec.base, spec.tokenizer.as_ref(), device)?;
    let template = chat_template(&spec, &tok)?;
    let eos = tok.inner.token_to_id(&template.eos_token).unwrap_or_else(|| crate::data::tokenizer::eos_id(&tok));

    // Data: packed rows, a held-out part, and the updates per stage.
    let (mut rows, stats) = rows_of(&spec.data.train, spec.data.max_examples, &template, &tok, eos, spec.data.seq_len)?;
    let eval_rows: Vec<PackedRow> = match &spec.data.eval {
        Some(src) => rows_of(src, None, &template, &tok, eos, spec.data.seq_len)?.0,
        None => rows.split_off(rows.len().saturating_sub(spec.data.val_rows.min(rows.len() / 2))),
    };
    let eval_rows = &eval_rows[..eval_rows.len().min(spec.data.eval_rows)];
    if rows.is_empty() {
        return Err(Error::Data(format!("no training row: {} examples, {} without a scored token", stats.conversations, stats.dropped)));
    }
    if rows.iter().chain(eval_rows).flat_map(|r| &r.inputs).any(|&t| t as usize >= cfg.vocab_size) {
        return Err(Error::Data(format!("the tokenizer produces ids ≥ the base model's vocabulary ({})", cfg.vocab_size)));
    }
    let b = spec.data.batch_size.max(1);
    let steps = [spec.stage1.updates(rows.len(), b), spec.stage2.updates(rows.len(), b)];
    for (key, s) in [("stage1", &spec.stage1), ("stage2", &spec.stage2)] {
        if s.schedule == Schedule::Plateau && s.eval_every.unwrap_or(0) == 0 {
            return Err(Error::Spec { file: "finetune spec".into(), key: format!("{key}.eval_every"), line: None, msg: "`schedule: plateau` steps on the held-out loss: set eval_every".into() });
        }
    }
    let total = steps[0] + steps[1];

    let dir = stages::prepare_dir(&spec.output, &spec, |s| s.train.device = String::new(), "finetune")?;
    if let Some(eval) = stages::finished(&dir) {
        return Ok(FinetuneOutcome { dir: dir.path, step: total, already_done: true, eval });
    }
    let tp = dir.path.join("chat_template.jinja");
    std::fs::write(&tp, &template.source).at(&tp)?;
    if !opts.quiet {
        eprintln!("finetune: {} examples → {} training rows, {} held-out rows ({} cut, {} without a scored token); {}+{} updates", stats.conversations, rows.len(), eval_rows.len(), stats.truncated, stats.dropped, steps[0], steps[1]);
    }

    tch::manual_seed(spec.train.seed as i64);
    let vs = VarStore::new(device);
    let calibration: Vec<&PackedRow> = rows.iter().take(spec.data.calibration_rows).collect();
    let model = build_model(&vs, &base_vs, &cfg, &spec.attention, &calibration)?;
    let stage_plan = |s: &FtStage, steps: u64| stages::StagePlan { steps, lr: s.lr_rule(), eval_every: s.eval_every.unwrap_or(0) };
    let plan = stages::Plan {
        stages: vec![stage_plan(&spec.stage1, steps[0]), stage_plan(&spec.stage2, steps[1])],
        clip: spec.train.clip,
        log_every: spec.train.log_every,
        checkpoint_every: spec.checkpoint.every,
        keep: spec.checkpoint.keep,
        tokens_per_step: (b * spec.data.seq_len) as u64,
        label: "finetune",
        quiet: opts.quiet,
        stop_after: opts.stop_after,
        rows: stages::Rows::Staged,
    };
    let mut task = Task { spec: &spec, model: &model, rows: &rows, eval_rows, params, autocast, device };
    let resume = crate::train::checkpoint::resume_point(&dir.path)?;
    let end = stages::run(&dir, &vs, &plan, &mut task, resume, None)?.end;
    if end < total {
        return Ok(FinetuneOutcome { dir: dir.path, step: end, already_done: false, eval: Value::Null });
    }

    // Held-out evaluation: the base model as loaded vs the fine-tuned one.
    let tuned = held_out_loss(&model, eval_rows, device, autocast);
    let base_eval_vs = VarStore::new(device);
    let base_model = build_model(&base_eval_vs, &base_vs, &cfg, &AttentionSpec::vanilla(), &[])?;
    let base = held_out_loss(&base_model, eval_rows, device, autocast);
    let eval = json!({"step": total, "rows": eval_rows.len(), "seq_len": spec.data.seq_len,
        "scored_tokens": eval_rows.iter().map(|r| scored(&[r])).sum::<usize>(),
        "base": {"loss": base, "ppl": base.exp()}, "finetuned": {"loss": tuned, "ppl": tuned.exp()},
        "during": boundary_losses(&dir.path)});
    let row = json!({"step": total, "stage": "eval", "base_loss": base, "base_ppl": base.exp(), "finetuned_loss": tuned, "finetuned_ppl": tuned.exp()});
    dir.append_metrics(row.as_object().expect("object"))?;
    // The model's own config: with DAR it carries `attnlab_attention`, so the folder loads back as DAR.
    export(&dir.path.join("export"), &vs, &model.cfg, &tok, &template)?;
    let ep = dir.path.join("eval.json");
    std::fs::write(&ep, serde_json::to_string_pretty(&eval)?).at(&ep)?;
    dir.mark_done()?;
    Ok(FinetuneOutcome { dir: dir.path, step: total, already_done: false, eval })
}

/// An HF folder: config.json (with `attnlab_attention` for DAR, which no HF architecture has),
/// model.safetensors, tokenizer.json and a tokenizer_config.json with the chat template.
fn export(dir: &Path, vs: &VarStore, cfg: &LlamaConfig, tok: &Tok, template: &ChatTemplate) -> Result<()> {
    crate::model::hf::save_llama(vs, cfg, dir)?;
    let tp = dir.join("tokenizer.json");
    tok.inner.save(&tp, false).map_err(|e| Error::Tokenizer(format!("{}: {e}", tp.display())))?;
    let tc = json!({"chat_template": template.source, "bos_token": template.bos_token, "eos_token": template.eos_token});
    let cp = dir.join("tokenizer_config.json");
    std::fs::write(&cp, serde_json::to_string_pretty(&tc)?).at(&cp)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{AttentionImpl, AttentionKind};

    /// config.yaml of a finetune run directory written before the attention became the spec's
    /// `AttentionSpec` (attnlab at 71effca, `attnlab config` of a DAR spec with `init: pca`).
    const OLD_CONFIG: &str = "command: finetune\nbase: some/llama\nattention:\n  kind: dar\n  d_down: 16\n  window: 8\n  init: pca\ndata:\n  train:\n    path: chat.jsonl\n    field: messages\n  seq_len: 4096\n  batch_size: 8\n  val_rows: 8\n  eval_rows: 64\n  calibration_rows: 8\nstage1:\n  epochs: 1.0\n  lr: 0.0003\n  weight_decay: 0.0\n  warmup: 0.03\n  schedule: linear\n  params: bottleneck\nstage2:\n  epochs: 1.0\n  lr: 0.00003\n  weight_decay: 0.0\n  warmup: 0.03\n  schedule: linear\n  params: all\ntrain:\n  device: auto\n  seed: 0\n  log_every: 10\n  clip: 1.0\n  precision: auto\ncheckpoint:\n  every: 200\n  keep: 2\noutput: OUT\n";

    /// `data.train` as a list of plain text and Alpaca: parsed, written back as given, and encoded
    /// with the parts alternating, prose scored on every token and Alpaca on its answer only.
    #[test]
    fn prose_and_instructions_mix_with_every_prose_token_scored() {
        let _rng = crate::testutil::rng();
        let tmp = tempfile::tempdir().unwrap();
        let (prose, alpaca) = (tmp.path().join("prose.jsonl"), tmp.path().join("alpaca.jsonl"));
        std::fs::write(&prose, "{\"text\": \"mira lives in oslo .\"}\n{\"text\": \"oslo is cold .\"}\n{\"text\": \"the end .\"}\n").unwrap();
        std::fs::write(&alpaca, "{\"instruction\": \"where is mira ?\", \"input\": \"\", \"output\": \"oslo\"}\n").unwrap();
        let yaml = format!("base: b\ndata:\n  train:\n  - text:\n      path: {}\n  - alpaca: {}\n  eval:\n    text:\n      path: {}\noutput: o\n", prose.display(), alpaca.display(), prose.display());
        let spec = FinetuneSpec::from_yaml(&yaml).unwrap();
        assert!(matches!(&spec.data.train, FtSource::Mix(parts) if matches!(parts[..], [FtSource::Text { .. }, FtSource::Chat(ChatSource::Alpaca { .. })])), "{:?}", spec.data.train);
        assert!(matches!(spec.data.eval, Some(FtSource::Text { .. })));
        assert_eq!(FinetuneSpec::from_yaml(&spec.to_yaml()).unwrap(), spec, "written back as given");
        let tok = Tok::load(&TokenizerSpec::Path("builtin".into())).unwrap();
        let eos = crate::data::tokenizer::eos_id(&tok);
        let template = ChatTemplate::builtin(&tok.inner.id_to_token(eos).unwrap());
        let ex = encoded(&spec.data.train, usize::MAX, &template, &tok, eos).unwrap();
        // prose 1, alpaca, prose 2, prose 3: the parts alternate until each is used up.
        assert_eq!(ex.len(), 4);
        for (i, e) in ex.iter().enumerate() {
            let scored = e.labels.iter().filter(|&&l| l != IGNORE).count();
            if i == 1 {
                assert!(scored > 0 && scored < e.tokens.len(), "the instruction's prompt is not scored: {e:?}");
            } else {
                assert_eq!((e.labels.clone(), *e.tokens.last().unwrap()), (e.tokens.clone(), eos as i64), "prose: every token scored, ended by eos");
            }
        }
        assert_eq!(ex[0].tokens[..ex[0].tokens.len() - 1], tok.encode("mira lives in oslo .").unwrap().into_iter().map(i64::from).collect::<Vec<_>>()[..]);
        assert_eq!(encoded(&spec.data.train, 1, &template, &tok, eos).unwrap().len(), 2, "max_examples caps each part");
        // A wrong entry is told the forms there are and the keys it has.
        let e = FinetuneSpec::from_yaml("base: b\ndata:\n  train:\n  - {txt: {path: a.jsonl}}\noutput: o\n").unwrap_err().to_string();
        assert!(e.contains("keys: txt") && e.contains("{text: SOURCE}") && e.contains("{alpaca: FILE}"), "{e}");
        let e = FinetuneSpec::from_yaml("base: b\ndata: {train: {text: {path: a.jsonl}, field: x}}\noutput: o\n").unwrap_err().to_string();
        assert!(e.contains("field") && e.contains("keys: text, field"), "{e}");
    }

    /// experiments/finetune-smollm2-dar.yaml runs end to end at smoke size (the real SmolLM2 from
    /// its GGUF, prose + Alpaca, one step a stage of 128 tokens): DAR at d_down 144 in the export, the
    /// base and the fine-tuned model scored on held-out prose.
    #[test]
    fn smollm2_dar_finetune_experiment_runs_at_smoke_size() {
        let _rng = crate::testutil::rng();
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        crate::model::gguf::tests_support::smollm2();
        let tmp = tempfile::tempdir().unwrap();
        let ((prose, alpaca), out) = (crate::testutil::smoke_prose_and_alpaca(tmp.path()), tmp.path().join("run"));
        let sets: Vec<String> = ["stage1.steps=1", "stage2.steps=1", "data.seq_len=128", "data.batch_size=1", "data.max_examples=3", "data.eval_rows=1", "data.calibration_rows=1", "train.device=cpu", "checkpoint.every=0"]
            .iter()
            .map(|s| s.to_string())
            .chain([
                format!("output={}", out.display()),
                format!("data.train=[{{text: {{path: {}}}}}, {{alpaca: {}}}]", prose.display(), alpaca.display()),
                format!("data.eval={{text: {{path: {}}}}}", prose.display()),
            ])
            .collect();
        let spec = FinetuneSpec::from_file(&root.join("experiments/finetune-smollm2-dar.yaml"), &sets).unwrap();
        assert_eq!((spec.base.as_str(), spec.attention.d_down_width(), spec.attention.window_len()), ("gguf:smollm2", Some(144), Some(128)));
        let o = finetune(spec, &FinetuneOptions { quiet: true, stop_after: None }).unwrap();
        assert_eq!(o.step, 2);
        let (base, tuned) = (o.eval["base"]["ppl"].as_f64().unwrap(), o.eval["finetuned"]["ppl"].as_f64().unwrap());
        assert!(base.is_finite() && tuned.is_finite() && base < 1000.0, "base {base}, fine-tuned {tuned}");
        let config: Value = serde_json::from_str(&std::fs::read_to_string(out.join("export/config.json")).unwrap()).unwrap();
        assert_eq!(config["attnlab_attention"]["d_down"], 144, "{config}");
    }

    fn ft(attention: &str) -> Result<FinetuneSpec> {
        FinetuneSpec::from_yaml(&format!("base: b\n{attention}data: {{train: {{path: x.jsonl}}}}\noutput: o\n"))
    }

    /// An old run directory's config reads back, serializes to the very same text (sweep hashes and
    /// config.yaml keep their form) and is accepted by prepare_dir for the same spec written anew.
    #[test]
    fn old_finetune_configs_still_parse_and_reopen() {
        let _rng = crate::testutil::rng();
        let old = FinetuneSpec::from_yaml(OLD_CONFIG).unwrap();
        let a = &old.attention;
        assert_eq!((a.kind(), a.d_down_width(), a.window_len(), a.init()), (AttentionKind::Dar, Some(16), Some(8), Some(AttentionInit::Pca)));
        assert_eq!(old.to_yaml(), OLD_CONFIG.strip_prefix("command: finetune\n").unwrap());
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ft");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.yaml"), OLD_CONFIG.replace("OUT", &dir.display().to_string())).unwrap();
        let new = FinetuneSpec::from_yaml(&format!("base: some/llama\nattention: {{kind: dar, d_down: 16, window: 8, init: pca}}\ndata: {{train: {{path: chat.jsonl}}}}\noutput: {}\n", dir.display())).unwrap().resolved();
        stages::prepare_dir(&dir, &new, |s| s.train.device = String::new(), "finetune").expect("the old config is the same run");
        let other = FinetuneSpec { attention: new.attention.clone().with_init(AttentionInit::SmallInit), ..new.clone() };
        assert!(stages::prepare_dir(&dir, &other, |s| s.train.device = String::new(), "finetune").is_err(), "another start is another run");
        // The old vanilla form (and no attention key at all) is vanilla, written as before.
        let v = ft("attention:\n  kind: vanilla\n").unwrap();
        assert_eq!(v.attention, AttentionSpec::vanilla());
        assert_eq!(ft("").unwrap().attention, AttentionSpec::vanilla());
        assert!(v.to_yaml().contains("attention:\n  kind: vanilla\ndata:"), "{}", v.to_yaml());
    }

    /// The keys of the spec's attention type: init takes small_init and pca, impl is kept; the
    /// serialized form writes impl only when it is not the default.
    #[test]
    fn finetune_attention_takes_the_spec_keys() {
        let s = ft("attention: {kind: dar, d_down: 8, window: 0, init: small_init, impl: sdpa}\n").unwrap();
        assert_eq!((s.attention.window_len(), s.attention.init(), s.attention.implementation()), (Some(0), Some(AttentionInit::SmallInit), AttentionImpl::Sdpa));
        assert!(s.to_yaml().contains("attention:\n  kind: dar\n  d_down: 8\n  window: 0\n  impl: sdpa\n  init: small_init\n"), "{}", s.to_yaml());
        assert_eq!(FinetuneSpec::from_yaml(&s.to_yaml()).unwrap(), s);
        assert_eq!(ft("attention: {kind: dar, d_down: 8, dar_act: linear}\n").unwrap().attention.window_len(), Some(128));
    }

    /// Values that do not apply to fine-tuning are refused, naming the key.
    #[test]
    fn finetune_attention_errors_name_the_key() {
        let _rng = crate::testutil::rng();
        let cases = [
            ("{kind: uniform, d_down: 8}", "attention.kind"),
            ("{kind: window, window: 8}", "attention.kind"),
            ("{kind: dar}", "attention.d_down"),
            ("{kind: dar, d_down: 0}", "attention.d_down"),
            ("{kind: dar, d_down: 8, window: -1}", "attention.window"),
            ("{kind: dar, d_down: 8, init: orthogonal}", "attention.init"),
            ("{kind: dar, d_down: 8, dar_act: sigmoid}", "attention.dar_act"),
            // Keys of another kind: serde refuses them, naming the key.
            ("{kind: vanilla, d_down: 8}", "unknown field `d_down`"),
            ("{kind: vanilla, init: pca}", "unknown field `init`"),
            ("{kind: dar, d_down: 8, sinks: 4}", "unknown field `sinks`"),
            ("{kind: vanilla, impl: sdpa}", "attention.impl"),
            ("{kind: dar, d_down: 8, init: svd}", "init"),
            ("{kind: still}", "kind"),
            // A value of the wrong type names its key too.
            ("{kind: dar, d_down: sixteen}", "`attention.d_down`: invalid type: string \"sixteen\""),
        ];
        for (attention, key) in cases {
            let e = ft(&format!("attention: {attention}\n")).unwrap_err().to_string();
            assert!(e.contains(key), "{attention}: {e}");
        }
        // From a file: the key's line too.
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("ft.yaml");
        std::fs::write(&f, "base: b\nattention:\n  kind: dar\n  window: wide\ndata: {train: {path: x.jsonl}}\noutput: o\n").unwrap();
        let e = FinetuneSpec::from_file(&f, &[]).unwrap_err().to_string();
        assert!(e.contains("ft.yaml: `attention.window` (line 4): invalid type: string \"wide\""), "{e}");
        // And pca is a fine-tuning start only: a pretraining spec refuses it.
        let e = crate::spec::from_str("attention: {kind: dar, d_down: 8, init: pca}\ndata: {train: {synthetic: {docs: 4}}}\ntrain: {steps: 1}\n", "t.yaml", &[]).unwrap_err().to_string();
        assert!(e.contains("attention.init") && e.contains("finetune"), "{e}");
    }

    /// HF's linear schedule with warmup: lr·s/W while warming up, then lr·(n − s)/(n − W).
    #[test]
    fn stage_schedules_follow_the_hf_formulas() {
        let (lr, n) = (1e-3, 100u64); // warmup 3% = 3 updates
        let lin = |s| stage_lr(lr, Schedule::Linear, 0.03, s, n);
        assert_eq!([lin(0), lin(1), lin(2)], [0.0, lr / 3.0, 2.0 * lr / 3.0]);
        assert_eq!(lin(3), lr);
        assert!((lin(50) - lr * 50.0 / 97.0).abs() < 1e-15);
        assert!((lin(99) - lr / 97.0).abs() < 1e-15);
        let cos = |s| stage_lr(lr, Schedule::Cosine, 0.0, s, n);
        assert!((cos(50) - lr * 0.5).abs() < 1e-15 && cos(0) == lr);
        assert_eq!(stage_lr(lr, Schedule::Constant, 0.03, 80, n), lr);
        // No warmup: the first update uses the full rate.
        assert_eq!(stage_lr(lr, Schedule::Linear, 0.0, 0, 10), lr);
    }

    #[test]
    fn spec_defaults_are_dar_md_4_2() {
        let _rng = crate::testutil::rng();
        let s = FinetuneSpec::from_yaml("base: b\nattention: {kind: dar, d_down: 64}\ndata: {train: {path: x.jsonl}}\noutput: o\n").unwrap().resolved();
        let a = &s.attention;
        assert_eq!((a.kind(), a.d_down_width(), a.window_len(), a.init()), (AttentionKind::Dar, Some(64), Some(128), Some(AttentionInit::SmallInit)));
        assert_eq!((s.stage1.lr, s.stage2.lr, s.stage1.epochs, s.stage2.epochs), (Some(3e-4), Some(3e-5), 1.0, 1.0));
        assert_eq!((s.stage1.params.as_deref(), s.stage2.params.as_deref()), (Some("bottleneck"), Some("all")));
        assert_eq!((s.data.seq_len, s.stage1.warmup, s.stage1.schedule, s.stage1.weight_decay), (4096, 0.03, Schedule::Linear, Some(0.0)));
        assert!(FinetuneSpec::from_yaml("base: b\nattention: {kind: dar, d_down: 64, init: svd}\ndata: {train: {path: x}}\noutput: o\n").is_err());
    }
}
