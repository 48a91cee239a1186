//! Tables 1–3 of the DAR paper rebuilt from whatever runs exist. The rows a table expects come from
//! the paper's rows (data/papers/dar.csv) translated to the scale at hand: d_down keeps its fraction
//! of d_model, and at a scale other than the paper's (or when the paper's window is ≥ T) Tables 1
//! and 2 use the window most of our DAR runs use. A row is filled by the run whose resolved config
//! matches and whose recipe equals the other rows' (groups.rs); Rel.(%) divides by the vanilla row.
//! A row holds every seed of its configuration: values are summarised over seeds (stats.rs), and
//! Rel.(%) is computed per seed against the vanilla run of the same seed, then summarised (paired).
use super::groups::{self, Key};
use super::load::Run;
use super::paper::{self, PaperRow};
use super::stats::{self, Stat};
use crate::spec::{AttentionInit, AttentionSpec};
use std::collections::{BTreeMap, BTreeSet};

/// Which perplexity the tables compare: word-level (lm-eval's word_perplexity; the paper's numbers
/// look word-level, evaluation.md §2.4) or token-level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Word,
    Token,
}

impl Unit {
    pub fn parse(s: &str) -> Option<Unit> {
        match s {
            "word" => Some(Unit::Word),
            "token" => Some(Unit::Token),
            _ => None,
        }
    }
    /// The field of eval.json / `eval/<corpus>/…` in metrics.jsonl.
    pub fn field(self) -> &'static str {
        match self {
            Unit::Word => "word_ppl",
            Unit::Token => "ppl",
        }
    }
    pub fn other(self) -> Unit {
        match self {
            Unit::Word => Unit::Token,
            Unit::Token => Unit::Word,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Unit::Word => "word",
            Unit::Token => "token",
        }
    }
}

/// Rel.(%) (dar.md §6): 100 · arithmetic mean over corpora of PPL(model) / PPL(vanilla), over the
/// corpora both have. Returns the value and those corpora; None when they share none.
pub fn rel(model: &BTreeMap<String, f64>, vanilla: &BTreeMap<String, f64>) -> Option<(f64, Vec<String>)> {
    let common: Vec<String> = model.keys().filter(|c| vanilla.contains_key(*c)).cloned().collect();
    if common.is_empty() {
        return None;
    }
    let mean = common.iter().map(|c| model[c] / vanilla[c]).sum::<f64>() / common.len() as f64;
    Some((100.0 * mean, common))
}

/// One seed's final perplexities: per corpus in the table's unit, and in the other unit.
#[derive(Debug, Clone, Default)]
pub struct SeedResult {
    pub run: String,
    pub ppl: BTreeMap<String, f64>,
    pub ppl_alt: BTreeMap<String, f64>,
}

pub struct Row {
    pub scale: String,
    /// The configuration this row asks for.
    pub config: AttentionSpec,
    /// The run that filled it (the first seed's; path relative to the results directory).
    pub run: Option<String>,
    /// Every run that fills it, one per seed, by seed.
    pub seeds: BTreeMap<u64, SeedResult>,
    /// Final PPL per corpus in the table's unit, and in the other unit: means over seeds.
    pub ppl: BTreeMap<String, f64>,
    pub ppl_alt: BTreeMap<String, f64>,
    /// The same as summaries over seeds.
    pub ppl_stat: BTreeMap<String, Stat>,
    pub ppl_alt_stat: BTreeMap<String, Stat>,
    /// Mean over seeds of the per-seed Rel.(%) (paired with the vanilla run of the same seed).
    pub rel: Option<f64>,
    pub rel_alt: Option<f64>,
    pub rel_stat: Option<Stat>,
    pub rel_alt_stat: Option<Stat>,
    /// Rel.(%) of each seed against the vanilla run of that seed (empty when unpaired): what
    /// paired differences between two rows subtract.
    pub rel_by_seed: BTreeMap<u64, f64>,
    /// The corpora `rel` averages over.
    pub rel_corpora: Vec<String>,
    pub paper: Option<PaperRow>,
    /// The paper's Rel.(%) recomputed over only the corpora `rel` used, when that is fewer than the paper's.
    pub paper_rel_same: Option<f64>,
    /// Why the row has no numbers.
    pub missing: Option<String>,
    /// Other remarks (another run also matched, …).
    pub note: Option<String>,
}

