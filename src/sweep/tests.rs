use super::*;
use serde_yaml::Value;
use std::path::{Path, PathBuf};

/// A tiny DAR spec on the synthetic corpus: the base of the test sweeps.
const BASE: &str = "model: {flavor: tiny}
attention: {kind: dar, d_down: 16, window: 16}
data:
  train: {synthetic: {seed: 1, docs: 100}}
train: {steps: 4, device: cpu}
output: results/ignored
";

/// Write base.yaml and sweep.yaml (with `OUT` replaced by `<tmp>/out`) into a temporary folder.
fn setup(sweep: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("base.yaml"), BASE).unwrap();
    let file = tmp.path().join("sweep.yaml");
    std::fs::write(&file, sweep.replace("OUT", &tmp.path().join("out").display().to_string())).unwrap();
    (tmp, file)
}

fn names(p: &SweepPlan) -> Vec<String> {
    p.runs.iter().map(|r| r.name.clone()).collect()
}

fn err_text<T: std::fmt::Debug>(r: crate::Result<T>) -> String {
    r.expect_err("expected an error").to_string()
}

/// `setup` for a sweep over base.yaml into OUT: `body` is what follows those two lines.
fn setup_body(body: &str) -> (tempfile::TempDir, PathBuf) {
    setup(&format!("\nbase: base.yaml\noutput: OUT{body}"))
}

/// The error planning `sweep` (a sweep file's text) gives.
fn plan_err(sweep: &str) -> String {
    let (_tmp, file) = setup(sweep);
    err_text(plan(&file, &[], None))
}

const GRID_ZIP_RUNS: &str = r#"
base: base.yaml
output: OUT
name: "{attention.kind}-d{attention.d_down}-s{train.seed}"
grid: {attention.d_down: [32, 16, 8]}
zip: {train.seed: [1, 2], train.lr: [0.001, 0.002]}
runs:
  - {attention.kind: dar}
  - {attention.kind: uniform, attention.window: null}
"#;

#[test]
fn grid_zip_and_runs_expand_in_order_with_names_dirs_and_values() {
    let (tmp, file) = setup(GRID_ZIP_RUNS);
    let p = plan(&file, &[], None).unwrap();
    let mut want = Vec::new();
    for kind in ["dar", "uniform"] {
        for d in [32, 16, 8] {
            for s in [1, 2] {
                want.push(format!("{kind}-d{d}-s{s}"));
            }
        }
    }
    assert_eq!(names(&p), want);
    assert_eq!(p.merged_duplicates, 0);
    let out = tmp.path().join("out");
    for r in &p.runs {
        // Zip keys move together: seed 2 always has lr 0.002.
        let lr = if r.spec.as_train().unwrap().seed() == 2 { 0.002 } else { 0.001 };
        assert_eq!(r.spec.as_train().unwrap().train.lr, Some(lr), "{}", r.name);
        let hash = r.id.strip_prefix(&format!("{}-", r.name)).unwrap();
        assert!(hash.len() == 12 && hash.chars().all(|c| c.is_ascii_hexdigit()), "{}", r.id);
        assert_eq!(r.dir, out.join(&r.id));
        assert_eq!(r.spec.as_train().unwrap().output.as_deref(), Some(r.dir.as_path()));
        assert_eq!(r.spec.as_train().unwrap().name.as_deref(), Some(r.name.as_str()));
        assert_eq!(r.spec_path, out.join("specs").join(format!("{}.yaml", r.id)));
    }
    let first = &p.runs[0];
    assert_eq!(first.overrides, "attention.d_down=32 train.seed=1 train.lr=0.001 attention.kind=dar");
    assert_eq!((first.spec.as_train().unwrap().d_down(), first.spec.as_train().unwrap().window()), (32, 16));
    let uniform = p.runs.iter().find(|r| r.name == "uniform-d8-s2").unwrap();
    assert_eq!((uniform.spec.as_train().unwrap().attention.kind(), uniform.spec.as_train().unwrap().window(), uniform.spec.as_train().unwrap().d_down()), (crate::spec::AttentionKind::Uniform, 0, 8));
}

