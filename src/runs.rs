//! What a folder of run directories holds, as aligned tables: `attnlab runs RESULTS` (every run
//! directory below RESULTS: its command, status, step and final metrics) and the summaries
//! `linearize` and `finetune` print at the end.
//!
//! A run directory is a folder with `config.yaml` (train, linearize and finetune all write one).
//! Its status: `done` (a DONE marker), `partial` (metrics or checkpoints, no DONE) or `new`
//! (config only).
use crate::spec::{read_with_overrides, SpecSource};
use crate::{Error, IoContext, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Which command made a run directory.
pub use crate::run_kind::RunKind as Command;

/// The command of a run's config.yaml tree (`RunKind::of_value`).
pub fn command_of(cfg: &serde_yaml::Value) -> Command {
    Command::of_value(cfg)
}

/// `attnlab config`: the spec with every default filled in, as its run directory records it: a train
/// spec loaded, overridden, resolved and validated (`SpecSource::load`); a linearize spec
/// (`teacher:`) or a finetune spec (a `base:` model) merged, overridden and resolved as that command
/// records it in config.yaml.
pub fn config_yaml(src: &SpecSource) -> Result<String> {
    fn yaml<T: serde::Serialize>(path: &Path, v: &T) -> Result<String> {
        serde_yaml::to_string(v).map_err(|e| Error::Other(format!("{}: {e}", path.display())))
    }
    let Some(path) = src.path.as_deref() else { return Ok(src.load()?.to_yaml()) };
    match command_of(&crate::spec::base::read_tree(path)?.value) {
        Command::Train => Ok(src.load()?.to_yaml()),
        Command::Linearize => yaml(path, &read_with_overrides::<crate::linearize::LinearizeSpec>(path, &src.sets)?.resolved()),
        Command::Finetune => yaml(path, &read_with_overrides::<crate::finetune::FinetuneSpec>(path, &src.sets)?.resolved()),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Done,
    Partial,
    New,
}

impl Status {
    /// A run directory as a launcher (`sweep`) sees it before starting it: DONE → done; a
    /// config.yaml, i.e. a started run that `train` resumes → partial; else new.
    pub fn of(dir: &Path) -> Status {
        if dir.join("DONE").is_file() {
            Status::Done
        } else if dir.join("config.yaml").is_file() {
            Status::Partial
        } else {
            Status::New
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Status::Done => "done",
            Status::Partial => "partial",
            Status::New => "new",
        }
    }
}

/// One run directory as `attnlab runs` lists it.
#[derive(Debug, Clone)]
pub struct RunInfo {
    pub dir: PathBuf,
    pub command: Command,
    pub status: Status,
    pub progress: Progress,
    /// The last logged training loss.
    pub loss: Option<f64>,
    /// Final metrics (eval.json) of a finished run, else the last evaluation logged: `name value` pairs.
    pub metrics: Vec<(String, f64)>,
}

/// How far a run got: the last step any metrics row names, of the planned steps (where the config
/// records them: train). Shown as `20/100`, `20`, `0/100` or `-`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Progress {
    pub step: Option<u64>,
    pub of: Option<u64>,
}

impl std::fmt::Display for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.step, self.of) {
            (Some(s), Some(t)) => write!(f, "{s}/{t}"),
            (Some(s), None) => write!(f, "{s}"),
            (None, Some(t)) => write!(f, "0/{t}"),
            (None, None) => write!(f, "-"),
        }
    }
}

/// Every run directory below `root` (or `root` itself), sorted by path. Run directories are not
/// searched further (their checkpoints and exports are not runs).
pub fn list(root: &Path) -> Result<Vec<RunInfo>> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        if dir.join("config.yaml").is_file() {
            out.push(inspect(&dir)?);
            continue;
        }
        for entry in std::fs::read_dir(&dir).at(&dir)? {
            let p = entry.at(&dir)?.path();
            if p.is_dir() {
                stack.push(p);
            }
        }
    }
    out.sort_by(|a, b| a.dir.cmp(&b.dir));
    Ok(out)
}