impl Row {
    pub fn model(&self) -> String {
        self.config.table_name()
    }
    pub fn describe(&self) -> String {
        format!("{} {}", self.scale, self.config.label())
    }
    /// Number of seeds with a result.
    pub fn n(&self) -> usize {
        self.seeds.values().filter(|s| !s.ppl.is_empty()).count()
    }
}

pub struct Table {
    pub number: u8,
    /// File stem: table1-pythia-70m-1a2b3c.
    pub id: String,
    pub title: String,
    /// Caption lines: the runs' setting, what Rel.(%) averages over, substitutions made.
    pub notes: Vec<String>,
    /// Our corpora, in column order.
    pub corpora: Vec<String>,
    /// Our corpus → the paper's column for it.
    pub paper_cols: BTreeMap<String, String>,
    pub unit: Unit,
    pub rows: Vec<Row>,
    /// Row minus row, seed by seed (DAR − window-only: what the distant path buys).
    pub pairs: Vec<PairedDiff>,
}

/// Rel.(%) of row `a` minus Rel.(%) of row `b` (percentage points), computed for each seed both
/// rows have — both against the vanilla run of that seed — then summarised over those seeds. Pairing
/// removes what a seed does to every arm alike (initialisation outside the bottleneck, data order).
#[derive(Debug, Clone)]
pub struct PairedDiff {
    pub a: String,
    pub b: String,
    /// Per seed: Rel.(a) − Rel.(b).
    pub by_seed: BTreeMap<u64, f64>,
    pub stat: Stat,
    /// Two-sided p-value of the paired t-test (mean difference 0); None for one seed or no spread.
    pub p: Option<f64>,
}

impl PairedDiff {
    /// Whether the 95% interval excludes 0.
    pub fn significant(&self) -> Option<bool> {
        self.stat.ci.map(|(lo, hi)| lo > 0.0 || hi < 0.0)
    }
}


/// Every pair of non-vanilla rows of one scale with paired seeds in common, `a − b` per seed.
pub fn paired_differences(rows: &[Row]) -> Vec<PairedDiff> {
    let mut arms: Vec<&Row> = rows.iter().filter(|r| !r.config.is_vanilla() && !r.rel_by_seed.is_empty()).collect();
    arms.sort_by_key(|r| super::groups::arm_rank(&r.config));
    let mut out = Vec::new();
    for (i, a) in arms.iter().enumerate() {
        for b in arms[i + 1..].iter().filter(|b| b.scale == a.scale) {
            let by_seed: BTreeMap<u64, f64> = a.rel_by_seed.iter().filter_map(|(s, x)| b.rel_by_seed.get(s).map(|y| (*s, x - y))).collect();
            let Some(stat) = Stat::of(&by_seed.values().copied().collect::<Vec<_>>()) else { continue };
            let p = stat.t_test_p();
            out.push(PairedDiff { a: a.config.label(), b: b.config.label(), by_seed, stat, p });
        }
    }
    out
}

impl Table {
    /// One line per row without numbers: "Table 2 (…), pythia-160m DAR (d_down 192, w 128): why".
    pub fn missing(&self) -> Vec<String> {
        self.rows.iter().filter_map(|r| r.missing.as_ref().map(|m| format!("Table {} ({}), {}: {m}", self.number, self.id, r.describe()))).collect()
    }
    pub fn filled(&self) -> usize {
        self.rows.iter().filter(|r| r.missing.is_none()).count()
    }
    /// Whether any row's Rel.(%) uses fewer corpora than the paper's.
    pub fn has_paper_rel_same(&self) -> bool {
        self.rows.iter().any(|r| r.paper_rel_same.is_some())
    }
}

/// Runs of one scale and one recipe: the rows of one Table 1 or 3, or one scale of a Table 2.
struct Section<'a> {
    key: Key,
    runs: Vec<&'a Run>,
}

impl Section<'_> {
    fn spec(&self) -> &crate::spec::Spec {
        &self.runs[0].spec
    }
    fn scale(&self) -> String {
        groups::scale(self.spec())
    }
    fn d_model(&self) -> usize {
        self.spec().shape().d_model
    }
    fn id(&self) -> String {
        format!("{}-{}", self.scale(), groups::key_id(&self.key))
    }
    /// "seed 1234" or "seeds 1, 2, 3".
    fn seeds_words(&self) -> String {
        seeds_words(&self.runs)
    }
}

