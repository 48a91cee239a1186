//! Launching runs as child processes (`attnlab train SPEC --quiet`), one per slot: a GPU, or a
//! CPU process when no GPUs are given. A failing run is reported and the others go on.
use super::{final_loss, report, Outcome, PlannedRun, RunReport, RunStatus, SweepOptions, SweepPlan};
use std::collections::VecDeque;
use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Instant;

/// Launch every run that is not DONE; returns one report per run, in plan order.
pub(super) fn run_all(plan: &SweepPlan, opts: &SweepOptions, exe: &Path) -> Vec<RunReport> {
    let mut reports: Vec<RunReport> = plan.runs.iter().map(|r| report(r, Outcome::Skipped)).collect();
    let todo: VecDeque<usize> = (0..plan.runs.len()).filter(|&i| reports[i].before != RunStatus::Done).collect();
    let total = todo.len();
    let skipped = plan.runs.len() - total;
    if skipped > 0 {
        eprintln!("sweep: {skipped} run(s) already done, skipped");
    }
    // One slot per GPU; without GPUs, `max_parallel` CPU slots (at least one).
    let mut slots: Vec<Option<&str>> = if opts.gpus.is_empty() { vec![None; opts.max_parallel.max(1)] } else { opts.gpus.iter().map(|g| Some(g.as_str())).collect() };
    slots.truncate(total.max(1));

    let queue = Mutex::new(todo);
    let results: Mutex<Vec<(usize, Launched)>> = Mutex::new(Vec::new());
    let started = Mutex::new(0usize);
    let (queue_ref, results_ref, started_ref) = (&queue, &results, &started);
    std::thread::scope(|s| {
        for &gpu in &slots {
            s.spawn(move || loop {
                let Some(i) = queue_ref.lock().expect("queue").pop_front() else { break };
                let run = &plan.runs[i];
                let k = {
                    let mut n = started_ref.lock().expect("counter");
                    *n += 1;
                    *n
                };
                let on = gpu.map(|g| format!(" on GPU {g}")).unwrap_or_default();
                eprintln!("sweep: [{k}/{total}] start {}{on} ({}){}", run.name, reports_label(run), if RunStatus::of(&run.dir) == RunStatus::Partial { ", resuming" } else { "" });
                let l = launch(run, gpu, exe);
                match &l.failure {
                    None => eprintln!("sweep: [{k}/{total}] {} finished in {:.1}s", run.name, l.wall_s),
                    Some(tail) => eprintln!(
                        "sweep: [{k}/{total}] {} FAILED ({}) after {:.1}s; full log: {}\n{}",
                        run.name,
                        l.exit.map_or("did not start".to_string(), |c| format!("exit {c}")),
                        l.wall_s,
                        l.log.display(),
                        indent(tail)
                    ),
                }
                results_ref.lock().expect("results").push((i, l));
            });
        }
    });
    for (i, l) in results.into_inner().expect("results") {
        let r = &mut reports[i];
        r.outcome = if l.failure.is_none() { Outcome::Trained } else { Outcome::Failed };
        r.exit = l.exit;
        r.wall_s = Some(l.wall_s);
        r.final_loss = final_loss(&r.dir);
        r.log = Some(l.log);
    }
    reports
}

fn reports_label(run: &PlannedRun) -> String {
    if run.overrides.is_empty() {
        run.dir.display().to_string()
    } else {
        run.overrides.clone()
    }
}

struct Launched {
    exit: Option<i32>,
    wall_s: f64,
    /// The tail of this launch's output when it failed.
    failure: Option<String>,
    log: PathBuf,
}

/// Run `exe train SPEC --quiet` for one run, its stdout and stderr appended to `<run dir>/train.log`.
fn launch(run: &PlannedRun, gpu: Option<&str>, exe: &Path) -> Launched {
    let log = run.dir.join("train.log");
    let start = Instant::now();
    let failed = |exit, msg: String| Launched { exit, wall_s: start.elapsed().as_secs_f64(), failure: Some(msg), log: log.clone() };
    if let Err(e) = std::fs::create_dir_all(&run.dir) {
        return failed(None, format!("cannot create {}: {e}", run.dir.display()));
    }
    let mut file = match OpenOptions::new().create(true).append(true).open(&log) {
        Ok(f) => f,
        Err(e) => return failed(None, format!("cannot open {}: {e}", log.display())),
    };
    let offset = file.metadata().map(|m| m.len()).unwrap_or(0);

    let mut cmd = Command::new(exe);
    cmd.arg(run.spec.command()).arg(&run.spec_path).arg("--quiet").stdin(Stdio::null());
    if let Some(g) = gpu {
        // The child sees only its GPU, as device 0.
        cmd.env("CUDA_VISIBLE_DEVICES", g);
    }
    // A partial run resumes with the device it was started with: train refuses a run directory
    // whose recorded config differs, and `train.device` is part of it.
    if let Some(device) = recorded_device(&run.dir).or_else(|| gpu.map(|_| "cuda:0".to_string())) {
        cmd.arg("--set").arg(format!("train.device={device}"));
    }
    let _ = writeln!(file, "== attnlab sweep: {}{} ==", describe(&cmd), gpu.map(|g| format!(" (CUDA_VISIBLE_DEVICES={g})")).unwrap_or_default());
    let (out, err) = match (file.try_clone(), file.try_clone()) {
        (Ok(o), Ok(e)) => (o, e),
        (Err(e), _) | (_, Err(e)) => return failed(None, format!("cannot share {}: {e}", log.display())),
    };
    let status = cmd.stdout(out).stderr(err).status();
    let wall_s = start.elapsed().as_secs_f64();
    match status {
        Ok(s) if s.success() => Launched { exit: s.code(), wall_s, failure: None, log },
        Ok(s) => {
            let tail = tail_since(&log, offset, 15);
            let code = s.code();
            Launched { exit: code, wall_s, failure: Some(if code.is_none() { format!("killed by a signal ({s})\n{tail}") } else { tail }), log }
        }
        Err(e) => {
            let _ = writeln!(file, "could not start {}: {e}", exe.display());
            Launched { exit: None, wall_s, failure: Some(format!("could not start {}: {e}", exe.display())), log }
        }
    }
}

/// `train.device` of the run directory's config.yaml, if it has one.
fn recorded_device(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("config.yaml")).ok()?;
    let v: serde_yaml::Value = serde_yaml::from_str(&text).ok()?;
    v.get("train")?.get("device")?.as_str().map(str::to_string)
}

fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program()).chain(cmd.get_args()).map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ")
}

/// The last `n` lines written to `path` after byte `offset` (this launch's output only).
fn tail_since(path: &Path, offset: u64, n: usize) -> String {
    let mut text = String::new();
    if let Ok(mut f) = std::fs::File::open(path) {
        let mut bytes = Vec::new();
        if f.seek(SeekFrom::Start(offset)).is_ok() && f.read_to_end(&mut bytes).is_ok() {
            text = String::from_utf8_lossy(&bytes).into_owned();
        }
    }
    let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with("== attnlab sweep:")).collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("    | {l}")).collect::<Vec<_>>().join("\n")
}
