//! Report tests on fake run directories written with the trainer's own writers (RunDir: config.yaml,
//! metrics.jsonl, eval.json, DONE), so the format is the one `attnlab train` produces.
use super::tables::{self, Table, Unit};
use super::*;
use crate::eval::perplexity::CorpusResult;
use crate::spec::{AttentionKind, AttentionSpec, Spec};
use crate::train::run::RunDir;
use polars::prelude::*;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// A resolved spec like a real sweep's: `flavor`, `attention` (YAML), two eval corpora (wikitext, c4).
fn spec(flavor: &str, attention: &str, steps: u64, eval: &[&str], out: &Path) -> Spec {
    let corpora: String = eval.iter().enumerate().map(|(i, c)| format!("    {c}: {{synthetic: {{seed: {}, docs: 5}}}}\n", i + 2)).collect();
    let yaml = format!(
        "model: {{flavor: {flavor}}}\nattention: {attention}\ndata:\n  train: {{synthetic: {{seed: 1, docs: 10}}}}\n  eval:\n{corpora}train: {{steps: {steps}, batch_size: 4}}\neval: {{every: 20}}\n"
    );
    let mut s = crate::spec::from_str(&yaml, "test spec", &[]).expect("test spec is valid");
    s.output = Some(out.to_path_buf());
    s.model.vocab = Some(384);
    s
}

/// A CorpusResult with the given token- and word-level perplexities.
fn result(ppl: f64, word_ppl: f64) -> CorpusResult {
    let (tokens, words, bytes) = (1000usize, 800usize, 4000usize);
    let nll = ppl.ln() * tokens as f64;
    CorpusResult {
        protocol: "rolling".into(),
        docs: 5,
        tokens,
        words,
        bytes,
        nll,
        loss: ppl.ln(),
        ppl,
        word_ppl,
        byte_ppl: (nll / bytes as f64).exp(),
        bits_per_byte: nll / bytes as f64 / std::f64::consts::LN_2,
        by_position: None,
    }
}

fn train_row(dir: &RunDir, step: u64, loss: f64) {
    let row = json!({"step": step, "tokens": step * 8192, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0, "elapsed_s": step as f64});
    dir.append_metrics(row.as_object().unwrap()).unwrap();
}

/// An evaluation row as the trainer writes it (eval_row in train/mod.rs).
fn eval_row(dir: &RunDir, step: u64, results: &BTreeMap<String, CorpusResult>) {
    let mut row = Map::new();
    row.insert("step".into(), json!(step));
    row.insert("tokens".into(), json!(step * 8192));
    row.insert("elapsed_s".into(), json!(step as f64));
    for (name, r) in results {
        for (k, v) in r.metrics(name) {
            row.insert(k, Value::from(v));
        }
    }
    dir.append_metrics(&row).unwrap();
}

/// corpus → (token ppl, word ppl)
fn results(v: &[(&str, f64, f64)]) -> BTreeMap<String, CorpusResult> {
    v.iter().map(|&(c, p, w)| (c.to_string(), result(p, w))).collect()
}

/// `spec` of a tiny run with a synthetic eval corpus and train.seed = `seed` (the seeded arms of
/// the paired tests).
fn seeded(attention: &str, steps: u64, out: &Path, seed: u64) -> Spec {
    let mut s = spec("tiny", attention, steps, &["synthetic"], out);
    s.train.seed = Some(seed);
    s
}

/// A finished run: train rows every 10 steps, evaluations at 20 and at the end, eval.json, DONE.
fn finished(s: &Spec, mid: &[(&str, f64, f64)], end: &[(&str, f64, f64)]) -> RunDir {
    let dir = RunDir::prepare(s).unwrap();
    let steps = s.steps();
    for step in (10..=steps).step_by(10) {
        train_row(&dir, step, 6.0 - step as f64 / 20.0);
        if step == 20 {
            eval_row(&dir, step, &results(mid));
        }
    }
    eval_row(&dir, steps, &results(end));
    dir.write_eval(steps, &results(end)).unwrap();
    dir.mark_done().unwrap();
    dir
}

/// Pythia-70M sweep with neutral directory names (matching must come from config.yaml):
/// a = vanilla, b = DAR d128 w128 (resumed: step 20 logged twice), c = uniform d128,
/// d = DAR d256 w128 unfinished, broken = unreadable config.
fn pythia_sweep(root: &Path) {
    let eval = ["wikitext", "c4"];
    let s = |att: &str, dir: &str| spec("pythia-70m", att, 40, &eval, &root.join(dir));
    finished(&s("{kind: vanilla}", "t/a"), &[("wikitext", 40.0, 60.0), ("c4", 80.0, 120.0)], &[("wikitext", 30.0, 50.0), ("c4", 60.0, 100.0)]);

    // b: interrupted after step 20 (checkpoint at 10), resumed: steps 20 and its evaluation logged again.
    let b = RunDir::prepare(&s("{kind: dar, d_down: 128, window: 128}", "t/b")).unwrap();
    train_row(&b, 10, 5.0);
    train_row(&b, 20, 9.0);
    eval_row(&b, 20, &results(&[("wikitext", 99.0, 99.0), ("c4", 99.0, 99.0)]));
    train_row(&b, 20, 3.5);
    eval_row(&b, 20, &results(&[("wikitext", 36.0, 54.0), ("c4", 88.0, 132.0)]));
    train_row(&b, 30, 3.0);
    train_row(&b, 40, 2.5);
    let end = results(&[("wikitext", 24.0, 40.0), ("c4", 63.0, 110.0)]);
    eval_row(&b, 40, &end);
    b.write_eval(40, &end).unwrap();
    b.mark_done().unwrap();

    finished(&s("{kind: uniform, d_down: 128}", "t/c"), &[("wikitext", 45.0, 70.0), ("c4", 90.0, 140.0)], &[("wikitext", 36.0, 60.0), ("c4", 75.0, 130.0)]);

    let d = RunDir::prepare(&s("{kind: dar, d_down: 256, window: 128}", "t/d")).unwrap();
    train_row(&d, 10, 5.5);
    train_row(&d, 20, 4.5);

    std::fs::create_dir_all(root.join("broken")).unwrap();
    std::fs::write(root.join("broken/config.yaml"), "model: {flavor: pythia-9000}\n").unwrap();
}

fn table(tables: &[Table], n: u8) -> &Table {
    tables.iter().find(|t| t.number == n).unwrap_or_else(|| panic!("no Table {n}; have {:?}", tables.iter().map(|t| &t.title).collect::<Vec<_>>()))
}