fn seeds_words(runs: &[&Run]) -> String {
    let seeds: BTreeSet<u64> = runs.iter().map(|r| r.spec.seed()).collect();
    let list: Vec<String> = seeds.iter().map(u64::to_string).collect();
    format!("{} {}", if list.len() == 1 { "seed" } else { "seeds" }, list.join(", "))
}

/// Build every table the runs allow.
pub fn build(all_runs: &[Run], paper: &[PaperRow], unit: Unit) -> Vec<Table> {
    let runs: Vec<&Run> = all_runs.iter().filter(|r| groups::tabulated(r)).collect();
    let sections: Vec<Section> = groups::by_recipe(&runs).into_iter().map(|(key, runs)| Section { key, runs }).collect();
    let rows_of = |t: u8| paper.iter().filter(|p| p.table == t).collect::<Vec<_>>();
    let mut tables = Vec::new();
    for s in &sections {
        tables.extend(within_scale(1, s, &rows_of(1), &runs, unit));
    }
    for (key, members) in groups::by_cross_scale(&runs) {
        tables.extend(scaling(&key, &members, &rows_of(2), &runs, unit));
    }
    for s in &sections {
        tables.extend(within_scale(3, s, &rows_of(3), &runs, unit));
    }
    tables
}

/// The paper's local window for Tables 1 and 2 (its DAR rows' window).
fn paper_window(prows: &[&PaperRow]) -> Option<usize> {
    prows.iter().filter_map(|p| p.window).filter(|&w| w > 0).max()
}

/// The window Tables 1/2 use for a section: the paper's, unless this is another scale (or the
/// paper's window is ≥ T, i.e. vanilla) and our DAR runs use another one.
fn table_window(sec: &Section, paper_w: usize, at_paper_scale: bool) -> (usize, Option<String>) {
    let mut counts: BTreeMap<usize, usize> = BTreeMap::new();
    for r in &sec.runs {
        let c = r.spec.attention.comparable();
        if let Some(w) = c.dar_window() {
            *counts.entry(w).or_default() += 1;
        }
    }
    let vanilla_like = paper_w >= sec.spec().seq_len();
    if (at_paper_scale && !vanilla_like) || counts.is_empty() || counts.contains_key(&paper_w) {
        return (paper_w, None);
    }
    // Most runs; ties go to the larger window (max_by_key keeps the last maximum).
    let w = *counts.iter().max_by_key(|e| *e.1).expect("non-empty").0;
    (w, Some(format!("w = {w} (the window most DAR runs here use) stands in for the paper's w = {paper_w}")))
}

/// The configuration a paper row asks for at width `d` (None when d_down does not scale to a whole number).
fn translate(p: &PaperRow, d: usize, window: Option<usize>) -> Option<AttentionSpec> {
    if p.kind.is_vanilla() {
        return Some(AttentionSpec::vanilla());
    }
    let scaled = p.d_down? * d;
    if scaled % p.d_model != 0 || scaled == 0 {
        return None;
    }
    let w = match p.window? {
        0 => 0,
        w => window.unwrap_or(w),
    };
    Some(AttentionSpec::bottleneck(scaled / p.d_model, w))
}

