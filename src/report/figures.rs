//! The report's figures: per-run and per-sweep loss / perplexity against step, and Figure 3
//! (Rel.(%) against step for every configuration of a sweep, vanilla as the 100% line).
//! A sweep is a recipe group (groups.rs): runs of one scale and recipe that differ in attention only.
use super::groups::{self, Config, Key};
use super::load::Run;
use super::plots::{self, Chart, Line};
use super::tables::{rel, Unit};
use crate::spec::{AttentionKind, DarAct};
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

fn save(chart: Chart, out: &Path, rel_stem: &str, caption: String) -> Result<Option<Figure>> {
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
    let what = format!("{} ({}, {})", run.rel, groups::scale(&run.spec), Config::of(&run.spec).label());
    let loss = Chart {
        title: format!("Training loss: {}", run.rel),
        x_label: "step".into(),
        y_label: "training loss (nats / token)".into(),
        lines: vec![Line { label: "train loss".into(), points: run.series("loss"), color: 0, reference: false }],
        log_y: false,
    };
    let ppl = Chart {
        title: format!("Validation perplexity: {}", run.rel),
        x_label: "step".into(),
        y_label: ppl_label(unit),
        lines: corpora(run)
            .into_iter()
            .enumerate()
            .map(|(i, c)| Line { points: run.series(&format!("eval/{c}/{}", unit.field())), label: c, color: i, reference: false })
            .collect(),
        log_y: false,
    }
    .log_y_if_wide();
    let mut out_figs = Vec::new();
    out_figs.extend(save(loss, out, &format!("{stem}/loss"), format!("Training loss of {what}"))?);
    out_figs.extend(save(ppl, out, &format!("{stem}/ppl"), format!("{} perplexity of {what}", unit.name()))?);
    Ok(out_figs)
}

/// Legend labels: the attention config, plus the run path where two runs share a config.
fn labels(runs: &[&Run]) -> Vec<String> {
    let sigmoid = |r: &Run| r.spec.attention.kind.has_bottleneck() && r.spec.attention.dar_act == DarAct::Sigmoid;
    let configs: Vec<String> = runs.iter().map(|r| Config::of(&r.spec).label() + if sigmoid(r) { " sigmoid" } else { "" }).collect();
    configs.iter().zip(runs).map(|(c, r)| if configs.iter().filter(|x| *x == c).count() > 1 { format!("{c} [{}]", r.rel) } else { c.clone() }).collect()
}

/// Runs of a sweep in table order: vanilla, DAR by d_down and window (wide first), uniform.
fn ordered<'a>(runs: &[&'a Run]) -> Vec<&'a Run> {
    let mut v = runs.to_vec();
    v.sort_by_key(|r| {
        let c = Config::of(&r.spec);
        (c.kind != AttentionKind::Vanilla, c.kind == AttentionKind::Uniform, std::cmp::Reverse(c.d_down), std::cmp::Reverse(c.window), r.rel.clone())
    });
    v
}

/// Loss and per-corpus perplexity of every run of a sweep on shared axes.
pub fn sweep_figures(key: &Key, runs: &[&Run], out: &Path, unit: Unit) -> Result<Vec<Figure>> {
    let runs = ordered(runs);
    let names = labels(&runs);
    let scale = groups::scale(&runs[0].spec);
    let id = format!("{scale}-{}", groups::key_id(key));
    let stem = format!("plots/sweeps/{}", slug(&id));
    let mut figs = Vec::new();
    let loss = Chart {
        title: format!("Training loss, {scale} sweep `{}`", groups::key_id(key)),
        x_label: "step".into(),
        y_label: "training loss (nats / token)".into(),
        lines: runs.iter().zip(&names).enumerate().map(|(i, (r, n))| Line { label: n.clone(), points: r.series("loss"), color: i, reference: false }).collect(),
        log_y: false,
    };
    figs.extend(save(loss, out, &format!("{stem}/loss"), format!("Training loss of the {scale} sweep `{}`", groups::key_id(key)))?);
    let all_corpora: BTreeSet<String> = runs.iter().flat_map(|r| corpora(r)).collect();
    for c in all_corpora {
        let chart = Chart {
            title: format!("{c}: {}, {scale} sweep `{}`", ppl_label(unit), groups::key_id(key)),
            x_label: "step".into(),
            y_label: ppl_label(unit),
            lines: runs
                .iter()
                .zip(&names)
                .enumerate()
                .map(|(i, (r, n))| Line { label: n.clone(), points: r.series(&format!("eval/{c}/{}", unit.field())), color: i, reference: false })
                .collect(),
            log_y: false,
        }
        .log_y_if_wide();
        figs.extend(save(
            chart,
            out,
            &format!("{stem}/ppl-{}", slug(&c)),
            format!("{c} {} perplexity of the {scale} sweep `{}`", unit.name(), groups::key_id(key)),
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

/// Figure 3 for one sweep: None without a vanilla run or another configuration.
pub fn figure3(key: &Key, runs: &[&Run], out: &Path, unit: Unit) -> Result<Option<Figure>> {
    let runs = ordered(runs);
    let evals = |r: &Run| r.rows.keys().filter(|&&s| !r.eval_at(s, unit.field()).is_empty()).count();
    let Some(vanilla) = runs.iter().copied().filter(|r| r.spec.attention.kind == AttentionKind::Vanilla).max_by_key(|r| evals(r)) else {
        return Ok(None);
    };
    // Colours by position in the whole sweep, as in the sweep's loss and perplexity charts.
    let names = labels(&runs);
    let mut lines: Vec<Line> = (runs.iter().zip(&names).enumerate())
        .filter(|(_, (r, _))| r.spec.attention.kind != AttentionKind::Vanilla)
        .map(|(i, (r, n))| Line { label: n.clone(), points: rel_curve(r, vanilla, unit), color: i, reference: false })
        .collect();
    let xs: Vec<f64> = lines.iter().flat_map(|l| l.points.iter().map(|p| p.0)).collect();
    if xs.is_empty() {
        return Ok(None);
    }
    let (x0, x1) = xs.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    lines.push(Line { label: format!("vanilla = 100% [{}]", vanilla.rel), points: vec![(x0, 100.0), (x1, 100.0)], color: 0, reference: true });
    let scale = groups::scale(&runs[0].spec);
    let id = groups::key_id(key);
    let chart = Chart {
        title: format!("Rel.(%) vs step, {scale} sweep `{id}`"),
        x_label: "step".into(),
        y_label: format!("Rel.(%) of {}-level PPL vs vanilla", unit.name()),
        lines,
        log_y: false,
    };
    let caption = format!(
        "Figure 3, {scale} sweep `{id}`: Rel.(%) = 100 · mean over corpora of PPL / PPL(vanilla) at each evaluated step ({} PPL; lower is better)",
        unit.name()
    );
    save(chart, out, &format!("plots/figure3-{}", slug(&format!("{scale}-{id}"))), caption)
}
