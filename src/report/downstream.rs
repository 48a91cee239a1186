//! The downstream table (DAR's Table 4): every run directory below the results folder that holds
//! `tasks/*.json` (written by `attnlab eval RUN --task NAME`), grouped by parent folder and model
//! width, one row per run, each task's primary metric beside the paper's value for the same
//! d_model / d_down ratio, the plain average, and Rel.(%) = 100 · mean over tasks of
//! score / score(baseline) (dar.md §6), the baseline being the group's d_down = d_model run (or its
//! vanilla run). The paper's numbers come from data/papers/dar_downstream.csv.
use crate::eval::tasks::{ModelInfo, TaskResult};
use crate::{Error, IoContext, Result};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

pub const CSV: &str = include_str!("../../data/papers/dar_downstream.csv");
/// The paper's six tasks, in its column order.
pub const TASKS: [&str; 6] = ["mmlu", "hellaswag", "commonsense_qa", "gsm8k", "mbpp", "multi_news"];
const TITLES: [&str; 6] = ["MMLU", "HellaSwag", "CSQA", "GSM8K", "MBPP", "Multi-News"];

#[derive(Debug, Clone, PartialEq)]
pub struct PaperRow {
    pub d_model: usize,
    pub d_down: usize,
    pub scores: BTreeMap<String, f64>,
    pub avg: f64,
    pub rel: f64,
    pub note: String,
}

pub fn paper() -> Result<Vec<PaperRow>> {
    let bad = |line: usize, msg: String| Error::Data(format!("data/papers/dar_downstream.csv line {line}: {msg}"));
    let mut lines = CSV.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
    let cols: Vec<&str> = lines.next().map(|(_, h)| h.split(',').map(str::trim).collect()).unwrap_or_default();
    let mut rows = Vec::new();
    for (i, line) in lines {
        let cells: Vec<&str> = line.splitn(cols.len(), ',').map(str::trim).collect();
        let get = |name: &str| -> Result<f64> {
            let at = cols.iter().position(|c| *c == name).ok_or_else(|| bad(1, format!("no column `{name}`")))?;
            let s = cells.get(at).copied().unwrap_or("");
            s.parse::<f64>().map_err(|_| bad(i + 1, format!("`{name}` = `{s}` is not a number")))
        };
        let mut scores = BTreeMap::new();
        for t in TASKS {
            scores.insert(t.to_string(), get(t)?);
        }
        rows.push(PaperRow {
            d_model: get("d_model")? as usize,
            d_down: get("d_down")? as usize,
            scores,
            avg: get("avg")?,
            rel: get("rel")?,
            note: cells.get(cols.len() - 1).unwrap_or(&"").to_string(),
        });
    }
    Ok(rows)
}

/// Rel.(%) over the tasks both have: 100 · mean of score / baseline score. None without common tasks.
pub fn rel(scores: &BTreeMap<String, f64>, base: &BTreeMap<String, f64>) -> Option<(f64, usize)> {
    let ratios: Vec<f64> = scores.iter().filter_map(|(t, v)| base.get(t).filter(|b| **b > 0.0).map(|b| v / b)).collect();
    (!ratios.is_empty()).then(|| (100.0 * ratios.iter().sum::<f64>() / ratios.len() as f64, ratios.len()))
}

/// One evaluated run: its primary score per task.
#[derive(Debug, Clone)]
pub struct DownRun {
    /// Run directory relative to the results folder.
    pub rel: String,
    pub model: ModelInfo,
    pub scores: BTreeMap<String, f64>,
    /// Task → the metric shown (acc, exact_match,strict-match, …).
    pub metric: BTreeMap<String, String>,
    /// Task → (documents kept, documents in all, min_context) where a min_context filter applied.
    pub kept: BTreeMap<String, (usize, usize, usize)>,
}

impl DownRun {
    fn label(&self) -> String {
        match self.model.d_down {
            Some(d) => d.to_string(),
            None => format!("{} (vanilla)", self.model.d_model),
        }
    }
    /// The d_model / d_down ratio (1 for vanilla).
    fn ratio(&self) -> Option<usize> {
        match self.model.d_down {
            None => Some(1),
            Some(d) if d > 0 && self.model.d_model.is_multiple_of(d) => Some(self.model.d_model / d),
            _ => None,
        }
    }
}