/// Table 1 (bottleneck sweep) or Table 3 (window ablation) for one section.
fn within_scale(number: u8, sec: &Section, prows: &[&PaperRow], all: &[&Run], unit: Unit) -> Option<Table> {
    let paper_scale = &prows.first()?.scale;
    let (scale, d, seq) = (sec.scale(), sec.d_model(), sec.spec().seq_len());
    let at_paper_scale = scale == *paper_scale;
    let mut notes = Vec::new();
    let mut slots: Vec<(AttentionSpec, Option<&PaperRow>)> = Vec::new();
    if number == 1 {
        let (tw, note) = table_window(sec, paper_window(prows)?, at_paper_scale);
        notes.extend(note);
        slots.extend(prows.iter().filter_map(|p| translate(p, d, Some(tw)).map(|c| (c, Some(*p)))));
    } else {
        // Windows ≥ T make DAR identical to vanilla: not worth a row.
        let mut dropped = Vec::new();
        for p in prows {
            match translate(p, d, None) {
                Some(c) if c.window_len().is_some_and(|w| w >= seq) => dropped.push(c.window_len().unwrap_or(0).to_string()),
                Some(c) => slots.push((c, Some(*p))),
                None => {}
            }
        }
        if !dropped.is_empty() {
            notes.push(format!("w = {} ≥ T = {seq} would equal vanilla: those paper rows are left out", dropped.join(", ")));
        }
    }
    let fits = |c: &AttentionSpec| !c.is_vanilla() && slots.iter().any(|(s, _)| s == c);
    if !at_paper_scale && !sec.runs.iter().any(|r| fits(&r.spec.attention.comparable())) {
        return None;
    }
    if number == 3 {
        // Our other windows at the ablation's d_down get rows too (no paper value).
        let d_downs: BTreeSet<usize> = slots.iter().filter_map(|(c, _)| c.d_down_width()).collect();
        for r in &sec.runs {
            let c = r.spec.attention.comparable();
            let default_init = c.init() == Some(AttentionInit::SmallInit);
            if c.dar_window().is_some() && default_init && c.d_down_width().is_some_and(|x| d_downs.contains(&x)) && !slots.iter().any(|(s, _)| *s == c) {
                slots.push((c, None));
            }
        }
        // Window-only runs: the same windows without any distant keys, the control for DAR's distant path.
        let controls = window_only(sec, &slots);
        if !controls.is_empty() {
            notes.push(WINDOW_ONLY_NOTE.to_string());
        }
        slots.extend(controls.into_iter().map(|c| (c, None)));
        // Vanilla first, then windows from wide to none (uniform last), DAR before window-only.
        slots.sort_by_key(|(c, _)| (!c.is_vanilla(), std::cmp::Reverse(c.window_len()), c.kind().order()));
    } else {
        // Configurations the paper's table lacks (another bottleneck start, window-only attention)
        // get rows of their own, so that every arm of an experiment is compared with vanilla.
        let mut extra: Vec<AttentionSpec> = Vec::new();
        for r in &sec.runs {
            let c = r.spec.attention.comparable();
            let other_start = c.has_bottleneck() && c.init() != Some(AttentionInit::SmallInit);
            if !c.is_vanilla() && (other_start || !c.has_bottleneck()) && !slots.iter().any(|(s, _)| *s == c) && !extra.contains(&c) {
                extra.push(c);
            }
        }
        if !extra.is_empty() {
            notes.push(format!("Rows without a paper value ({}): configurations of this recipe the paper's table has no row for.", extra.iter().map(|c| c.label()).collect::<Vec<_>>().join("; ")));
        }
        if extra.iter().any(|c| c.kind().is_local_only()) {
            notes.push(WINDOW_ONLY_NOTE.to_string());
        }
        slots.extend(extra.into_iter().map(|c| (c, None)));
    }
    let mut rows: Vec<Row> = slots.into_iter().map(|(c, p)| fill(sec, c, p.cloned(), all, unit)).collect();
    add_rel(&mut rows);
    let name = if number == 1 { "bottleneck sweep" } else { "window ablation" };
    let what = if number == 1 {
        format!("w = {}", rows.iter().filter_map(|r| r.config.window_len()).find(|&w| w > 0).map_or("–".into(), |w| w.to_string()))
    } else {
        format!("d_down = {}", rows.iter().filter_map(|r| r.config.d_down_width()).next().map_or("–".into(), |x| x.to_string()))
    };
    notes.insert(0, format!("Runs: {}, {} (recipe `{}`).", groups::recipe_summary(sec.spec()), sec.seeds_words(), groups::key_id(&sec.key)));
    if !at_paper_scale {
        notes.push(format!("Paper columns: the paper's {paper_scale} rows, matched by d_down / d_model and window."));
    }
    Some(finish(
        number,
        format!("table{number}-{}", sec.id()),
        format!("Table {number}: {name}, {} (d_model {d}), {what}", scale),
        notes,
        sec_corpora(&[sec]),
        rows,
        unit,
    ))
}

const WINDOW_ONLY_NOTE: &str = "Window-only rows: the same local window with no distant keys at all — the control for DAR's distant path (DAR − window-only is what the compressed distant tokens add).";