#[test]
fn entries_with_their_own_axes_and_names() {
    let (_tmp, file) = setup_body(
        r#"
name: "dar-w{attention.window}"
set: {train.steps: 7}
runs:
  - {name: vanilla, attention.kind: vanilla, attention.d_down: null, attention.window: null}
  - {grid: {attention.window: [8, 4, 0]}}
  - {name: "u{attention.d_down}", attention.kind: uniform, attention.window: null, zip: {attention.d_down: [16, 8]}}
"#,
    );
    let p = plan(&file, &[], None).unwrap();
    assert_eq!(names(&p), ["vanilla", "dar-w8", "dar-w4", "dar-w0", "u16", "u8"]);
    assert!(p.runs.iter().all(|r| r.spec.as_train().unwrap().steps() == 7));
}

#[test]
fn axis_errors_name_the_sweep_file_and_the_key() {
    let zip = GRID_ZIP_RUNS.replace("train.seed: [1, 2]", "train.seed: [1, 2, 3]");
    let e = plan_err(&zip);
    assert!(e.contains("sweep.yaml") && e.contains("`train.lr`") && e.contains("same length") && e.contains("line 6"), "{e}");

    let e = plan_err(&GRID_ZIP_RUNS.replace("[32, 16, 8]", "32"));
    assert!(e.contains("sweep.yaml") && e.contains("attention.d_down") && e.contains("list"), "{e}");

    let e = plan_err(&GRID_ZIP_RUNS.replace("grid:", "gird:"));
    assert!(e.contains("sweep.yaml") && e.contains("gird"), "{e}");

    // A run the spec rejects: vanilla keeps the base's d_down.
    let e = plan_err(&GRID_ZIP_RUNS.replace("{attention.kind: dar}", "{attention.kind: vanilla}"));
    assert!(e.contains("sweep.yaml") && e.contains("`attention.d_down`") && e.contains("vanilla"), "{e}");

    // An unknown key in an override.
    let e = plan_err(&GRID_ZIP_RUNS.replace("attention.window: null", "attention.windw: 3"));
    assert!(e.contains("sweep.yaml") && e.contains("windw"), "{e}");

    // A placeholder with no value, and a template that does not tell runs apart.
    let e = plan_err(&GRID_ZIP_RUNS.replace("{attention.kind: dar}", "{attention.kind: vanilla, attention.d_down: null, attention.window: null}"));
    assert!(e.contains("{attention.d_down}") && e.contains("name"), "{e}");
    let e = plan_err(&GRID_ZIP_RUNS.replace("-s{train.seed}", ""));
    assert!(e.contains("dar-d32") && e.contains("name template"), "{e}");
}

#[test]
fn null_deletes_a_key_and_other_values_override() {
    let mut v: Value = serde_yaml::from_str("attention: {kind: dar, d_down: 16, window: 8}\ntrain: {steps: 3}\n").unwrap();
    apply(&mut v, "attention.d_down", &Value::Null).unwrap();
    apply(&mut v, "attention.nothing.here", &Value::Null).unwrap();
    apply(&mut v, "train.betas", &serde_yaml::from_str("[0.9, 0.99]").unwrap()).unwrap();
    apply(&mut v, "model.flavor", &Value::String("tiny".into())).unwrap();
    apply(&mut v, "name", &Value::String("123".into())).unwrap();
    assert!(v["attention"].get("d_down").is_none());
    assert_eq!(v["attention"]["window"].as_u64(), Some(8));
    assert_eq!(v["train"]["betas"][1].as_f64(), Some(0.99));
    assert_eq!(v["model"]["flavor"].as_str(), Some("tiny"));
    assert_eq!(v["name"].as_str(), Some("123"), "a string stays a string");
    assert!(apply(&mut v, "attention.kind.x", &Value::Null).is_err());
    assert!(apply(&mut v, "a..b", &Value::Bool(true)).is_err());

    // Through a sweep: vanilla from a DAR base, and --set null too.
    let (_tmp, file) = setup("base: base.yaml\noutput: OUT\nname: v\nset: {attention.kind: vanilla, attention.d_down: null}\n");
    let p = plan(&file, &["attention.window=null".into()], None).unwrap();
    assert_eq!(p.runs.len(), 1);
    assert_eq!((p.runs[0].spec.as_train().unwrap().attention.d_down_width(), p.runs[0].spec.as_train().unwrap().attention.window_len()), (None, None));
}