/// Every run directory below `root` with task results, sorted by path.
pub fn collect(root: &Path) -> Result<Vec<DownRun>> {
    let mut dirs = Vec::new();
    find(root, &mut dirs)?;
    dirs.sort();
    let mut runs = Vec::new();
    for dir in dirs {
        let tasks = dir.join("tasks");
        let mut scores = BTreeMap::new();
        let mut metric = BTreeMap::new();
        let mut model = None;
        let mut kept = BTreeMap::new();
        let mut files: Vec<PathBuf> = std::fs::read_dir(&tasks).at(&tasks)?.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == "json")).collect();
        files.sort();
        for f in files {
            let text = std::fs::read_to_string(&f).at(&f)?;
            let Ok(r) = serde_json::from_str::<TaskResult>(&text) else { continue };
            model.get_or_insert(r.model.clone());
            scores.insert(r.task.clone(), r.primary);
            metric.insert(r.task.clone(), r.primary_metric.clone());
            if r.min_context > 0 {
                kept.insert(r.task.clone(), (r.docs, r.docs_total, r.min_context));
            }
        }
        if let Some(model) = model {
            let rel = dir.strip_prefix(root).map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
            runs.push(DownRun { rel: if rel.is_empty() { ".".into() } else { rel }, model, scores, metric, kept });
        }
    }
    Ok(runs)
}

fn find(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    if dir.join("tasks").is_dir() {
        out.push(dir.to_path_buf());
    }
    for e in std::fs::read_dir(dir).at(dir)?.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if p.is_dir() && !name.starts_with('.') && !["tasks", "checkpoints", "report"].contains(&name.as_str()) {
            find(&p, out)?;
        }
    }
    Ok(())
}

pub struct Row {
    pub run: DownRun,
    pub paper: Option<PaperRow>,
    pub avg: Option<f64>,
    pub rel: Option<f64>,
    /// Tasks our Rel.(%) averages over.
    pub rel_tasks: usize,
    /// The paper's Rel.(%) over only the tasks ours uses, when that is fewer than six.
    pub paper_rel_same: Option<f64>,
}

pub struct Table {
    pub id: String,
    pub title: String,
    pub notes: Vec<String>,
    pub rows: Vec<Row>,
}

/// Tables from the runs: one per (parent folder, d_model).
pub fn build(runs: &[DownRun], paper: &[PaperRow]) -> Vec<Table> {
    let mut groups: BTreeMap<(String, usize), Vec<&DownRun>> = BTreeMap::new();
    for r in runs {
        let parent = Path::new(&r.rel).parent().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
        groups.entry((parent, r.model.d_model)).or_default().push(r);
    }
    let paper_base = paper.iter().find(|p| p.d_down == p.d_model);
    let mut tables = Vec::new();
    for ((parent, d), mut members) in groups {
        // Widest bottleneck first; vanilla (no bottleneck) first of all.
        members.sort_by_key(|r| (std::cmp::Reverse(r.model.d_down.unwrap_or(usize::MAX)), r.rel.clone()));
        let base = members.iter().find(|r| r.model.d_down == Some(d)).or_else(|| members.iter().find(|r| r.model.d_down.is_none())).copied();
        let mut notes = vec![format!(
            "Scores: each task's primary metric ({}). Avg. = plain mean over the six tasks (shown only when all six exist); Rel.(%) = 100 · mean over tasks of score / score(baseline) (dar.md §6).",
            TASKS.iter().filter_map(|t| members.iter().find_map(|r| r.metric.get(*t)).map(|m| format!("{t}: {m}"))).collect::<Vec<_>>().join(", ")
        )];
        match base {
            Some(b) if b.model.d_down.is_none() => notes.push(format!("Baseline: `{}` ({}): the group has no DAR run with d_down = d_model, the paper's baseline.", b.rel, b.label())),
            Some(b) => notes.push(format!("Baseline: `{}` (d_down = {} = d_model, as the paper's Table 4).", b.rel, b.label())),
            None => notes.push("No baseline run (d_down = d_model or vanilla) in this group: Rel.(%) is not computed.".into()),
        }
        notes.push("Paper columns: DAR Table 4 (OLMo-2-1B-SFT, d = 2048), matched by d_model / d_down.".into());
        // The paper scores only samples whose input is at least w tokens long: say what was kept.
        let kept: Vec<String> = members
            .iter()
            .flat_map(|r| r.kept.iter().map(move |(t, (k, n, m))| format!("`{}` {t}: {k} of {n} (inputs ≥ {m} tokens)", r.rel)))
            .collect();
        if !kept.is_empty() {
            notes.push(format!("Documents kept by the min_context filter: {}.", kept.join("; ")));
        }
        let rows = members
            .iter()
            .map(|r| {
                let p = r.ratio().and_then(|k| paper.iter().find(|p| p.d_model / p.d_down == k && p.d_model.is_multiple_of(p.d_down))).cloned();
                let (rel_v, n) = base.and_then(|b| rel(&r.scores, &b.scores)).map_or((None, 0), |(v, n)| (Some(v), n));
                let all = TASKS.iter().all(|t| r.scores.contains_key(*t));
                let avg = all.then(|| TASKS.iter().map(|t| r.scores[*t]).sum::<f64>() / 6.0);
                let paper_rel_same = match (&p, paper_base, base) {
                    (Some(p), Some(pb), Some(b)) if n > 0 && n < 6 => {
                        // The tasks our Rel.(%) used: both have a score and the baseline's is not 0.
                        let used = |t: &String| r.scores.contains_key(t) && b.scores.get(t).is_some_and(|v| *v > 0.0);
                        let common = |m: &BTreeMap<String, f64>| m.iter().filter(|(t, _)| used(t)).map(|(t, v)| (t.clone(), *v)).collect();
                        rel(&common(&p.scores), &pb.scores).map(|x| x.0)
                    }
                    _ => None,
                };
                Row { run: (*r).clone(), paper: p, avg, rel: rel_v, rel_tasks: n, paper_rel_same }
            })
            .collect::<Vec<_>>();
        if rows.iter().any(|r| r.rel_tasks > 0 && r.rel_tasks < 6) {
            notes.push("Our Rel.(%) averages over the tasks both the row and the baseline have, leaving out tasks where the baseline scores 0 (no ratio); \"paper Rel.% (same tasks)\" recomputes the paper's over those.".into());
        }
        let where_ = if parent.is_empty() { "results".to_string() } else { format!("`{parent}`") };
        tables.push(Table {
            id: format!("downstream-d{d}-{}", parent.replace(['/', ' '], "_")).trim_end_matches('-').to_string(),
            title: format!("Downstream tasks (DAR Table 4), d_model {d}, runs in {where_}"),
            notes,
            rows,
        });
    }
    tables
}