/// The window-only configurations a section has runs of that `slots` lack.
fn window_only(sec: &Section, slots: &[(AttentionSpec, Option<&PaperRow>)]) -> Vec<AttentionSpec> {
    let mut out: Vec<AttentionSpec> = Vec::new();
    for r in &sec.runs {
        let c = r.spec.attention.comparable();
        if c.kind().is_local_only() && !slots.iter().any(|(s, _)| *s == c) && !out.contains(&c) {
            out.push(c);
        }
    }
    out.sort_by_key(|c| std::cmp::Reverse(c.window_len()));
    out
}

/// Table 2 (scaling): vanilla vs DAR at d_down = d/4 for every scale trained the same way.
fn scaling(cross_key: &Key, members: &[&Run], prows: &[&PaperRow], all: &[&Run], unit: Unit) -> Option<Table> {
    let paper_w = paper_window(prows)?;
    let mut paper_scales: Vec<&str> = Vec::new();
    for p in prows {
        if !paper_scales.contains(&p.scale.as_str()) {
            paper_scales.push(&p.scale);
        }
    }
    let sections: Vec<Section> = groups::by_recipe(members).into_iter().map(|(key, runs)| Section { key, runs }).collect();
    // Expected scales: the paper's (when we train any of them) and every scale we have, by width.
    let mut scales: Vec<(String, usize)> = sections.iter().map(|s| (s.scale(), s.d_model())).collect();
    if scales.iter().any(|(s, _)| paper_scales.contains(&s.as_str())) {
        for p in prows {
            scales.push((p.scale.clone(), p.d_model));
        }
    }
    scales.sort_by_key(|(s, d)| (*d, s.clone()));
    scales.dedup();

    let (mut rows, mut notes, mut used) = (Vec::new(), Vec::new(), Vec::new());
    let (mut fits_any, mut has_controls) = (false, false);
    for (scale, d) in &scales {
        let own: Vec<&PaperRow> = prows.iter().copied().filter(|p| p.scale == *scale).collect();
        // A scale the paper lacks asks for the pattern of its first scale, without paper values.
        let pattern: Vec<&PaperRow> = if own.is_empty() { prows.iter().copied().filter(|p| p.scale == prows[0].scale).collect() } else { own.clone() };
        let at_paper_scale = !own.is_empty();
        let candidates: Vec<&Section> = sections.iter().filter(|s| s.scale() == *scale).collect();
        let slots_for = |tw: usize| -> Vec<(AttentionSpec, Option<PaperRow>)> {
            pattern.iter().filter_map(|p| translate(p, *d, Some(tw)).map(|c| (c, at_paper_scale.then(|| (*p).clone())))).collect()
        };
        // Prefer the recipe that has the DAR row, then the one with any matching run.
        let score = |s: &Section| {
            let slots = slots_for(table_window(s, paper_w, at_paper_scale).0);
            let hit = |row: fn(&AttentionSpec) -> bool| s.runs.iter().any(|r| slots.iter().any(|(c, _)| row(c) && *c == r.spec.attention.comparable()));
            (hit(|c| c.dar_window().is_some()), hit(AttentionSpec::is_vanilla))
        };
        let best = candidates.iter().copied().max_by_key(|s| score(*s));
        let mut scale_rows: Vec<Row> = match best {
            Some(sec) => {
                let (tw, note) = table_window(sec, paper_w, at_paper_scale);
                notes.extend(note.map(|n| format!("{scale}: {n}")));
                fits_any |= score(sec).0;
                used.push(sec);
                let mut slots = slots_for(tw);
                let refs: Vec<(AttentionSpec, Option<&PaperRow>)> = slots.iter().map(|(c, p)| (c.clone(), p.as_ref())).collect();
                let controls = window_only(sec, &refs);
                has_controls |= !controls.is_empty();
                slots.extend(controls.into_iter().map(|c| (c, None)));
                slots.into_iter().map(|(c, p)| fill(sec, c, p, all, unit)).collect()
            }
            None => slots_for(paper_w).into_iter().map(|(c, p)| absent(scale, *d, c, p, cross_key, all)).collect(),
        };
        add_rel(&mut scale_rows);
        rows.extend(scale_rows);
    }
    let trains_paper_scale = sections.iter().any(|s| paper_scales.contains(&s.scale().as_str()));
    if used.is_empty() || !(fits_any || trains_paper_scale) {
        return None;
    }
    let ratio = prows.iter().find_map(|p| p.d_down.map(|x| p.d_model / x.max(1))).unwrap_or(4);
    if has_controls {
        notes.push(WINDOW_ONLY_NOTE.to_string());
    }
    let all_used: Vec<&Run> = used.iter().flat_map(|s| s.runs.iter().copied()).collect();
    notes.insert(0, format!("Runs: {}, {} (scale-independent recipe `{}`).", groups::recipe_summary(used[0].spec()), seeds_words(&all_used), groups::key_id(cross_key)));
    let title = format!("Table 2: scaling, vanilla vs DAR at d_down = d_model/{ratio}, w = {paper_w}");
    Some(finish(2, format!("table2-{}", groups::key_id(cross_key)), title, notes, sec_corpora(&used), rows, unit))
}