#[test]
fn identical_resolved_configs_are_merged() {
    // Vanilla ignores the d_down axis once null removes it; uniform with window 0 written out equals
    // uniform with the window left to resolve.
    let (_tmp, file) = setup_body(
        r#"
name: "{attention.kind}-d{attention.d_down}"
grid: {attention.d_down: [32, 16, 8]}
runs:
  - {name: vanilla, attention.kind: vanilla, attention.d_down: null, attention.window: null}
  - {attention.kind: dar}
  - {attention.kind: uniform, attention.window: null}
  - {attention.kind: uniform, attention.window: 0}
"#,
    );
    let p = plan(&file, &[], None).unwrap();
    assert_eq!(names(&p), ["vanilla", "dar-d32", "dar-d16", "dar-d8", "uniform-d32", "uniform-d16", "uniform-d8"]);
    assert_eq!(p.merged_duplicates, 5);
    // Each key once, with the value that won.
    assert_eq!(p.runs[0].overrides, "attention.d_down=null attention.kind=vanilla attention.window=null");
}

#[test]
fn run_ids_are_stable_and_change_with_the_config() {
    let (tmp, file) = setup(GRID_ZIP_RUNS);
    let ids = |p: &SweepPlan| p.runs.iter().map(|r| r.id.clone()).collect::<Vec<_>>();
    let a = plan(&file, &[], None).unwrap();
    let b = plan(&file, &[], None).unwrap();
    assert_eq!(ids(&a), ids(&b));
    // The output folder is not part of the config: same ids elsewhere.
    let c = plan(&file, &[], Some(&tmp.path().join("elsewhere"))).unwrap();
    assert_eq!(ids(&a), ids(&c));
    assert!(c.runs[0].dir.starts_with(tmp.path().join("elsewhere")));
    // Nor are the base's own output and name.
    std::fs::write(tmp.path().join("base.yaml"), BASE.replace("results/ignored", "results/other") + "name: something\n").unwrap();
    assert_eq!(ids(&a), ids(&plan(&file, &[], None).unwrap()));
    std::fs::write(tmp.path().join("base.yaml"), BASE).unwrap();
    // A changed value: same names, new directories.
    let d = plan(&file, &["train.steps=5".into()], None).unwrap();
    assert_eq!(names(&a), names(&d));
    for (x, y) in a.runs.iter().zip(&d.runs) {
        assert_ne!(x.id, y.id);
    }
    std::fs::write(&file, std::fs::read_to_string(&file).unwrap().replace("0.002]", "0.003]")).unwrap();
    let e = plan(&file, &[], None).unwrap();
    for (x, y) in a.runs.iter().zip(&e.runs) {
        assert_eq!(x.id == y.id, x.spec.as_train().unwrap().seed() == 1, "{} vs {}", x.id, y.id);
    }
}

#[test]
fn status_comes_from_the_run_directory() {
    let (tmp, file) = setup(GRID_ZIP_RUNS);
    let p = plan(&file, &[], None).unwrap();
    let (new, partial, done) = (&p.runs[0].dir, &p.runs[1].dir, &p.runs[2].dir);
    std::fs::create_dir_all(new).unwrap(); // an empty folder (say, only train.log) is still new
    std::fs::create_dir_all(partial).unwrap();
    std::fs::write(partial.join("config.yaml"), "x").unwrap();
    std::fs::create_dir_all(done).unwrap();
    std::fs::write(done.join("config.yaml"), "x").unwrap();
    std::fs::write(done.join("DONE"), "").unwrap();
    std::fs::write(done.join("metrics.jsonl"), "{\"step\": 1, \"loss\": 3.5}\n{\"step\": 2, \"loss\": 3.25}\n{\"step\": 2, \"eval/x/ppl\": 9.0}\n").unwrap();
    assert_eq!([new, partial, done].map(|d| RunStatus::of(d)), [RunStatus::New, RunStatus::Partial, RunStatus::Done]);
    assert_eq!(RunStatus::of(&tmp.path().join("missing")), RunStatus::New);
    assert_eq!(final_loss(done), Some(3.25));

    // A dry run reports the same and writes nothing.
    let s = run_sweep(&file, &SweepOptions { dry_run: true, ..Default::default() }).unwrap();
    let before: Vec<RunStatus> = s.runs.iter().map(|r| r.before).collect();
    assert_eq!(&before[..4], [RunStatus::New, RunStatus::Partial, RunStatus::Done, RunStatus::New]);
    assert!(s.runs.iter().all(|r| r.outcome == Outcome::Planned));
    assert!(!tmp.path().join("out/specs").exists());
    let t = plan_table(&s.runs);
    let row = t.lines().nth(3).unwrap();
    assert!(t.starts_with("name") && row.starts_with("dar-d16-s1") && row.ends_with("done"), "{t}");
}

