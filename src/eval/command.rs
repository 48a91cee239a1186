//! `attnlab eval RUN`: load a run's checkpoint, evaluate it one of three ways and write the result
//! into the run directory (with an lm-eval format copy and a refreshed TensorBoard file):
//! held-out perplexity (eval.json), a downstream task (tasks/NAME.json) or a long-context task
//! (ruler.json with ruler_samples/, babilong.json).
use super::{babilong, lm_eval, ruler, tasks, CorpusResult};
use crate::spec::{LocalSource, SourceSpec, TextFormat};
use crate::train;
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The `attnlab eval` flags (their meaning: `attnlab eval --help`).
#[derive(Debug, Clone, Default)]
pub struct EvalArgs {
    /// Where a pretrained model's results go (a GGUF has no run directory; default
    /// `results/<file stem>`). Run directories keep theirs inside.
    pub out: Option<PathBuf>,
    /// Perplexity: score at most this many tokens per corpus (default: the spec's `eval.max_tokens`).
    pub max_tokens: Option<usize>,
    /// Extra perplexity corpora, `NAME=PATH` or `NAME=wikitext:PATH`.
    pub corpora: Vec<String>,
    /// None: perplexity. `ruler:…` / `babilong:…`: long context. Anything else: a downstream task.
    pub task: Option<String>,
    pub downstream: DownstreamArgs,
    pub long_context: LongContextArgs,
}

/// The flags of a downstream task.
#[derive(Debug, Clone, Default)]
pub struct DownstreamArgs {
    pub request: tasks::Request,
    /// Default: `tasks::default_min_context`.
    pub min_context: Option<usize>,
}

/// The flags of a long-context task.
#[derive(Debug, Clone, Default)]
pub struct LongContextArgs {
    pub grid: ruler::Grid,
    /// Default: the task's (RULER 128, BABILong 20).
    pub max_new_tokens: Option<usize>,
    pub essay: Option<PathBuf>,
    pub babi: Option<PathBuf>,
    /// `--set` overrides of a linearized model's operator, recorded in the cells.
    pub sets: Vec<String>,
    /// Prompts as they are even when the model has a chat template.
    pub no_chat: bool,
    /// Samples per forward (None: `ruler::batch_for`'s default).
    pub batch_size: Option<usize>,
}

/// What `eval` wrote, for the command to print.
pub enum Evaluated {
    Perplexity {
        step: u64,
        results: BTreeMap<String, CorpusResult>,
        /// The lm-eval results file (None when no corpus has per-document numbers).
        lm_eval: Option<PathBuf>,
    },
    Task {
        step: u64,
        result: tasks::TaskResult,
        path: PathBuf,
        lm_eval: PathBuf,
    },
    LongContext {
        step: u64,
        cells: Vec<ruler::Cell>,
        /// ruler.json or babilong.json.
        path: PathBuf,
        /// RULER writes an lm-eval file and per-sample records (ruler_samples/); BABILong neither.
        lm_eval: Option<PathBuf>,
    },
}

/// Evaluate `run` at checkpoint `step` (default: the newest) on `device` (default: the run's) as
/// `a` says (see the module doc).
pub fn eval(run: &Path, step: Option<u64>, device: Option<&str>, a: &EvalArgs) -> Result<Evaluated> {
    let pretrained = crate::model::gguf::is_gguf(&run.to_string_lossy());
    if !pretrained && a.out.is_some() {
        return Err(Error::Other(format!("--out is for pretrained models (a GGUF); {} keeps its results inside", run.display())));
    }
    let out = match &a.out {
        Some(o) => o.clone(),
        None if pretrained => Path::new("results").join(crate::model::gguf::resolve(&run.to_string_lossy())?.file_stem().map_or("gguf".into(), |s| s.to_string_lossy().to_string())),
        None => run.to_path_buf(),
    };
    if pretrained {
        std::fs::create_dir_all(&out).map_err(|e| Error::io(&out, e))?;
    }
    match a.task.as_deref() {
        None if pretrained => pretrained_perplexity(run, &out, device, &a.corpora, a.max_tokens),
        None => perplexity(run, step, device, &a.corpora, a.max_tokens),
        Some(task) if !a.corpora.is_empty() => {
            let what = if is_long_context(task) { "evaluates generation" } else { "is a downstream task" };
            Err(Error::Other(format!("--corpus is for perplexity; --task {task} {what} (give one or the other)")))
        }
        Some("recall") => recall(run, step, device, &a.long_context),
        Some(task) if is_long_context(task) => long_context(run, &out, task, step, device, &a.long_context),
        Some(_) if pretrained => Err(Error::Other(format!("{}: downstream tasks read a run directory; export the GGUF (`attnlab export`) and fine-tune or evaluate perplexity / RULER / BABILong directly", run.display()))),
        Some(task) => downstream(run, task, step, device, &a.downstream),
    }
}