/// Our corpora: every evaluation corpus the sections' specs name.
fn sec_corpora(secs: &[&Section]) -> Vec<String> {
    let set: BTreeSet<String> = secs.iter().flat_map(|s| s.runs.iter().flat_map(|r| r.spec.data.eval.keys().cloned())).collect();
    set.into_iter().collect()
}

/// Fill one row from a section: per seed the matching run (an evaluated one first), or why there is none.
fn fill(sec: &Section, want: AttentionSpec, paper: Option<PaperRow>, all: &[&Run], unit: Unit) -> Row {
    let mut row = empty_row(sec.scale(), want.clone(), paper);
    let matching: Vec<&Run> = sec.runs.iter().copied().filter(|r| want == r.spec.attention.comparable()).collect();
    if matching.is_empty() {
        let want_words = wanted(&groups::scale_words(sec.spec()), &want);
        row.missing =
            Some(format!("{want_words} in recipe `{}`{}", groups::key_id(&sec.key), near_miss(&sec.scale(), &want, &sec.key, groups::recipe_key, all)));
        return row;
    }
    let evaluated = |r: &Run| !r.final_eval(unit.field()).is_empty() || !r.final_eval(unit.other().field()).is_empty();
    let mut by_seed: BTreeMap<u64, Vec<&Run>> = BTreeMap::new();
    for r in &matching {
        by_seed.entry(r.spec.seed()).or_default().push(r);
    }
    let (mut others, mut failed) = (Vec::new(), Vec::new());
    for (seed, runs) in &by_seed {
        let run = runs.iter().copied().find(|r| evaluated(r)).unwrap_or(runs[0]);
        others.extend(runs.iter().filter(|r| r.rel != run.rel).map(|r| r.rel.clone()));
        let res = SeedResult { run: run.rel.clone(), ppl: run.final_eval(unit.field()), ppl_alt: run.final_eval(unit.other().field()) };
        if res.ppl.is_empty() {
            let state = if run.done {
                "finished (DONE)".to_string()
            } else {
                format!("not finished: last logged step {}", run.last_step().map_or("none".into(), |s| s.to_string()))
            };
            let has_other = if res.ppl_alt.is_empty() { "" } else { " (only the other unit was recorded)" };
            failed.push(format!("`{}` has no {} perplexity at its final step {}{has_other}; {state}", run.rel, unit.name(), run.steps()));
        }
        row.seeds.insert(*seed, res);
    }
    row.run = row.seeds.values().find(|s| !s.ppl.is_empty()).or(row.seeds.values().next()).map(|s| s.run.clone());
    if !others.is_empty() {
        row.note = Some(format!("also matches: {}", others.join(", ")));
    }
    let done: Vec<&SeedResult> = row.seeds.values().filter(|s| !s.ppl.is_empty()).collect();
    if done.is_empty() {
        row.missing = Some(failed.join("; "));
        return row;
    }
    if !failed.is_empty() {
        let n = failed.len();
        let text = format!("{n} of {} seeds left out: {}", row.seeds.len(), failed.join("; "));
        row.note = Some(row.note.take().map_or(text.clone(), |t| format!("{t}; {text}")));
    }
    let summarise = |field: fn(&SeedResult) -> &BTreeMap<String, f64>| -> BTreeMap<String, Stat> {
        let corpora: BTreeSet<&String> = done.iter().flat_map(|s| field(s).keys()).collect();
        corpora.into_iter().filter_map(|c| Stat::of(&done.iter().filter_map(|s| field(s).get(c).copied()).collect::<Vec<_>>()).map(|st| (c.clone(), st))).collect()
    };
    row.ppl_stat = summarise(|s| &s.ppl);
    row.ppl_alt_stat = summarise(|s| &s.ppl_alt);
    row.ppl = row.ppl_stat.iter().map(|(c, s)| (c.clone(), s.mean)).collect();
    row.ppl_alt = row.ppl_alt_stat.iter().map(|(c, s)| (c.clone(), s.mean)).collect();
    row
}