#[test]
fn slurm_script_runs_one_array_task_per_spec() {
    let (tmp, file) = setup(GRID_ZIP_RUNS);
    let s = run_sweep(&file, &SweepOptions { emit: Some(Emit::Slurm), exe: Some("/opt/attnlab".into()), ..Default::default() }).unwrap();
    let out = tmp.path().join("out");
    assert_eq!(s.script.as_deref(), Some(out.join("sweep.sbatch").as_path()));
    let script = std::fs::read_to_string(out.join("sweep.sbatch")).unwrap();
    for needle in ["#!/bin/bash", "#SBATCH --array=0-11\n", "#SBATCH --gres=gpu:1\n", "ATTNLAB=${ATTNLAB:-'/opt/attnlab'}", "$((SLURM_ARRAY_TASK_ID + 1))p", "specs.txt'", "exec \"$ATTNLAB\" train \"$SPEC\" --quiet"] {
        assert!(script.contains(needle), "missing `{needle}` in\n{script}");
    }
    let cwd = std::env::current_dir().unwrap();
    assert!(script.contains(&format!("cd '{}'", cwd.display())), "{script}");
    let listed: Vec<String> = std::fs::read_to_string(out.join("specs.txt")).unwrap().lines().map(str::to_string).collect();
    assert_eq!(listed.len(), 12);
    let p = plan(&file, &[], None).unwrap();
    for (line, run) in listed.iter().zip(&p.runs) {
        assert_eq!(Path::new(line), run.spec_path);
        // The spec file runs exactly the planned config.
        assert_eq!(crate::spec::load(Path::new(line), &[]).unwrap(), *run.spec.as_train().unwrap());
        assert!(!run.dir.exists(), "nothing may run in emit mode");
    }
    assert!(s.runs.iter().all(|r| r.outcome == Outcome::Planned));
}

/// A stand-in for `attnlab` (`train SPEC --quiet [...]`): records its arguments, writes config.yaml,
/// a loss and DONE into the spec's output, and fails for seed 666.
#[cfg(unix)]
fn fake_attnlab(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let exe = dir.join("fake-attnlab");
    let script = r#"#!/bin/sh
[ "$1" = train ] || exit 0
out=$(sed -n 's/^output: //p' "$2")
echo "args: $* gpu=${CUDA_VISIBLE_DEVICES:-none}"
mkdir -p "$out" && cp "$2" "$out/config.yaml"
if grep -q "seed: 666" "$2"; then echo "boom: loss is NaN" >&2; exit 3; fi
if grep -q "seed: 75" "$2"; then echo "run directory $out is in use by another attnlab process" >&2; exit 75; fi
sleep 0.2
echo '{"step": 4, "loss": 2.5}' >> "$out/metrics.jsonl"
touch "$out/DONE"
"#;
    std::fs::write(&exe, script).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    // Other test threads fork while the file was open for writing: wait until it is executable.
    for _ in 0..100 {
        match std::process::Command::new(&exe).status() {
            Err(e) if e.raw_os_error() == Some(26) => std::thread::sleep(std::time::Duration::from_millis(20)),
            r => {
                r.unwrap();
                break;
            }
        }
    }
    exe
}

