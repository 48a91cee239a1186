//! The long-range recall test (eval/recall.rs, the runs' recall.json) per sweep: every attention
//! configuration's answer-digit accuracy, whole-code accuracy and answer loss at each gap, pooled
//! over seeds, beside chance; and the paired differences of digit accuracy between arms (A − B per
//! seed). DAR − window-only at a gap beyond the window's reach is what the distant path carries.
//!
//! Runs that scored the test while training (`eval.recall`) also get learning curves (codes right
//! against step, steps to 50%: `curves`), and runs that differ only in the number of facts per
//! document a capacity curve (codes right against facts: `capacity`).
use super::figures::{self, slug, Figure};
use super::groups;
use super::load::Run;
use super::longctx::Grid;
use super::plots::{Chart, Dash, Line};
use super::render::Cell;
use super::stats::Stat;
use crate::eval::recall::RecallScore;
use crate::spec::AttentionSpec;
use crate::Result;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// A run's recall.json scores (empty when it has none or it cannot be read).
pub fn read(run: &Run) -> Vec<RecallScore> {
    let Ok(text) = std::fs::read_to_string(run.dir.join("recall.json")) else { return Vec::new() };
    serde_json::from_str::<serde_json::Value>(&text).ok().and_then(|v| serde_json::from_value(v["gaps"].clone()).ok()).unwrap_or_default()
}


/// Per recipe with recall scores: the pooled table and the paired differences.
pub fn build(runs: &[Run]) -> Vec<Grid> {
    let all: Vec<&Run> = runs.iter().collect();
    let mut out = Vec::new();
    for (key, members) in groups::by_recipe(&all) {
        // configuration → seed → gap → score
        let mut arms: Vec<(AttentionSpec, BTreeMap<u64, BTreeMap<usize, RecallScore>>)> = Vec::new();
        let scale = groups::scale(&members[0].spec);
        for r in &members {
            let scores = read(r);
            if scores.is_empty() {
                continue;
            }
            let c = r.spec.attention.comparable();
            let seeds = match arms.iter_mut().find(|(a, _)| *a == c) {
                Some((_, s)) => s,
                None => {
                    arms.push((c, BTreeMap::new()));
                    &mut arms.last_mut().expect("just pushed").1
                }
            };
            seeds.insert(r.spec.seed(), scores.into_iter().map(|s| (s.gap, s)).collect());
        }
        if arms.is_empty() {
            continue;
        }
        arms.sort_by_key(|(c, _)| (super::groups::arm_rank(c), std::cmp::Reverse(c.d_down_width()), std::cmp::Reverse(c.window_len())));
        let gaps: BTreeSet<usize> = arms.iter().flat_map(|(_, s)| s.values().flat_map(|g| g.keys().copied())).collect();
        let id = format!("recall-{scale}-{}", groups::key_id(&key));
        let mut body = Vec::new();
        for &gap in &gaps {
            for (c, seeds) in &arms {
                let at: Vec<&RecallScore> = seeds.values().filter_map(|g| g.get(&gap)).collect();
                if at.is_empty() {
                    continue;
                }
                let reach = at[0].window_reach;
                body.push(vec![
                    Cell::Text(c.label()),
                    Cell::Text(gap.to_string()),
                    Cell::Text(at.len().to_string()),
                    stat(at.iter().map(|s| 100.0 * s.digit_accuracy).collect(), PCT),
                    stat(at.iter().map(|s| 100.0 * s.code_accuracy).collect(), PCT),
                    stat(at.iter().map(|s| s.loss).collect(), f64::INFINITY),
                    Cell::Text(match reach {
                        Some(r) if r < gap => format!("{r} < gap: chance by construction"),
                        Some(r) => format!("{r} ≥ gap"),
                        None => "every token".into(),
                    }),
                ]);
            }
        }
        let head = ["attention", "gap", "seeds", "digits right %", "codes right %", "answer loss (nats)", "window-only reach"].map(String::from).to_vec();
        let rows = body.len();
        out.push(Grid {
            id: id.clone(),
            title: format!("Long-range recall, recipe `{}`", groups::key_id(&key)),
            notes: vec![format!(
                "Scored only at the answer digits of codes stated once, `gap` tokens or more before the question (`attnlab eval RUN --task recall`). Chance: 10% of digits, 0.1% of codes, loss ln 10 = {:.3} nats. {}",
                10f64.ln(),
                super::stats::WHAT_INTERVALS_MEAN
            )],
            head,
            body,
            rows,
            missing: Vec::new(),
        });

        // Paired differences of digit accuracy, per gap.
        let rows: Vec<Vec<Cell>> = gaps
            .iter()
            .flat_map(|&gap| super::paired::pairs(&arms, move |g| g.get(&gap).map(|s| 100.0 * s.digit_accuracy)).into_iter().map(move |p| super::paired::row(p, gap.to_string())))
            .collect();
        let title = format!("Long-range recall, paired differences, recipe `{}`", groups::key_id(&key));
        out.extend(super::paired::grid(format!("{id}-paired"), title, "gap", "digits right (points)", "% of answer digits right", rows));
    }
    out
}

