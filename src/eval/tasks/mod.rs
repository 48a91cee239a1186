//! Downstream tasks as data (lm-evaluation-harness style): a task is a YAML file — dataset, prompt
//! templates, few-shot settings, metrics — and two generic code paths run every task:
//! log-likelihood multiple choice (`output_type: multiple_choice`) and greedy generation
//! (`output_type: generate_until`). The built-in tasks live in data/tasks/*.yaml (compiled in);
//! data/tasks/README.md writes down their prompts, few-shot counts and where they follow or depart
//! from lm-eval. `attnlab eval RUN --task NAME|FILE.yaml` runs one and writes RUN/tasks/NAME.json.
//!
//! Prompt (lm-eval `fewshot_context`): `description + Σ(shot_text + target_delimiter + shot_target
//! + fewshot_delimiter) + doc_text`. Multiple choice scores `target_delimiter + choice` after the
//! prompt (loglik.rs); generation decodes greedily until a stop string, EOS or `max_gen_toks`.
pub mod data;
pub mod loglik;
pub mod metrics;
pub mod sandbox;
pub mod template;

use crate::data::Tok;
use crate::model::Model;
use crate::{Error, Result};
use rand::{seq::index::sample, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use tch::{Device, Kind, Tensor};

/// Built-in task files (data/tasks/), by name.
pub const BUILTIN: [(&str, &str); 6] = [
    ("mmlu", include_str!("../../../data/tasks/mmlu.yaml")),
    ("hellaswag", include_str!("../../../data/tasks/hellaswag.yaml")),
    ("commonsense_qa", include_str!("../../../data/tasks/commonsense_qa.yaml")),
    ("gsm8k", include_str!("../../../data/tasks/gsm8k.yaml")),
    ("mbpp", include_str!("../../../data/tasks/mbpp.yaml")),
    ("multi_news", include_str!("../../../data/tasks/multi_news.yaml")),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputType {
    MultipleChoice,
    GenerateUntil,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitDef {
    /// Split name; local files are found by it (`test*.jsonl`, `dev-*.parquet`, …).
    pub name: String,
    /// Files of the hub repository that hold it.
    #[serde(default)]
    pub files: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetDef {
    /// Hub dataset repository (used when --data is not given).
    #[serde(default)]
    pub hf: Option<String>,
    #[serde(default)]
    pub revision: Option<String>,
    /// The split evaluated.
    pub eval: SplitDef,
    /// The split few-shot examples come from.
    #[serde(default)]
    pub fewshot: Option<SplitDef>,
}

/// A field added to every document (lm-eval's `process_docs`), rendered from a template.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Derived {
    pub field: String,
    pub template: String,
}

/// The choices of a multiple-choice document: fixed strings, or a template that yields a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Choices {
    List(Vec<String>),
    Template(String),
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Sampler {
    /// The first k few-shot documents (of the document's group).
    #[default]
    FirstN,
    /// k distinct documents drawn per evaluated document with a seeded RNG (lm-eval's default
    /// sampler draws with Python's `random.Random(1234)`; our draws differ from its).
    Random,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FewshotDef {
    #[serde(default)]
    pub sampler: Sampler,
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Few-shot examples share this field's value with the document (MMLU: `subject`).
    #[serde(default)]
    pub group_by: Option<String>,
    /// Fixed few-shot documents (MBPP's three), used instead of a split.
    #[serde(default)]
    pub docs: Vec<Value>,
}

impl Default for FewshotDef {
    fn default() -> Self {
        FewshotDef { sampler: Sampler::FirstN, seed: default_seed(), group_by: None, docs: Vec::new() }
    }
}

fn default_seed() -> u64 {
    1234
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Truncate {
    /// Keep the end of a prompt that is too long (lm-eval).
    #[default]
    Left,
    /// Keep both ends and drop the middle (LongBench).
    Middle,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerationDef {
    /// Stop strings; the output is cut at the first one.
    #[serde(default)]
    pub until: Vec<String>,
    #[serde(default = "default_gen_toks")]
    pub max_gen_toks: usize,
    #[serde(default)]
    pub truncate: Truncate,
}

impl Default for GenerationDef {
    fn default() -> Self {
        GenerationDef { until: Vec::new(), max_gen_toks: default_gen_toks(), truncate: Truncate::Left }
    }
}

fn default_gen_toks() -> usize {
    256
}

/// A metric, scored per document and averaged.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "metric", rename_all = "snake_case", deny_unknown_fields)]
pub enum MetricDef {
    /// argmax of summed log-probabilities is the gold choice.
    Acc,
    /// argmax of log-probability / choice length in characters.
    AccNorm,
    /// Regex extraction (optional) then lm-eval's exact_match; reported as `exact_match,NAME`.
    ExactMatch {
        name: String,
        #[serde(default)]
        regex: Option<String>,
        #[serde(default)]
        group_select: i64,
        #[serde(default)]
        ignore_case: bool,
        #[serde(default)]
        regexes_to_ignore: Vec<String>,
    },
    /// The completion + "\n" + the reference tests run in the sandbox; 1 when it exits 0.
    #[serde(rename = "pass_at_1")]
    PassAt1 {
        #[serde(default = "default_timeout")]
        timeout_s: f64,
        #[serde(default = "default_memory")]
        memory_mb: u64,
    },
    /// ROUGE-L F-measure, the maximum over references.
    RougeL,
}

fn default_timeout() -> f64 {
    10.0
}
fn default_memory() -> u64 {
    1024
}

impl MetricDef {
    pub fn key(&self) -> String {
        match self {
            MetricDef::Acc => "acc".into(),
            MetricDef::AccNorm => "acc_norm".into(),
            MetricDef::ExactMatch { name, .. } => format!("exact_match,{name}"),
            MetricDef::PassAt1 { .. } => "pass_at_1".into(),
            MetricDef::RougeL => "rouge_l".into(),
        }
    }
}

fn space() -> String {
    " ".into()
}
fn blank_line() -> String {
    "\n\n".into()
}

/// One task file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskDef {
    pub task: String,
    pub output_type: OutputType,
    pub dataset: DatasetDef,
    #[serde(default)]
    pub process_docs: Vec<Derived>,
    /// Prepended once to the prompt (rendered with the evaluated document).
    #[serde(default)]
    pub description: String,
    pub doc_to_text: String,
    /// Multiple choice: the gold choice (an index, or one of the choice strings). Generation: the reference(s).
    pub doc_to_target: String,
    /// The target written after a few-shot example, when it differs from `doc_to_target` (MBPP).
    #[serde(default)]
    pub fewshot_target: Option<String>,
    #[serde(default)]
    pub doc_to_choice: Option<Choices>,
    #[serde(default = "space")]
    pub target_delimiter: String,
    #[serde(default = "blank_line")]
    pub fewshot_delimiter: String,
    #[serde(default)]
    pub num_fewshot: usize,
    #[serde(default)]
    pub fewshot: FewshotDef,
    pub metrics: Vec<MetricDef>,
    /// The metric the report's downstream table shows.
    pub primary: String,
    #[serde(default)]
    pub generation: GenerationDef,
    /// Also report every metric per value of this field (MMLU: per subject).
    #[serde(default)]
    pub breakdown: Option<String>,
}

impl TaskDef {
    pub fn parse(yaml: &str, origin: &str) -> Result<TaskDef> {
        let t: TaskDef = serde_yaml::from_str(yaml).map_err(|e| Error::Schema { file: origin.to_string(), msg: e.to_string() })?;
        let bad = |key: &str, msg: String| Error::Spec { file: origin.to_string(), key: key.to_string(), line: None, msg };
        for (key, tpl) in [("description", &t.description), ("doc_to_text", &t.doc_to_text), ("doc_to_target", &t.doc_to_target)] {
            template::check(tpl).map_err(|e| bad(key, e.to_string()))?;
        }
        for d in &t.process_docs {
            template::check(&d.template).map_err(|e| bad("process_docs", e.to_string()))?;
        }
        let keys: Vec<String> = t.metrics.iter().map(MetricDef::key).collect();
        if !keys.contains(&t.primary) {
            return Err(bad("primary", format!("`{}` is not one of the task's metrics ({})", t.primary, keys.join(", "))));
        }
        match t.output_type {
            OutputType::MultipleChoice => {
                if t.doc_to_choice.is_none() {
                    return Err(bad("doc_to_choice", "multiple_choice needs doc_to_choice".into()));
                }
                if let Some(m) = t.metrics.iter().find(|m| !matches!(m, MetricDef::Acc | MetricDef::AccNorm)) {
                    return Err(bad("metrics", format!("{} is not a multiple-choice metric (acc, acc_norm)", m.key())));
                }
            }
            OutputType::GenerateUntil => {
                if let Some(m) = t.metrics.iter().find(|m| matches!(m, MetricDef::Acc | MetricDef::AccNorm)) {
                    return Err(bad("metrics", format!("{} needs output_type: multiple_choice", m.key())));
                }
            }
        }
        for m in &t.metrics {
            if let MetricDef::ExactMatch { regex, regexes_to_ignore, .. } = m {
                for r in regex.iter().chain(regexes_to_ignore) {
                    regex::Regex::new(r).map_err(|e| bad("metrics", format!("regex `{r}`: {e}")))?;
                }
            }
        }
        Ok(t)
    }

    /// A built-in task by name, or a task file by path.
    pub fn load(name_or_path: &str) -> Result<TaskDef> {
        if let Some((_, yaml)) = BUILTIN.iter().find(|(n, _)| *n == name_or_path) {
            return TaskDef::parse(yaml, &format!("data/tasks/{name_or_path}.yaml"));
        }
        let p = std::path::Path::new(name_or_path);
        if p.is_file() {
            let text = std::fs::read_to_string(p).map_err(|e| Error::io(p, e))?;
            return TaskDef::parse(&text, name_or_path);
        }
        Err(Error::Other(format!(
            "unknown task `{name_or_path}` (built-in: {}; or a task YAML file)",
            BUILTIN.iter().map(|b| b.0).collect::<Vec<_>>().join(", ")
        )))
    }

    fn process(&self, doc: &mut Value) -> Result<()> {
        for d in &self.process_docs {
            let v = template::render_value(&d.template, doc)?;
            doc.as_object_mut().ok_or_else(|| Error::Data("a document is not a JSON object".into()))?.insert(d.field.clone(), v);
        }
        Ok(())
    }

    fn choices(&self, doc: &Value) -> Result<Vec<String>> {
        match self.doc_to_choice.as_ref().expect("checked in parse") {
            Choices::List(l) => Ok(l.clone()),
            Choices::Template(t) => match template::render_value(t, doc)? {
                Value::Array(a) => Ok(a.iter().map(template::as_text).collect()),
                other => Err(Error::Data(format!("doc_to_choice `{t}` gave {other}, not a list"))),
            },
        }
    }

    /// The gold index: a number, or a string that is one of the choices or an integer.
    fn gold(&self, doc: &Value, choices: &[String]) -> Result<usize> {
        let v = template::render_value(&self.doc_to_target, doc)?;
        let idx = match &v {
            Value::Number(n) => n.as_u64().map(|x| x as usize),
            Value::String(s) => choices.iter().position(|c| c == s).or_else(|| s.trim().parse::<usize>().ok()),
            _ => None,
        };
        idx.filter(|&i| i < choices.len()).ok_or_else(|| Error::Data(format!("{}: target {v} is not one of {} choices", self.task, choices.len())))
    }

    /// The text written after a few-shot example.
    fn shot_target(&self, doc: &Value) -> Result<String> {
        if let Some(t) = &self.fewshot_target {
            return template::render(t, doc);
        }
        match self.output_type {
            OutputType::MultipleChoice => {
                let c = self.choices(doc)?;
                Ok(c[self.gold(doc, &c)?].clone())
            }
            OutputType::GenerateUntil => template::render(&self.doc_to_target, doc),
        }
    }
}

/// Which documents to evaluate and how: what the user asks for (`attnlab eval --task` flags).
#[derive(Debug, Clone, Default)]
pub struct Request {
    /// Local path or `hf:OWNER/NAME` (default: the task's hub dataset).
    pub data: Option<String>,
    /// Evaluate the first N documents only.
    pub limit: Option<usize>,
    /// Few-shot count (default: the task's).
    pub shots: Option<usize>,
    /// Padded tokens per log-likelihood forward.
    pub batch_tokens: usize,
}

/// What to run: the request, and what the model decides.
#[derive(Debug, Clone)]
pub struct Options {
    pub request: Request,
    /// The model's context length: longer inputs are truncated.
    pub max_len: usize,
    /// Leave out documents whose input (prompt with its shots, in tokens) is shorter than this: the
    /// DAR paper excludes samples shorter than w so that the distant path is engaged (dar.md §4.2).
    /// 0 keeps every document.
    pub min_context: usize,
    pub quiet: bool,
}

/// What was evaluated: enough for the report to place a run in the downstream table.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub step: u64,
    pub arch: String,
    /// vanilla, dar or uniform.
    pub attention: String,
    pub d_model: usize,
    /// Bottleneck width (None for vanilla attention).
    pub d_down: Option<usize>,
    pub window: Option<usize>,
}

impl ModelInfo {
    /// What a task result records of the model of `spec` at checkpoint `step`.
    pub fn of(spec: &crate::spec::Spec, step: u64) -> ModelInfo {
        let a = &spec.attention;
        let vanilla = a.is_vanilla();
        ModelInfo {
            step,
            arch: format!("{:?}", spec.model.arch.unwrap_or_default()).to_lowercase(),
            attention: a.kind().name().into(),
            d_model: spec.shape().d_model,
            d_down: if vanilla { None } else { a.d_down_width() },
            window: if vanilla { None } else { a.window_len() },
        }
    }
}

/// `--min-context`'s default: the window for models with distant-token attention (as the DAR
/// paper evaluates: every kept document reaches the distant path), 0 for vanilla.
pub fn default_min_context(spec: &crate::spec::Spec) -> usize {
    spec.attention.min_context()
}

/// A task's result (RUN/tasks/NAME.json).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskResult {
    pub task: String,
    #[serde(default)]
    pub model: ModelInfo,
    pub docs: usize,
    /// Documents before the `min_context` filter (= `docs` without one).
    #[serde(default)]
    pub docs_total: usize,
    /// The filter: documents with inputs shorter than this many tokens were left out (0: none).
    #[serde(default)]
    pub min_context: usize,
    pub num_fewshot: usize,
    /// Metric key → mean over documents.
    pub metrics: BTreeMap<String, f64>,
    pub primary_metric: String,
    pub primary: f64,
    /// Metric means per value of the task's `breakdown` field (MMLU subjects), with `n`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub breakdown: BTreeMap<String, BTreeMap<String, f64>>,
    /// Remarks (e.g. the sandbox had no network isolation).
    #[serde(default)]
    pub notes: Vec<String>,
    pub seconds: f64,
}

/// One evaluated document (RUN/tasks/NAME.samples.jsonl).
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub doc: usize,
    pub prompt_tokens: usize,
    /// Multiple choice: the summed log-probability of each choice; generation: none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub loglikelihoods: Vec<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gold: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response: Option<String>,
    pub metrics: BTreeMap<String, f64>,
    /// For lm-eval's per-sample file (eval::lm_eval), not in samples.jsonl: the processed document,
    /// the full prompt, the scored continuations (multiple choice) and the target as text.
    #[serde(skip)]
    pub lm_eval: LmEvalDoc,
}

#[derive(Debug, Clone, Default)]
pub struct LmEvalDoc {
    pub doc: Value,
    pub prompt: String,
    pub continuations: Vec<String>,
    pub target: String,
}

/// The few-shot documents for `doc` (index `i`): first_n or seeded random, within its group.
fn pick_shots<'a>(def: &TaskDef, pool: &'a [Value], doc: &Value, i: usize, k: usize) -> Vec<&'a Value> {
    let same = |d: &&Value| def.fewshot.group_by.as_ref().is_none_or(|g| d.get(g) == doc.get(g));
    let candidates: Vec<&Value> = pool.iter().filter(same).filter(|d| *d != doc).collect();
    let k = k.min(candidates.len());
    match def.fewshot.sampler {
        Sampler::FirstN => candidates.into_iter().take(k).collect(),
        Sampler::Random => {
            let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(def.fewshot.seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            sample(&mut r, candidates.len(), k).into_iter().map(|j| candidates[j]).collect()
        }
    }
}

/// The full prompt of `doc`.
pub fn build_prompt(def: &TaskDef, doc: &Value, shots: &[&Value]) -> Result<String> {
    let mut s = template::render(&def.description, doc)?;
    for shot in shots {
        s += &template::render(&def.doc_to_text, shot)?;
        s += &def.target_delimiter;
        s += &def.shot_target(shot)?;
        s += &def.fewshot_delimiter;
    }
    s += &template::render(&def.doc_to_text, doc)?;
    Ok(s)
}

/// Token id that stands in for an empty context and ends generation: the tokenizer's EOS.
pub fn eos_id(tok: &Tok) -> u32 {
    ["<|endoftext|>", "<|end_of_text|>", "</s>", "<|eot_id|>", "<|im_end|>"].iter().find_map(|t| tok.inner.token_to_id(t)).unwrap_or(crate::data::EOD)
}

/// Greedy decoding until a stop string, `eos` or `max_new` tokens; the text is cut at the first stop string.
pub fn generate_until(model: &Model, tok: &Tok, prompt: &[u32], max_new: usize, until: &[String], eos: Option<u32>, device: Device) -> Result<String> {
    let mut cache = model.new_cache(1, model.head_weight().kind(), device);
    crate::eval::generate::reserve(&mut cache, (prompt.len() + max_new) as i64);
    let ids = Tensor::from_slice(&prompt.iter().map(|&t| i64::from(t)).collect::<Vec<_>>()).view([1, -1]).to_device(device);
    let mut logits = crate::eval::generate::prefill(model, &mut cache, &ids);
    let mut out: Vec<u32> = Vec::new();
    let cut = |text: &str| until.iter().filter_map(|u| text.find(u.as_str())).min();
    for _ in 0..max_new {
        let id = logits.view([-1]).to_kind(Kind::Float).argmax(0, false).int64_value(&[]) as u32;
        if Some(id) == eos {
            break;
        }
        out.push(id);
        if !until.is_empty() {
            let text = tok.decode(&out)?;
            if let Some(at) = cut(&text) {
                return Ok(text[..at].to_string());
            }
        }
        logits = model.extend(&mut cache, &Tensor::from_slice(&[i64::from(id)]).view([1, 1]).to_device(device));
    }
    let text = tok.decode(&out)?;
    Ok(match cut(&text) {
        Some(at) => text[..at].to_string(),
        None => text,
    })
}

/// Fit a prompt into `budget` tokens.
fn truncate(ids: Vec<u32>, budget: usize, how: Truncate) -> Vec<u32> {
    if ids.len() <= budget {
        return ids;
    }
    match how {
        Truncate::Left => ids[ids.len() - budget..].to_vec(),
        Truncate::Middle => {
            let head = budget / 2;
            ids[..head].iter().chain(&ids[ids.len() - (budget - head)..]).copied().collect()
        }
    }
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        f64::NAN
    } else {
        s / n as f64
    }
}

