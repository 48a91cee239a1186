//! Paired differences between attention arms over seeds: for every pair (A, B) of arms in report
//! order, A − B per seed where both have the value (same seed = same data order and, outside the
//! bottleneck, the same initial weights), summed over the seeds with a paired t-test. The recall
//! and RULER tables by arm share it.
use super::longctx::Grid;
use super::render::Cell;
use super::stats::Stat;
use crate::spec::AttentionSpec;
use std::collections::BTreeMap;

/// One pair's row: A's and B's labels, then the cells [A − B over seeds, per seed, p (paired t),
/// whether the 95% interval excludes 0].
pub struct Pair {
    pub a: String,
    pub b: String,
    pub cells: Vec<Cell>,
}

/// Every pair of `arms` (each: its configuration and, per seed, what `value` reads from) with at
/// least one seed in common.
pub fn pairs<T>(arms: &[(AttentionSpec, BTreeMap<u64, T>)], value: impl Fn(&T) -> Option<f64>) -> Vec<Pair> {
    let mut out = Vec::new();
    for (i, (a, sa)) in arms.iter().enumerate() {
        for (b, sb) in &arms[i + 1..] {
            let by_seed: BTreeMap<u64, f64> = sa.iter().filter_map(|(seed, x)| Some((*seed, value(x)? - value(sb.get(seed)?)?))).collect();
            let Some(st) = Stat::of(&by_seed.values().copied().collect::<Vec<_>>()) else { continue };
            let seeds: Vec<String> = by_seed.iter().map(|(s, v)| format!("s{s} {v:.1}")).collect();
            out.push(Pair {
                a: a.label(),
                b: b.label(),
                cells: vec![
                    Cell::Stat(st),
                    Cell::Text(seeds.join(", ")),
                    st.t_test_p().map_or(Cell::Empty, |p| Cell::Text(Stat::p_text(p))),
                    st.ci.map_or(Cell::Empty, |(lo, hi)| Cell::Text(if lo > 0.0 || hi < 0.0 { "yes" } else { "no" }.into())),
                ],
            });
        }
    }
    out
}

/// The paired table of `rows` (each: A, B, what the row is at, then a [`Pair`]'s cells), None when
/// there are none. `at` titles the third column, `what` the difference (e.g. "digits right
/// (points)"), `unit` says what was compared per seed in the note.
pub fn grid(id: String, title: String, at: &str, what: &str, unit: &str, rows: Vec<Vec<Cell>>) -> Option<Grid> {
    if rows.is_empty() {
        return None;
    }
    let head = ["A".into(), "B".into(), at.into(), format!("A − B: {what}"), "per seed".into(), "p (paired t)".into(), "95% interval excludes 0".into()].to_vec();
    Some(Grid {
        id,
        title,
        notes: vec![format!("A − B: {unit}, per seed (same seed = same data order and, outside the bottleneck, the same initial weights), then over seeds; paired t-test.")],
        head,
        rows: rows.len(),
        body: rows,
        missing: Vec::new(),
    })
}

/// One row of a paired table: A, B, what it is at, then the pair's cells.
pub fn row(p: Pair, at: String) -> Vec<Cell> {
    let mut row = vec![Cell::Text(p.a), Cell::Text(p.b), Cell::Text(at)];
    row.extend(p.cells);
    row
}