/// The first step at which `points` (step, value; in step order) reach `level`, linearly
/// interpolated between the last point below it and the first at or above it (the first point's
/// step when that is already there); None when no point reaches it.
pub fn steps_to(points: &[(f64, f64)], level: f64) -> Option<f64> {
    let at = points.iter().position(|p| p.1 >= level)?;
    if at == 0 {
        return Some(points[0].0);
    }
    let ((x0, y0), (x1, y1)) = (points[at - 1], points[at]);
    Some(x0 + (x1 - x0) * (level - y0) / (y1 - y0))
}

/// Gaps with a `recall/g<G>/codes` column (the trainer's recall evaluation) in any of `runs`.
fn curve_gaps(runs: &[&Run]) -> BTreeSet<usize> {
    runs.iter()
        .flat_map(|r| r.rows.values().flat_map(|row| row.keys().filter_map(|k| crate::recall::parse_metric(k).filter(|(_, f)| *f == "codes").map(|(g, _)| g))))
        .collect()
}

/// `runs` by comparable attention configuration, in the order of the recall table (DAR by width,
/// window-only, the other kinds, vanilla last).
fn by_arm<'a>(runs: &[&'a Run]) -> Vec<(AttentionSpec, Vec<&'a Run>)> {
    let mut arms: Vec<(AttentionSpec, Vec<&'a Run>)> = Vec::new();
    for &r in runs {
        let c = r.spec.attention.comparable();
        match arms.iter_mut().find(|(a, _)| *a == c) {
            Some((_, m)) => m.push(r),
            None => arms.push((c, vec![r])),
        }
    }
    arms.sort_by_key(|(c, _)| (groups::arm_rank(c), std::cmp::Reverse(c.d_down_width()), std::cmp::Reverse(c.window_len())));
    arms
}

/// The level steps-to is measured at: half the codes right.
pub const HALF: f64 = 50.0;

/// The top of a percentage.
const PCT: f64 = 100.0;

/// A table cell summing `v` over seeds, its interval cut to `[0, hi]`: every quantity in these
/// tables (%, nats, steps) is ≥ 0, and percentages are ≤ [`PCT`].
fn stat(v: Vec<f64>, hi: f64) -> Cell {
    Stat::of(&v).map_or(Cell::Empty, |s| Cell::Stat(s.clipped(0.0, hi)))
}

/// Seed bands (mean ± s.d.) of percentages cut to 0–100.
fn clip_bands(lines: &mut [Line]) {
    for b in lines.iter_mut().flat_map(|l| l.band.iter_mut()) {
        (b.1, b.2) = (b.1.max(0.0), b.2.min(PCT));
    }
}

/// Recall learning curves (runs that scored `eval.recall` while training), per recipe: for each
/// gap, a chart of codes right against step per configuration (seeds pooled: mean, ± 1 s.d. band)
/// and a table of steps to 50% of codes right (interpolated between evaluations; over the seeds
/// that got there) and the last evaluation's accuracy.
pub fn curves(runs: &[Run], out: &Path) -> Result<(Vec<Grid>, Vec<Figure>)> {
    let all: Vec<&Run> = runs.iter().collect();
    let (mut grids, mut figs) = (Vec::new(), Vec::new());
    for (key, members) in groups::by_recipe(&all) {
        let gaps = curve_gaps(&members);
        if gaps.is_empty() {
            continue;
        }
        let scale = groups::scale(&members[0].spec);
        let id = groups::key_id(&key);
        let stem = format!("plots/recall/{}", slug(&format!("{scale}-{id}")));
        let mut body = Vec::new();
        for &gap in &gaps {
            let metric = format!("recall/g{gap}/codes");
            let curve = |r: &Run| -> Vec<(f64, f64)> { r.series(&metric).into_iter().map(|(x, y)| (x, 100.0 * y)).collect() };
            let (mut lines, pooled) = figures::pooled_lines(&members, |rs| rs.iter().map(|r| curve(r)).collect());
            clip_bands(&mut lines);
            let xs: Vec<f64> = lines.iter().flat_map(|l| l.points.iter().map(|p| p.0)).collect();
            if let (Some(x0), Some(x1)) = (xs.iter().copied().reduce(f64::min), xs.iter().copied().reduce(f64::max)) {
                lines.push(Line { label: "50% of codes (steps-to-50%)".into(), points: vec![(x0, HALF), (x1, HALF)], band: Vec::new(), color: None, dash: Dash::Dotted, reference: true });
            }
            let reach = members.iter().find_map(|r| crate::recall::window_reach(&r.spec));
            let chart = Chart {
                title: format!("Recall at gap {gap}: codes right vs step, {scale} `{id}`"),
                x_label: "step".into(),
                y_label: "codes right (% of 3-digit codes; chance 0.1%)".into(),
                lines,
                log_y: false,
                log_x: false,
            };
            let band = if pooled { " Lines: mean over seeds; bands: ± 1 s.d. over seeds." } else { "" };
            let reach = reach.map_or(String::new(), |r| format!(" Window-only reach: {r} tokens{}.", if r < gap { " < gap: at chance by construction" } else { "" }));
            figs.extend(figures::save(chart, out, &format!("{stem}/codes-g{gap}"), format!("Recall learning curve, gap {gap}, {scale} recipe `{id}`: % of codes with all three digits right at each evaluation during training.{reach}{band}"))?);
            for (c, rs) in by_arm(&members) {
                let curves: Vec<Vec<(f64, f64)>> = rs.iter().map(|r| curve(r)).filter(|c| !c.is_empty()).collect();
                if curves.is_empty() {
                    continue;
                }
                let reached: Vec<f64> = curves.iter().filter_map(|c| steps_to(c, HALF)).collect();
                let last = |m: &str| -> Vec<f64> { rs.iter().filter_map(|r| r.series(&format!("recall/g{gap}/{m}")).last().map(|p| 100.0 * p.1)).collect() };
                let steps: Vec<String> = rs.iter().filter_map(|r| Some(r.series(&metric).last()?.0 as u64)).collect::<BTreeSet<_>>().iter().map(u64::to_string).collect();
                body.push(vec![
                    Cell::Text(c.label()),
                    Cell::Text(gap.to_string()),
                    Cell::Text(curves.len().to_string()),
                    Cell::Text(format!("{}/{}", reached.len(), curves.len())),
                    stat(reached, f64::INFINITY),
                    Cell::Text(steps.join(", ")),
                    stat(last("codes"), PCT),
                    stat(last("digits"), PCT),
                ]);
            }
        }
        let rows = body.len();
        grids.push(Grid {
            id: format!("recall-curves-{scale}-{id}"),
            title: format!("Recall learning curves, recipe `{id}`"),
            notes: vec![format!(
                "Scored during training (`eval.recall`) on the same documents at every evaluation. Steps to 50%: the first step with half the codes right, interpolated linearly between evaluations, over the seeds that got there (`reached`); a seed that never did is not in the mean. Last: the final evaluation (at `step`). Chance: 0.1% of codes, 10% of digits. {}",
                super::stats::WHAT_INTERVALS_MEAN
            )],
            head: ["attention", "gap", "seeds", "reached 50%", "steps to 50% codes right", "step", "codes right % (last)", "digits right % (last)"].map(String::from).to_vec(),
            body,
            rows,
            missing: Vec::new(),
        });
    }
    Ok((grids, figs))
}

/// What must be equal for runs to sit on one capacity curve: the recipe without the number of facts.
fn capacity_key(spec: &crate::spec::Spec) -> groups::Key {
    let mut k = groups::recipe_key(spec);
    k.retain(|name, _| name != "data.train.synthetic.recall_facts" && name != "eval.recall.facts");
    k
}

/// Codes per document a score was taken at (recall.json's, else the run's default).
fn facts_of(r: &Run, s: &RecallScore) -> Option<usize> {
    s.facts.or_else(|| crate::recall::default_facts(&r.spec))
}

/// Capacity (issue 36): runs of one recipe that differ in the number of facts per document, per
/// gap: codes right (recall.json, the final scores) against the number of facts per configuration,
/// seeds pooled, as a chart (log x) and a table.
pub fn capacity(runs: &[Run], out: &Path) -> Result<(Vec<Grid>, Vec<Figure>)> {
    let mut groups_: Vec<(groups::Key, Vec<&Run>)> = Vec::new();
    for r in runs {
        let k = capacity_key(&r.spec);
        match groups_.iter_mut().find(|(g, _)| *g == k) {
            Some((_, m)) => m.push(r),
            None => groups_.push((k, vec![r])),
        }
    }
    let (mut grids, mut figs) = (Vec::new(), Vec::new());
    for (key, members) in groups_ {
        // run → gap → (facts, score)
        let scored: Vec<(&Run, Vec<(usize, RecallScore)>)> =
            members.iter().map(|&r| (r, read(r).into_iter().filter_map(|s| Some((facts_of(r, &s)?, s))).collect::<Vec<_>>())).filter(|(_, s)| !s.is_empty()).collect();
        let facts: BTreeSet<usize> = scored.iter().flat_map(|(_, s)| s.iter().map(|(k, _)| *k)).collect();
        if facts.len() < 2 {
            continue;
        }
        let runs_: Vec<&Run> = scored.iter().map(|(r, _)| *r).collect();
        let gaps: BTreeSet<usize> = scored.iter().flat_map(|(_, s)| s.iter().map(|(_, s)| s.gap)).collect();
        let scale = groups::scale(&members[0].spec);
        let id = groups::key_id(&key);
        let of = |r: &Run, gap: usize| -> Vec<(usize, RecallScore)> {
            scored.iter().filter(|(x, _)| std::ptr::eq(*x, r)).flat_map(|(_, s)| s.iter().filter(|(_, s)| s.gap == gap).cloned()).collect()
        };
        let mut body = Vec::new();
        for &gap in &gaps {
            // One curve per seed: its runs' (facts, codes right %).
            let per_seed = |rs: &[&Run]| -> Vec<Vec<(f64, f64)>> {
                let mut by_seed: BTreeMap<u64, Vec<(f64, f64)>> = BTreeMap::new();
                for r in rs {
                    by_seed.entry(r.spec.seed()).or_default().extend(of(r, gap).into_iter().map(|(k, s)| (k as f64, 100.0 * s.code_accuracy)));
                }
                by_seed.into_values().map(|mut c| {
                    c.sort_by(|a, b| a.0.total_cmp(&b.0));
                    c
                }).collect()
            };
            let (mut lines, pooled) = figures::pooled_lines(&runs_, per_seed);
            clip_bands(&mut lines);
            let chart = Chart {
                title: format!("Recall capacity at gap {gap}: codes right vs facts per document, {scale} `{id}`"),
                x_label: "facts (codes stated, all asked ≥ gap later) per document, log scale".into(),
                y_label: "codes right (%; chance 0.1%)".into(),
                lines,
                log_y: false,
                log_x: true,
            };
            let band = if pooled { " Lines: mean over seeds; bands: ± 1 s.d. over seeds." } else { "" };
            figs.extend(figures::save(chart, out, &format!("plots/recall/{}/capacity-g{gap}", slug(&format!("{scale}-{id}"))), format!("Recall capacity, gap {gap}, {scale} recipe `{id}` without its number of facts: % of codes right at the end of training against the number of codes stated per document (recall.json).{band}"))?);
            for (c, rs) in by_arm(&runs_) {
                for &k in &facts {
                    let at: Vec<RecallScore> = rs.iter().flat_map(|r| of(r, gap)).filter(|(f, _)| *f == k).map(|(_, s)| s).collect();
                    if at.is_empty() {
                        continue;
                    }
                    body.push(vec![
                        Cell::Text(c.label()),
                        Cell::Text(gap.to_string()),
                        Cell::Text(k.to_string()),
                        Cell::Text(at.len().to_string()),
                        stat(at.iter().map(|s| 100.0 * s.code_accuracy).collect(), PCT),
                        stat(at.iter().map(|s| 100.0 * s.digit_accuracy).collect(), PCT),
                    ]);
                }
            }
        }
        let rows = body.len();
        grids.push(Grid {
            id: format!("recall-capacity-{scale}-{id}"),
            title: format!("Recall capacity: codes right vs facts per document, recipe `{id}` (any number of facts)"),
            notes: vec![format!("Final scores (recall.json) of runs that differ only in the number of codes per document (`data.train.synthetic.recall_facts`, scored on as many). Chance: 0.1% of codes, 10% of digits. {}", super::stats::WHAT_INTERVALS_MEAN)],
            head: ["attention", "gap", "facts", "seeds", "codes right %", "digits right %"].map(String::from).to_vec(),
            body,
            rows,
            missing: Vec::new(),
        });
    }
    Ok((grids, figs))
}