fn is_long_context(task: &str) -> bool {
    task.starts_with("ruler:") || task.starts_with("babilong:")
}

/// `--corpus NAME=PATH` (plain text) or `NAME=wikitext:PATH` (lm-eval's WikiText split and detokenizer).
pub fn parse_corpus(arg: &str) -> Result<(String, SourceSpec)> {
    let (name, path) = arg.split_once('=').ok_or_else(|| Error::Other(format!("--corpus `{arg}` is not NAME=PATH")))?;
    let (format, path) = match path.strip_prefix("wikitext:") {
        Some(p) => (TextFormat::Wikitext, p),
        None => (TextFormat::Text, path),
    };
    Ok((name.to_string(), SourceSpec::Local(LocalSource { path: path.into(), field: "text".into(), format })))
}

fn lm_info(run: &Path, step: u64, device: tch::Device, limit: Option<usize>, seconds: f64) -> lm_eval::RunInfo {
    lm_eval::RunInfo { run: run.to_path_buf(), step, device: format!("{device:?}"), limit, seconds }
}

fn perplexity(run: &Path, step: Option<u64>, device: Option<&str>, extra: &[String], max_tokens: Option<usize>) -> Result<Evaluated> {
    // A linearize run directory, or its export folder (hybrid.yaml, no config.yaml).
    if run.join("hybrid.yaml").is_file() || crate::run_kind::RunKind::of(run).ok() == Some(crate::run_kind::RunKind::Linearize) {
        return Err(Error::Other(format!("{}: a linearized model; its held-out perplexity is in the run's eval.json (for RULER give --task)", run.display())));
    }
    let loaded = train::run::load(run, step, device)?;
    let mut spec = loaded.spec.clone();
    spec.eval.max_tokens = max_tokens.or(spec.eval.max_tokens);
    for c in extra {
        let (name, src) = parse_corpus(c)?;
        spec.data.eval.insert(name, src);
    }
    let corpora = train::load_eval_corpora(&spec, &loaded.tok)?;
    if corpora.is_empty() {
        return Err(Error::Other("no evaluation corpora: the run's spec lists none; add --corpus NAME=PATH".into()));
    }
    let t0 = std::time::Instant::now();
    let scored = super::perplexity::evaluate_perplexity(&loaded.model, &corpora, &spec, loaded.device, false);
    let results: BTreeMap<_, _> = scored.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect();
    train::run::RunDir { path: run.to_path_buf() }.write_eval(loaded.step, &results)?;
    let lm_tasks: Vec<_> = corpora.iter().filter_map(|c| scored.get(&c.name).and_then(|(r, d)| lm_eval::perplexity_task(c, r, d))).collect();
    let info = lm_info(run, loaded.step, loaded.device, None, t0.elapsed().as_secs_f64());
    let lm = if lm_tasks.is_empty() { None } else { Some(lm_eval::write(&info, &lm_tasks)?) };
    crate::tensorboard::refresh(run);
    Ok(Evaluated::Perplexity { step: loaded.step, results, lm_eval: lm })
}

/// Windows of a pretrained model's rolling perplexity: its context, at most this.
const PRETRAINED_WINDOW: usize = 2048;

