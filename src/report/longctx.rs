//! Long-context tables: RULER and BABILong scores per run and length (the run directories'
//! ruler.json and babilong.json, written by `attnlab eval RUN --task …`), and STILL's routing-metric
//! and component ablations (still.md §9, §11) with the paper's numbers (data/papers/still.csv).
//!
//! Runs are training runs (config.yaml = Spec) or linearized ones (config.yaml = LinearizeSpec).
//! Ablation rows are matched by the linearized runs' `attention: {kind: still, routing, gate,
//! feature_map}`; runs compare when their specs differ only there (and in output and device).
use super::groups;
use super::paper::StillRow;
use super::render::{self, Cell};
use crate::eval::ruler;
use crate::linearize::LinearizeSpec;
use crate::attention::still::StillConfig;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The task name the ablations score S-NIAH with (the paper's S-NIAH-1).
pub const SNIAH: &str = "niah_single_1";
/// Rows every evaluated linearized run is expected to have in the long-context table (the STILL
/// paper's protocol); a training run is expected to have what its recipe's other runs were scored on.
const EXPECTED: [&str; 5] = ["niah_single_1", "niah_single_2", "niah_single_3", "babilong:qa1", "babilong:qa2"];

/// A STILL configuration as the ablations name it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct StillKey {
    pub routing: String,
    pub gate: bool,
    pub feature_map: String,
}

impl StillKey {
    pub fn label(&self) -> String {
        format!("routing {}, gate {}, {}", self.routing, if self.gate { "on" } else { "off" }, self.feature_map)
    }
}

pub struct LongRun {
    pub rel: String,
    /// Attention in words.
    pub attention: String,
    /// Set for linearized STILL runs.
    pub still: Option<StillKey>,
    /// A linearized run (STILL, LoLCATs, …), not a training run.
    pub linearized: bool,
    /// Runs with one recipe differ only in the ablated keys (and bookkeeping).
    pub recipe: String,
    /// RULER cells (task as in ruler.json) and BABILong cells (task `babilong:qa1`, …).
    pub cells: Vec<ruler::Cell>,
    pub warnings: Vec<String>,
}

impl LongRun {
    /// Score of `task` at `length`.
    pub fn score(&self, task: &str, length: usize) -> Option<f64> {
        self.cells.iter().find(|c| c.task == task && c.length == length).map(|c| c.score)
    }
    pub fn lengths(&self, task: &str) -> BTreeSet<usize> {
        self.cells.iter().filter(|c| c.task == task).map(|c| c.length).collect()
    }
    /// Mean over `lengths` of `task`, or None when one is missing.
    fn mean(&self, task: &str, lengths: &BTreeSet<usize>) -> Option<f64> {
        let v: Option<Vec<f64>> = lengths.iter().map(|&l| self.score(task, l)).collect();
        v.filter(|v| !v.is_empty()).map(|v| v.iter().sum::<f64>() / v.len() as f64)
    }
    /// BABILong-PG: the mean of qa1 and qa2 at `length` (evaluation.md §4.2).
    pub fn babilong(&self, length: usize) -> Option<f64> {
        Some((self.score("babilong:qa1", length)? + self.score("babilong:qa2", length)?) / 2.0)
    }
}

/// A finished table: header, body, and one line per row without a result.
pub struct Grid {
    pub id: String,
    pub title: String,
    pub notes: Vec<String>,
    pub head: Vec<String>,
    pub body: Vec<Vec<Cell>>,
    pub rows: usize,
    pub missing: Vec<String>,
}

impl Grid {
    pub fn filled(&self) -> usize {
        self.rows - self.missing.len()
    }
    pub fn render(&self, format: &str) -> String {
        match format {
            "md" => format!("**{}**\n\n{}", self.title, render::markdown_grid(&self.head, &self.body)),
            "tex" => render::latex_grid(&self.title, &self.head, &self.body),
            _ => render::csv_grid(&self.head, &self.body),
        }
    }
}

fn read_cells(path: &Path, prefix: &str, warnings: &mut Vec<String>) -> Vec<ruler::Cell> {
    let Ok(text) = std::fs::read_to_string(path) else { return Vec::new() };
    match serde_json::from_str::<Vec<ruler::Cell>>(&text) {
        Ok(cells) => cells.into_iter().map(|mut c| {
            // A cell evaluated with --set overrides (another κ, the oracle, …) is its own row.
            c.task = match &c.overrides {
                Some(o) => format!("{prefix}{} [{o}]", c.task),
                None => format!("{prefix}{}", c.task),
            };
            c
        }).collect(),
        Err(e) => {
            warnings.push(format!("{}: {e}", path.file_name().unwrap_or_default().to_string_lossy()));
            Vec::new()
        }
    }
}

