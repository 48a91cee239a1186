//! The report's figures: per-run and per-sweep loss / perplexity against step, and Figure 3
//! (Rel.(%) against step for every configuration of a sweep, vanilla as the 100% line).
//! A sweep is a recipe group (groups.rs): runs of one scale and recipe that differ in attention and
//! seed only. A sweep's charts draw one series per configuration: the mean over its seeds, with a
//! band of ± one s.d. where there are several; vanilla black, DAR solid, uniform dashed,
//! window-only dotted, one colour per d_down (per window in a window ablation). Loss by window
//! position (eval.json's `by_position`) is drawn the same way, absolute and minus vanilla's.
use super::groups::{self, Key};
use super::load::Run;
use super::plots::{self, Chart, Dash, Line};
use super::stats::Stat;
use super::tables::{rel, Unit};
use crate::eval::perplexity::PositionLoss;
use crate::spec::{AttentionSpec, DarAct};
use crate::Result;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

pub struct Figure {
    pub caption: String,
    /// The PNG and SVG files, relative to the report folder.
    pub files: Vec<PathBuf>,
}

/// A file-name-safe form of a run path or label.
pub fn slug(s: &str) -> String {
    let t: String = s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '_' }).collect();
    match t.trim_matches(|c| c == '_' || c == '.') {
        "" => "run".into(),
        t => t.to_string(),
    }
}

pub(super) fn save(chart: Chart, out: &Path, rel_stem: &str, caption: String) -> Result<Option<Figure>> {
    if chart.is_empty() {
        return Ok(None);
    }
    let files = plots::save(&chart, &out.join(rel_stem))?;
    let files = files.iter().map(|f| f.strip_prefix(out).unwrap_or(f).to_path_buf()).collect();
    Ok(Some(Figure { caption, files }))
}

fn ppl_label(unit: Unit) -> String {
    format!("{}-level perplexity", unit.name())
}

/// Corpora a run evaluates during training (the spec's), which the curves follow.
fn corpora(run: &Run) -> Vec<String> {
    run.spec.data.eval.keys().cloned().collect()
}

/// Loss and perplexity against step for one run.
pub fn run_figures(run: &Run, out: &Path, unit: Unit) -> Result<Vec<Figure>> {
    let stem = format!("plots/runs/{}", slug(&run.rel));
    let what = format!("{} ({}, {})", run.rel, groups::scale(&run.spec), run.spec.attention.comparable().label());
    let loss = Chart {
        title: format!("Training loss: {}", run.rel),
        x_label: "step".into(),
        y_label: "training loss (nats / token)".into(),
        lines: vec![Line::solid("train loss".into(), run.series("loss"), 0)],
        log_y: false,
        log_x: false,
    };
    let ppl = Chart {
        title: format!("Validation perplexity: {}", run.rel),
        x_label: "step".into(),
        y_label: ppl_label(unit),
        lines: corpora(run)
            .into_iter()
            .enumerate()
            .map(|(i, c)| Line::solid(c.clone(), run.series(&format!("eval/{c}/{}", unit.field())), i))
            .collect(),
        log_y: false,
        log_x: false,
    }
    .log_y_if_wide();
    let mut out_figs = Vec::new();
    out_figs.extend(save(loss, out, &format!("{stem}/loss"), format!("Training loss of {what}"))?);
    out_figs.extend(save(ppl, out, &format!("{stem}/ppl"), format!("{} perplexity of {what}", unit.name()))?);
    Ok(out_figs)
}

/// One configuration of a sweep: its runs (one per seed, usually) and how it is drawn.
struct Series<'a> {
    config: AttentionSpec,
    sigmoid: bool,
    runs: Vec<&'a Run>,
    label: String,
    color: Option<usize>,
    dash: Dash,
}

fn is_sigmoid(r: &Run) -> bool {
    !r.spec.attention.is_vanilla() && r.spec.attention.dar_act() == DarAct::Sigmoid
}

/// The dash of a kind: its registered line style (vanilla and DAR solid, uniform dashed, …).
fn dash_of(c: &AttentionSpec) -> Dash {
    c.kind().line_style()
}