/// Rolling perplexity (evaluation.md §2.2) of a pretrained GGUF on the `--corpus` files, written to
/// `out`/eval.json (step 0) and an lm-eval file.
fn pretrained_perplexity(run: &Path, out: &Path, device: Option<&str>, extra: &[String], max_tokens: Option<usize>) -> Result<Evaluated> {
    if extra.is_empty() {
        return Err(Error::Other(format!("{}: a pretrained model has no eval corpora of its own; give --corpus NAME=PATH (e.g. wiki=wikitext:PATH)", run.display())));
    }
    let loaded = super::generate::load(run, None, device)?;
    let crate::model::Model::Llama(m) = &loaded.model else { unreachable!("a GGUF loads as a Llama") };
    let window = m.cfg.max_position_embeddings.min(PRETRAINED_WINDOW);
    let corpora = extra.iter().map(|c| parse_corpus(c).and_then(|(name, src)| super::EvalCorpus::load(&name, &src, &loaded.tok))).collect::<Result<Vec<_>>>()?;
    let t0 = std::time::Instant::now();
    let scored: BTreeMap<String, (CorpusResult, Vec<f64>)> = corpora
        .iter()
        .map(|c| {
            let bar = crate::progress::bar(0, &format!("perplexity {}", c.name), false);
            (c.name.clone(), super::perplexity::evaluate_docs(&loaded.model, c, window, 8, max_tokens, crate::spec::EvalProtocol::Rolling, loaded.device, &bar))
        })
        .collect();
    let results: BTreeMap<_, _> = scored.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect();
    train::run::RunDir { path: out.to_path_buf() }.write_eval(0, &results)?;
    let lm_tasks: Vec<_> = corpora.iter().filter_map(|c| scored.get(&c.name).and_then(|(r, d)| lm_eval::perplexity_task(c, r, d))).collect();
    let info = lm_info(out, 0, loaded.device, None, t0.elapsed().as_secs_f64());
    let lm = if lm_tasks.is_empty() { None } else { Some(lm_eval::write(&info, &lm_tasks)?) };
    Ok(Evaluated::Perplexity { step: 0, results, lm_eval: lm })
}

fn downstream(run: &Path, task: &str, step: Option<u64>, device: Option<&str>, a: &DownstreamArgs) -> Result<Evaluated> {
    let def = tasks::TaskDef::load(task)?;
    let loaded = train::run::load(run, step, device)?;
    let min_context = a.min_context.unwrap_or_else(|| tasks::default_min_context(&loaded.spec));
    let opts = tasks::Options { request: a.request.clone(), max_len: loaded.spec.seq_len(), min_context, quiet: false };
    let (mut result, samples) = tasks::evaluate(&loaded.model, &loaded.tok, &def, &opts, loaded.device).map_err(|e| Error::Other(format!("task {task} on {}: {e}", run.display())))?;
    result.model = tasks::ModelInfo::of(&loaded.spec, loaded.step);
    let path = tasks::write(run, &result, &samples)?;
    let info = lm_info(run, loaded.step, loaded.device, a.request.limit, result.seconds);
    let lm = lm_eval::write(&info, &[lm_eval::downstream_task(&def, &result, &samples)])?;
    crate::tensorboard::refresh(run);
    Ok(Evaluated::Task { step: loaded.step, result, path, lm_eval: lm })
}