/// Recipe id of a linearize spec: everything but the ablated keys, the run's name and output, and the device.
fn linearize_recipe(spec: &LinearizeSpec) -> String {
    let mut s = spec.clone();
    s.name = None;
    s.output = PathBuf::new();
    s.train.device = String::new();
    s.attention = s.attention.recipe_form();
    crate::util::short_hash(&s.to_yaml())[..6].to_string()
}

fn name<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_value(v).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default()
}

/// Every run directory below `root` with a readable config (training or linearize spec).
pub fn discover(root: &Path) -> crate::Result<Vec<LongRun>> {
    let mut dirs = Vec::new();
    super::load::find_run_dirs(root, &mut dirs)?;
    dirs.sort();
    let mut out = Vec::new();
    for dir in dirs {
        let Ok(text) = std::fs::read_to_string(dir.join("config.yaml")) else { continue };
        use crate::run_kind::RunKind;
        let kind = RunKind::of_config(&text);
        let linearized = matches!(kind, Ok(RunKind::Linearize));
        let (attention, still, recipe) = match kind {
            Ok(RunKind::Linearize) => {
                let Ok(spec) = LinearizeSpec::from_yaml(&text) else { continue };
                // STILL's runs are told apart by its ablated components; every other hybrid by its label.
                match spec.attention.options::<StillConfig>() {
                    Some(c) => {
                        let key = StillKey { routing: name(&c.routing), gate: c.gate, feature_map: name(&c.feature_map) };
                        (format!("{} ({})", spec.attention.table_name(), key.label()), Some(key), linearize_recipe(&spec))
                    }
                    None => (spec.attention.label(), None, linearize_recipe(&spec)),
                }
            }
            Ok(RunKind::Train) => {
                let Ok(spec) = crate::spec::from_str(&text, "config.yaml", &[]) else { continue };
                (spec.attention.comparable().label(), None, groups::key_id(&groups::recipe_key(&spec)))
            }
            // Finetune runs have no long-context rows yet; load::discover reports unreadable configs.
            _ => continue,
        };
        let mut warnings = Vec::new();
        let mut cells = read_cells(&dir.join("ruler.json"), "", &mut warnings);
        cells.extend(read_cells(&dir.join("babilong.json"), "babilong:", &mut warnings));
        let rel = match dir.strip_prefix(root) {
            Ok(p) if p.as_os_str().is_empty() => ".".into(),
            Ok(p) => p.to_string_lossy().into_owned(),
            Err(_) => dir.to_string_lossy().into_owned(),
        };
        out.push(LongRun { rel, attention, still, linearized, recipe, cells, warnings });
    }
    Ok(out)
}

fn num(v: Option<f64>) -> Cell {
    v.map_or(Cell::Empty, Cell::Num)
}

fn lengths_of<'a>(runs: impl IntoIterator<Item = &'a LongRun>, task: &str) -> BTreeSet<usize> {
    runs.into_iter().flat_map(|r| r.lengths(task)).collect()
}

fn len_title(l: usize) -> String {
    if l.is_multiple_of(1024) {
        format!("{}K", l / 1024)
    } else if l.is_multiple_of(512) {
        format!("{}K", l as f64 / 1024.0)
    } else {
        l.to_string()
    }
}

/// Every table: the long-context scores of all evaluated runs, then per recipe of linearized STILL
/// runs the routing and the component ablation.
pub fn build(runs: &[LongRun], paper: &[StillRow]) -> Vec<Grid> {
    let mut out = Vec::new();
    out.extend(scores(runs));
    let mut recipes: BTreeMap<&str, Vec<&LongRun>> = BTreeMap::new();
    for r in runs.iter().filter(|r| r.still.is_some()) {
        recipes.entry(r.recipe.as_str()).or_default().push(r);
    }
    for (recipe, members) in &recipes {
        out.push(ablation(recipe, members, paper, "routing"));
        out.push(ablation(recipe, members, paper, "component"));
    }
    out
}