fn read_json(p: &Path) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()
}

/// Read one run directory.
pub fn inspect(dir: &Path) -> Result<RunInfo> {
    let cp = dir.join("config.yaml");
    let cfg: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(&cp).at(&cp)?).unwrap_or(serde_yaml::Value::Null);
    let command = command_of(&cfg);
    let rows: Vec<Value> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let step = rows.iter().filter_map(|r| r["step"].as_u64()).max();
    let loss = rows.iter().rev().find_map(|r| r["loss"].as_f64());
    // A listed run has a config.yaml; until it logged or checkpointed anything it counts as new.
    let status = match Status::of(dir) {
        Status::Partial if rows.is_empty() && !dir.join("checkpoints").is_dir() => Status::New,
        s => s,
    };
    let done = status == Status::Done;
    let progress = Progress { step, of: (command == Command::Train).then(|| cfg["train"]["steps"].as_u64()).flatten() };
    let final_eval = if done { read_json(&dir.join("eval.json")) } else { None };
    let metrics = match final_eval {
        Some(e) => final_metrics(command, &e),
        None => last_logged(&rows),
    };
    Ok(RunInfo { dir: dir.to_path_buf(), command, status, progress, loss, metrics })
}

/// The headline numbers of an eval.json.
fn final_metrics(command: Command, e: &Value) -> Vec<(String, f64)> {
    let pick = |pairs: &[(&str, &str, &str)]| -> Vec<(String, f64)> {
        pairs.iter().filter_map(|(name, a, b)| e[a][b].as_f64().map(|v| (name.to_string(), v))).collect()
    };
    match command {
        Command::Train => e["corpora"]
            .as_object()
            .map(|m| m.iter().filter_map(|(c, r)| r["ppl"].as_f64().map(|v| (format!("{c} ppl"), v))).collect())
            .unwrap_or_default(),
        Command::Linearize => pick(&[("teacher ppl", "teacher", "ppl"), ("student ppl", "student", "ppl")]),
        Command::Finetune => pick(&[("base ppl", "base", "ppl"), ("finetuned ppl", "finetuned", "ppl")]),
    }
}

/// The last evaluation a metrics.jsonl logged: `eval/<corpus>/ppl` (train) or `val_loss` (stages).
fn last_logged(rows: &[Value]) -> Vec<(String, f64)> {
    for r in rows.iter().rev() {
        let Some(m) = r.as_object() else { continue };
        let ppl: Vec<(String, f64)> = m
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("eval/")?.strip_suffix("/ppl")?.to_string(), v.as_f64()?)))
            .map(|(c, v)| (format!("{c} ppl"), v))
            .collect();
        if !ppl.is_empty() {
            return ppl;
        }
        if let Some(v) = m.get("val_loss").and_then(Value::as_f64) {
            return vec![(format!("stage {} val_loss", m.get("stage").and_then(Value::as_u64).unwrap_or(0)), v)];
        }
    }
    Vec::new()
}

/// Columns padded to their widest cell; cells that parse as numbers are right-aligned.
pub fn aligned(header: &[&str], rows: &[Vec<String>]) -> String {
    columns(header, rows, true)
}

/// Columns padded to their widest cell, two spaces apart, trailing blanks trimmed; with
/// `right_align_numbers`, cells that parse as numbers (also `12%`, `3/10`) are right-aligned.
pub fn columns(header: &[&str], rows: &[Vec<String>], right_align_numbers: bool) -> String {
    let n = header.len();
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate().take(n) {
            width[i] = width[i].max(c.chars().count());
        }
    }
    let numeric = |c: &str| c.trim_end_matches('%').replace('/', "").parse::<f64>().is_ok();
    let line = |cells: Vec<&str>, align: bool| {
        let parts: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let pad = width[i] - c.chars().count();
                if align && right_align_numbers && numeric(c) { format!("{}{c}", " ".repeat(pad)) } else { format!("{c}{}", " ".repeat(pad)) }
            })
            .collect();
        parts.join("  ").trim_end().to_string()
    };
    let mut out = line(header.to_vec(), false) + "\n";
    for r in rows {
        let cells: Vec<&str> = (0..n).map(|i| r.get(i).map(String::as_str).unwrap_or("")).collect();
        out += &(line(cells, true) + "\n");
    }
    out
}

