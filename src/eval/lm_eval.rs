//! Results in lm-evaluation-harness's file format, beside attnlab's own: `attnlab eval` also writes
//! `RUN/lm_eval/results_<date>.json` and `RUN/lm_eval/samples_<task>_<date>.jsonl`, so tools
//! that read lm-eval output (its `make_table`, leaderboards, W&B's lm-eval logger, notebooks)
//! read ours. Layout and keys as lm-eval 0.4 writes them (EvaluationTracker.save_results_* and
//! evaluator.py; tests/fixtures/lm_eval/ holds files lm-eval itself wrote,
//! scripts/make_lm_eval_fixture.py): `results` (`<metric>,<filter>` and `<metric>_stderr,<filter>`,
//! "N/A" where lm-eval has no stderr), `versions`, `n-shot`, `higher_is_better`, `n-samples`,
//! `configs`, `config`, `task_hashes`; per sample doc_id, doc, target, arguments
//! (`gen_args_i.arg_j`), resps and filtered_resps (as strings), filter, metrics, the sha256
//! doc / prompt / target hashes and each metric's value.
//!
//! `versions` says `attnlab-<version>`: the prompts are ours (data/tasks/README.md lists where they
//! differ from lm-eval's), so numbers must not be mistaken for lm-eval's own.
use super::perplexity::{CorpusResult, EvalCorpus};
use super::ruler;
use super::tasks::{self, MetricDef, OutputType, Sample, TaskDef, TaskResult};
use crate::{IoContext, Result};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The `versions` entry of every task.
pub fn version() -> String {
    format!("attnlab-{}", env!("CARGO_PKG_VERSION"))
}

/// One evaluated task, ready to write.
#[derive(Debug, Clone, Default)]
pub struct Task {
    pub name: String,
    pub n_shot: usize,
    /// (metric, filter) → value and its standard error (None: lm-eval's "N/A").
    pub results: Vec<(String, String, f64, Option<f64>)>,
    pub higher_is_better: BTreeMap<String, bool>,
    pub n_samples: usize,
    /// lm-eval's `configs[task]`: how the task was run.
    pub config: Value,
    /// Sample lines, already in lm-eval's shape (`sample`).
    pub samples: Vec<Value>,
}

/// How the model was run: lm-eval's top-level `config`.
#[derive(Debug, Clone, Default)]
pub struct RunInfo {
    /// The run directory evaluated.
    pub run: PathBuf,
    pub step: u64,
    pub device: String,
    pub limit: Option<usize>,
    pub seconds: f64,
}