fn header(t: &Table) -> Vec<String> {
    let mut h = vec!["d_down".to_string()];
    for title in TITLES {
        h.push(title.to_string());
        h.push(format!("paper {title}"));
    }
    h.extend(["Avg.", "paper Avg.", "Rel.%", "paper Rel.%"].map(String::from));
    if t.rows.iter().any(|r| r.paper_rel_same.is_some()) {
        h.push("paper Rel.% (same tasks)".into());
    }
    h.push("run".into());
    h
}

fn cells(t: &Table, r: &Row, num: &dyn Fn(Option<f64>) -> String) -> Vec<String> {
    let mut c = vec![r.run.label()];
    for task in TASKS {
        c.push(num(r.run.scores.get(task).copied()));
        c.push(num(r.paper.as_ref().map(|p| p.scores[task])));
    }
    c.push(num(r.avg));
    c.push(num(r.paper.as_ref().map(|p| p.avg)));
    c.push(num(r.rel));
    c.push(num(r.paper.as_ref().map(|p| p.rel)));
    if t.rows.iter().any(|r| r.paper_rel_same.is_some()) {
        c.push(num(r.paper_rel_same));
    }
    c.push(r.run.rel.clone());
    c
}

pub fn markdown(t: &Table) -> String {
    let h = header(t);
    let mut o = format!("| {} |\n|{}|\n", h.join(" | "), h.iter().map(|_| "---").collect::<Vec<_>>().join("|"));
    let num = |v: Option<f64>| v.map_or("–".to_string(), |x| if x > 1.5 { format!("{x:.2}") } else { format!("{x:.4}") });
    for r in &t.rows {
        let _ = writeln!(o, "| {} |", cells(t, r, &num).join(" | "));
    }
    o
}

pub fn csv(t: &Table) -> String {
    let quote = |s: &str| if s.contains([',', '"']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_string() };
    let num = |v: Option<f64>| v.map_or(String::new(), |x| x.to_string());
    let mut o = header(t).iter().map(|h| quote(h)).collect::<Vec<_>>().join(",") + "\n";
    for r in &t.rows {
        o += &(cells(t, r, &num).iter().map(|c| quote(c)).collect::<Vec<_>>().join(",") + "\n");
    }
    o
}