/// `attnlab runs`: one row per run directory (paths relative to `root`).
pub fn table(root: &Path, runs: &[RunInfo]) -> String {
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            let rel = r.dir.strip_prefix(root).ok().filter(|p| !p.as_os_str().is_empty()).unwrap_or(r.dir.as_path());
            let metrics = r.metrics.iter().map(|(k, v)| format!("{k} {}", fmt(*v))).collect::<Vec<_>>().join(", ");
            vec![rel.display().to_string(), r.command.name().into(), r.status.name().into(), r.progress.to_string(), r.loss.map(fmt).unwrap_or_else(|| "-".into()), metrics]
        })
        .collect();
    aligned(&["run", "command", "status", "step", "loss", "metrics"], &rows)
}

/// `attnlab runs RESULTS`: the table of every run directory below `root`.
pub fn listing(root: &Path) -> Result<String> {
    Ok(table(root, &list(root)?))
}

/// 4 significant-ish digits without exponent noise for the usual ranges.
fn fmt(v: f64) -> String {
    if v.abs() >= 1000.0 {
        format!("{v:.1}")
    } else if v.abs() >= 1.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.4}")
    }
}

/// The end-of-run table of `attnlab linearize`: held-out loss and perplexity, teacher vs student.
pub fn linearize_summary(dir: &Path, eval: &Value) -> String {
    two_model_summary(dir, eval, ("teacher", "teacher"), ("student", "student"))
}

/// The end-of-run table of `attnlab finetune`: held-out loss and perplexity, base vs fine-tuned.
pub fn finetune_summary(dir: &Path, eval: &Value) -> String {
    two_model_summary(dir, eval, ("base", "base"), ("finetuned", "fine-tuned"))
}