fn row<'a>(t: &'a Table, c: AttentionSpec) -> &'a tables::Row {
    t.rows.iter().find(|r| r.config == c).unwrap_or_else(|| panic!("{}: no row {}", t.title, c.label()))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn last_logged_value_wins_and_rows_merge_per_step() {
    let tmp = tempfile::tempdir().unwrap();
    pythia_sweep(tmp.path());
    let (runs, skipped) = load::discover(tmp.path()).unwrap();
    assert_eq!(runs.len(), 4);
    assert_eq!(skipped.len(), 1, "the broken config is reported, not fatal");
    assert_eq!(skipped[0].rel, "broken");

    let mut df = frame::build(&runs).unwrap();
    let path = tmp.path().join("runs.parquet");
    frame::write_parquet(&mut df, &path).unwrap();
    let back = ParquetReader::new(std::fs::File::open(&path).unwrap()).finish().unwrap();
    for df in [&df, &back] {
        let run = df.column("run").unwrap().str().unwrap();
        let step = df.column("step").unwrap().i64().unwrap();
        let loss = df.column("loss").unwrap().f64().unwrap();
        let wiki = df.column("eval/wikitext/word_ppl").unwrap().f64().unwrap();
        let kind = df.column("kind").unwrap().str().unwrap();
        let b: Vec<usize> = (0..df.height()).filter(|&i| run.get(i) == Some("t/b")).collect();
        // Steps 10, 20, 30, 40: the repeated step 20 and the evaluation rows are merged into one row each.
        assert_eq!(b.iter().map(|&i| step.get(i).unwrap()).collect::<Vec<_>>(), vec![10, 20, 30, 40]);
        let at20 = b.iter().copied().find(|&i| step.get(i) == Some(20)).unwrap();
        assert_eq!(loss.get(at20), Some(3.5));
        assert_eq!(wiki.get(at20), Some(54.0));
        assert_eq!(kind.get(at20), Some("dar"));
        assert_eq!(df.column("d_down").unwrap().i64().unwrap().get(at20), Some(128));
        assert_eq!(df.column("flavor").unwrap().str().unwrap().get(at20), Some("pythia-70m"));
        assert_eq!(df.column("done").unwrap().bool().unwrap().get(at20), Some(true));
    }
    assert_eq!(df.height(), 4 + 4 + 4 + 2, "a, b, c log steps 10..40; d logged 10 and 20");
}

#[test]
fn rel_matches_hand_computation_and_rows_are_matched_by_config() {
    let tmp = tempfile::tempdir().unwrap();
    pythia_sweep(tmp.path());
    let (runs, _) = load::discover(tmp.path()).unwrap();
    let paper = paper::dar().unwrap();
    let tables = tables::build(&runs, &paper, Unit::Word);

    let t1 = table(&tables, 1);
    assert!(t1.title.contains("pythia-70m"), "{}", t1.title);
    let dar = row(t1, AttentionSpec::bottleneck(128, 128));
    assert_eq!(dar.run.as_deref(), Some("t/b"));
    // word PPL: (40/50 + 110/100) / 2 = 0.95; token PPL: (24/30 + 63/60) / 2 = 0.925.
    assert!(close(dar.rel.unwrap(), 95.0), "{:?}", dar.rel);
    assert!(close(dar.rel_alt.unwrap(), 92.5), "{:?}", dar.rel_alt);
    let uni = row(t1, AttentionSpec::bottleneck(128, 0));
    assert_eq!(uni.run.as_deref(), Some("t/c"));
    assert!(close(uni.rel.unwrap(), 100.0 * (60.0 / 50.0 + 130.0 / 100.0) / 2.0));
    assert!(close(row(t1, AttentionSpec::vanilla()).rel.unwrap(), 100.0));

    // The paper's value sits beside ours, and its Rel over only our corpora (c4, wikitext) is recomputed
    // from the paper's own rows.
    let p = dar.paper.as_ref().expect("paper row for DAR 128");
    let pv = paper.iter().find(|r| r.table == 1 && r.kind == AttentionKind::Vanilla).unwrap();
    let want = 100.0 * (p.ppl["c4"] / pv.ppl["c4"] + p.ppl["wikitext103"] / pv.ppl["wikitext103"]) / 2.0;
    assert!(close(dar.paper_rel_same.unwrap(), want));
    assert_eq!(t1.paper_cols.get("wikitext").map(String::as_str), Some("wikitext103"));
    assert!(t1.notes.iter().any(|n| n.contains("averages over c4, wikitext only")), "{:?}", t1.notes);

    // Unfinished DAR d256: the run is found, but has no result, and the reason says so.
    let d256 = row(t1, AttentionSpec::bottleneck(256, 128));
    assert_eq!(d256.run.as_deref(), Some("t/d"));
    assert!(d256.missing.as_deref().unwrap().contains("not finished: last logged step 20"), "{:?}", d256.missing);
    assert!(row(t1, AttentionSpec::bottleneck(64, 128)).missing.as_deref().unwrap().contains("kind dar, d_down 64, window 128"));

    // With token units the primary Rel is the token one.
    let tok = tables::build(&runs, &paper, Unit::Token);
    assert!(close(row(table(&tok, 1), AttentionSpec::bottleneck(128, 128)).rel.unwrap(), 92.5));

    // Table 3: uniform is the w = 0 row; Table 2 expects the paper's three scales.
    let t3 = table(&tables, 3);
    assert_eq!(row(t3, AttentionSpec::bottleneck(128, 0)).run.as_deref(), Some("t/c"));
    assert_eq!(t3.rows.last().unwrap().config.window_len(), Some(0));
    let t2 = table(&tables, 2);
    let scales: Vec<&str> = t2.rows.iter().map(|r| r.scale.as_str()).collect();
    assert_eq!(scales, ["pythia-70m", "pythia-70m", "pythia-160m", "pythia-160m", "pythia-410m", "pythia-410m"]);
}

#[test]
fn figure3_curve_is_rel_at_each_common_step() {
    let tmp = tempfile::tempdir().unwrap();
    pythia_sweep(tmp.path());
    let (runs, _) = load::discover(tmp.path()).unwrap();
    let by = |rel: &str| runs.iter().find(|r| r.rel == rel).unwrap();
    let curve = figures::rel_curve(by("t/b"), by("t/a"), Unit::Word);
    // step 20 (the resumed values): (54/60 + 132/120) / 2; step 40: 95.
    assert_eq!(curve.len(), 2);
    assert_eq!(curve[0].0, 20.0);
    assert!(close(curve[0].1, 100.0 * (54.0 / 60.0 + 132.0 / 120.0) / 2.0));
    assert!(close(curve[1].1, 95.0));
}

#[test]
fn report_writes_tables_figures_and_says_what_is_missing() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, out) = (tmp.path().join("results"), tmp.path().join("report"));
    pythia_sweep(&root);
    let summary = run_report(&root, &out, &["md,tex".into(), "csv".into()], "word").unwrap();
    assert_eq!((summary.runs, summary.finished, summary.skipped), (4, 3, 1));

    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("no run with flavor pythia-160m (d_model 768), kind dar, d_down 192, window 128"), "{md}");
    assert!(md.contains("no run with flavor pythia-70m (d_model 512), kind dar, d_down 64, window 128"));
    assert!(md.contains("`t/d` has no word perplexity at its final step 40"));
    assert!(md.contains("| DAR | 128 | 128 |"), "DAR row in the Markdown table");
    assert!(md.contains("95.00"));
    assert!(md.contains("`broken` skipped"));
    assert!(summary.missing.iter().any(|m| m.contains("pythia-160m")));

    let figure3 = md.lines().find(|l| l.starts_with("![Figure 3")).expect("Figure 3 embedded");
    let png = figure3.rsplit_once("](").unwrap().1.trim_end_matches(')');
    let png = out.join(png);
    let bytes = std::fs::read(&png).unwrap();
    assert!(bytes.len() > 1000 && bytes.starts_with(b"\x89PNG"), "{} is a PNG", png.display());
    let svg = std::fs::read_to_string(png.with_extension("svg")).unwrap();
    assert!(svg.contains("<svg") && svg.contains("Rel.(%)"), "SVG with its axis label");
    for f in ["plots/runs/t_b/loss.png", "plots/runs/t_b/ppl.svg", "plots/sweeps/pythia-70m-", "tables/table1-pythia-70m-"] {
        assert!(summary.files.iter().any(|p| p.strip_prefix(&out).unwrap().to_string_lossy().starts_with(f)), "no file {f}*");
    }
    for p in &summary.files {
        assert!(std::fs::metadata(p).unwrap().len() > 0, "{} is empty", p.display());
    }
    let csv = summary.files.iter().find(|p| p.to_string_lossy().contains("table1-") && p.extension().unwrap() == "csv").unwrap();
    let csv = std::fs::read_to_string(csv).unwrap();
    let head: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let col = head.iter().position(|h| *h == "Rel.% (word)").unwrap();
    let dar: Vec<&str> = csv.lines().find(|l| l.starts_with("DAR,128,128,")).unwrap().split(',').collect();
    assert!(close(dar[col].parse::<f64>().unwrap(), 95.0), "{csv}");
    assert!(run_report(&root, &out, &["pdf".into()], "word").is_err());
    assert!(run_report(&root, &out, &["md".into()], "bytes").is_err());
}