/// The synthetic recall test (eval/recall.rs): `--lengths` are the gaps, `--samples` documents per
/// gap; writes recall.json, and a ruler.json cell per gap (score: % of answer digits right) so that
/// the report's long-context table shows it beside S-NIAH.
fn recall(run: &Path, step: Option<u64>, device: Option<&str>, a: &LongContextArgs) -> Result<Evaluated> {
    let loaded = train::run::load(run, step, device)?;
    let facts = super::recall::default_facts(&loaded.spec);
    let scores = super::recall::evaluate(&loaded.model, &loaded.tok, &loaded.spec, &a.grid.lengths, a.grid.samples, facts, a.batch_size.unwrap_or(16), loaded.device, false)?;
    let detail = super::recall::write(run, loaded.step, &scores)?;
    let cells: Vec<ruler::Cell> = scores
        .iter()
        .map(|s| ruler::Cell { task: "recall".into(), length: s.gap, samples: s.docs, score: 100.0 * s.digit_accuracy, mean_prompt_tokens: s.mean_tokens, ..Default::default() })
        .collect();
    let path = ruler::write_cells(run, "ruler.json", &cells)?;
    for s in &scores {
        println!(
            "recall gap {}: loss {:.3} at {} answer digits (chance {:.3}), {:.1}% of digits and {:.1}% of codes right (chance 10% and 0.1%){}",
            s.gap,
            s.loss,
            s.digits,
            s.chance_loss,
            100.0 * s.digit_accuracy,
            100.0 * s.code_accuracy,
            s.window_reach.map_or(String::new(), |r| format!("; window-only reach {r} tokens{}", if s.gap > r { " < gap: at chance by construction" } else { " ≥ gap: not a clean test" }))
        );
    }
    println!("details: {}", detail.display());
    Ok(Evaluated::LongContext { step: loaded.step, cells, path, lm_eval: None })
}