/// A sweep's runs as series, in table order (vanilla, DAR by d_down and window, wide first,
/// uniform, others), with colours: one per d_down (per window when only the window varies),
/// vanilla black, and never two series with the same colour and dash.
fn series<'a>(runs: &[&'a Run]) -> Vec<Series<'a>> {
    let mut out: Vec<Series<'a>> = Vec::new();
    for &r in runs {
        let (config, sigmoid) = (r.spec.attention.comparable(), is_sigmoid(r));
        match out.iter_mut().find(|s| s.config == config && s.sigmoid == sigmoid) {
            Some(s) => s.runs.push(r),
            None => out.push(Series { dash: dash_of(&config), config, sigmoid, runs: vec![r], label: String::new(), color: None }),
        }
    }
    out.sort_by_key(|s| (s.config.kind().order(), std::cmp::Reverse(s.config.d_down_width()), std::cmp::Reverse(s.config.window_len()), s.config.init().map(|i| i as u8), s.sigmoid));
    // Colour by window only in a window ablation: one d_down, several DAR windows (uniform's 0
    // alone does not make one).
    let bottleneck: Vec<&AttentionSpec> = out.iter().map(|s| &s.config).filter(|c| c.has_bottleneck()).collect();
    let d_downs: BTreeSet<Option<usize>> = bottleneck.iter().map(|c| c.d_down_width()).collect();
    let windows: BTreeSet<Option<usize>> = bottleneck.iter().filter(|c| c.dar_window().is_some()).map(|c| c.window_len()).collect();
    let by_window = d_downs.len() <= 1 && windows.len() > 1;
    let key = |c: &AttentionSpec| -> String {
        match (c.has_bottleneck(), by_window) {
            (true, false) => format!("d{}", c.d_down_width().unwrap_or(0)),
            _ => format!("w{}", c.window_len().unwrap_or(0)),
        }
    };
    let mut colors: BTreeMap<String, usize> = BTreeMap::new();
    let mut taken: BTreeSet<(usize, bool, bool, bool)> = BTreeSet::new();
    let mut next = 0;
    for s in out.iter_mut() {
        let n = s.runs.iter().map(|r| r.spec.seed()).collect::<BTreeSet<_>>().len();
        let seeds = if n > 1 { format!(", {n} seeds") } else { String::new() };
        s.label = format!("{}{}{seeds}", s.config.label(), if s.sigmoid { " sigmoid" } else { "" });
        if s.config.is_vanilla() {
            continue;
        }
        let dash = (s.dash == Dash::Solid, s.dash == Dash::Dashed, s.dash == Dash::Dotted);
        let mut c = *colors.entry(key(&s.config)).or_insert_with(|| {
            next += 1;
            next - 1
        });
        // The same colour and dash as an earlier series (another start or activation of one
        // configuration): the next colour no key uses.
        if taken.contains(&(c, dash.0, dash.1, dash.2)) {
            c = next;
            next += 1;
        }
        taken.insert((c, dash.0, dash.1, dash.2));
        s.color = Some(c);
    }
    out
}

/// (label, colour, dash) of each series of a sweep, for tests.
#[cfg(test)]
pub fn styles_for_test(runs: &[&Run]) -> Vec<(String, Option<usize>, Dash)> {
    series(runs).into_iter().map(|s| (s.label, s.color, s.dash)).collect()
}

/// Mean over curves at each x every curve has (any curve has, when there is one), with the band
/// mean ± s.d. where more than one curve contributes.
fn pool(curves: &[Vec<(f64, f64)>]) -> (Vec<(f64, f64)>, Vec<(f64, f64, f64)>) {
    let mut at: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    for c in curves {
        for &(x, y) in c {
            if y.is_finite() {
                at.entry(x.to_bits()).or_default().push(y);
            }
        }
    }
    let n = curves.iter().filter(|c| !c.is_empty()).count();
    let (mut points, mut band) = (Vec::new(), Vec::new());
    let mut xs: Vec<(f64, Vec<f64>)> = at.into_iter().map(|(x, v)| (f64::from_bits(x), v)).filter(|(_, v)| v.len() == n || n <= 1).collect();
    xs.sort_by(|a, b| a.0.total_cmp(&b.0));
    for (x, v) in xs {
        let Some(s) = Stat::of(&v) else { continue };
        points.push((x, s.mean));
        if n > 1 {
            band.push((x, s.mean - s.sd, s.mean + s.sd));
        }
    }
    (points, band)
}

