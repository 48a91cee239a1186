//! RULER scores by attention arm over seeds, per recipe: each configuration's score at each task and
//! length pooled over the seeds of runs that scored it (ruler.json, from `eval.ruler` or `attnlab eval
//! --task ruler:…`), and the paired differences between arms (A − B per seed). On the needle-trained
//! sweep, DAR − window-only above the window's reach is what the distant path retrieves. Cells with
//! `--set` overrides (linearized students) are the STILL ablation's, not an arm's.
use super::groups;
use super::load::Run;
use super::longctx::Grid;
use super::render::Cell;
use super::stats::Stat;
use crate::spec::AttentionSpec;
use std::collections::{BTreeMap, BTreeSet};

/// (task, length) → score, %: a run's RULER cells as trained (not the recall test's own cells).
fn read(run: &Run) -> BTreeMap<(String, usize), f64> {
    let Ok(text) = std::fs::read_to_string(run.dir.join("ruler.json")) else { return BTreeMap::new() };
    let cells: Vec<crate::eval::ruler::Cell> = serde_json::from_str(&text).unwrap_or_default();
    cells.into_iter().filter(|c| c.overrides.is_none() && c.task != "recall").map(|c| ((c.task, c.length), c.score)).collect()
}

/// Per recipe with RULER scores in at least two runs: the pooled table and the paired differences.
pub fn build(runs: &[Run]) -> Vec<Grid> {
    let all: Vec<&Run> = runs.iter().collect();
    let mut out = Vec::new();
    for (key, members) in groups::by_recipe(&all) {
        // configuration → seed → (task, length) → score
        let mut arms: Vec<(AttentionSpec, BTreeMap<u64, BTreeMap<(String, usize), f64>>)> = Vec::new();
        let mut scored = 0;
        for r in &members {
            let scores = read(r);
            if scores.is_empty() {
                continue;
            }
            scored += 1;
            let c = r.spec.attention.comparable();
            match arms.iter_mut().find(|(a, _)| *a == c) {
                Some((_, seeds)) => {
                    seeds.insert(r.spec.seed(), scores);
                }
                None => arms.push((c, BTreeMap::from([(r.spec.seed(), scores)]))),
            }
        }
        if scored < 2 {
            continue;
        }
        arms.sort_by_key(|(c, _)| (groups::arm_rank(c), std::cmp::Reverse(c.d_down_width()), std::cmp::Reverse(c.window_len())));
        let points: BTreeSet<(String, usize)> = arms.iter().flat_map(|(_, s)| s.values().flat_map(|m| m.keys().cloned())).collect();
        let id = format!("ruler-{}-{}", groups::scale(&members[0].spec), groups::key_id(&key));
        let mut body = Vec::new();
        for p in &points {
            for (c, seeds) in &arms {
                let at: Vec<f64> = seeds.values().filter_map(|m| m.get(p).copied()).collect();
                let Some(st) = Stat::of(&at) else { continue };
                body.push(vec![Cell::Text(c.label()), Cell::Text(p.0.clone()), Cell::Text(p.1.to_string()), Cell::Text(at.len().to_string()), Cell::Stat(st.clipped(0.0, 100.0))]);
            }
        }
        let rows = body.len();
        out.push(Grid {
            id: id.clone(),
            title: format!("RULER by attention arm, recipe `{}`", groups::key_id(&key)),
            notes: vec![format!("String match, % of samples, at each target length in tokens. {}", super::stats::WHAT_INTERVALS_MEAN)],
            head: ["attention", "task", "length", "seeds", "score %"].map(String::from).to_vec(),
            body,
            rows,
            missing: Vec::new(),
        });
        let rows: Vec<Vec<Cell>> = points
            .iter()
            .flat_map(|p| super::paired::pairs(&arms, |m| m.get(p).copied()).into_iter().map(move |pair| super::paired::row(pair, format!("{} @ {}", p.0, p.1))))
            .collect();
        let title = format!("RULER by attention arm, paired differences, recipe `{}`", groups::key_id(&key));
        out.extend(super::paired::grid(format!("{id}-paired"), title, "task @ length", "score (points)", "score in points", rows));
    }
    out
}