#[cfg(unix)]
#[test]
fn launches_children_per_gpu_reports_failures_and_skips_done_runs() {
    let (tmp, file) = setup_body(
        r#"
name: "s{train.seed}"
grid: {train.seed: [1, 666, 3, 4]}
"#,
    );
    let exe = fake_attnlab(tmp.path());
    let opts = SweepOptions { gpus: vec!["7".into(), "9".into()], exe: Some(exe.clone()), ..Default::default() };
    let s = run_sweep(&file, &opts).unwrap();
    assert_eq!(s.failed(), 1);
    assert_eq!(s.runs.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["s1", "s666", "s3", "s4"]);
    for r in &s.runs {
        let log = std::fs::read_to_string(r.log.as_ref().unwrap()).unwrap();
        assert!(log.contains("--quiet --set train.device=cuda:0") && (log.contains("gpu=7") || log.contains("gpu=9")), "{log}");
        assert!(log.contains(&format!("specs/{}-", r.name)), "the child runs the written spec: {log}");
        if r.name == "s666" {
            assert_eq!((r.outcome, r.exit, r.final_loss), (Outcome::Failed, Some(3), None));
            assert!(log.contains("boom") && RunStatus::of(&r.dir) == RunStatus::Partial, "{log}");
        } else {
            assert_eq!((r.outcome, r.exit, r.final_loss), (Outcome::Trained, Some(0), Some(2.5)), "{}", r.name);
            assert!(RunStatus::of(&r.dir) == RunStatus::Done && r.wall_s.unwrap() >= 0.2);
        }
    }
    let table = summary_table(&s.runs);
    assert!(table.lines().any(|l| l.starts_with("s666") && l.contains("FAILED")), "{table}");

    // Again, sequentially: done runs are skipped, the failed (partial) one is launched again.
    let opts = SweepOptions { exe: Some(exe), ..Default::default() };
    let s = run_sweep(&file, &opts).unwrap();
    let outcomes: Vec<Outcome> = s.runs.iter().map(|r| r.outcome).collect();
    assert_eq!(outcomes, [Outcome::Skipped, Outcome::Failed, Outcome::Skipped, Outcome::Skipped]);
    assert_eq!(s.runs[1].before, RunStatus::Partial);
    assert_eq!(s.runs[0].final_loss, Some(2.5));
    let log = std::fs::read_to_string(s.runs[1].log.as_ref().unwrap()).unwrap();
    assert_eq!(log.matches("== attnlab sweep:").count(), 2, "the log is appended: {log}");
    // It resumes on the device it was started with (what its config.yaml records).
    assert!(log.contains("--quiet --set train.device=cpu gpu="), "{log}");
    assert!(log.contains("gpu=none") || std::env::var_os("CUDA_VISIBLE_DEVICES").is_some(), "{log}");

    // A missing executable is a failed run, not a crashed sweep.
    let opts = SweepOptions { exe: Some(tmp.path().join("no-such-attnlab")), ..Default::default() };
    let s = run_sweep(&file, &opts).unwrap();
    assert_eq!((s.failed(), s.runs[1].exit), (1, None));
}

/// A run whose directory another process holds is reported busy and not launched (or, when the
/// child finds it taken, exit 75); the other runs go on; the busy one runs once it is free.
#[cfg(unix)]
#[test]
fn a_locked_run_is_busy_and_the_others_go_on() {
    let (tmp, file) = setup_body("\nname: \"s{train.seed}\"\ngrid: {train.seed: [1, 2, 75]}\n");
    let exe = fake_attnlab(tmp.path());
    let p = plan(&file, &[], None).unwrap();
    std::fs::create_dir_all(&p.runs[1].dir).unwrap();
    let lock = crate::train::lock::RunLock::try_acquire(&p.runs[1].dir).unwrap();
    let dry = run_sweep(&file, &SweepOptions { dry_run: true, ..Default::default() }).unwrap();
    assert!(plan_table(&dry.runs).lines().any(|l| l.starts_with("s2") && l.contains("busy: pid")), "{}", plan_table(&dry.runs));
    let s = run_sweep(&file, &SweepOptions { exe: Some(exe.clone()), ..Default::default() }).unwrap();
    assert_eq!(s.runs.iter().map(|r| r.outcome).collect::<Vec<_>>(), [Outcome::Trained, Outcome::Busy, Outcome::Busy]);
    assert_eq!((s.failed(), s.runs[2].exit), (0, Some(75)));
    assert!(!p.runs[1].dir.join("config.yaml").exists(), "a busy run must not be launched");
    assert!(summary_table(&s.runs).lines().any(|l| l.starts_with("s2") && l.contains("busy")));
    drop(lock);
    let s = run_sweep(&file, &SweepOptions { exe: Some(exe), ..Default::default() }).unwrap();
    assert_eq!(s.runs.iter().map(|r| r.outcome).collect::<Vec<_>>(), [Outcome::Skipped, Outcome::Trained, Outcome::Busy]);
}

/// Expected runs per file in sweeps/ (every file there must be listed).
const SWEEPS: [(&str, usize); 28] = [
    ("dar-evidence-reduced.yaml", 15),
    ("dar-evidence-smoke.yaml", 12),
    ("dar-longrange-niah-reduced.yaml", 12),
    ("dar-longrange-reduced.yaml", 12),
    ("dar-longrange-smoke.yaml", 12),
    ("dar-recall-capacity-reduced.yaml", 50),
    ("dar-recall-capacity-smoke.yaml", 12),
    ("dar-recall-curves-reduced.yaml", 21),
    ("dar-recall-curves-smoke.yaml", 14),
    ("dar-window-ablation-reduced.yaml", 16),
    ("dar-window-ablation-smoke.yaml", 14),
    ("finetune-smollm2-dar.yaml", 5),
    ("still-components-paper.yaml", 6),
    ("still-components-reduced.yaml", 6),
    ("still-components-smoke.yaml", 6),
    ("still-routing-paper.yaml", 7),
    ("still-routing-reduced.yaml", 7),
    ("still-routing-smoke.yaml", 7),
    ("still-routing-smollm2.yaml", 11),
    ("table1-paper.yaml", 7),
    ("table1-reduced.yaml", 7),
    ("table1-smoke.yaml", 7),
    ("table2-paper.yaml", 6),
    ("table2-reduced.yaml", 6),
    ("table2-smoke.yaml", 6),
    ("table3-paper.yaml", 8),
    ("table3-reduced.yaml", 8),
    ("table3-smoke.yaml", 6),
];

