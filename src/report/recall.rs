//! The long-range recall test (eval/recall.rs, the runs' recall.json) per sweep: every attention
//! configuration's answer-digit accuracy, whole-code accuracy and answer loss at each gap, pooled
//! over seeds, beside chance; and the paired differences of digit accuracy between arms (A − B per
//! seed). DAR − window-only at a gap beyond the window's reach is what the distant path carries.
use super::groups;
use super::load::Run;
use super::longctx::Grid;
use super::render::Cell;
use super::stats::Stat;
use crate::eval::recall::RecallScore;
use crate::spec::AttentionSpec;
use std::collections::{BTreeMap, BTreeSet};

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
        let stat = |v: Vec<f64>| Stat::of(&v).map_or(Cell::Empty, Cell::Stat);
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
                    stat(at.iter().map(|s| 100.0 * s.digit_accuracy).collect()),
                    stat(at.iter().map(|s| 100.0 * s.code_accuracy).collect()),
                    stat(at.iter().map(|s| s.loss).collect()),
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
        let mut pairs = Vec::new();
        for &gap in &gaps {
            for (i, (a, sa)) in arms.iter().enumerate() {
                for (b, sb) in &arms[i + 1..] {
                    let by_seed: BTreeMap<u64, f64> = sa
                        .iter()
                        .filter_map(|(seed, g)| Some((*seed, 100.0 * (g.get(&gap)?.digit_accuracy - sb.get(seed)?.get(&gap)?.digit_accuracy))))
                        .collect();
                    let Some(st) = Stat::of(&by_seed.values().copied().collect::<Vec<_>>()) else { continue };
                    let seeds: Vec<String> = by_seed.iter().map(|(s, v)| format!("s{s} {v:.1}")).collect();
                    pairs.push(vec![
                        Cell::Text(a.label()),
                        Cell::Text(b.label()),
                        Cell::Text(gap.to_string()),
                        Cell::Stat(st),
                        Cell::Text(seeds.join(", ")),
                        st.t_test_p().map_or(Cell::Empty, |p| Cell::Text(Stat::p_text(p))),
                        st.ci.map_or(Cell::Empty, |(lo, hi)| Cell::Text(if lo > 0.0 || hi < 0.0 { "yes" } else { "no" }.into())),
                    ]);
                }
            }
        }
        if !pairs.is_empty() {
            let rows = pairs.len();
            out.push(Grid {
                id: format!("{id}-paired"),
                title: format!("Long-range recall, paired differences, recipe `{}`", groups::key_id(&key)),
                notes: vec!["A − B: % of answer digits right, per seed (same seed = same data order and, outside the bottleneck, the same initial weights), then over seeds; paired t-test.".into()],
                head: ["A", "B", "gap", "A − B: digits right (points)", "per seed", "p (paired t)", "95% interval excludes 0"].map(String::from).to_vec(),
                body: pairs,
                rows,
                missing: Vec::new(),
            });
        }
    }
    out
}