/// A row of a Table 2 scale with no runs at all.
fn absent(scale: &str, d: usize, want: AttentionSpec, paper: Option<PaperRow>, cross_key: &Key, all: &[&Run]) -> Row {
    let mut row = empty_row(scale.to_string(), want.clone(), paper);
    let words = match scale.starts_with('d') && scale.contains("-L") {
        true => format!("d_model {d}"),
        false => format!("flavor {scale} (d_model {d})"),
    };
    row.missing = Some(format!("{} trained like the other rows{}", wanted(&words, &want), near_miss(scale, &want, cross_key, groups::cross_scale_key, all)));
    row
}

fn empty_row(scale: String, config: AttentionSpec, paper: Option<PaperRow>) -> Row {
    Row {
        scale,
        config,
        run: None,
        seeds: BTreeMap::new(),
        ppl: BTreeMap::new(),
        ppl_alt: BTreeMap::new(),
        ppl_stat: BTreeMap::new(),
        ppl_alt_stat: BTreeMap::new(),
        rel: None,
        rel_alt: None,
        rel_stat: None,
        rel_alt_stat: None,
        rel_by_seed: BTreeMap::new(),
        rel_corpora: Vec::new(),
        paper,
        paper_rel_same: None,
        missing: None,
        note: None,
    }
}

/// "no run with flavor pythia-160m (d_model 768), kind dar, d_down 192, window 128".
fn wanted(scale_words: &str, c: &AttentionSpec) -> String {
    match (c.is_vanilla(), c.d_down_width(), c.window_len()) {
        (true, _, _) => format!("no run with {scale_words}, kind vanilla,"),
        (_, Some(d), Some(0)) => format!("no run with {scale_words}, kind uniform (or dar with window 0), d_down {d},"),
        (_, d, w) => format!("no run with {scale_words}, kind dar, d_down {}, window {},", d.unwrap_or(0), w.unwrap_or(0)),
    }
}

/// When a run with the wanted config and scale exists under another recipe, name it and how it differs.
fn near_miss(scale: &str, want: &AttentionSpec, key: &Key, key_of: fn(&crate::spec::Spec) -> Key, all: &[&Run]) -> String {
    let best = all
        .iter()
        .filter(|r| groups::scale(&r.spec) == scale && *want == r.spec.attention.comparable())
        .map(|r| (r, groups::differences(&key_of(&r.spec), key, 3)))
        .filter(|(_, d)| !d.is_empty())
        .min_by_key(|(_, d)| d.len());
    match best {
        Some((r, diffs)) => format!("; `{}` has this configuration but another recipe ({})", r.rel, diffs.join("; ")),
        None => String::new(),
    }
}