fn pooled_line(s: &Series, curves: &[Vec<(f64, f64)>]) -> Line {
    let (points, band) = pool(curves);
    Line { label: s.label.clone(), points, band, color: s.color, dash: s.dash, reference: false }
}

/// One line per configuration of `runs`, styled as the sweep charts style it (colour per d_down,
/// dash per kind, vanilla black): the mean of the curves `curves` gives for the configuration's
/// runs (one per seed, usually), with a band of ± 1 s.d. where there are several. Also whether any
/// configuration pools several curves.
pub(super) fn pooled_lines(runs: &[&Run], curves: impl Fn(&[&Run]) -> Vec<Vec<(f64, f64)>>) -> (Vec<Line>, bool) {
    let all = series(runs);
    let mut pooled = false;
    let lines = all
        .iter()
        .map(|s| {
            let c = curves(&s.runs);
            pooled |= c.iter().filter(|c| !c.is_empty()).count() > 1;
            pooled_line(s, &c)
        })
        .collect();
    (lines, pooled)
}

/// Loss and per-corpus perplexity of every configuration of a sweep on shared axes (seeds pooled).
pub fn sweep_figures(key: &Key, runs: &[&Run], out: &Path, unit: Unit) -> Result<Vec<Figure>> {
    let all = series(runs);
    let scale = groups::scale(&runs[0].spec);
    let id = format!("{scale}-{}", groups::key_id(key));
    let stem = format!("plots/sweeps/{}", slug(&id));
    let seeds = all.iter().any(|s| s.runs.len() > 1);
    let band = if seeds { " Lines: mean over seeds; bands: ± 1 s.d. over seeds." } else { "" };
    let mut figs = Vec::new();
    let loss = Chart {
        title: format!("Training loss, {scale} sweep `{}`", groups::key_id(key)),
        x_label: "step".into(),
        y_label: "training loss (nats / token)".into(),
        lines: all.iter().map(|s| pooled_line(s, &s.runs.iter().map(|r| r.series("loss")).collect::<Vec<_>>())).collect(),
        log_y: false,
        log_x: false,
    };
    figs.extend(save(loss, out, &format!("{stem}/loss"), format!("Training loss of the {scale} sweep `{}`.{band}", groups::key_id(key)))?);
    let all_corpora: BTreeSet<String> = runs.iter().flat_map(|r| corpora(r)).collect();
    for c in all_corpora {
        let metric = format!("eval/{c}/{}", unit.field());
        let chart = Chart {
            title: format!("{c}: {}, {scale} sweep `{}`", ppl_label(unit), groups::key_id(key)),
            x_label: "step".into(),
            y_label: ppl_label(unit),
            lines: all.iter().map(|s| pooled_line(s, &s.runs.iter().map(|r| r.series(&metric)).collect::<Vec<_>>())).collect(),
            log_y: false,
        log_x: false,
        }
        .log_y_if_wide();
        figs.extend(save(
            chart,
            out,
            &format!("{stem}/ppl-{}", slug(&c)),
            format!("{c} {} perplexity of the {scale} sweep `{}`.{band}", unit.name(), groups::key_id(key)),
        )?);
    }
    Ok(figs)
}

/// Rel.(%) of `run` against `vanilla` at every step both evaluated, over the corpora both specs name.
pub fn rel_curve(run: &Run, vanilla: &Run, unit: Unit) -> Vec<(f64, f64)> {
    let keep: BTreeSet<String> = corpora(run).into_iter().filter(|c| vanilla.spec.data.eval.contains_key(c)).collect();
    let only = |m: BTreeMap<String, f64>| -> BTreeMap<String, f64> { m.into_iter().filter(|(c, _)| keep.contains(c)).collect() };
    run.rows.keys().filter_map(|&s| rel(&only(run.eval_at(s, unit.field())), &only(vanilla.eval_at(s, unit.field()))).map(|(r, _)| (s as f64, r))).collect()
}