/// RULER / BABILong per run: one row per (run, task), one column per length, and the mean.
fn scores(runs: &[LongRun]) -> Option<Grid> {
    let evaluated: Vec<&LongRun> = runs.iter().filter(|r| !r.cells.is_empty()).collect();
    if evaluated.is_empty() {
        return None;
    }
    let lengths: BTreeSet<usize> = evaluated.iter().flat_map(|r| r.cells.iter().map(|c| c.length)).collect();
    let mut head: Vec<String> = ["run", "attention", "task"].map(String::from).to_vec();
    head.extend(lengths.iter().map(|&l| len_title(l)));
    head.push("mean".into());
    let (mut body, mut missing, mut rows) = (Vec::new(), Vec::new(), 0);
    let order = |t: &str| ruler::TASKS.iter().position(|x| *x == t).unwrap_or(ruler::TASKS.len()) as i64;
    // A training sweep scores what its spec's eval.ruler asks: its runs are held to their recipe's tasks.
    let mut recipe_tasks: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for r in evaluated.iter().filter(|r| !r.linearized) {
        recipe_tasks.entry(r.recipe.as_str()).or_default().extend(r.cells.iter().map(|c| c.task.as_str()));
    }
    for r in &evaluated {
        let mut tasks: Vec<String> = if r.linearized {
            EXPECTED.iter().map(|t| t.to_string()).collect()
        } else {
            recipe_tasks[r.recipe.as_str()].iter().map(|t| t.to_string()).collect()
        };
        for c in &r.cells {
            if !tasks.contains(&c.task) {
                tasks.push(c.task.clone());
            }
        }
        tasks.sort_by_key(|t| (t.starts_with("babilong:"), order(t), t.clone()));
        let has_babilong = |l: usize| r.babilong(l).is_some();
        if lengths.iter().any(|&l| has_babilong(l)) {
            tasks.push("babilong (qa1+qa2)".into());
        }
        for t in &tasks {
            rows += 1;
            let vals: Vec<Option<f64>> = lengths.iter().map(|&l| if t == "babilong (qa1+qa2)" { r.babilong(l) } else { r.score(t, l) }).collect();
            let have: Vec<f64> = vals.iter().flatten().copied().collect();
            if have.is_empty() {
                let file = if t.starts_with("babilong:") { "babilong.json" } else { "ruler.json" };
                missing.push(format!("Long-context scores, {} {t}: not evaluated (no `{}` in {file}; run `attnlab eval {} --task {}`)", r.rel, t.trim_start_matches("babilong:"), r.rel, if t.starts_with("babilong:") { format!("{t} --essay … --babi …") } else { format!("ruler:{t}") }));
            }
            let mut row = vec![Cell::Text(r.rel.clone()), Cell::Text(r.attention.clone()), Cell::Text(t.clone())];
            row.extend(vals.iter().map(|v| num(*v)));
            row.push(num((!have.is_empty()).then(|| have.iter().sum::<f64>() / have.len() as f64)));
            body.push(row);
        }
    }
    Some(Grid {
        id: "long-context".into(),
        title: "Long-context scores: RULER (string match, %) and BABILong-style QA (accuracy, %) per target length".into(),
        notes: vec![
            "Rows: every run with a ruler.json or babilong.json. `mean`: over the lengths the row has. `babilong (qa1+qa2)`: the mean of qa1 and qa2 at each length (\"BABILong-PG\", evaluation.md §4.2: essay backgrounds, not comparable with the paper's PG-19 qa1–qa5 average).".into(),
        ],
        head,
        body,
        rows,
        missing,
    })
}