fn sweep_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("sweeps").join(name)
}

#[test]
fn every_sweep_file_expands_to_the_expected_runs() {
    let mut found: Vec<String> = std::fs::read_dir(sweep_file(""))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    found.sort();
    assert_eq!(found, SWEEPS.map(|s| s.0.to_string()));
    for (name, n) in SWEEPS {
        let p = match plan(&sweep_file(name), &[], None) {
            Ok(p) => p,
            Err(e) => panic!("{name}: {e}"),
        };
        assert_eq!(p.runs.len(), n, "{name}: {:?}", names(&p));
        for r in p.runs.iter().filter(|r| r.spec.command() == "train") {
            let s = r.spec.as_train().unwrap();
            let (steps, batch, every) = (s.steps(), s.batch_size(), s.eval.every);
            if name.contains("paper") {
                // The paper's §3: 70M at 256 × 19,073 steps, 160M / 410M at 896 × 5,450 (both 10.0B tokens).
                let want = if s.model.flavor == Some(crate::spec::Flavor::Pythia70m) { (19073, 256) } else { (5450, 896) };
                assert_eq!((steps, batch, s.seq_len(), every), (want.0, want.1, 2048, Some(2000)), "{name} {}", r.name);
            } else if name.starts_with("dar-longrange") {
                // Issue 27's long-range sweeps: the recall recipe (reduced, CPU smoke) and the needle teacher's.
                let want = match name {
                    "dar-longrange-reduced.yaml" => (800, 64, 512),
                    "dar-longrange-smoke.yaml" => (30, 8, 256),
                    _ => (5000, 16, 1024),
                };
                assert_eq!((steps, batch, s.seq_len()), want, "{name} {}", r.name);
            } else if name.starts_with("dar-recall") {
                // Issue 36: recall scored while training (curves), the capacity sweep's T and facts.
                let want = match name {
                    "dar-recall-curves-reduced.yaml" => (8000, 64, 512),
                    "dar-recall-capacity-reduced.yaml" => (8000, 16, 2048),
                    "dar-recall-curves-smoke.yaml" => (60, 8, 256),
                    _ => (30, 8, 256),
                };
                assert_eq!((steps, batch, s.seq_len()), want, "{name} {}", r.name);
                let recall = s.eval.recall.as_ref().expect("eval.recall");
                let crate::spec::SourceSpec::Synthetic { synthetic } = &s.data.train else { panic!("{name}: not synthetic") };
                assert_eq!(recall.facts, synthetic.recall_facts, "{name} {}", r.name);
                if name.contains("capacity") {
                    assert!(recall.facts.is_some() && synthetic.recall_gap.is_some_and(|g| g.bounds().0 >= 64), "{name} {}", r.name);
                } else {
                    let (lo, hi) = synthetic.recall_gap.expect("recall corpus").bounds();
                    assert!(recall.gaps.iter().all(|g| (lo..=hi).contains(g)), "{name}: scored gaps {:?} outside training's {lo}..={hi}", recall.gaps);
                }
            } else if name.starts_with("dar-") && name.contains("reduced") {
                let d: Vec<String> = s.data.eval.keys().cloned().collect();
                assert_eq!((steps, batch, s.seq_len(), d), (609, 64, 1024, vec!["wiki-gutenberg".to_string(), "wikitext".into()]), "{name} {}", r.name);
            } else if name.contains("reduced") {
                assert_eq!((steps, batch, s.seq_len()), (336, 32, 2048), "{name} {}", r.name);
            } else {
                assert_eq!((s.model.flavor, s.train.device.as_deref(), s.seq_len()), (Some(crate::spec::Flavor::Tiny), Some("cpu"), 128), "{name} {}", r.name);
            }
        }
    }
    let routing = plan(&sweep_file("still-routing-reduced.yaml"), &[], None).unwrap();
    assert!(routing.runs.iter().all(|r| r.spec.command() == "linearize"));
    assert_eq!(names(&routing)[..3], ["still-self_saliency", "still-self_saliency_reference_code", "still-diag_attention"]);
    let comp = names(&plan(&sweep_file("still-components-paper.yaml"), &[], None).unwrap());
    assert_eq!(comp, ["still-self_saliency-gate-true-np_map", "still-self_saliency-gate-false-np_map", "still-self_saliency-gate-true-hedgehog", "still-self_saliency-gate-false-hedgehog", "still-none-gate-true-np_map", "lolcats-w64"]);
    let t2 = names(&plan(&sweep_file("table2-paper.yaml"), &[], None).unwrap());
    assert_eq!(t2, ["pythia-70m-vanilla", "pythia-160m-vanilla", "pythia-410m-vanilla", "pythia-70m-dar-d128-w128", "pythia-160m-dar-d192-w128", "pythia-410m-dar-d256-w128"]);
    let t2 = names(&plan(&sweep_file("table2-smoke.yaml"), &[], None).unwrap());
    assert_eq!(t2, ["2x64-vanilla", "3x96-vanilla", "4x128-vanilla", "2x64-dar-d16-w8", "3x96-dar-d24-w8", "4x128-dar-d32-w8"]);
    let t1 = names(&plan(&sweep_file("table1-smoke.yaml"), &[], None).unwrap());
    assert_eq!(t1, ["2x64-vanilla", "2x64-dar-d32-w8", "2x64-dar-d16-w8", "2x64-dar-d8-w8", "2x64-uniform-d32", "2x64-uniform-d16", "2x64-uniform-d8"]);
    // The run the tables share (and vanilla) resolves to one directory in all three.
    for (scale, shared) in [("paper", "pythia-70m-dar-d128-w128"), ("reduced", "pythia-70m-dar-d128-w128"), ("smoke", "2x64-dar-d16-w8")] {
        let mut ids = Vec::new();
        for t in 1..=3 {
            let p = plan(&sweep_file(&format!("table{t}-{scale}.yaml")), &[], None).unwrap();
            for want in [shared.to_string(), shared.split("-dar").next().unwrap().to_string() + "-vanilla"] {
                ids.push(p.runs.iter().find(|r| r.name == want).unwrap_or_else(|| panic!("table{t}-{scale}: no {want}")).dir.clone());
            }
        }
        assert_eq!(ids[0..2], ids[2..4], "{scale}");
        assert_eq!(ids[0..2], ids[4..6], "{scale}");
    }
}