#[test]
fn reduced_scale_sweep_gets_its_own_tables() {
    // A tiny sweep (d_model 64, T = 128) at window 16: Tables 1 and 3 are labelled tiny, d_down
    // keeps its fraction of d_model (512/128 → 64/16), and w = 16 stands in for 128 (≥ T).
    let tmp = tempfile::tempdir().unwrap();
    let s = |att: &str, dir: &str| spec("tiny", att, 40, &["synthetic"], &tmp.path().join(dir));
    finished(&s("{kind: vanilla}", "x"), &[], &[("synthetic", 10.0, 20.0)]);
    finished(&s("{kind: dar, d_down: 16, window: 16}", "y"), &[], &[("synthetic", 11.0, 22.0)]);
    finished(&s("{kind: uniform, d_down: 16}", "z"), &[], &[("synthetic", 12.0, 26.0)]);
    let (runs, _) = load::discover(tmp.path()).unwrap();
    let tables = tables::build(&runs, &paper::dar().unwrap(), Unit::Word);
    let t1 = table(&tables, 1);
    assert!(t1.title.contains("tiny") && t1.title.contains("w = 16"), "{}", t1.title);
    assert!(close(row(t1, AttentionSpec::bottleneck(16, 16)).rel.unwrap(), 110.0));
    assert!(close(row(t1, AttentionSpec::bottleneck(16, 0)).rel.unwrap(), 130.0));
    assert!(row(t1, AttentionSpec::bottleneck(16, 16)).paper.is_some(), "paper 70M row matched by d_down / d_model");
    assert!(row(t1, AttentionSpec::bottleneck(8, 16)).missing.is_some());
    let t3 = table(&tables, 3);
    assert!(t3.rows.iter().all(|r| r.config.window_len().is_none_or(|w| w < 128)), "w ≥ T rows left out");
    let t2 = table(&tables, 2);
    assert!(t2.rows.iter().all(|r| r.scale == "tiny"), "no paper scales expected for a tiny-only sweep");
}

#[test]
fn paper_file_reproduces_its_rel_column_except_the_flagged_rows() {
    // dar.md §6: the mean of per-corpus ratios reproduces the reported Rel.(%) within rounding; the rows
    // that do not must carry a note saying so. This catches transcription errors in dar.csv.
    let rows = paper::dar().unwrap();
    assert_eq!(rows.iter().map(|r| r.table).collect::<std::collections::BTreeSet<_>>().len(), 3);
    for r in &rows {
        let v = rows.iter().find(|v| v.table == r.table && v.scale == r.scale && v.kind == AttentionKind::Vanilla).unwrap();
        let (ours, corpora) = rel(&r.ppl, &v.ppl).unwrap();
        assert_eq!(corpora.len(), 3);
        if (ours - r.rel).abs() > 0.011 {
            assert!(r.note.contains("give"), "table {} {:?} w {:?}: recomputed {ours:.3}, reported {}", r.table, r.d_down, r.window, r.rel);
        }
    }
}

// ---- long-context tables (longctx.rs) -------------------------------------------------------

/// A linearized run as `attnlab linearize` leaves it (config.yaml = the resolved LinearizeSpec,
/// DONE) plus what `attnlab eval --task` writes: ruler.json / babilong.json cells (task, length, score).
fn linearized(root: &Path, rel: &str, teacher: &str, attention: &str, ruler: &[(&str, usize, f64)], babilong: &[(&str, usize, f64)]) {
    let dir = root.join(rel);
    std::fs::create_dir_all(&dir).unwrap();
    let yaml = format!("{{teacher: {teacher}, attention: {attention}, data: {{train: {{alpaca: a.jsonl}}}}, output: {}}}", dir.display());
    let spec = crate::linearize::LinearizeSpec::from_yaml(&yaml).unwrap().resolved();
    std::fs::write(dir.join("config.yaml"), spec.to_yaml()).unwrap();
    std::fs::write(dir.join("eval.json"), r#"{"step": 10, "student": {"loss": 2.0, "ppl": 7.39}}"#).unwrap();
    std::fs::write(dir.join("DONE"), "").unwrap();
    cells(&dir, "ruler.json", ruler);
    cells(&dir, "babilong.json", babilong);
}

fn cells(dir: &Path, file: &str, v: &[(&str, usize, f64)]) {
    if v.is_empty() {
        return;
    }
    let cells: Vec<crate::eval::ruler::Cell> =
        v.iter().map(|&(t, l, s)| crate::eval::ruler::Cell { task: t.into(), length: l, samples: 10, score: s, mean_prompt_tokens: l as f64 - 130.0 , ..Default::default() }).collect();
    std::fs::write(dir.join(file), serde_json::to_string_pretty(&cells).unwrap()).unwrap();
}

/// Two recipes of linearized STILL runs (teacher a: five runs, teacher b: one) and a DAR training run
/// with RULER scores.
fn still_sweep(root: &Path) {
    let s = |r: &str| format!("{{kind: still, {r}}}");
    linearized(root, "lin/ss", "a", &s("routing: self_saliency"), &[("niah_single_1", 512, 50.0), ("niah_single_1", 1024, 30.0), ("niah_single_2", 512, 20.0)], &[("qa1", 512, 40.0), ("qa1", 1024, 20.0), ("qa2", 512, 10.0), ("qa2", 1024, 30.0)]);
    linearized(root, "lin/diag", "a", &s("routing: diag_attn"), &[("niah_single_1", 512, 10.0), ("niah_single_1", 1024, 20.0)], &[]);
    linearized(root, "lin/nogate", "a", &s("gate: false"), &[], &[("qa1", 1024, 25.0), ("qa2", 1024, 15.0)]);
    linearized(root, "lin/hh", "a", &s("feature_map: hedgehog"), &[], &[]);
    linearized(root, "lin/ref", "a", &s("routing: self_saliency_reference_code"), &[("niah_single_1", 512, 70.0)], &[]);
    linearized(root, "other/kn", "b", &s("routing: key_norm"), &[("niah_single_1", 512, 5.0)], &[]);
    let d = spec("pythia-70m", "{kind: dar, d_down: 128, window: 128}", 40, &["wikitext"], &root.join("t/dar"));
    let dir = finished(&d, &[("wikitext", 40.0, 60.0)], &[("wikitext", 30.0, 50.0)]);
    cells(&dir.path, "ruler.json", &[("niah_single_1", 512, 80.0), ("niah_multikey_1", 1024, 60.0)]);
}

fn grid<'a>(grids: &'a [longctx::Grid], prefix: &str, teacher_of: &str, runs: &[longctx::LongRun]) -> &'a longctx::Grid {
    let recipe = &runs.iter().find(|r| r.rel == teacher_of).unwrap().recipe;
    grids.iter().find(|g| g.id == format!("{prefix}-{recipe}")).unwrap_or_else(|| panic!("no {prefix} grid for {recipe}"))
}