/// Figure 3 for one sweep: None without a vanilla run or another configuration. Each run is
/// compared with the vanilla run of its own seed (or, when the sweep has none, with the vanilla run
/// evaluated most often), and the per-seed curves are pooled.
pub fn figure3(key: &Key, runs: &[&Run], out: &Path, unit: Unit) -> Result<Option<Figure>> {
    let evals = |r: &Run| r.rows.keys().filter(|&&s| !r.eval_at(s, unit.field()).is_empty()).count();
    let vanillas: Vec<&Run> = runs.iter().copied().filter(|r| r.spec.attention.is_vanilla()).collect();
    let Some(fallback) = vanillas.iter().copied().max_by_key(|r| evals(r)) else {
        return Ok(None);
    };
    let vanilla_of = |r: &Run| -> &Run {
        vanillas.iter().copied().filter(|v| v.spec.seed() == r.spec.seed()).max_by_key(|v| evals(v)).unwrap_or(fallback)
    };
    let all = series(runs);
    let mut lines: Vec<Line> = all
        .iter()
        .filter(|s| !s.config.is_vanilla())
        .map(|s| pooled_line(s, &s.runs.iter().map(|r| rel_curve(r, vanilla_of(r), unit)).collect::<Vec<_>>()))
        .collect();
    let xs: Vec<f64> = lines.iter().flat_map(|l| l.points.iter().map(|p| p.0)).collect();
    if xs.is_empty() {
        return Ok(None);
    }
    let (x0, x1) = xs.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    let seeds: BTreeSet<u64> = vanillas.iter().map(|v| v.spec.seed()).collect();
    let which = if seeds.len() > 1 { format!("{} seeds", seeds.len()) } else { fallback.rel.clone() };
    lines.insert(0, Line { label: format!("vanilla = 100% [{which}]"), points: vec![(x0, 100.0), (x1, 100.0)], band: Vec::new(), color: None, dash: Dash::Solid, reference: true });
    let scale = groups::scale(&runs[0].spec);
    let id = groups::key_id(key);
    let pooled = all.iter().any(|s| s.runs.len() > 1);
    let chart = Chart {
        title: format!("Rel.(%) vs step, {scale} sweep `{id}`"),
        x_label: "step".into(),
        y_label: format!("Rel.(%) of {}-level PPL vs vanilla", unit.name()),
        lines,
        log_y: false,
        log_x: false,
    };
    let caption = format!(
        "Figure 3, {scale} sweep `{id}`: Rel.(%) = 100 · mean over corpora of PPL / PPL(vanilla of the same seed) at each evaluated step ({} PPL; lower is better){}",
        unit.name(),
        if pooled { "; lines: mean over seeds, bands: ± 1 s.d. over seeds" } else { "" }
    );
    save(chart, out, &format!("plots/figure3-{}", slug(&format!("{scale}-{id}"))), caption)
}

/// x of each bin of a loss-by-position record (the mean context length of its positions, position
/// + 1, so that a log axis can start at the first token) and its loss.
pub fn position_curve(p: &PositionLoss) -> Vec<(f64, f64)> {
    p.edges.windows(2).zip(&p.loss).filter_map(|(e, l)| l.map(|l| ((e[0] + e[1] + 1) as f64 / 2.0, l))).collect()
}

/// `run`'s loss by position minus `vanilla`'s, bin by bin (same bins only).
pub fn position_delta(run: &PositionLoss, vanilla: &PositionLoss) -> Vec<(f64, f64)> {
    if run.edges != vanilla.edges {
        return Vec::new();
    }
    let v: BTreeMap<u64, f64> = position_curve(vanilla).into_iter().map(|(x, y)| (x.to_bits(), y)).collect();
    position_curve(run).into_iter().filter_map(|(x, y)| v.get(&x.to_bits()).map(|b| (x, y - b))).collect()
}

/// Vertical reference lines at each local window w of the sweep, spanning `lines`' y range: the
/// bins right of it are the positions with keys at distance ≥ w.
fn window_marks(all: &[Series], lines: &[Line]) -> Vec<Line> {
    let ys: Vec<f64> = lines.iter().flat_map(|l| l.points.iter().map(|p| p.1).chain(l.band.iter().flat_map(|b| [b.1, b.2]))).filter(|y| y.is_finite()).collect();
    let (lo, hi) = ys.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &y| (a.min(y), b.max(y)));
    if !lo.is_finite() {
        return Vec::new();
    }
    let windows: BTreeSet<usize> = all.iter().filter(|s| !s.config.is_vanilla()).filter_map(|s| s.config.window_len()).filter(|&w| w > 0).collect();
    windows
        .into_iter()
        .map(|w| Line {
            label: format!("w = {w}: farther keys exist right of it"),
            points: vec![(w as f64 + 0.5, lo), (w as f64 + 0.5, hi)],
            band: Vec::new(),
            color: None,
            dash: Dash::Dotted,
            reference: true,
        })
        .collect()
}

