//! Run directories → `Run` values: the resolved spec from config.yaml and the logged metrics merged
//! per step. A resumed run re-logs the steps after its last checkpoint, and evaluation rows share a
//! step with training rows, so rows are merged key by key with the line written last winning.
//! eval.json is written after metrics.jsonl (and again by `attnlab eval`), so it is merged last.
use crate::eval::perplexity::PositionLoss;
use crate::spec::Spec;
use crate::{Error, IoContext, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Metric name → value for one step.
pub type Row = BTreeMap<String, f64>;

pub struct Run {
    /// Path relative to the results directory ("." when the results directory is itself a run).
    pub rel: String,
    pub dir: PathBuf,
    pub spec: Spec,
    /// The run wrote DONE.
    pub done: bool,
    /// Metrics by step.
    pub rows: BTreeMap<u64, Row>,
    /// Lines or files that could not be read (reported, not fatal).
    pub warnings: Vec<String>,
    /// Mean loss by window position per corpus, from eval.json (empty for runs evaluated before
    /// `eval` recorded it).
    pub by_position: BTreeMap<String, PositionLoss>,
}

/// A folder holding config.yaml that could not be used, and why.
pub struct Skipped {
    pub rel: String,
    pub why: String,
}

impl Run {
    pub fn name(&self) -> String {
        self.spec.name.clone().unwrap_or_else(|| self.dir.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| self.rel.clone()))
    }

    /// Planned optimizer steps.
    pub fn steps(&self) -> u64 {
        self.spec.steps()
    }

    /// Last logged step, if any.
    pub fn last_step(&self) -> Option<u64> {
        self.rows.keys().next_back().copied()
    }

    /// `field` (ppl, word_ppl, …) of every corpus evaluated at `step`.
    pub fn eval_at(&self, step: u64, field: &str) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        if let Some(row) = self.rows.get(&step) {
            for (k, &v) in row {
                if let Some((corpus, f)) = k.strip_prefix("eval/").and_then(|r| r.split_once('/')) {
                    if f == field && v.is_finite() && v > 0.0 {
                        out.insert(corpus.to_string(), v);
                    }
                }
            }
        }
        out
    }

    /// Evaluation at the planned final step: what the tables compare.
    pub fn final_eval(&self, field: &str) -> BTreeMap<String, f64> {
        self.eval_at(self.steps(), field)
    }

    /// (step, value) of one metric over training.
    pub fn series(&self, key: &str) -> Vec<(f64, f64)> {
        self.rows.iter().filter_map(|(&s, r)| r.get(key).filter(|v| v.is_finite()).map(|&v| (s as f64, v))).collect()
    }
}

/// Every run directory below `root` (sorted by path), and the folders with an unusable config.yaml.
pub fn discover(root: &Path) -> Result<(Vec<Run>, Vec<Skipped>)> {
    if !root.is_dir() {
        return Err(Error::Other(format!("{} is not a directory", root.display())));
    }
    let mut dirs = Vec::new();
    find_run_dirs(root, &mut dirs)?;
    dirs.sort();
    let (mut runs, mut skipped) = (Vec::new(), Vec::new());
    for dir in dirs {
        let rel = relative(root, &dir);
        match load_run(&dir, rel.clone()) {
            Ok(run) => runs.push(run),
            // Linearized runs have their own spec: only the long-context tables (longctx.rs) use them.
            Err(_) if is_linearize_run(&dir) => {}
            Err(e) => skipped.push(Skipped { rel, why: e.to_string() }),
        }
    }
    Ok((runs, skipped))
}

fn is_linearize_run(dir: &Path) -> bool {
    crate::run_kind::RunKind::of(dir).is_ok_and(|k| k == crate::run_kind::RunKind::Linearize)
}

fn relative(root: &Path, dir: &Path) -> String {
    match dir.strip_prefix(root) {
        Ok(p) if p.as_os_str().is_empty() => ".".into(),
        Ok(p) => p.to_string_lossy().into_owned(),
        Err(_) => dir.to_string_lossy().into_owned(),
    }
}