/// The value in the row whose first cells are `keys` and the column titled `col` (None when empty).
fn value(g: &longctx::Grid, keys: &[&str], col: &str) -> Option<f64> {
    let j = g.head.iter().position(|h| h == col).unwrap_or_else(|| panic!("{}: no column {col} in {:?}", g.title, g.head));
    let text = |c: &render::Cell| match c {
        render::Cell::Text(s) => s.clone(),
        _ => String::new(),
    };
    let row = g.body.iter().find(|r| keys.iter().enumerate().all(|(i, k)| text(&r[i]) == *k)).unwrap_or_else(|| panic!("{}: no row {keys:?}", g.title));
    match row[j] {
        render::Cell::Num(v) => Some(v),
        render::Cell::Stat(s) => Some(s.mean),
        render::Cell::Empty => None,
        render::Cell::Text(ref s) => panic!("{col}: text {s}"),
    }
}

#[test]
fn ruler_and_babilong_scores_per_run_and_length() {
    let tmp = tempfile::tempdir().unwrap();
    still_sweep(tmp.path());
    let runs = longctx::discover(tmp.path()).unwrap();
    assert_eq!(runs.len(), 7);
    let grids = longctx::build(&runs, &paper::still().unwrap());
    let g = grids.iter().find(|g| g.id == "long-context").unwrap();
    assert_eq!(g.head, ["run", "attention", "task", "0.5K", "1K", "mean"]);
    assert_eq!(value(g, &["lin/ss", "STILL (routing self_saliency, gate on, np_map)", "niah_single_1"], "0.5K"), Some(50.0));
    assert_eq!(value(g, &["lin/ss", "STILL (routing self_saliency, gate on, np_map)", "niah_single_1"], "mean"), Some(40.0));
    assert_eq!(value(g, &["lin/ss", "STILL (routing self_saliency, gate on, np_map)", "niah_single_2"], "1K"), None);
    // BABILong-PG = mean of qa1 and qa2 per length: (40 + 10)/2 and (20 + 30)/2.
    assert_eq!(value(g, &["lin/ss", "STILL (routing self_saliency, gate on, np_map)", "babilong (qa1+qa2)"], "0.5K"), Some(25.0));
    assert_eq!(value(g, &["lin/ss", "STILL (routing self_saliency, gate on, np_map)", "babilong:qa2"], "1K"), Some(30.0));
    // A training run's extra RULER task gets its own row.
    let dar = runs.iter().find(|r| r.rel == "t/dar").unwrap();
    assert_eq!(value(g, &["t/dar", &dar.attention, "niah_multikey_1"], "1K"), Some(60.0));
    // Runs without results are not rows; evaluated runs list the expected tasks they lack.
    assert!(!g.body.iter().any(|r| matches!(&r[0], render::Cell::Text(s) if s == "lin/hh")));
    assert!(g.missing.iter().any(|m| m.contains("lin/ss niah_single_3") && m.contains("--task ruler:niah_single_3")), "{:?}", g.missing);
    assert!(g.missing.iter().any(|m| m.contains("lin/diag babilong:qa1") && m.contains("babilong.json")), "{:?}", g.missing);
    // A training run is held to its recipe's tasks, not to the STILL paper's.
    assert!(!g.missing.iter().any(|m| m.contains("t/dar")), "{:?}", g.missing);
}

#[test]
fn training_runs_are_expected_to_have_their_recipes_tasks() {
    let tmp = tempfile::tempdir().unwrap();
    for (rel, attention, scored) in [("dar", "{kind: dar, d_down: 32, window: 8}", vec![("niah_single_1", 512, 80.0), ("niah_single_2", 512, 40.0)]), ("window", "{kind: window, window: 8}", vec![("niah_single_1", 512, 0.0)])] {
        let dir = finished(&spec("tiny", attention, 40, &["synthetic"], &tmp.path().join(rel)), &[("synthetic", 40.0, 60.0)], &[("synthetic", 30.0, 50.0)]);
        cells(&dir.path, "ruler.json", &scored);
    }
    let runs = longctx::discover(tmp.path()).unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0].recipe, runs[1].recipe, "one recipe: only the attention differs");
    let grids = longctx::build(&runs, &[]);
    let g = grids.iter().find(|g| g.id == "long-context").unwrap();
    // The window run lacks the task its sibling was scored on; nobody lacks the paper's BABILong.
    assert_eq!(g.missing.len(), 1, "{:?}", g.missing);
    assert!(g.missing[0].contains("window niah_single_2") && g.missing[0].contains("--task ruler:niah_single_2"), "{:?}", g.missing);
    let window = runs.iter().find(|r| r.rel == "window").unwrap();
    assert_eq!(value(g, &["window", &window.attention, "niah_single_2"], "0.5K"), None);
    assert_eq!(value(g, &["window", &window.attention, "niah_single_1"], "0.5K"), Some(0.0));
}

#[test]
fn still_ablations_group_by_config_keys_with_paper_values() {
    let tmp = tempfile::tempdir().unwrap();
    still_sweep(tmp.path());
    let runs = longctx::discover(tmp.path()).unwrap();
    let paper = paper::still().unwrap();
    let grids = longctx::build(&runs, &paper);
    // One long-context table, and a routing + component table per recipe (teachers a and b).
    assert_eq!(grids.len(), 5);
    let routing = grid(&grids, "still-routing", "lin/ss", &runs);
    assert_eq!(value(routing, &["self_saliency"], "S-NIAH-1 mean"), Some(40.0));
    assert_eq!(value(routing, &["self_saliency"], "paper (mean 0.5K, 1K)"), Some(42.6));
    assert_eq!(value(routing, &["diag_attention", "a_tt"], "S-NIAH-1 1K"), Some(20.0));
    assert_eq!(value(routing, &["diag_attention"], "S-NIAH-1 mean"), Some(15.0));
    assert_eq!(value(routing, &["self_saliency"], "BABILong mean"), Some(25.0));
    assert_eq!(value(routing, &["diag_attention"], "BABILong mean"), None);
    assert_eq!(value(routing, &["key_norm"], "paper (mean 0.5K, 1K)"), Some(12.9));
    assert_eq!(value(routing, &["key_norm"], "S-NIAH-1 mean"), None, "teacher b's key_norm run is another recipe");
    // Our extra metric gets a row without a paper value.
    assert_eq!(value(routing, &["self_saliency_reference_code"], "S-NIAH-1 mean"), Some(70.0));
    assert_eq!(value(routing, &["self_saliency_reference_code"], "paper (mean 0.5K, 1K)"), None);
    assert_eq!(routing.rows, 7);
    assert!(routing.missing.iter().any(|m| m.contains("q·k") && m.contains("no linearized run with routing self_logit")), "{:?}", routing.missing);
    assert_eq!(routing.missing.len(), 4, "self_logit, key_norm, random, uniform: {:?}", routing.missing);

    let comp = grid(&grids, "still-component", "lin/ss", &runs);
    assert_eq!(value(comp, &["full"], "BABILong 1K"), Some(25.0));
    assert_eq!(value(comp, &["full"], "paper BABILong 1K"), Some(27.5));
    assert_eq!(value(comp, &["full"], "S-NIAH-1 mean"), Some(40.0));
    assert_eq!(value(comp, &["w/o Gate"], "BABILong 1K"), Some(20.0));
    assert_eq!(value(comp, &["w/o Gate"], "BABILong 0.5K"), None);
    assert_eq!(value(comp, &["w/o NP-Map"], "paper BABILong 1K"), Some(22.4));
    assert!(comp.missing.iter().any(|m| m.contains("w/o NP-Map") && m.contains("lin/hh has no babilong")), "{:?}", comp.missing);
    assert!(comp.missing.iter().any(|m| m.contains("w/o Self-Saliency") && m.contains("routing none")), "{:?}", comp.missing);
    assert_eq!(comp.filled(), 2);

    let other = grid(&grids, "still-routing", "other/kn", &runs);
    assert_eq!(value(other, &["key_norm"], "S-NIAH-1 mean"), Some(5.0));
    assert_eq!(other.filled(), 1);
}