fn two_model_summary(dir: &Path, eval: &Value, (a, a_name): (&str, &str), (b, b_name): (&str, &str)) -> String {
    let cell = |m: &str, k: &str| eval[m][k].as_f64().map(fmt).unwrap_or_else(|| "-".into());
    let rows = vec![
        vec![a_name.to_string(), cell(a, "loss"), cell(a, "ppl")],
        vec![b_name.to_string(), cell(b, "loss"), cell(b, "ppl")],
    ];
    let delta = match (eval[a]["ppl"].as_f64(), eval[b]["ppl"].as_f64()) {
        (Some(x), Some(y)) if x > 0.0 => format!(", {b_name} ppl {:+.2}% against {a_name}", 100.0 * (y / x - 1.0)),
        _ => String::new(),
    };
    let shape = format!(
        "{}: held-out {} rows of {} tokens at step {}{delta}\n",
        dir.display(),
        eval["rows"].as_u64().map_or("-".into(), |v| v.to_string()),
        eval["seq_len"].as_u64().map_or("-".into(), |v| v.to_string()),
        eval["step"].as_u64().map_or("-".into(), |v| v.to_string())
    );
    shape + &aligned(&["model", "loss", "ppl"], &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `attnlab config`: each command's spec resolved as its run directory records it (the kind told
    /// by the spec's keys).
    #[test]
    fn config_yaml_resolves_each_command_spec() {
        assert!(config_yaml(&SpecSource::default()).unwrap().contains("steps:"));
        let tmp = tempfile::tempdir().unwrap();
        let file = |name: &str, text: &str| {
            let p = tmp.path().join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let ft = file("ft.yaml", "base: some/llama\ndata: {train: {path: chat.jsonl}}\noutput: o\n");
        let text = config_yaml(&SpecSource { path: Some(ft), sets: vec!["stage1.lr=0.001".into()], out: None }).unwrap();
        let back = crate::finetune::FinetuneSpec::from_yaml(&text).unwrap();
        assert_eq!((back.stage1.lr, back.stage2.lr), (Some(0.001), Some(3e-5)), "{text}");
        let lin = file("lin.yaml", "teacher: t\nattention: {kind: still}\ndata: {train: {alpaca: a.jsonl}}\noutput: o\n");
        let text = config_yaml(&SpecSource { path: Some(lin.clone()), ..Default::default() }).unwrap();
        assert_eq!(crate::linearize::LinearizeSpec::from_yaml(&text).unwrap(), crate::linearize::LinearizeSpec::from_file(&lin).unwrap().resolved());
    }

    #[test]
    fn aligned_pads_columns_and_right_aligns_numbers() {
        let t = aligned(&["run", "ppl"], &[vec!["a".into(), "12.5".into()], vec!["longer".into(), "3".into()]]);
        assert_eq!(t, "run     ppl\na       12.5\nlonger     3\n");
    }

    #[test]
    fn lists_nested_runs_with_command_status_and_metrics() {
        let root = tempfile::tempdir().unwrap();
        let w = |rel: &str, text: &str| {
            let p = root.path().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        };
        w("sweep/a-1/config.yaml", "model: {flavor: tiny}\ntrain: {steps: 20}\n");
        w("sweep/a-1/metrics.jsonl", "{\"step\": 10, \"loss\": 3.5}\n{\"step\": 20, \"loss\": 3.25}\n{\"step\": 20, \"eval/wiki/ppl\": 40.0}\n");
        w("sweep/a-1/eval.json", "{\"step\": 20, \"corpora\": {\"wiki\": {\"ppl\": 41.5}}}");
        w("sweep/a-1/DONE", "");
        // A checkpoint folder inside a run is not a run, even with a config-like file.
        w("sweep/a-1/checkpoints/20/config.yaml", "x: 1\n");
        w("lin/config.yaml", "teacher: hf:x\n");
        w("lin/metrics.jsonl", "{\"step\": 4, \"stage\": 1, \"loss\": 0.5}\n{\"step\": 4, \"stage\": 1, \"val_loss\": 0.25}\n");
        w("ft/config.yaml", "base: results/teacher\n");
        w("not-a-run/notes.txt", "");
        let runs = list(root.path()).unwrap();
        let got: Vec<(String, &str, &str)> = runs.iter().map(|r| (r.dir.strip_prefix(root.path()).unwrap().display().to_string(), r.command.name(), r.status.name())).collect();
        assert_eq!(got, [("ft".into(), "finetune", "new"), ("lin".into(), "linearize", "partial"), ("sweep/a-1".into(), "train", "done")]);
        assert_eq!((runs[2].progress, runs[2].loss), (Progress { step: Some(20), of: Some(20) }, Some(3.25)));
        assert_eq!([runs[0].progress, runs[1].progress].map(|p| p.to_string()), ["-", "4"]);
        // Finished: eval.json's numbers, not the last logged row's.
        assert_eq!(runs[2].metrics, [("wiki ppl".to_string(), 41.5)]);
        assert_eq!(runs[1].metrics, [("stage 1 val_loss".to_string(), 0.25)]);
        let t = table(root.path(), &runs);
        assert!(t.lines().nth(3).unwrap().starts_with("sweep/a-1  train      done     20/20   3.250  wiki ppl 41.500"), "{t}");
    }

    #[test]
    fn staged_summaries_compare_the_two_models() {
        let e: Value = serde_json::from_str(r#"{"step": 8, "rows": 2, "seq_len": 64, "teacher": {"loss": 2.0, "ppl": 7.389}, "student": {"loss": 2.1, "ppl": 8.166}}"#).unwrap();
        let t = linearize_summary(Path::new("runs/x"), &e);
        assert!(t.starts_with("runs/x: held-out 2 rows of 64 tokens at step 8, student ppl +10.52% against teacher\n"), "{t}");
        assert!(t.contains("teacher  2.000  7.389") && t.contains("student  2.100  8.166"), "{t}");
    }
}