/// The report.md section.
pub fn section(tables: &[Table], files: &BTreeMap<String, Vec<PathBuf>>) -> String {
    let mut o = String::from("## Downstream tasks (DAR Table 4)\n\n");
    if tables.is_empty() {
        o += "No run has task results (`attnlab eval RUN --task mmlu|hellaswag|commonsense_qa|gsm8k|mbpp|multi_news` writes RUN/tasks/NAME.json).\n\n";
    }
    for t in tables {
        let _ = writeln!(o, "### {}\n", t.title);
        for n in &t.notes {
            let _ = writeln!(o, "{n}\n");
        }
        o += &markdown(t);
        o.push('\n');
        if let Some(f) = files.get(&t.id) {
            let _ = writeln!(o, "Files: {}\n", f.iter().map(|p| format!("[{}]({})", p.extension().unwrap_or_default().to_string_lossy(), p.display())).collect::<Vec<_>>().join(", "));
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::tasks::TaskResult;

    /// The paper's Rel.(%) follows from its task scores by the mean of ratios (dar.md §6: all six
    /// rows), and its Avg. is the plain mean — an independent check of the transcription and of `rel`.
    #[test]
    fn paper_rel_recomputes_from_scores() {
        let rows = paper().unwrap();
        assert_eq!(rows.len(), 6);
        let base = rows.iter().find(|r| r.d_down == 2048).unwrap();
        for r in &rows {
            let (v, n) = rel(&r.scores, &base.scores).unwrap();
            assert_eq!(n, 6);
            assert!((v - r.rel).abs() < 0.006, "d_down {}: {v} vs {}", r.d_down, r.rel);
            let avg = r.scores.values().sum::<f64>() / 6.0;
            assert!((avg - r.avg).abs() < 6e-5, "d_down {}: avg {avg} vs {}", r.d_down, r.avg);
        }
    }

    fn write_run(root: &Path, name: &str, d_down: Option<usize>, scores: &[(&str, f64)]) {
        for (task, v) in scores {
            let r = TaskResult {
                task: task.to_string(),
                model: ModelInfo { step: 10, arch: "llama".into(), attention: if d_down.is_some() { "dar" } else { "vanilla" }.into(), d_model: 64, d_down, window: d_down.map(|_| 128) },
                docs: 10,
                docs_total: 10,
                min_context: 0,
                num_fewshot: 0,
                metrics: [("acc".to_string(), *v)].into_iter().collect(),
                primary_metric: "acc".into(),
                primary: *v,
                breakdown: BTreeMap::new(),
                notes: Vec::new(),
                seconds: 1.0,
            };
            crate::eval::tasks::write(&root.join(name), &r, &[]).unwrap();
        }
    }

    /// Runs found below the results folder, baseline = d_down = d_model, Rel.(%) by hand, paper rows by ratio.
    #[test]
    fn table_from_task_results() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        write_run(root, "sweep/full", Some(64), &[("mmlu", 0.40), ("gsm8k", 0.20)]);
        write_run(root, "sweep/d16", Some(16), &[("mmlu", 0.30), ("gsm8k", 0.30)]);
        write_run(root, "sweep/d8", Some(8), &[("mmlu", 0.20)]);
        write_run(root, "sweep/full", Some(64), &[("mbpp", 0.0)]);
        write_run(root, "sweep/d16", Some(16), &[("mbpp", 0.1)]);
        std::fs::write(root.join("sweep/d8/tasks/broken.json"), "{").unwrap();
        let runs = collect(root).unwrap();
        assert_eq!(runs.len(), 3);
        let tables = build(&runs, &paper().unwrap());
        assert_eq!(tables.len(), 1);
        let t = &tables[0];
        let labels: Vec<String> = t.rows.iter().map(|r| r.run.label()).collect();
        assert_eq!(labels, ["64", "16", "8"]);
        // d16: (0.30/0.40 + 0.30/0.20) / 2 = (0.75 + 1.5) / 2 = 112.5 % (MBPP left out: the baseline scores 0).
        assert!((t.rows[1].rel.unwrap() - 112.5).abs() < 1e-9);
        assert!((t.rows[0].rel.unwrap() - 100.0).abs() < 1e-9);
        // d8: only MMLU → 50 %, over one task.
        assert_eq!((t.rows[2].rel, t.rows[2].rel_tasks), (Some(50.0), 1));
        // Ratios 1, 4, 8 → paper rows 2048, 512, 256.
        let pd: Vec<usize> = t.rows.iter().map(|r| r.paper.as_ref().unwrap().d_down).collect();
        assert_eq!(pd, [2048, 512, 256]);
        // Paper Rel over MMLU + GSM8K for d_down 512: (0.4051/0.4044 + 0.4114/0.4450) / 2.
        let want = 100.0 * (0.4051 / 0.4044 + 0.4114 / 0.4450) / 2.0;
        assert!((t.rows[1].paper_rel_same.unwrap() - want).abs() < 1e-9);
        assert!(t.rows.iter().all(|r| r.avg.is_none()), "Avg. needs all six tasks");
        let md = markdown(t);
        assert!(md.contains("| 16 | 0.3000 | 0.4051 |"), "{md}");
        assert_eq!(t.rows[1].rel_tasks, 2);
        assert!(csv(t).lines().count() == 4);
    }
}