/// STILL's routing-metric (`routing`) or component (`component`) ablation for one recipe.
fn ablation(recipe: &str, runs: &[&LongRun], paper: &[StillRow], table: &str) -> Grid {
    let routing = table == "routing";
    // Rows: the paper's, then any other configuration we ran that belongs in this table.
    let mut slots: Vec<(StillKey, Option<&StillRow>)> = paper
        .iter()
        .filter(|p| p.table == table)
        .map(|p| (StillKey { routing: p.routing.clone(), gate: p.gate, feature_map: p.feature_map.clone() }, Some(p)))
        .collect();
    let default = |k: &StillKey| k.gate && k.feature_map == "np_map";
    for r in runs {
        let k = r.still.clone().expect("still runs");
        let belongs = if routing { default(&k) } else { k.routing == "self_saliency" || k.routing == "none" };
        if belongs && !slots.iter().any(|(s, _)| *s == k) {
            slots.push((k, None));
        }
    }
    let sniah_lengths = lengths_of(runs.iter().copied(), SNIAH);
    let qa_lengths: BTreeSet<usize> = lengths_of(runs.iter().copied(), "babilong:qa1").intersection(&lengths_of(runs.iter().copied(), "babilong:qa2")).copied().collect();
    let mut head: Vec<String> = if routing { vec!["routing".into(), "paper row".into()] } else { vec!["variant".into(), "routing".into(), "gate".into(), "feature map".into()] };
    if routing {
        head.extend(sniah_lengths.iter().map(|&l| format!("S-NIAH-1 {}", len_title(l))));
        head.extend(["S-NIAH-1 mean".to_string(), "BABILong mean".to_string(), "paper (mean 0.5K, 1K)".to_string()]);
    } else {
        head.extend(qa_lengths.iter().map(|&l| format!("BABILong {}", len_title(l))));
        head.extend(["S-NIAH-1 mean".to_string(), "paper BABILong 1K".to_string()]);
    }
    head.push("run".into());
    let (mut body, mut missing) = (Vec::new(), Vec::new());
    let what = if routing { "Routing ablation" } else { "Component ablation" };
    for (key, p) in &slots {
        let matching: Vec<&&LongRun> = runs.iter().filter(|r| r.still.as_ref() == Some(key)).collect();
        let need = |r: &LongRun| if routing { !r.lengths(SNIAH).is_empty() } else { qa_lengths.iter().any(|&l| r.babilong(l).is_some()) };
        let run = matching.iter().find(|r| need(r)).or(matching.first()).copied();
        let sniah = run.and_then(|r| r.mean(SNIAH, &r.lengths(SNIAH)));
        let name = p.map_or(key.label(), |p| p.variant.clone());
        match run {
            None => missing.push(format!("{what} ({recipe}), {name}: no linearized run with {}", key.label())),
            Some(r) if !need(r) => missing.push(format!(
                "{what} ({recipe}), {name}: run {} has no {}",
                r.rel,
                if routing { "niah_single_1 in ruler.json (`attnlab eval RUN --task ruler:niah_single_1 --lengths 512,1024`)" } else { "babilong qa1 and qa2 at one length in babilong.json (`attnlab eval RUN --task babilong:qa1 …`, then qa2)" }
            )),
            _ => {}
        }
        let mut row: Vec<Cell> = if routing {
            vec![Cell::Text(key.routing.clone()), p.map_or(Cell::Empty, |p| Cell::Text(p.variant.clone()))]
        } else {
            vec![Cell::Text(name.clone()), Cell::Text(key.routing.clone()), Cell::Text(if key.gate { "on" } else { "off" }.into()), Cell::Text(key.feature_map.clone())]
        };
        if routing {
            row.extend(sniah_lengths.iter().map(|&l| num(run.and_then(|r| r.score(SNIAH, l)))));
        } else {
            row.extend(qa_lengths.iter().map(|&l| num(run.and_then(|r| r.babilong(l)))));
        }
        row.push(num(sniah));
        if routing {
            // BABILong (qa1+qa2) over the lengths where the run has both: the "plus BABILong-style accuracy".
            let qa: Vec<f64> = run.map(|r| qa_lengths.iter().filter_map(|&l| r.babilong(l)).collect()).unwrap_or_default();
            row.push(num((!qa.is_empty()).then(|| qa.iter().sum::<f64>() / qa.len() as f64)));
        }
        row.push(num(p.map(|p| p.value)));
        row.push(run.map_or(Cell::Empty, |r| Cell::Text(r.rel.clone())));
        body.push(row);
    }
    let mut notes = vec![format!("Linearized STILL runs of recipe `{recipe}` (their specs differ only in attention.routing / gate / feature_map, output and device).")];
    if routing {
        notes.push("Rows: gate on and NP-Map, one per routing metric (still.md §4). Ours: S-NIAH-1 (RULER niah_single_1) per length and its mean over the lengths the run has (the paper's is the mean of 0.5K and 1K), and BABILong (qa1+qa2) averaged over the lengths the run has.".into());
    } else {
        notes.push("BABILong: mean of qa1 and qa2 accuracy (essay backgrounds, evaluation.md §4.2); the paper's is the qa1–qa5 average on PG-19 at 1K, shown alongside, not comparable.".into());
    }
    notes.push("Paper values: data/papers/still.csv (still.md §11, from a digest of arXiv 2602.02180; the ablations' model is not stated).".into());
    Grid {
        id: format!("still-{table}-{recipe}"),
        title: format!("{what} (STILL{}), recipe {recipe}", if routing { ", S-NIAH-1" } else { ": gate / NP-Map / selection" }),
        notes,
        head,
        rows: slots.len(),
        body,
        missing,
    }
}

#[cfg(test)]
mod recipe_tests {
    use super::*;

    /// Runs of one sweep differ in name, output and the ablated keys: one recipe; another stage
    /// length is another recipe.
    #[test]
    fn sweep_runs_share_a_recipe() {
        let spec = |name: &str, routing: &str, steps: u64| {
            LinearizeSpec::from_yaml(&format!(
                "{{name: {name}, teacher: t, attention: {{kind: still, routing: {routing}, gate: false}}, data: {{train: {{synthetic: {{}}}}}}, stage1: {{steps: {steps}}}, output: out/{name}}}"
            ))
            .unwrap()
        };
        let a = linearize_recipe(&spec("still-key_norm", "key_norm", 10));
        assert_eq!(a, linearize_recipe(&spec("still-random", "random", 10)));
        assert_ne!(a, linearize_recipe(&spec("still-random", "random", 11)));
    }
}