/// A linearize sweep: specs written for `attnlab linearize`, the child launched with that command,
/// per-run overrides in the resolved spec, and a different routing giving a different run dir.
#[cfg(unix)]
#[test]
fn linearize_sweeps_launch_linearize() {
    let tmp = tempfile::tempdir().unwrap();
    let p = plan(&sweep_file("still-routing-smoke.yaml"), &[], Some(&tmp.path().join("out"))).unwrap();
    write_specs(&p).unwrap();
    let r = &p.runs[4];
    let crate::sweep::RunSpec::Linearize(spec) = &r.spec else { panic!("{} is not a linearize run", r.name) };
    let still = |s: &crate::linearize::LinearizeSpec| s.attention.options::<crate::attention::still::StillConfig>().expect("a STILL run").routing;
    assert_eq!(still(spec), crate::attention::still::Routing::KeyNorm);
    assert_eq!((spec.stage1.steps, spec.output.as_path()), (Some(10), r.dir.as_path()));
    let written = crate::linearize::LinearizeSpec::from_file(&r.spec_path).unwrap();
    assert_eq!(&written, spec);
    assert!(std::fs::read_to_string(&r.spec_path).unwrap().contains("attnlab linearize THIS_FILE"));
    let dirs: std::collections::HashSet<_> = p.runs.iter().map(|r| r.dir.clone()).collect();
    assert_eq!(dirs.len(), 7);
    // The child gets `linearize`, as the fake attnlab records.
    let opts = SweepOptions { exe: Some(fake_attnlab(tmp.path())), out: Some(tmp.path().join("out2")), ..Default::default() };
    let s = run_sweep(&sweep_file("still-routing-smoke.yaml"), &opts).unwrap();
    let log = std::fs::read_to_string(s.runs[0].log.as_ref().unwrap()).unwrap();
    assert!(log.contains(" linearize "), "{log}");
}