/// `attnlab report` writes the new tables, lists their missing rows, and does not call the
/// linearized runs unreadable.
#[test]
fn report_includes_long_context_tables() {
    let tmp = tempfile::tempdir().unwrap();
    still_sweep(tmp.path());
    let out = tmp.path().join("report");
    let summary = run_report(tmp.path(), &out, &["md".into(), "csv".into()], "word").unwrap();
    assert_eq!(summary.skipped, 0, "linearized runs are not training runs, but not broken either");
    assert!(summary.tables.iter().any(|(t, filled, rows)| t.starts_with("Routing ablation") && *filled == 3 && *rows == 7), "{:?}", summary.tables);
    assert!(summary.missing.iter().any(|m| m.contains("w/o Self-Saliency")));
    let md = std::fs::read_to_string(&summary.report).unwrap();
    assert!(md.contains("## Long context") && md.contains("| self_saliency | self-saliency | 50.00 | 30.00 | 40.00 | 25.00 | 42.60 | lin/ss |"), "{md}");
    let csv = std::fs::read_dir(out.join("tables")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).find(|n| n.starts_with("still-component") && n.ends_with(".csv")).unwrap();
    let text = std::fs::read_to_string(out.join("tables").join(csv)).unwrap();
    assert!(text.starts_with("variant,routing,gate,feature map,BABILong 0.5K,BABILong 1K,S-NIAH-1 mean,paper BABILong 1K,run\nfull,self_saliency,on,np_map,25,25,40,27.5,lin/ss\n"), "{text}");
}

/// still.csv carries still.md §11's numbers; a malformed file names its line.
#[test]
fn still_paper_rows() {
    let rows = paper::still().unwrap();
    let v = |t: &str, n: &str| rows.iter().find(|r| r.table == t && r.variant == n).unwrap().value;
    assert_eq!((v("routing", "self-saliency"), v("routing", "uniform"), v("component", "w/o Gate & NP-Map")), (42.6, 12.3, 19.2));
    assert_eq!(rows.len(), 11);
    let err = paper::parse_still("table,variant,routing,gate,feature_map,value,metric,note\nrouting,x,y,maybe,np_map,1,m,\n").unwrap_err();
    assert!(err.to_string().contains("line 2") && err.to_string().contains("maybe"), "{err}");
}

/// Three seeds of vanilla and DAR (tiny, one corpus): one row per configuration with n = 3, the
/// PPL summarised as mean ± s.d. and t-interval, Rel.(%) the mean of the per-seed ratios (paired by
/// seed, not the ratio of the means), the intervals in every format, Figure 3 with a band.
#[test]
fn seeds_pool_into_rows_with_intervals_and_rel_is_paired_by_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, out) = (tmp.path().join("results"), tmp.path().join("report"));
    let s = |att: &str, dir: &str, seed: u64| seeded(att, 40, &root.join(dir), seed);
    // word PPL: vanilla 20, 30, 40; DAR 22, 30, 36 → per-seed 110, 100, 90 % (mean 100), while the
    // ratio of the means would be 88/90 = 97.8 %.
    let (van, dar) = ([20.0, 30.0, 40.0], [22.0, 30.0, 36.0]);
    for (i, seed) in [1u64, 2, 3].into_iter().enumerate() {
        finished(&s("{kind: vanilla}", &format!("v{seed}"), seed), &[("synthetic", 2.0 * van[i], 4.0 * van[i])], &[("synthetic", van[i] / 2.0, van[i])]);
        finished(&s("{kind: dar, d_down: 16, window: 16}", &format!("d{seed}"), seed), &[("synthetic", 2.0 * dar[i], 4.0 * dar[i])], &[("synthetic", dar[i] / 2.0, dar[i])]);
    }
    // A fourth DAR seed without its vanilla run, and an orthogonal-start run of seed 1.
    finished(&s("{kind: uniform, d_down: 16}", "u4", 4), &[], &[("synthetic", 20.0, 40.0)]);
    finished(&s("{kind: dar, d_down: 16, window: 16, init: orthogonal}", "o1", 1), &[], &[("synthetic", 9.0, 18.0)]);
    let (runs, _) = load::discover(&root).unwrap();
    let tables = tables::build(&runs, &paper::dar().unwrap(), Unit::Word);
    let t1 = table(&tables, 1);
    let d = row(t1, AttentionSpec::bottleneck(16, 16));
    assert_eq!((d.n(), d.seeds.keys().copied().collect::<Vec<_>>()), (3, vec![1, 2, 3]));
    let rel = d.rel_stat.unwrap();
    assert!(close(rel.mean, 100.0) && close(rel.sd, 10.0) && rel.n == 3, "{rel:?}");
    let half = 4.302_652_729_911_275 * 10.0 / 3f64.sqrt();
    let (lo, hi) = rel.ci.unwrap();
    assert!((lo - (100.0 - half)).abs() < 1e-6 && (hi - (100.0 + half)).abs() < 1e-6);
    let p = d.ppl_stat["synthetic"];
    assert!(close(p.mean, 88.0 / 3.0) && p.n == 3);
    // Token PPL (the other unit) is paired the same way: here the same ratios.
    assert!(close(d.rel_alt.unwrap(), 100.0));
    assert!(close(row(t1, AttentionSpec::vanilla()).rel.unwrap(), 100.0));
    // Unpaired: uniform has only seed 4 → the ratio of means, said so.
    let u = row(t1, AttentionSpec::bottleneck(16, 0));
    assert!(close(u.rel.unwrap(), 100.0 * 40.0 / 30.0) && u.note.as_deref().unwrap().contains("unpaired"), "{:?}", u.note);
    // The orthogonal start gets its own row (no paper value), paired with seed 1's vanilla.
    let o = row(t1, AttentionSpec::bottleneck(16, 16).with_init(crate::spec::AttentionInit::Orthogonal));
    assert!(o.paper.is_none() && close(o.rel.unwrap(), 90.0) && o.n() == 1);

    let summary = run_report(&root, &out, &["md,tex,csv".into()], "word").unwrap();
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("100.00 ± 10.00 (3) [75.16, 124.84]"), "{md}");
    assert!(md.contains("seed-to-seed variance") && md.contains("| DAR (orthogonal) | 16 | 16 |"));
    let csv = summary.files.iter().find(|p| p.to_string_lossy().contains("table1-") && p.extension().unwrap() == "csv").unwrap();
    let csv = std::fs::read_to_string(csv).unwrap();
    let head: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let line: Vec<&str> = csv.lines().find(|l| l.starts_with("DAR,16,16,")).unwrap().split(',').collect();
    let at = |h: &str| line[head.iter().position(|x| *x == h).unwrap_or_else(|| panic!("{h}: {head:?}"))].parse::<f64>().unwrap();
    assert!(close(at("Rel.% (word)"), 100.0) && close(at("Rel.% (word) sd"), 10.0) && at("Rel.% (word) n") == 3.0);
    assert!((at("Rel.% (word) ci95_hi") - (100.0 + half)).abs() < 1e-9);
    let tex = std::fs::read_to_string(csv_path(&summary, "tex")).unwrap();
    assert!(tex.contains("100.00 $\\pm$ 10.00 (3)"), "{tex}");
    // Figure 3 pools the seeds with a band; runs.parquet has the seed.
    assert!(md.contains("bands: ± 1 s.d. over seeds"));
    let back = ParquetReader::new(std::fs::File::open(out.join("runs.parquet")).unwrap()).finish().unwrap();
    let seeds: std::collections::BTreeSet<i64> = back.column("seed").unwrap().i64().unwrap().iter().flatten().collect();
    assert_eq!(seeds, [1, 2, 3, 4].into());
    let recipes: std::collections::BTreeSet<String> = back.column("recipe").unwrap().str().unwrap().iter().flatten().map(String::from).collect();
    assert_eq!(recipes.len(), 1, "the seed is not part of the recipe");
}