/// RULER / BABILong of `run`, results into `out` (the run directory itself, or a pretrained model's --out).
fn long_context(run: &Path, out: &Path, task: &str, step: Option<u64>, device: Option<&str>, a: &LongContextArgs) -> Result<Evaluated> {
    let loaded = super::generate::load_with(run, step, device, &a.sets)?;
    let overrides = (!a.sets.is_empty()).then(|| a.sets.join(" "));
    let with_overrides = |c: ruler::Cell| ruler::Cell { overrides: overrides.clone(), ..c };
    let essay = a.essay.as_deref().map(ruler::read_essay).transpose()?;
    let chat = if a.no_chat { None } else { loaded.chat.as_ref() };
    let budget = |default_new: usize| ruler::Budget { grid: a.grid.clone(), chat, max_new: a.max_new_tokens.unwrap_or(default_new), device: loaded.device, quiet: false, batch_size: a.batch_size };
    if let Some(name) = task.strip_prefix("babilong:") {
        let babi = a.babi.as_deref().ok_or_else(|| Error::Other("--task babilong:… needs --babi (e.g. ../shared/data/babi)".into()))?;
        let essay = essay.as_deref().ok_or_else(|| Error::Other("--task babilong:… needs --essay (e.g. ../shared/data/haystack/ruler_paul_graham_essays.json.gz)".into()))?;
        let records = babilong::read_records(babi, name)?;
        let cells: Vec<_> = babilong::evaluate(&loaded.model, &loaded.tok, name, &records, essay, &budget(babilong::TOKENS_TO_GENERATE))?.into_iter().map(with_overrides).collect();
        let path = ruler::write_cells(out, "babilong.json", &cells)?;
        return Ok(Evaluated::LongContext { step: loaded.step, cells, path, lm_eval: None });
    }
    let name = task.strip_prefix("ruler:").ok_or_else(|| Error::Other(format!("--task `{task}`: want ruler:<task> or babilong:<task>")))?;
    let b = budget(ruler::TOKENS_TO_GENERATE);
    let t0 = std::time::Instant::now();
    let (cells, all_records) = ruler::evaluate_into(out, &loaded.model, &loaded.tok, name, essay.as_deref(), &b, overrides)?;
    let info = lm_info(out, loaded.step, loaded.device, Some(a.grid.samples), t0.elapsed().as_secs_f64());
    let lm = lm_eval::write(&info, &[lm_eval::ruler_task(name, &cells, &all_records, b.max_new)])?;
    let path = ruler::write_cells(out, "ruler.json", &cells)?;
    Ok(Evaluated::LongContext { step: loaded.step, cells, path, lm_eval: Some(lm) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corpus_arguments_name_a_file_and_its_format() {
        let (name, src) = parse_corpus("wiki=wikitext:data/test.raw").unwrap();
        assert_eq!(name, "wiki");
        assert_eq!(src, SourceSpec::Local(LocalSource { path: "data/test.raw".into(), field: "text".into(), format: TextFormat::Wikitext }));
        let (_, src) = parse_corpus("a=b=c.txt").unwrap();
        assert_eq!(src, SourceSpec::Local(LocalSource { path: "b=c.txt".into(), field: "text".into(), format: TextFormat::Text }));
        assert!(parse_corpus("nameonly").unwrap_err().to_string().contains("not NAME=PATH"));
    }

    #[test]
    fn a_task_refuses_extra_corpora_before_loading_anything() {
        let _rng = crate::testutil::rng();
        let a = EvalArgs { task: Some("mmlu".into()), corpora: vec!["x=y".into()], ..Default::default() };
        let e = eval(Path::new("/nonexistent-run"), None, None, &a).err().unwrap().to_string();
        assert!(e.contains("--corpus is for perplexity") && e.contains("downstream"), "{e}");
        let a = EvalArgs { task: Some("ruler:niah_single_1".into()), ..a };
    // (the corpus check comes before any file is read)
        let e = eval(Path::new("/nonexistent-run"), None, None, &a).err().unwrap().to_string();
        assert!(e.contains("evaluates generation"), "{e}");
    }

    /// A GGUF evaluates without a run directory: perplexity and RULER results go to --out, RULER
    /// cells record whether the prompts went through the model's chat template.
    #[test]
    fn a_gguf_model_evaluates_into_its_out_folder() {
        let _rng = crate::testutil::rng();
        let gguf = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf_tiny/tiny.gguf");
        let tmp = tempfile::tempdir().unwrap();
        let text = tmp.path().join("t.txt");
        std::fs::write(&text, "the thin hen\n\nthen the tin hen said 42\n").unwrap();
        let out = tmp.path().join("out");
        let a = EvalArgs { out: Some(out.clone()), corpora: vec![format!("t={}", text.display())], ..Default::default() };
        let Evaluated::Perplexity { results, .. } = eval(&gguf, None, Some("cpu"), &a).unwrap() else { panic!("perplexity") };
        assert!(results["t"].ppl.is_finite() && results["t"].ppl > 1.0, "{:?}", results["t"]);
        assert!(out.join("eval.json").is_file());
        let e = eval(&gguf, None, Some("cpu"), &EvalArgs { out: Some(out.clone()), ..Default::default() }).err().unwrap().to_string();
        assert!(e.contains("give --corpus"), "{e}");
        for no_chat in [false, true] {
            let long_context = LongContextArgs { grid: ruler::Grid { lengths: vec![256], samples: 1 }, max_new_tokens: Some(2), no_chat, ..Default::default() };
            let a = EvalArgs { out: Some(out.clone()), task: Some("ruler:niah_single_1".into()), long_context, ..Default::default() };
            eval(&gguf, None, Some("cpu"), &a).unwrap();
        }
        let cells: Vec<ruler::Cell> = serde_json::from_str(&std::fs::read_to_string(out.join("ruler.json")).unwrap()).unwrap();
        assert_eq!(cells.iter().map(|c| c.chat).collect::<Vec<_>>(), [true, false]);
        let e = eval(Path::new("/some/run"), None, None, &EvalArgs { out: Some(out), ..Default::default() }).err().unwrap().to_string();
        assert!(e.contains("--out is for pretrained models"), "{e}");
    }

    /// `eval.ruler` scores the trained model before the run is marked done, and its per-sample
    /// answers are the ones `attnlab eval RUN --task ruler:…` gives from the run's checkpoint; a bad
    /// task or a missing essay stops the run before it trains.
    #[test]
    fn a_run_scores_its_ruler_task_before_it_is_done() {
        let _rng = crate::testutil::rng();
        let tmp = tempfile::tempdir().unwrap();
        let tok = tmp.path().join("tok.json");
        std::fs::write(&tok, crate::testutil::shared_text("data/tokenizers/gpt-neox-20b.json")).unwrap();
        let prose = tmp.path().join("prose.txt");
        std::fs::write(&prose, crate::testutil::shared_text("data/text/wikitext-2/test.raw.txt").chars().take(20_000).collect::<String>()).unwrap();
        let run = tmp.path().join("run");
        let yaml = |ruler: &str| {
            format!(
                "model: {{flavor: tiny}}\nattention: {{kind: vanilla}}\ndata: {{tokenizer: {}, train: {{path: {}, format: text}}, seq_len: 64}}\n\
                 train: {{steps: 2, batch_size: 2, device: cpu}}\neval: {{every: 0, ruler: {ruler}}}\ncheckpoint: {{every: 0, keep: 1}}\noutput: {}\n",
                tok.display(),
                prose.display(),
                run.display()
            )
        };
        let spec = crate::spec::from_str(&yaml("{task: niah_single_1, lengths: [96, 128], samples: 2, max_new_tokens: 3}"), "t.yaml", &[]).unwrap();
        let opts = crate::train::TrainOptions { quiet: true, finish: Some(ruler::score_trained), ..Default::default() };
        crate::train::train(spec, &opts).unwrap();
        assert!(run.join("DONE").is_file());
        let cells: Vec<ruler::Cell> = serde_json::from_str(&std::fs::read_to_string(run.join("ruler.json")).unwrap()).unwrap();
        assert_eq!(cells.iter().map(|c| (c.task.as_str(), c.length, c.samples)).collect::<Vec<_>>(), [("niah_single_1", 96, 2), ("niah_single_1", 128, 2)]);
        // The same task from the checkpoint, into another folder: the same answers, sample by sample.
        let out = tmp.path().join("again");
        let a = LongContextArgs { grid: ruler::Grid { lengths: vec![96, 128], samples: 2 }, max_new_tokens: Some(3), ..Default::default() };
        long_context(&run, &out, "ruler:niah_single_1", None, Some("cpu"), &a).unwrap();
        for len in [96, 128] {
            let read = |dir: &Path| std::fs::read_to_string(dir.join(format!("ruler_samples/niah_single_1-{len}.jsonl"))).unwrap();
            assert_eq!(read(&run), read(&out), "length {len}");
        }
        // Bad settings name their key; a missing essay stops the run before any step.
        let e = crate::spec::from_str(&yaml("{task: niah_single_9, lengths: [96]}"), "t.yaml", &[]).unwrap_err().to_string();
        assert!(e.contains("eval.ruler.task") && e.contains("niah_single_9"), "{e}");
        let e = crate::spec::from_str(&yaml("{task: niah_single_2, lengths: [96]}"), "t.yaml", &[]).unwrap_err().to_string();
        assert!(e.contains("eval.ruler.essay"), "{e}");
        let e = crate::spec::from_str(&yaml("{task: niah_single_1, lengths: []}"), "t.yaml", &[]).unwrap_err().to_string();
        assert!(e.contains("eval.ruler.lengths"), "{e}");
        std::fs::remove_dir_all(&run).unwrap();
        let missing = tmp.path().join("no-essay.json");
        let spec = crate::spec::from_str(&yaml(&format!("{{task: niah_single_2, lengths: [96], essay: {}}}", missing.display())), "t.yaml", &[]).unwrap();
        let e = crate::train::train(spec, &opts).err().unwrap().to_string();
        assert!(e.contains("no-essay.json"), "{e}");
        assert!(!run.join("metrics.jsonl").is_file(), "trained before finding the essay missing");
        // A caller without a scorer is refused before training too.
        std::fs::remove_dir_all(&run).unwrap();
        let spec = crate::spec::from_str(&yaml("{task: niah_single_1, lengths: [96]}"), "t.yaml", &[]).unwrap();
        let e = crate::train::train(spec, &crate::train::TrainOptions { quiet: true, ..Default::default() }).err().unwrap().to_string();
        assert!(e.contains("does not score RULER"), "{e}");
    }
}