/// The loss by position of the vanilla run with `r`'s seed, on `corpus`.
fn vanilla_position<'a>(runs: &[&'a Run], r: &Run, corpus: &str) -> Option<&'a PositionLoss> {
    runs.iter().copied().find(|v| v.spec.attention.is_vanilla() && v.spec.seed() == r.spec.seed()).and_then(|v| v.by_position.get(corpus))
}

/// Loss by position (eval.json's `by_position`) for every configuration of a sweep, per corpus: the
/// mean loss, and the difference from the vanilla run of the same seed (paired), each pooled over
/// seeds (bands ± 1 s.d.), on a log position axis with the window marked. Past the window, DAR below
/// window-only means its distant path carries information window-only cannot have.
pub fn position_figures(key: &Key, runs: &[&Run], out: &Path) -> Result<Vec<Figure>> {
    let corpora: BTreeSet<String> = runs.iter().flat_map(|r| r.by_position.keys().cloned()).collect();
    if corpora.is_empty() {
        return Ok(Vec::new());
    }
    let all = series(runs);
    let scale = groups::scale(&runs[0].spec);
    let id = groups::key_id(key);
    let stem = format!("plots/sweeps/{}", slug(&format!("{scale}-{id}")));
    let seeds = all.iter().any(|s| s.runs.len() > 1);
    let band = if seeds { " Lines: mean over seeds; bands: ± 1 s.d. over seeds." } else { "" };
    let x_label = "tokens of context (window position + 1, log scale)".to_string();
    let mut figs = Vec::new();
    for c in corpora {
        let mut lines: Vec<Line> = all.iter().map(|s| pooled_line(s, &s.runs.iter().filter_map(|r| r.by_position.get(&c).map(position_curve)).collect::<Vec<_>>())).collect();
        let marks = window_marks(&all, &lines);
        lines.extend(marks);
        let chart = Chart { title: format!("{c}: loss by position, {scale} sweep `{id}`"), x_label: x_label.clone(), y_label: "mean loss (nats / token)".into(), lines, log_y: false, log_x: true };
        figs.extend(save(chart, out, &format!("{stem}/loss-by-position-{}", slug(&c)), format!("{c}: mean loss by window position of the {scale} sweep `{id}` (bins of eval.json's `by_position`).{band}"))?);

        let mut lines: Vec<Line> = all
            .iter()
            .filter(|s| !s.config.is_vanilla())
            .map(|s| pooled_line(s, &s.runs.iter().filter_map(|r| Some(position_delta(r.by_position.get(&c)?, vanilla_position(runs, r, &c)?))).collect::<Vec<_>>()))
            .collect();
        if lines.iter().all(|l| l.points.is_empty()) {
            continue;
        }
        let xs: Vec<f64> = lines.iter().flat_map(|l| l.points.iter().map(|p| p.0)).collect();
        let (x0, x1) = xs.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
        lines.insert(0, Line { label: "vanilla (same seed) = 0".into(), points: vec![(x0, 0.0), (x1, 0.0)], band: Vec::new(), color: None, dash: Dash::Solid, reference: true });
        let marks = window_marks(&all, &lines);
        lines.extend(marks);
        let chart = Chart {
            title: format!("{c}: loss minus vanilla's by position, {scale} sweep `{id}`"),
            x_label: x_label.clone(),
            y_label: "loss − vanilla loss, same seed (nats / token)".into(),
            lines,
            log_y: false,
            log_x: true,
        };
        figs.extend(save(
            chart,
            out,
            &format!("{stem}/loss-by-position-vs-vanilla-{}", slug(&c)),
            format!("{c}: loss minus the loss of the vanilla run of the same seed, by window position, {scale} sweep `{id}` (below 0: better than vanilla).{band}"),
        )?);
    }
    Ok(figs)
}