/// Rel.(%) of every row against the vanilla row among them (rows of one scale), in both units:
/// per seed against the vanilla run of the same seed, then summarised over seeds (a paired
/// comparison); when the two rows share no seed, the ratio of their means, noted as unpaired.
/// Also the paper's Rel.(%) over the same corpora when ours averages over fewer.
fn add_rel(rows: &mut [Row]) {
    let Some(v) = rows.iter().position(|r| r.config.is_vanilla()) else { return };
    let (vanilla, vanilla_paper) = (rows[v].seeds.clone(), rows[v].paper.clone());
    let (vanilla_mean, vanilla_mean_alt) = (rows[v].ppl.clone(), rows[v].ppl_alt.clone());
    for row in rows.iter_mut() {
        let paired = |field: fn(&SeedResult) -> &BTreeMap<String, f64>| -> (BTreeMap<u64, f64>, Vec<String>) {
            let (mut rels, mut corpora) = (BTreeMap::new(), Vec::new());
            for (seed, s) in &row.seeds {
                if let Some((r, c)) = vanilla.get(seed).and_then(|v| rel(field(s), field(v))) {
                    rels.insert(*seed, r);
                    corpora = c;
                }
            }
            (rels, corpora)
        };
        let (by_seed, corpora) = paired(|s| &s.ppl);
        let rels: Vec<f64> = by_seed.values().copied().collect();
        let rels_alt: Vec<f64> = paired(|s| &s.ppl_alt).0.into_values().collect();
        row.rel_by_seed = by_seed;
        if !rels.is_empty() {
            row.rel_stat = Stat::of(&rels);
            row.rel_corpora = corpora;
        } else if let Some((r, c)) = rel(&row.ppl, &vanilla_mean) {
            row.rel_stat = Stat::of(&[r]);
            row.rel_corpora = c;
            let text = "unpaired: no seed in common with the vanilla row, Rel.(%) of the means".to_string();
            row.note = Some(row.note.take().map_or(text.clone(), |t| format!("{t}; {text}")));
        }
        row.rel_alt_stat = if rels_alt.is_empty() { rel(&row.ppl_alt, &vanilla_mean_alt).and_then(|(r, _)| Stat::of(&[r])) } else { Stat::of(&rels_alt) };
        row.rel = row.rel_stat.map(|s| s.mean);
        row.rel_alt = row.rel_alt_stat.map(|s| s.mean);
        if let (Some(p), Some(pv)) = (&row.paper, &vanilla_paper) {
            let cols: BTreeSet<String> = row.rel_corpora.iter().filter_map(|c| paper::paper_column(c, p.ppl.keys())).collect();
            if !cols.is_empty() && cols.len() < p.ppl.len() {
                let pick = |m: &BTreeMap<String, f64>| m.iter().filter(|(k, _)| cols.contains(*k)).map(|(k, v)| (k.clone(), *v)).collect::<BTreeMap<_, _>>();
                row.paper_rel_same = rel(&pick(&p.ppl), &pick(&pv.ppl)).map(|(r, _)| r);
            }
        }
    }
}

fn finish(number: u8, id: String, title: String, mut notes: Vec<String>, corpora: Vec<String>, rows: Vec<Row>, unit: Unit) -> Table {
    let paper_columns: BTreeSet<String> = rows.iter().filter_map(|r| r.paper.as_ref()).flat_map(|p| p.ppl.keys().cloned()).collect();
    let paper_cols: BTreeMap<String, String> = corpora.iter().filter_map(|c| paper::paper_column(c, &paper_columns).map(|p| (c.clone(), p))).collect();
    notes.push(format!(
        "PPL: {}-level (`{}`), {}-level beside it. Rel.(%) = 100 · mean over corpora of PPL / PPL(vanilla of the same scale, recipe and seed) (dar.md §6), computed per seed and then summarised over seeds (paired).",
        unit.name(),
        unit.field(),
        unit.other().name()
    ));
    if rows.iter().any(|r| r.n() > 1) {
        notes.push(stats::WHAT_INTERVALS_MEAN.to_string());
    }
    let used: BTreeSet<&String> = rows.iter().flat_map(|r| r.rel_corpora.iter()).collect();
    if !paper_columns.is_empty() && used.len() < paper_columns.len() {
        let ours: Vec<&str> = used.iter().map(|s| s.as_str()).collect();
        let theirs: Vec<&str> = paper_columns.iter().map(|c| paper::column_title(c)).collect();
        notes.push(format!(
            "Our Rel.(%) averages over {} only (the corpora we evaluated); the paper's over {}. \"paper Rel. (same corpora)\" recomputes the paper's over ours.",
            if ours.is_empty() { "no corpus".to_string() } else { ours.join(", ") },
            theirs.join(", ")
        ));
    }
    let pairs = paired_differences(&rows);
    if !pairs.is_empty() {
        notes.push(format!(
            "Paired differences (below the table): Rel.(%) of one row minus another's, in percentage points of {}-level PPL, per seed (both against the vanilla run of that seed), then mean ± s.d. (n) [95% t-interval] and the paired t-test's p; negative = the first row is better.",
            unit.name()
        ));
    }
    Table { number, id, title, notes, corpora, paper_cols, unit, rows, pairs }
}