/// The issue-27 evidence in miniature: per-seed Rel.% of DAR (orthogonal start) 95.35 / 95.09 /
/// 97.26 and of window-only 96.70 / 97.40 / 98.04 against vanilla PPL 100. The window-only control
/// gets a row, and DAR − window-only is paired by seed: differences −1.35, −2.31, −0.78, mean −1.48,
/// s.d. 0.7732, 95% t-interval −1.48 ± 4.3027 · 0.7732 / √3 = [−3.4008, 0.4408], paired t = −3.315
/// on 2 degrees of freedom, p = 1 − |t| / √(2 + t²) = 0.0802 (hand-computed).
#[test]
fn window_only_rows_and_paired_differences_by_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, out) = (tmp.path().join("results"), tmp.path().join("report"));
    let s = |att: &str, dir: &str, seed: u64| seeded(att, 40, &root.join(dir), seed);
    let (dar, win, uni) = ([95.35, 95.09, 97.26], [96.70, 97.40, 98.04], [109.92, 109.84, 111.61]);
    for (i, seed) in [1u64, 2, 3].into_iter().enumerate() {
        let end = |ppl: f64| vec![("synthetic", ppl, 2.0 * ppl)];
        finished(&s("{kind: vanilla}", &format!("v{seed}"), seed), &[], &end(100.0));
        finished(&s("{kind: dar, d_down: 16, window: 16, init: orthogonal}", &format!("d{seed}"), seed), &[], &end(dar[i]));
        finished(&s("{kind: window, window: 16}", &format!("w{seed}"), seed), &[], &end(win[i]));
        finished(&s("{kind: uniform, d_down: 16}", &format!("u{seed}"), seed), &[], &end(uni[i]));
    }
    let (runs, _) = load::discover(&root).unwrap();
    let tables = tables::build(&runs, &paper::dar().unwrap(), Unit::Token);
    for t in &tables {
        // Every DAR table of this recipe shows the control.
        assert!(t.rows.iter().any(|r| r.config.kind() == AttentionKind::Window && r.n() == 3), "{}: no window-only row", t.title);
    }
    let t1 = table(&tables, 1);
    let w = row(t1, serde_yaml::from_str::<AttentionSpec>("{kind: window, window: 16}").unwrap());
    assert!(close(w.rel.unwrap(), (96.70 + 97.40 + 98.04) / 3.0));
    let pair = t1.pairs.iter().find(|p| p.a.starts_with("DAR") && p.b.starts_with("window-only")).unwrap_or_else(|| panic!("{:?}", t1.pairs));
    let want = [95.35 - 96.70, 95.09 - 97.40, 97.26 - 98.04];
    for (got, want) in pair.by_seed.values().zip(want) {
        assert!((got - want).abs() < 1e-9, "{got} vs {want}");
    }
    let st = pair.stat;
    assert!((st.mean + 1.48).abs() < 1e-9 && (st.sd - 0.773_239_936_9).abs() < 1e-8 && st.n == 3, "{st:?}");
    let (lo, hi) = st.ci.unwrap();
    assert!((lo + 3.400_834_487_5).abs() < 1e-8 && (hi - 0.440_834_487_5).abs() < 1e-8, "{lo} {hi}");
    assert!((pair.p.unwrap() - 0.080_195_160_7).abs() < 1e-8, "{:?}", pair.p);
    assert_eq!(pair.significant(), Some(false));
    // DAR − uniform is significant: −14.57 ± 0.6 or so, every seed far below 0.
    let du = t1.pairs.iter().find(|p| p.a.starts_with("DAR") && p.b.starts_with("uniform")).unwrap();
    assert_eq!(du.significant(), Some(true));
    // Three arms: three pairs (vanilla is the reference, not an arm).
    assert_eq!(t1.pairs.len(), 3, "{:?}", t1.pairs.iter().map(|p| (&p.a, &p.b)).collect::<Vec<_>>());

    let summary = run_report(&root, &out, &["md,tex,csv".into()], "token").unwrap();
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("| DAR (d_down 16, w 16, orthogonal) | window-only (w 16) | -1.48 ± 0.77 (3) [-3.40, 0.44] | s1 -1.35, s2 -2.31, s3 -0.78 | 0.080 | no |"), "{md}");
    assert!(md.contains("Window-only rows"), "the control is explained");
    let csv = summary.files.iter().find(|p| p.to_string_lossy().contains("-paired.csv")).expect("a paired-differences CSV");
    let csv = std::fs::read_to_string(csv).unwrap();
    assert!(csv.lines().next().unwrap().contains("A − B: Rel.% points (token) ci95_lo"), "{csv}");
}

/// Loss by position: eval.json's `by_position` is read back, drawn per sweep (absolute, and minus
/// the vanilla run of the same seed, which is hand-checked), and eval.json files without it load.
#[test]
fn loss_by_position_is_read_and_drawn() {
    use crate::eval::perplexity::PositionLoss;
    let tmp = tempfile::tempdir().unwrap();
    let (root, out) = (tmp.path().join("results"), tmp.path().join("report"));
    let edges = vec![0, 1, 2, 4, 8];
    let pos = |l: [f64; 4]| PositionLoss { edges: edges.clone(), tokens: vec![3, 3, 6, 12], loss: l.iter().map(|&x| Some(x)).collect() };
    for seed in [1u64, 2] {
        for (att, dir, l) in [
            ("{kind: vanilla}", "v", [5.0, 4.0, 3.5, 3.0]),
            ("{kind: dar, d_down: 16, window: 2}", "d", [5.0, 4.1, 3.4, 2.8 + seed as f64 / 10.0]),
            ("{kind: window, window: 2}", "w", [5.0, 4.1, 3.6, 3.2]),
        ] {
            let s = seeded(att, 40, &root.join(format!("{dir}{seed}")), seed);
            let dir = finished(&s, &[], &[("synthetic", 20.0, 40.0)]);
            let mut r = results(&[("synthetic", 20.0, 40.0)]);
            r.get_mut("synthetic").unwrap().by_position = Some(pos(l));
            dir.write_eval(40, &r).unwrap();
        }
    }
    // An eval.json from before by_position existed (the evidence runs') still loads.
    let old = root.join("v1/eval.json");
    let text = std::fs::read_to_string(&old).unwrap();
    assert!(text.contains("by_position"));
    let (runs, _) = load::discover(&root).unwrap();
    let d1 = runs.iter().find(|r| r.rel == "d1").unwrap();
    let v1 = runs.iter().find(|r| r.rel == "v1").unwrap();
    assert_eq!(figures::position_curve(&d1.by_position["synthetic"]), vec![(1.0, 5.0), (2.0, 4.1), (3.5, 3.4), (6.5, 2.9)]);
    let delta = figures::position_delta(&d1.by_position["synthetic"], &v1.by_position["synthetic"]);
    let want = [(1.0, 0.0), (2.0, 0.1), (3.5, -0.1), (6.5, -0.1)];
    for ((x, y), (wx, wy)) in delta.iter().zip(want) {
        assert!(*x == wx && (y - wy).abs() < 1e-12, "{delta:?}");
    }
    let summary = run_report(&root, &out, &["md".into()], "token").unwrap();
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("## Loss by position") && md.contains("loss-by-position-vs-vanilla-synthetic.png"), "{md}");
    assert!(summary.files.iter().any(|f| f.to_string_lossy().ends_with("loss-by-position-synthetic.svg")));
    std::fs::write(&old, r#"{"step": 40, "corpora": {"synthetic": {"protocol": "rolling", "ppl": 20.0, "word_ppl": 40.0}}}"#).unwrap();
    let (runs, _) = load::discover(&root).unwrap();
    let v1 = runs.iter().find(|r| r.rel == "v1").unwrap();
    assert!(v1.by_position.is_empty() && v1.warnings.is_empty() && v1.final_eval("ppl")["synthetic"] == 20.0);
}