/// A run directory holds config.yaml; its subfolders (checkpoints) are not searched further.
pub(crate) fn find_run_dirs(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    if dir.join("config.yaml").is_file() {
        out.push(dir.to_path_buf());
        return Ok(());
    }
    for entry in std::fs::read_dir(dir).at(dir)? {
        let path = entry.at(dir)?.path();
        let hidden = path.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.'));
        if path.is_dir() && !hidden {
            find_run_dirs(&path, out)?;
        }
    }
    Ok(())
}

/// Read one run directory.
pub fn load_run(dir: &Path, rel: String) -> Result<Run> {
    let cfg = dir.join("config.yaml");
    let text = std::fs::read_to_string(&cfg).at(&cfg)?;
    let spec = crate::spec::from_str(&text, &cfg.display().to_string(), &[])?;
    let mut run = Run { rel, dir: dir.to_path_buf(), spec, done: dir.join("DONE").is_file(), rows: BTreeMap::new(), warnings: Vec::new(), by_position: BTreeMap::new() };
    let metrics = dir.join("metrics.jsonl");
    // Malformed lines (a torn last row, say) are skipped with a warning on stderr and in the report.
    let read = crate::train::metrics::read(&metrics)?;
    run.warnings.extend(read.warnings);
    for (line, obj) in read.rows {
        merge_metrics_line(&mut run.rows, &obj).unwrap_or_else(|| run.warnings.push(format!("{} line {line}: no step", metrics.display())));
    }
    let eval = dir.join("eval.json");
    if eval.is_file() {
        match merge_eval_json(&mut run.rows, &eval) {
            Ok(by_position) => run.by_position = by_position,
            Err(e) => run.warnings.push(format!("eval.json: {e}")),
        }
    }
    Ok(run)
}

/// Merge one metrics.jsonl object into the row of its step (keys it has overwrite older values).
fn merge_metrics_line(rows: &mut BTreeMap<u64, Row>, obj: &serde_json::Map<String, Value>) -> Option<()> {
    let step = obj.get("step")?.as_u64()?;
    let row = rows.entry(step).or_default();
    for (k, v) in obj {
        if k == "step" {
            continue;
        }
        // serde_json writes NaN as null: keep it as NaN so the column exists and the old value is replaced.
        match v {
            Value::Number(n) => row.insert(k.clone(), n.as_f64().unwrap_or(f64::NAN)),
            Value::Null => row.insert(k.clone(), f64::NAN),
            _ => None,
        };
    }
    Some(())
}

/// eval.json = {"step": N, "corpora": {name: {protocol, ppl, word_ppl, …}}} → `eval/<name>/<field>`
/// at step N, named as metrics.jsonl names them (stream results as stream_ppl / stream_loss).
/// Returns each corpus's loss by position, where eval.json has one.
fn merge_eval_json(rows: &mut BTreeMap<u64, Row>, path: &Path) -> Result<BTreeMap<String, PositionLoss>> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).at(path)?)?;
    let step = v["step"].as_u64().ok_or_else(|| Error::Data("no integer `step`".into()))?;
    let corpora = v["corpora"].as_object().ok_or_else(|| Error::Data("no `corpora` object".into()))?;
    let row = rows.entry(step).or_default();
    let mut by_position = BTreeMap::new();
    for (name, result) in corpora {
        let Some(fields) = result.as_object() else { continue };
        if let Some(p) = fields.get("by_position") {
            let p: PositionLoss = serde_json::from_value(p.clone()).map_err(|e| Error::Data(format!("corpus `{name}`, by_position: {e}")))?;
            by_position.insert(name.clone(), p);
        }
        let stream = fields.get("protocol").and_then(Value::as_str) == Some("stream");
        for (field, value) in fields {
            let key = match (stream, field.as_str()) {
                (true, "ppl") => "stream_ppl",
                (true, "loss") => "stream_loss",
                (true, _) => continue,
                (false, f) => f,
            };
            let value = match value {
                Value::Number(n) => n.as_f64().unwrap_or(f64::NAN),
                Value::Null => f64::NAN,
                _ => continue,
            };
            row.insert(format!("eval/{name}/{key}"), value);
        }
    }
    Ok(by_position)
}