/// References of a generation document: a string, or every string of a list.
fn references(def: &TaskDef, doc: &Value) -> Result<Vec<String>> {
    Ok(match template::render_value(&def.doc_to_target, doc)? {
        Value::Array(a) => a.iter().map(template::as_text).collect(),
        v => vec![template::as_text(&v)],
    })
}

/// Run one task: load its documents, build prompts, score. Returns the result and one sample per document.
pub fn evaluate(model: &Model, tok: &Tok, def: &TaskDef, opts: &Options, device: Device) -> Result<(TaskResult, Vec<Sample>)> {
    let t0 = std::time::Instant::now();
    let mut docs = data::load_split(&def.dataset, &def.dataset.eval, opts.request.data.as_deref(), true)?;
    if let Some(n) = opts.request.limit {
        docs.truncate(n);
    }
    if docs.is_empty() {
        return Err(Error::Data(format!("{}: no documents to evaluate", def.task)));
    }
    for d in docs.iter_mut() {
        def.process(d)?;
    }
    let k = opts.request.shots.unwrap_or(def.num_fewshot);
    let mut pool: Vec<Value> = Vec::new();
    if k > 0 {
        pool = if !def.fewshot.docs.is_empty() {
            def.fewshot.docs.clone()
        } else {
            let split = def.dataset.fewshot.as_ref().ok_or_else(|| Error::Data(format!("{}: {k}-shot needs a few-shot split (the task has none; use --shots 0)", def.task)))?;
            data::load_split(&def.dataset, split, opts.request.data.as_deref(), false)?
        };
        for d in pool.iter_mut() {
            def.process(d)?;
        }
    }
    let mut prompts = Vec::with_capacity(docs.len());
    for (i, d) in docs.iter().enumerate() {
        let shots = pick_shots(def, &pool, d, i, k);
        if shots.len() < k {
            return Err(Error::Data(format!("{}: document {i} has only {} few-shot examples for {k} shots", def.task, shots.len())));
        }
        prompts.push(build_prompt(def, d, &shots)?);
    }
    let docs_total = docs.len();
    // Documents keep their index in the split (Sample::doc) through the min_context filter.
    let mut ids: Vec<usize> = (0..docs.len()).collect();
    if opts.min_context > 0 {
        let mut kept = (Vec::new(), Vec::new(), Vec::new());
        for ((d, p), i) in docs.into_iter().zip(prompts).zip(ids) {
            if tok.encode(&p)?.len() >= opts.min_context {
                kept.0.push(d);
                kept.1.push(p);
                kept.2.push(i);
            }
        }
        (docs, prompts, ids) = kept;
        if docs.is_empty() {
            return Err(Error::Data(format!("{}: none of {docs_total} documents has an input of ≥ {} tokens (min_context; lower it with --min-context)", def.task, opts.min_context)));
        }
    }
    let bar = crate::progress::bar(docs.len() as u64, &def.task, opts.quiet);
    let mut samples = Vec::with_capacity(docs.len());
    let mut notes = Vec::new();
    match def.output_type {
        OutputType::MultipleChoice => {
            let eos = eos_id(tok);
            let mut reqs = Vec::new();
            let mut spans = Vec::new();
            let mut golds = Vec::new();
            let mut all_choices = Vec::new();
            for (d, p) in docs.iter().zip(&prompts) {
                let choices = def.choices(d)?;
                golds.push(def.gold(d, &choices)?);
                let start = reqs.len();
                for c in &choices {
                    reqs.push(loglik::encode_pair(tok, p, &format!("{}{c}", def.target_delimiter), eos)?);
                }
                spans.push(start..reqs.len());
                all_choices.push(choices);
            }
            // Scored in chunks of documents so the progress bar moves.
            let mut lls = Vec::with_capacity(reqs.len());
            for (chunk, docs_chunk) in spans.chunks(64).enumerate() {
                let (a, b) = (docs_chunk[0].start, docs_chunk[docs_chunk.len() - 1].end);
                lls.extend(loglik::loglikelihoods(model, &reqs[a..b], opts.max_len, opts.request.batch_tokens, device));
                bar.set_position(((chunk * 64) + docs_chunk.len()) as u64);
            }
            for (i, span) in spans.iter().enumerate() {
                let l = lls[span.clone()].to_vec();
                let (acc, acc_norm) = metrics::mc_scores(&l, &all_choices[i], golds[i]);
                let mut m = BTreeMap::new();
                for def_m in &def.metrics {
                    m.insert(def_m.key(), if matches!(def_m, MetricDef::Acc) { acc } else { acc_norm });
                }
                let lm_eval = LmEvalDoc { doc: docs[i].clone(), prompt: prompts[i].clone(), continuations: all_choices[i].iter().map(|c| format!("{}{c}", def.target_delimiter)).collect(), target: golds[i].to_string() };
                samples.push(Sample { doc: ids[i], prompt_tokens: reqs[span.start].context.len(), loglikelihoods: l, gold: Some(golds[i]), response: None, metrics: m, lm_eval });
            }
        }
        OutputType::GenerateUntil => {
            let eos = Some(eos_id(tok));
            let g = &def.generation;
            let budget = opts.max_len.saturating_sub(g.max_gen_toks).max(1);
            let mut isolated = true;
            let doc_ids = &ids;
            for (i, (d, p)) in docs.iter().zip(&prompts).enumerate() {
                let ids = truncate(tok.encode(p)?, budget, g.truncate);
                let response = generate_until(model, tok, &ids, g.max_gen_toks, &g.until, eos, device)?;
                let refs = references(def, d)?;
                let mut m = BTreeMap::new();
                for def_m in &def.metrics {
                    let v = match def_m {
                        MetricDef::ExactMatch { regex, group_select, ignore_case, regexes_to_ignore, .. } => {
                            let ignore: Vec<regex::Regex> = regexes_to_ignore.iter().map(|r| regex::Regex::new(r).expect("checked in parse")).collect();
                            let pred = match regex {
                                Some(r) => metrics::regex_extract(&regex::Regex::new(r).expect("checked in parse"), *group_select, &response),
                                None => response.clone(),
                            };
                            refs.iter().map(|r| metrics::exact_match(&pred, r, &ignore, *ignore_case)).fold(0.0, f64::max)
                        }
                        MetricDef::PassAt1 { timeout_s, memory_mb } => {
                            let limits = sandbox::Limits {
                                wall: std::time::Duration::from_secs_f64(*timeout_s),
                                cpu_s: timeout_s.ceil() as u64,
                                memory_bytes: memory_mb << 20,
                                ..sandbox::Limits::default()
                            };
                            let o = sandbox::run_python(&sandbox::mbpp_program(&response, &refs.join("\n")), limits)?;
                            isolated &= o.network_isolated;
                            f64::from(u8::from(o.status == sandbox::Status::Passed))
                        }
                        MetricDef::RougeL => refs.iter().map(|r| metrics::rouge_l(response.trim(), r)).fold(0.0, f64::max),
                        MetricDef::Acc | MetricDef::AccNorm => unreachable!("checked in parse"),
                    };
                    m.insert(def_m.key(), v);
                }
                let target = if refs.len() == 1 { refs[0].clone() } else { serde_json::to_string(&refs)? };
                let lm_eval = LmEvalDoc { doc: d.clone(), prompt: p.clone(), continuations: Vec::new(), target };
                samples.push(Sample { doc: doc_ids[i], prompt_tokens: ids.len(), loglikelihoods: Vec::new(), gold: None, response: Some(response), metrics: m, lm_eval });
                bar.inc(1);
            }
            if def.metrics.iter().any(|m| matches!(m, MetricDef::PassAt1 { .. })) && !isolated {
                notes.push("the kernel refused a network namespace: generated code ran WITHOUT network isolation".into());
            }
        }
    }
    bar.finish_and_clear();
    let keys: Vec<String> = def.metrics.iter().map(MetricDef::key).collect();
    let metrics: BTreeMap<String, f64> = keys.iter().map(|k| (k.clone(), mean(samples.iter().map(|s| s.metrics[k])))).collect();
    let mut breakdown: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    if let Some(field) = &def.breakdown {
        let mut groups: BTreeMap<String, Vec<&Sample>> = BTreeMap::new();
        // Samples are in document order, one per (kept) document.
        for (j, s) in samples.iter().enumerate() {
            groups.entry(docs[j].get(field).map(template::as_text).unwrap_or_default()).or_default().push(s);
        }
        for (g, ss) in groups {
            let mut row: BTreeMap<String, f64> = keys.iter().map(|k| (k.clone(), mean(ss.iter().map(|s| s.metrics[k])))).collect();
            row.insert("n".into(), ss.len() as f64);
            breakdown.insert(g, row);
        }
    }
    let primary = metrics[&def.primary];
    Ok((
        TaskResult { task: def.task.clone(), model: ModelInfo::default(), docs: docs.len(), docs_total, min_context: opts.min_context, num_fewshot: k, metrics, primary_metric: def.primary.clone(), primary, breakdown, notes, seconds: t0.elapsed().as_secs_f64() },
        samples,
    ))
}

/// Write `RUN/tasks/NAME.json` (the result) and `RUN/tasks/NAME.samples.jsonl` (one line per document).
pub fn write(run: &std::path::Path, result: &TaskResult, samples: &[Sample]) -> Result<std::path::PathBuf> {
    use crate::IoContext;
    let dir = run.join("tasks");
    std::fs::create_dir_all(&dir).at(&dir)?;
    let path = dir.join(format!("{}.json", result.task));
    std::fs::write(&path, serde_json::to_string_pretty(result)?).at(&path)?;
    let lines: Vec<String> = samples.iter().map(serde_json::to_string).collect::<std::result::Result<_, _>>()?;
    let sp = dir.join(format!("{}.samples.jsonl", result.task));
    std::fs::write(&sp, lines.join("\n") + "\n").at(&sp)?;
    Ok(path)
}

#[cfg(test)]
mod tests;