/// Finished runs of DAR (d_down 16, w 8), window-only (w 8) and vanilla under `root` for each
/// (seed, DAR's value, window-only's value), vanilla's value the same at every seed; `write` puts the
/// value into each run's directory.
fn three_arms(root: &Path, seeds: [(u64, f64, f64); 2], vanilla: f64, write: impl Fn(&Path, f64)) {
    for (seed, dar, win) in seeds {
        for (att, dir, v) in [("{kind: dar, d_down: 16, window: 8}", "d", dar), ("{kind: window, window: 8}", "w", win), ("{kind: vanilla}", "v", vanilla)] {
            let d = finished(&seeded(att, 40, &root.join(format!("{dir}{seed}")), seed), &[], &[("synthetic", 20.0, 40.0)]);
            write(&d.path, v);
        }
    }
}

/// recall.json of each run → one table per recipe, seeds pooled, and DAR − window-only paired by
/// seed: DAR 60% / 50% of digits, window-only 10% / 12% → differences 50, 38: mean 44, s.d. 8.485.
#[test]
fn recall_scores_pool_over_seeds_with_paired_differences() {
    use crate::eval::recall::RecallScore;
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("results");
    let score = |gap: usize, acc: f64| RecallScore {
        gap,
        facts: None,
        docs: 10,
        digits: 90,
        loss: 2.0,
        digit_accuracy: acc,
        code_accuracy: acc / 10.0,
        chance_loss: 10f64.ln(),
        chance_digit_accuracy: 0.1,
        chance_code_accuracy: 0.001,
        window_reach: None,
        mean_tokens: 100.0,
    };
    three_arms(&root, [(1, 0.6, 0.1), (2, 0.5, 0.12)], 0.9, |d, acc| {
        let v = json!({"step": 40, "gaps": [score(64, acc), score(8, 0.95)]});
        std::fs::write(d.join("recall.json"), v.to_string()).unwrap();
    });
    let (runs, _) = load::discover(&root).unwrap();
    let grids = recall::build(&runs);
    assert_eq!(grids.len(), 2);
    let md = render::markdown_grid(&grids[0].head, &grids[0].body);
    assert!(md.contains("| DAR (d_down 16, w 8) | 64 | 2 | 55.00 ± 7.07 (2) ["), "{md}");
    let pairs = render::markdown_grid(&grids[1].head, &grids[1].body);
    let half = 12.706_204_736_174_7 * 72f64.sqrt() / 2f64.sqrt();
    assert!(pairs.contains(&format!("| DAR (d_down 16, w 8) | window-only (w 8) | 64 | 44.00 ± 8.49 (2) [{:.2}, {:.2}] | s1 50.0, s2 38.0 |", 44.0 - half, 44.0 + half)), "{pairs}");
}

/// ruler.json of each run (as `eval.ruler` writes it) → per recipe a table by arm, seeds pooled,
/// and DAR − window-only paired by seed: at 1024 DAR 80 / 60%, window-only 10 / 12% → differences
/// 70, 48: mean 59, s.d. 15.56. The recall test's own cells and cells with overrides are not arms'.
#[test]
fn ruler_scores_pool_over_seeds_by_arm_with_paired_differences() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("results");
    let cell = |task: &str, length: usize, score: f64, overrides: Option<&str>| json!({"task": task, "length": length, "samples": 100, "score": score, "mean_prompt_tokens": 900.0, "overrides": overrides});
    three_arms(&root, [(1, 80.0, 10.0), (2, 60.0, 12.0)], 95.0, |d, score| {
        let cells = json!([cell("niah_single_1", 512, 100.0, None), cell("niah_single_1", 1024, score, None), cell("recall", 256, 3.0, None), cell("niah_single_1", 1024, 0.0, Some("attention.window=2"))]);
        std::fs::write(d.join("ruler.json"), cells.to_string()).unwrap();
    });
    let (runs, _) = load::discover(&root).unwrap();
    let grids = ruler_arms::build(&runs);
    assert_eq!(grids.len(), 2);
    let md = render::markdown_grid(&grids[0].head, &grids[0].body);
    assert!(md.contains("| DAR (d_down 16, w 8) | niah_single_1 | 1024 | 2 | 70.00 ± 14.14 (2) ["), "{md}");
    assert!(md.contains("| window-only (w 8) | niah_single_1 | 512 | 2 | 100.00 ± 0.00 (2)"), "{md}");
    assert!(!md.contains("recall"), "{md}");
    assert_eq!(grids[0].rows, 6, "3 arms × 2 lengths: {md}");
    let pairs = render::markdown_grid(&grids[1].head, &grids[1].body);
    let half = 12.706_204_736_174_7 * (22.0 * 22.0 / 2.0f64).sqrt() / 2f64.sqrt();
    assert!(pairs.contains(&format!("| DAR (d_down 16, w 8) | window-only (w 8) | niah_single_1 @ 1024 | 59.00 ± 15.56 (2) [{:.2}, {:.2}] | s1 70.0, s2 48.0 |", 59.0 - half, 59.0 + half)), "{pairs}");
}

/// Steps to 50%, by hand: linear between the evaluations around the first crossing.
#[test]
fn steps_to_half_interpolates_between_evaluations() {
    use recall::steps_to;
    // 10% at 500, 30% at 1000, 70% at 1500: 50% is halfway from 1000 to 1500.
    assert_eq!(steps_to(&[(500.0, 10.0), (1000.0, 30.0), (1500.0, 70.0)], 50.0), Some(1250.0));
    // Already there at the first evaluation; exactly 50%; a later dip does not move it; never.
    assert_eq!(steps_to(&[(500.0, 60.0), (1000.0, 90.0)], 50.0), Some(500.0));
    assert_eq!(steps_to(&[(500.0, 10.0), (1000.0, 50.0)], 50.0), Some(1000.0));
    assert_eq!(steps_to(&[(500.0, 20.0), (1000.0, 80.0), (1500.0, 40.0), (2000.0, 90.0)], 50.0), Some(750.0));
    assert_eq!(steps_to(&[(500.0, 10.0), (1000.0, 49.9)], 50.0), None);
    assert_eq!(steps_to(&[], 50.0), None);
}