/// The smoke sweep's specs really train (in-process, 2 steps), and the run then reads as done.
#[test]
fn a_smoke_sweep_spec_trains() {
    let _rng = crate::testutil::rng();
    let tmp = tempfile::tempdir().unwrap();
    let sets = ["train.steps=2".to_string(), format!("data.cache={}", tmp.path().join("cache").display())];
    let p = plan(&sweep_file("table1-smoke.yaml"), &sets, Some(&tmp.path().join("out"))).unwrap();
    write_specs(&p).unwrap();
    let run = &p.runs[1];
    let spec = crate::spec::load(&run.spec_path, &[]).unwrap();
    assert_eq!(spec, *run.spec.as_train().unwrap());
    let t = std::time::Instant::now();
    crate::train::train(spec, &crate::train::TrainOptions { quiet: true, ..Default::default() }).unwrap();
    eprintln!("smoke run {} (2 steps) trained in {:.1}s", run.name, t.elapsed().as_secs_f64());
    assert_eq!(RunStatus::of(&run.dir), RunStatus::Done);
    assert!(final_loss(&run.dir).is_some());
}

#[test]
fn slurm_script_for_data_parallel_runs_starts_one_srun_task_per_gpu() {
    let (tmp, file) = setup(GRID_ZIP_RUNS);
    let shape = crate::sweep::RunShape { nodes: 2, gpus_per_node: 4 };
    run_sweep(&file, &SweepOptions { emit: Some(Emit::Slurm), exe: Some("/opt/attnlab".into()), shape, ..Default::default() }).unwrap();
    let script = std::fs::read_to_string(tmp.path().join("out/sweep.sbatch")).unwrap();
    for needle in ["#SBATCH --array=0-11\n", "#SBATCH --nodes=2\n", "#SBATCH --ntasks-per-node=4\n", "#SBATCH --gres=gpu:4\n", "8 data-parallel workers", "export MASTER_ADDR=$(scontrol show hostnames", "srun --kill-on-bad-exit=1", "RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID LOCAL_WORLD_SIZE=4"] {
        assert!(script.contains(needle), "missing `{needle}` in\n{script}");
    }
    assert!(!script.contains("--gres=gpu:1"), "{script}");
    // The script is valid bash.
    let st = std::process::Command::new("bash").args(["-n", tmp.path().join("out/sweep.sbatch").to_str().unwrap()]).status().unwrap();
    assert!(st.success());
}

#[test]
fn seeds_are_an_axis_with_suffixed_names_and_clear_errors() {
    let sweep = r#"
base: base.yaml
output: OUT
name: "{attention.kind}-d{attention.d_down}"
seeds: [1, 2, 3]
runs:
  - {name: "vanilla", attention.kind: vanilla, attention.d_down: null, attention.window: null}
  - {attention.kind: dar}
"#;
    let (_tmp, file) = setup(sweep);
    let p = plan(&file, &[], None).unwrap();
    // Seed-major: a sweep cut short still has every configuration of its first seeds.
    assert_eq!(names(&p), ["vanilla-s1", "dar-d16-s1", "vanilla-s2", "dar-d16-s2", "vanilla-s3", "dar-d16-s3"]);
    let seeds: Vec<u64> = p.runs.iter().map(|r| r.spec.as_train().unwrap().seed()).collect();
    assert_eq!(seeds, [1, 1, 2, 2, 3, 3]);
    // Runs of one seed differ from each other only in attention; one config per (seed, attention).
    assert_eq!(p.runs.iter().map(|r| r.id.clone()).collect::<std::collections::HashSet<_>>().len(), 6);
    for (bad, what) in [("seeds: []", "empty list"), ("seeds: [1, 1]", "repeats"), ("seeds: [1]\ngrid: {train.seed: [4]}", "both set `train.seed`")] {
        let (_t, f) = setup(&sweep.replace("seeds: [1, 2, 3]", bad));
        let e = err_text(plan(&f, &[], None));
        assert!(e.contains("seeds") && e.contains(what), "{bad}: {e}");
    }
}

/// Concurrent CPU runs share the cores instead of each taking all of them; one run at a time, or a
/// user's own OMP_NUM_THREADS, is left alone.
#[test]
fn concurrent_cpu_runs_split_the_cores() {
    use super::launch::cpu_threads_per_run as threads;
    assert_eq!(threads(2, 2, false), Some(1));
    assert_eq!(threads(3, 16, false), Some(5));
    assert_eq!(threads(4, 2, false), Some(1), "never zero threads");
    assert_eq!(threads(1, 16, false), None);
    assert_eq!(threads(2, 16, true), None);
}