pub fn sha256(s: &str) -> String {
    Sha256::digest(s.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// lm-eval's `sanitize_list`: every leaf as a string (Python's `str`: True/False, floats as repr).
fn sanitize(v: &Value) -> Value {
    match v {
        Value::Array(a) => Value::Array(a.iter().map(sanitize).collect()),
        Value::String(s) => Value::String(s.clone()),
        Value::Bool(b) => Value::String(if *b { "True" } else { "False" }.into()),
        Value::Number(n) if n.is_f64() => Value::String(py_float(n.as_f64().unwrap_or(f64::NAN))),
        other => Value::String(other.to_string()),
    }
}

/// Python's `repr(float)` for the values we write (shortest round-trip digits, always a point).
fn py_float(x: f64) -> String {
    let s = format!("{x:?}");
    if s.contains('e') && !s.contains("e-") && !s.contains('.') {
        s.replace('e', ".0e+")
    } else {
        s
    }
}

/// One sample line as lm-eval writes it. `arguments[i]` are the arguments of request i
/// (`[context, continuation]` or `[prompt, generation kwargs]`), `resps[i]` its raw responses.
#[allow(clippy::too_many_arguments)]
pub fn sample(doc_id: usize, doc: &Value, target: &str, arguments: &[Vec<Value>], resps: &[Vec<Value>], filtered: &[Value], filter: &str, metrics: &[(String, Value)]) -> Value {
    let mut args = Map::new();
    for (i, a) in arguments.iter().enumerate() {
        let m: Map<String, Value> = a.iter().enumerate().map(|(j, v)| (format!("arg_{j}"), v.clone())).collect();
        args.insert(format!("gen_args_{i}"), Value::Object(m));
    }
    let prompt = arguments.first().and_then(|a| a.first()).and_then(Value::as_str).unwrap_or_default();
    // lm-eval hashes json.dumps(doc, indent=2, ensure_ascii=False): serde_json's pretty form.
    let doc_text = serde_json::to_string_pretty(doc).unwrap_or_default();
    let mut line = Map::new();
    line.insert("doc_id".into(), json!(doc_id));
    line.insert("doc".into(), doc.clone());
    line.insert("target".into(), json!(target));
    line.insert("arguments".into(), Value::Object(args));
    line.insert("resps".into(), Value::Array(resps.iter().map(|r| sanitize(&Value::Array(r.clone()))).collect()));
    line.insert("filtered_resps".into(), Value::Array(filtered.iter().map(sanitize).collect()));
    line.insert("filter".into(), json!(filter));
    line.insert("metrics".into(), json!(metrics.iter().map(|m| m.0.clone()).collect::<Vec<_>>()));
    line.insert("doc_hash".into(), json!(sha256(&doc_text)));
    line.insert("prompt_hash".into(), json!(sha256(prompt)));
    line.insert("target_hash".into(), json!(sha256(target)));
    for (k, v) in metrics {
        line.insert(k.clone(), v.clone());
    }
    Value::Object(line)
}

/// lm-eval's `mean_stderr` (sample standard deviation / √n); None ("N/A") below two values.
pub fn mean_stderr(xs: &[f64]) -> Option<f64> {
    let n = xs.len();
    if n < 2 {
        return None;
    }
    let mu = xs.iter().sum::<f64>() / n as f64;
    Some((xs.iter().map(|x| (x - mu).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt() / (n as f64).sqrt())
}

/// A perplexity corpus as lm-eval's `wikitext` task (loglikelihood_rolling): word_perplexity,
/// byte_perplexity and bits_per_byte, stderr "N/A"; per document `[loglikelihood, words|bytes]`
/// as lm-eval's process_results. `doc_nll[i]` belongs to `corpus.docs[i]`. None for the stream
/// protocol (no per-document numbers, no lm-eval equivalent).
pub fn perplexity_task(corpus: &EvalCorpus, result: &CorpusResult, doc_nll: &[f64]) -> Option<Task> {
    if result.protocol != "rolling" {
        return None;
    }
    let metrics = ["word_perplexity", "byte_perplexity", "bits_per_byte"];
    let samples = corpus
        .docs
        .iter()
        .zip(doc_nll)
        .enumerate()
        .map(|(i, ((_, d), nll))| {
            let ll = -nll;
            let doc = json!({"text": d.text, "words": d.words, "bytes": d.bytes});
            let m = vec![(metrics[0].to_string(), json!([ll, d.words])), (metrics[1].to_string(), json!([ll, d.bytes])), (metrics[2].to_string(), json!([ll, d.bytes]))];
            sample(i, &doc, &d.text, &[vec![json!(d.text)]], &[vec![json!(ll)]], &[json!(ll)], "none", &m)
        })
        .collect();
    Some(Task {
        name: corpus.name.clone(),
        n_shot: 0,
        results: vec![
            (metrics[0].into(), "none".into(), result.word_ppl, None),
            (metrics[1].into(), "none".into(), result.byte_ppl, None),
            (metrics[2].into(), "none".into(), result.bits_per_byte, None),
        ],
        higher_is_better: metrics.iter().map(|m| (m.to_string(), false)).collect(),
        n_samples: result.docs,
        config: json!({"task": corpus.name, "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "the document (WikiText: lm-eval's split and detokenizer)",
            "metric_list": metrics.iter().map(|m| json!({"metric": m})).collect::<Vec<_>>(),
            "attnlab": {"protocol": "rolling", "tokens": result.tokens, "token_perplexity": result.ppl, "loss": result.loss},
            "metadata": {"version": version()}}),
        samples,
    })
}

/// `exact_match,NAME` → ("exact_match", "NAME"); other keys have lm-eval's filter "none".
fn split_key(key: &str) -> (String, String) {
    match key.split_once(',') {
        Some((m, f)) => (m.to_string(), f.to_string()),
        None => (key.to_string(), "none".to_string()),
    }
}

/// A downstream task (data/tasks/*.yaml) as lm-eval reports it: each metric with its filter and
/// mean stderr; one sample line per document and filter.
pub fn downstream_task(def: &TaskDef, result: &TaskResult, samples: &[Sample]) -> Task {
    let keys: Vec<String> = def.metrics.iter().map(MetricDef::key).collect();
    let results = keys
        .iter()
        .map(|k| {
            let (m, f) = split_key(k);
            let xs: Vec<f64> = samples.iter().map(|s| s.metrics[k]).collect();
            (m, f, result.metrics[k], mean_stderr(&xs))
        })
        .collect();
    let mut lines = Vec::new();
    // lm-eval writes the samples of one filter after another.
    let filters: Vec<String> = {
        let mut f: Vec<String> = keys.iter().map(|k| split_key(k).1).collect();
        f.dedup();
        f
    };
    for filter in &filters {
        for s in samples {
            let l = &s.lm_eval;
            let metrics: Vec<(String, Value)> = keys.iter().filter(|k| split_key(k).1 == *filter).map(|k| (split_key(k).0, json!(s.metrics[k]))).collect();
            let line = match def.output_type {
                OutputType::MultipleChoice => {
                    let args: Vec<Vec<Value>> = l.continuations.iter().map(|c| vec![json!(l.prompt), json!(c)]).collect();
                    // (log-likelihood, is_greedy): attnlab does not compute is_greedy.
                    let resps: Vec<Vec<Value>> = s.loglikelihoods.iter().map(|ll| vec![json!([ll, "N/A"])]).collect();
                    let filtered: Vec<Value> = s.loglikelihoods.iter().map(|ll| json!([ll, "N/A"])).collect();
                    sample(s.doc, &l.doc, &l.target, &args, &resps, &filtered, filter, &metrics)
                }
                OutputType::GenerateUntil => {
                    let g = &def.generation;
                    let kwargs = json!({"until": g.until, "max_gen_toks": g.max_gen_toks, "do_sample": false, "temperature": 0.0});
                    let response = s.response.clone().unwrap_or_default();
                    let filtered = def
                        .metrics
                        .iter()
                        .find_map(|m| match m {
                            MetricDef::ExactMatch { name, regex: Some(r), group_select, .. } if name == filter => {
                                Some(tasks::metrics::regex_extract(&regex::Regex::new(r).expect("checked when the task was parsed"), *group_select, &response))
                            }
                            _ => None,
                        })
                        .unwrap_or_else(|| response.clone());
                    sample(s.doc, &l.doc, &l.target, &[vec![json!(l.prompt), kwargs]], &[vec![json!(response)]], &[json!(filtered)], filter, &metrics)
                }
            };
            lines.push(line);
        }
    }
    let metric_list: Vec<Value> = keys.iter().map(|k| json!({"metric": split_key(k).0, "aggregation": "mean", "higher_is_better": true})).collect();
    Task {
        name: result.task.clone(),
        n_shot: result.num_fewshot,
        results,
        higher_is_better: keys.iter().map(|k| (split_key(k).0, true)).collect(),
        n_samples: result.docs,
        config: json!({"task": def.task, "output_type": match def.output_type { OutputType::MultipleChoice => "multiple_choice", OutputType::GenerateUntil => "generate_until" },
            "dataset_path": def.dataset.hf, "test_split": def.dataset.eval.name, "description": def.description, "doc_to_text": def.doc_to_text, "doc_to_target": def.doc_to_target,
            "target_delimiter": def.target_delimiter, "fewshot_delimiter": def.fewshot_delimiter, "num_fewshot": result.num_fewshot, "metric_list": metric_list,
            "generation_kwargs": if def.output_type == OutputType::GenerateUntil { json!({"until": def.generation.until, "max_gen_toks": def.generation.max_gen_toks, "do_sample": false}) } else { Value::Null },
            "metadata": {"version": version(), "prompts": "attnlab's data/tasks (see data/tasks/README.md for where they differ from lm-eval)"}}),
        samples: lines,
    }
}

/// Python's `str(list_of_strings)` (what lm-eval writes as RULER's target).
fn py_list(xs: &[String]) -> String {
    let q: Vec<String> = xs.iter().map(|x| format!("'{}'", x.replace('\\', "\\\\").replace('\'', "\\'"))).collect();
    format!("[{}]", q.join(", "))
}

/// A RULER task as lm-eval's `ruler` tasks report it: one metric per sequence length (`"4096,none"`,
/// the mean string_match_all in [0, 1], stderr "N/A"); each sample scores its own length and -1
/// for the others, as lm-eval's common_utils.process_results.
pub fn ruler_task(name: &str, cells: &[ruler::Cell], records: &[ruler::Record], max_new: usize) -> Task {
    let lengths: Vec<usize> = cells.iter().map(|c| c.length).collect();
    let samples = records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let (length, answer) = (r.result.length, &r.result.prediction);
            let doc = json!({"index": r.result.index, "input": r.sample.input, "outputs": r.sample.outputs, "max_length": length, "gen_prefix": r.sample.answer_prefix});
            let metrics: Vec<(String, Value)> = lengths.iter().map(|&l| (l.to_string(), json!(if l == length { r.result.score / 100.0 } else { -1.0 }))).collect();
            let prompt = format!("{}{}", r.sample.input, r.sample.answer_prefix);
            let kwargs = json!({"do_sample": false, "temperature": 0.0, "max_gen_toks": max_new, "until": []});
            sample(i, &doc, &py_list(&r.sample.outputs), &[vec![json!(prompt), kwargs]], &[vec![json!(answer)]], &[json!(answer)], "none", &metrics)
        })
        .collect();
    Task {
        name: name.to_string(),
        n_shot: 0,
        results: cells.iter().map(|c| (c.length.to_string(), "none".to_string(), c.score / 100.0, None)).collect(),
        higher_is_better: lengths.iter().map(|l| (l.to_string(), true)).collect(),
        n_samples: records.len(),
        config: json!({"task": name, "output_type": "generate_until", "doc_to_text": "{{input}}", "doc_to_target": "{{outputs}}", "gen_prefix": "{{gen_prefix}}", "target_delimiter": " ",
            "metric_list": lengths.iter().map(|l| json!({"metric": l.to_string(), "aggregation": "mean over samples of this length", "higher_is_better": true})).collect::<Vec<_>>(),
            "generation_kwargs": {"do_sample": false, "temperature": 0.0, "max_gen_toks": max_new, "until": []},
            "metadata": {"version": version(), "max_seq_lengths": lengths, "haystacks": "attnlab's RULER generator (src/eval/ruler.rs), seed 42"}}),
        samples,
    }
}

/// The results file's JSON (lm-eval's top-level keys).
pub fn results_json(info: &RunInfo, tasks: &[Task], unix_time: f64) -> Value {
    let mut results = Map::new();
    let (mut versions, mut n_shot, mut hib, mut n_samples, mut configs, mut hashes, mut groups) = (Map::new(), Map::new(), Map::new(), Map::new(), Map::new(), Map::new(), Map::new());
    for t in tasks {
        let mut r = Map::new();
        r.insert("alias".into(), json!(t.name));
        for (m, f, v, se) in &t.results {
            r.insert(format!("{m},{f}"), json!(v));
            r.insert(format!("{m}_stderr,{f}"), se.map_or(json!("N/A"), |s| json!(s)));
        }
        results.insert(t.name.clone(), Value::Object(r));
        groups.insert(t.name.clone(), json!([]));
        versions.insert(t.name.clone(), json!(version()));
        n_shot.insert(t.name.clone(), json!(t.n_shot));
        hib.insert(t.name.clone(), json!(t.higher_is_better));
        n_samples.insert(t.name.clone(), json!({"original": t.n_samples, "effective": t.n_samples}));
        configs.insert(t.name.clone(), t.config.clone());
        // lm-eval: sha256 of the concatenated doc, prompt and target hashes of the samples.
        let all: String = t.samples.iter().map(|s| format!("{}{}{}", s["doc_hash"].as_str().unwrap_or(""), s["prompt_hash"].as_str().unwrap_or(""), s["target_hash"].as_str().unwrap_or(""))).collect();
        hashes.insert(t.name.clone(), json!(sha256(&all)));
    }
    let run = info.run.display().to_string();
    json!({
        "results": results,
        "group_subtasks": groups,
        "configs": configs,
        "versions": versions,
        "n-shot": n_shot,
        "higher_is_better": hib,
        "n-samples": n_samples,
        "config": {"model": "attnlab", "model_args": format!("run={run},step={}", info.step), "batch_size": null, "batch_sizes": [], "device": info.device,
            "use_cache": null, "limit": info.limit, "bootstrap_iters": 0, "gen_kwargs": null, "random_seed": null, "numpy_seed": null, "torch_seed": null, "fewshot_seed": null},
        "git_hash": null,
        "date": unix_time,
        "lm_eval_version": null,
        "attnlab_version": env!("CARGO_PKG_VERSION"),
        "task_hashes": hashes,
        "model_source": "attnlab",
        "model_name": run,
        "model_name_sanitized": run.replace(['/', '\\'], "__"),
        "total_evaluation_time_seconds": info.seconds.to_string(),
    })
}

/// lm-eval's date id, `datetime.now().isoformat().replace(":", "-")` (here in UTC).
pub fn date_id(unix_time: f64) -> String {
    let secs = unix_time.floor() as i64;
    let micros = ((unix_time - secs as f64) * 1e6).round().min(999_999.0) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}-{:02}-{:02}.{micros:06}", rem / 3600, rem / 60 % 60, rem % 60)
}

/// Write `RUN/lm_eval/results_<date>.json` and a `samples_<task>_<date>.jsonl` per task; returns
/// the results file.
pub fn write(info: &RunInfo, tasks: &[Task]) -> Result<PathBuf> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    write_at(info, tasks, now)
}

pub fn write_at(info: &RunInfo, tasks: &[Task], unix_time: f64) -> Result<PathBuf> {
    let dir = info.run.join("lm_eval");
    std::fs::create_dir_all(&dir).at(&dir)?;
    let date = date_id(unix_time);
    for t in tasks {
        let p = dir.join(format!("samples_{}_{date}.jsonl", t.name));
        let mut text = String::new();
        for s in &t.samples {
            text.push_str(&serde_json::to_string(s)?);
            text.push('\n');
        }
        std::fs::write(&p, text).at(&p)?;
    }
    let p = dir.join(format!("results_{date}.json"));
    std::fs::write(&p, serde_json::to_string_pretty(&results_json(info, tasks, unix_time))?).at(&p)?;
    Ok(p)
}

/// Newest `results_*.json` under `RUN/lm_eval` (for tests and tools).
pub fn latest_results(run: &Path) -> Option<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(run.join("lm_eval")).ok()?.flatten().map(|e| e.path()).filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("results_") && n.ends_with(".json"))).collect();
    v.sort();
    v.pop()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lm_eval")
    }

    fn fixture(prefix: &str) -> PathBuf {
        let mut v: Vec<PathBuf> = std::fs::read_dir(fixture_dir()).unwrap().flatten().map(|e| e.path()).filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with(prefix)).collect();
        v.sort();
        v.pop().unwrap_or_else(|| panic!("no fixture {prefix}*"))
    }

    fn lines(p: &Path) -> Vec<Value> {
        std::fs::read_to_string(p).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    }

    fn keys(v: &Value) -> Vec<String> {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    }

    /// Our hashes, sanitizing and argument layout reproduce the sample lines lm-eval wrote.
    #[test]
    fn sample_lines_match_lm_evals_own() {
        // Python's sha256 of json.dumps(doc, indent=2, sort_keys=True) per fixture sample: our
        // objects' keys are sorted (lm-eval keeps the dataset's order), the rest is lm-eval's rule.
        let sorted: BTreeMap<String, Vec<String>> = serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("sorted_doc_hashes.json")).unwrap()).unwrap();
        for (prefix, args_of) in [("samples_mc_fixture", 2usize), ("samples_gen_fixture", 1), ("samples_wikitext", 1), ("samples_niah_fixture", 1)] {
            for (n, theirs) in lines(&fixture(prefix)).into_iter().enumerate() {
                let arguments: Vec<Vec<Value>> = (0..args_of.max(theirs["arguments"].as_object().unwrap().len()))
                    .map(|i| theirs["arguments"][format!("gen_args_{i}")].as_object().unwrap().values().cloned().collect())
                    .collect();
                // resps as lm-eval held them before sanitizing: numbers and booleans.
                let unsanitize = |v: &Value| -> Value {
                    match v.as_str() {
                        Some("False") => json!(false),
                        Some("True") => json!(true),
                        Some(s) => s.parse::<f64>().map(|x| json!(x)).unwrap_or_else(|_| json!(s)),
                        None => v.clone(),
                    }
                };
                let deep = |v: &Value| -> Value {
                    fn go(v: &Value, f: &dyn Fn(&Value) -> Value) -> Value {
                        match v {
                            Value::Array(a) => Value::Array(a.iter().map(|x| go(x, f)).collect()),
                            x => f(x),
                        }
                    }
                    go(v, &unsanitize)
                };
                let resps: Vec<Vec<Value>> = theirs["resps"].as_array().unwrap().iter().map(|r| deep(r).as_array().unwrap().clone()).collect();
                let filtered: Vec<Value> = theirs["filtered_resps"].as_array().unwrap().iter().map(deep).collect();
                let metrics: Vec<(String, Value)> = theirs["metrics"].as_array().unwrap().iter().map(|m| (m.as_str().unwrap().to_string(), theirs[m.as_str().unwrap()].clone())).collect();
                let ours = sample(theirs["doc_id"].as_u64().unwrap() as usize, &theirs["doc"], theirs["target"].as_str().unwrap(), &arguments, &resps, &filtered, theirs["filter"].as_str().unwrap(), &metrics);
                assert_eq!(keys(&ours), keys(&theirs), "{prefix}");
                assert_eq!(ours["doc_hash"].as_str().unwrap(), sorted[prefix][n], "{prefix} line {n}: doc_hash");
                if prefix == "samples_wikitext" {
                    assert_eq!(ours["doc_hash"], theirs["doc_hash"], "one key: lm-eval's own hash");
                }
                for k in ["prompt_hash", "target_hash", "arguments", "resps", "filtered_resps", "filter", "metrics", "target"] {
                    assert_eq!(ours[k], theirs[k], "{prefix}: {k}");
                }
            }
        }
    }

    /// Our results file has lm-eval's top-level keys and per-task key layout, and its numbers are
    /// the ones given; lm-eval's mean_stderr on the fixture's per-sample acc gives its stderr.
    #[test]
    fn results_file_has_lm_evals_layout() {
        let theirs: Value = serde_json::from_str(&std::fs::read_to_string(fixture("results_")).unwrap()).unwrap();
        let task = Task {
            name: "mc".into(),
            n_shot: 5,
            results: vec![("acc".into(), "none".into(), 0.5, mean_stderr(&[1.0, 0.0])), ("word_perplexity".into(), "none".into(), 12.5, None)],
            higher_is_better: [("acc".to_string(), true)].into(),
            n_samples: 2,
            config: json!({"task": "mc"}),
            samples: vec![],
        };
        let info = RunInfo { run: "results/x".into(), step: 7, device: "cpu".into(), limit: Some(2), seconds: 1.5 };
        let tmp = tempfile::tempdir().unwrap();
        let info = RunInfo { run: tmp.path().to_path_buf(), ..info };
        let p = write_at(&info, &[task], 1_796_160_711.272_092).unwrap();
        assert_eq!(p.file_name().unwrap().to_str().unwrap(), "results_2026-12-01T21-31-51.272092.json");
        assert!(tmp.path().join("lm_eval/samples_mc_2026-12-01T21-31-51.272092.jsonl").is_file());
        let ours: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        for k in ["results", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples", "config", "task_hashes", "date", "model_name", "total_evaluation_time_seconds"] {
            assert!(theirs.get(k).is_some() && ours.get(k).is_some(), "{k}");
        }
        let mut config_keys = keys(&ours["config"]);
        config_keys.retain(|k| theirs["config"].get(k).is_none());
        assert!(config_keys.is_empty(), "config keys lm-eval does not write: {config_keys:?}");
        // lm-eval's mc fixture: acc 0.5 over [1, 0] with stderr 0.5; perplexities "N/A".
        assert_eq!(theirs["results"]["mc_fixture"]["acc_stderr,none"], json!(0.5));
        assert_eq!(ours["results"]["mc"]["acc_stderr,none"], json!(0.5));
        assert_eq!(theirs["results"]["wikitext"]["word_perplexity_stderr,none"], json!("N/A"));
        assert_eq!(ours["results"]["mc"]["word_perplexity_stderr,none"], json!("N/A"));
        assert_eq!(ours["results"]["mc"]["acc,none"], json!(0.5));
        assert_eq!(ours["versions"]["mc"], json!(format!("attnlab-{}", env!("CARGO_PKG_VERSION"))));
        assert_eq!((ours["n-shot"]["mc"].clone(), ours["n-samples"]["mc"]["effective"].clone()), (json!(5), json!(2)));
        assert_eq!(ours["higher_is_better"]["mc"]["acc"], json!(true));
        // Every task entry of lm-eval's has `alias` and `<metric>,<filter>` / `<metric>_stderr,<filter>` pairs; ours too.
        for file in [&theirs, &ours] {
            for (_, r) in file["results"].as_object().unwrap() {
                for k in r.as_object().unwrap().keys().filter(|k| k.contains(',')) {
                    let (m, f) = k.split_once(',').unwrap();
                    let pair = if let Some(base) = m.strip_suffix("_stderr") { format!("{base},{f}") } else { format!("{m}_stderr,{f}") };
                    assert!(r.get(&pair).is_some(), "{k} without {pair}");
                }
            }
        }
    }

    #[test]
    fn dates_and_stderr() {
        assert_eq!(date_id(0.0), "1970-01-01T00-00-00.000000");
        assert_eq!(date_id(951_782_400.5), "2000-02-29T00-00-00.500000");
        assert_eq!(date_id(1_796_160_711.272_092), "2026-12-01T21-31-51.272092");
        assert_eq!(mean_stderr(&[1.0]), None);
        // sqrt(var([1,0,0,1]) / 4) with the n-1 variance 1/3.
        assert!((mean_stderr(&[1.0, 0.0, 0.0, 1.0]).unwrap() - (1.0f64 / 3.0 / 4.0).sqrt()).abs() < 1e-15);
        assert_eq!(py_list(&["7".into(), "a'b".into()]), "['7', 'a\\'b']");
    }
}