/// `recall/g<G>/codes` rows of metrics.jsonl as the trainer writes them → per recipe a table of
/// steps to 50% over seeds and a chart per gap. DAR: seed 1 10% → 30% → 70% (1250 steps), seed 2
/// 20% → 60% (875): mean 1062.5, s.d. 265.17; window-only never gets there (0/2).
#[test]
fn recall_curves_give_steps_to_half_over_seeds() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("results");
    let curves = [
        ("{kind: dar, d_down: 16, window: 8}", "d", 1u64, [0.1, 0.3, 0.7]),
        ("{kind: dar, d_down: 16, window: 8}", "d", 2, [0.2, 0.6, 0.9]),
        ("{kind: window, window: 8}", "w", 1, [0.001, 0.0, 0.002]),
        ("{kind: window, window: 8}", "w", 2, [0.0, 0.001, 0.001]),
    ];
    for (att, dir, seed, codes) in curves {
        let s = seeded(att, 1500, &root.join(format!("{dir}{seed}")), seed);
        let d = RunDir::prepare(&s).unwrap();
        for (i, c) in codes.iter().enumerate() {
            let step = 500 * (i as u64 + 1);
            train_row(&d, step, 3.0);
            let mut row = Map::new();
            row.insert("step".into(), json!(step));
            for (k, v) in crate::recall::metrics(&[crate::recall::RecallScore { gap: 256, facts: None, docs: 4, digits: 36, loss: 1.0, digit_accuracy: 0.5, code_accuracy: *c, chance_loss: 10f64.ln(), chance_digit_accuracy: 0.1, chance_code_accuracy: 0.001, window_reach: None, mean_tokens: 300.0 }]) {
                row.insert(k, json!(v));
            }
            d.append_metrics(&row).unwrap();
        }
        d.mark_done().unwrap();
    }
    let (runs, _) = load::discover(&root).unwrap();
    let out = tmp.path().join("report");
    let (grids, figs) = recall::curves(&runs, &out).unwrap();
    assert_eq!(grids.len(), 1);
    let md = render::markdown_grid(&grids[0].head, &grids[0].body);
    let sd = (2.0 * 187.5f64.powi(2)).sqrt();
    let half = 12.706_204_736_174_7 * sd / 2f64.sqrt();
    // Two seeds' t-intervals run past 0 steps and 0–100%: cut to what the quantities can be.
    assert!(1062.5 - half < 0.0);
    assert!(md.contains(&format!("| DAR (d_down 16, w 8) | 256 | 2 | 2/2 | 1062.50 ± {sd:.2} (2) [0.00, {:.2}] | 1500 | 80.00 ± 14.14 (2) [0.00, 100.00] |", 1062.5 + half)), "{md}");
    assert!(md.contains("| window-only (w 8) | 256 | 2 | 0/2 | – | 1500 |"), "{md}");
    assert_eq!(figs.len(), 1);
    assert!(figs[0].files.iter().any(|f| f.to_string_lossy().ends_with("codes-g256.png")) && figs[0].caption.contains("bands: ± 1 s.d."), "{:?}", figs[0].files);
    assert!(out.join(&figs[0].files[0]).is_file());
}

/// Runs that differ only in the number of facts per document sit on one capacity curve: per
/// configuration and number of facts, codes right over seeds (recall.json), and one chart per gap.
#[test]
fn recall_capacity_pools_codes_right_per_number_of_facts() {
    use crate::spec::{RecallGap, SourceSpec, SyntheticSpec};
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("results");
    for (att, dir, base) in [("{kind: dar, d_down: 16, window: 8}", "d", 0.6), ("{kind: vanilla}", "v", 0.9)] {
        for facts in [2usize, 8] {
            for seed in [1u64, 2] {
                let mut s = seeded(att, 40, &root.join(format!("{dir}-f{facts}-s{seed}")), seed);
                s.data.train = SourceSpec::Synthetic { synthetic: SyntheticSpec { seed: 1, docs: 10, recall_gap: Some(RecallGap::One(64)), recall_facts: Some(facts) } };
                let d = finished(&s, &[], &[("synthetic", 20.0, 40.0)]);
                let codes = base / facts as f64 + 0.01 * seed as f64;
                let score = crate::recall::RecallScore { gap: 64, facts: Some(facts), docs: 4, digits: 36, loss: 1.0, digit_accuracy: 0.5, code_accuracy: codes, chance_loss: 10f64.ln(), chance_digit_accuracy: 0.1, chance_code_accuracy: 0.001, window_reach: None, mean_tokens: 300.0 };
                crate::recall::write(&d.path, 40, &[score]).unwrap();
            }
        }
    }
    let (runs, _) = load::discover(&root).unwrap();
    assert_eq!(runs.len(), 8);
    let (grids, figs) = recall::capacity(&runs, &tmp.path().join("report")).unwrap();
    assert_eq!((grids.len(), figs.len()), (1, 1));
    let md = render::markdown_grid(&grids[0].head, &grids[0].body);
    // DAR at 8 facts: 100 · (0.6 / 8 + 0.01 s) = 8.5, 9.5.
    assert!(md.contains("| DAR (d_down 16, w 8) | 64 | 8 | 2 | 9.00 ± 0.71 (2) ["), "{md}");
    assert!(md.contains("| vanilla | 64 | 2 | 2 | 46.50 ± 0.71 (2) ["), "{md}");
    assert_eq!(grids[0].rows, 4);
}

fn csv_path(s: &ReportSummary, ext: &str) -> PathBuf {
    s.files.iter().find(|p| p.to_string_lossy().contains("table1-") && p.extension().unwrap() == ext).unwrap().clone()
}

/// Sweep charts: vanilla black, DAR solid, uniform dashed; one colour per d_down; no two series with
/// the same colour and dash (a second start of one configuration gets a colour of its own).
#[test]
fn sweep_series_get_one_colour_per_d_down_and_a_dash_per_kind() {
    let tmp = tempfile::tempdir().unwrap();
    let s = |att: &str, dir: &str| spec("tiny", att, 40, &["synthetic"], &tmp.path().join(dir));
    for (att, dir) in [
        ("{kind: vanilla}", "v"),
        ("{kind: dar, d_down: 16, window: 16}", "d16"),
        ("{kind: dar, d_down: 16, window: 16, init: orthogonal}", "o16"),
        ("{kind: dar, d_down: 8, window: 16}", "d8"),
        ("{kind: uniform, d_down: 16}", "u16"),
        ("{kind: uniform, d_down: 8}", "u8"),
    ] {
        finished(&s(att, dir), &[("synthetic", 30.0, 60.0)], &[("synthetic", 20.0, 40.0)]);
    }
    let (runs, _) = load::discover(tmp.path()).unwrap();
    let all: Vec<&load::Run> = runs.iter().collect();
    let styles = figures::styles_for_test(&all);
    let get = |label: &str| styles.iter().find(|(l, _, _)| l.starts_with(label)).cloned().unwrap_or_else(|| panic!("{label}: {styles:?}"));
    use plots::Dash;
    let (_, v_color, v_dash) = get("vanilla");
    assert_eq!((v_color, v_dash), (None, Dash::Solid));
    let (_, d16, dash) = get("DAR (d_down 16, w 16)");
    assert_eq!(dash, Dash::Solid);
    let (_, u16, udash) = get("uniform (d_down 16)");
    assert_eq!((u16, udash), (d16, Dash::Dashed), "one colour per d_down");
    let (_, d8, _) = get("DAR (d_down 8, w 16)");
    let (_, u8c, _) = get("uniform (d_down 8)");
    assert_eq!(d8, u8c);
    let (_, o16, _) = get("DAR (d_down 16, w 16, orthogonal)");
    assert!(o16 != d16 && o16 != d8, "the orthogonal start would look like another series");
    let mut seen = std::collections::HashSet::new();
    for (l, c, d) in &styles {
        assert!(seen.insert((*c, *d)), "{l} shares colour and dash with another series");
    }
}
