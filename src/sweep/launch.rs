//! Launching runs as child processes (`attnlab train SPEC --quiet`), one per slot: a GPU, or a
//! CPU process when no GPUs are given. A failing run is reported and the others go on; a run whose
//! directory another process holds (train::lock) is reported busy and not launched.
//!
//! Children never outlive the sweep: each gets SIGTERM from the kernel when the sweep dies
//! (PR_SET_PDEATHSIG, even on SIGKILL), and a SIGINT / SIGTERM to the sweep is passed on to its
//! running children, after which the sweep starts nothing new and exits with an error. A killed
//! child loses only the steps since its last checkpoint (checkpoints are written atomically);
//! running the sweep again finishes exactly the missing runs.
use super::{final_loss, report, Outcome, PlannedRun, RunReport, RunStatus, SweepOptions, SweepPlan};
use std::collections::VecDeque;
use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The signal (SIGINT / SIGTERM) that asked the sweep to stop; 0 while none has.
static STOP: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_stop_signal(sig: libc::c_int) {
    // A second signal means "now": die at once (children get SIGTERM through PR_SET_PDEATHSIG).
    if STOP.swap(sig, Ordering::SeqCst) != 0 {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(128 + sig) };
    }
}

/// Catch SIGINT and SIGTERM for the rest of the sweep: they set STOP (async-signal-safe).
fn install_stop_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction with a plain handler and an empty mask is valid; the handler
        // only touches an atomic and calls _exit.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_stop_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut sa.sa_mask);
            sa.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// The signal that stopped the sweep, if one did.
pub(super) fn stopped_by() -> Option<i32> {
    match STOP.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}


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
    let threads = if opts.gpus.is_empty() { cpu_threads_per_run(slots.len(), std::thread::available_parallelism().map_or(1, |n| n.get()), std::env::var_os("OMP_NUM_THREADS").is_some()) } else { None };
    if let Some(t) = threads {
        eprintln!("sweep: {} CPU runs at once, {t} thread(s) each (OMP_NUM_THREADS; set it yourself to choose)", slots.len());
    }

    install_stop_handlers();
    let queue = Mutex::new(todo);
    let results: Mutex<Vec<(usize, Launched)>> = Mutex::new(Vec::new());
    let started = Mutex::new(0usize);
    let (queue_ref, results_ref, started_ref) = (&queue, &results, &started);
    std::thread::scope(|s| {
        for &gpu in &slots {
            s.spawn(move || loop {
                if stopped_by().is_some() {
                    break;
                }
                let Some(i) = queue_ref.lock().expect("queue").pop_front() else { break };
                let run = &plan.runs[i];
                let k = {
                    let mut n = started_ref.lock().expect("counter");
                    *n += 1;
                    *n
                };
                // Another process (an earlier sweep still running, a job of the same array)
                // is writing this run: leave it to that one.
                if let Some(holder) = crate::train::lock::holder(&run.dir) {
                    eprintln!("sweep: [{k}/{total}] {} is busy: {} is in use by {holder}; not launched", run.name, run.dir.display());
                    results_ref.lock().expect("results").push((i, Launched { exit: None, wall_s: 0.0, failure: None, log: run.dir.join("train.log"), end: End::Busy }));
                    continue;
                }
                let on = gpu.map(|g| format!(" on GPU {g}")).unwrap_or_default();
                eprintln!("sweep: [{k}/{total}] start {}{on} ({}){}", run.name, reports_label(run), if RunStatus::of(&run.dir) == RunStatus::Partial { ", resuming" } else { "" });
                let l = launch(run, gpu, threads, exe);
                match &l.failure {
                    _ if l.end == End::Busy => eprintln!("sweep: [{k}/{total}] {} is busy (another process took its run directory first); see {}", run.name, l.log.display()),
                    _ if l.end == End::Stopped => eprintln!("sweep: [{k}/{total}] {} stopped by the sweep's signal after {:.1}s; its last checkpoint is kept: run the sweep again to resume", run.name, l.wall_s),
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
        r.outcome = match (l.end, &l.failure) {
            (End::Busy, _) => Outcome::Busy,
            (End::Stopped, _) => Outcome::Stopped,
            (End::Exited, None) => Outcome::Trained,
            (End::Exited, Some(_)) => Outcome::Failed,
        };
        r.exit = l.exit;
        r.wall_s = Some(l.wall_s);
        r.final_loss = final_loss(&r.dir);
        r.log = Some(l.log);
    }
    if stopped_by().is_some() {
        // Runs the stop kept from starting.
        for r in reports.iter_mut().filter(|r| r.outcome == Outcome::Skipped && r.before != RunStatus::Done) {
            r.outcome = Outcome::Planned;
        }
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
    end: End,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// The child ran and exited (successfully or not).
    Exited,
    /// Not run, or refused at once: another process holds the run directory.
    Busy,
    /// Stopped by a signal the sweep received and passed on.
    Stopped,
}

/// The intra-op threads each of `slots` concurrent CPU runs gets on `cores` cores: their share,
/// since libtorch gives every process all the cores and two such processes on one machine fight
/// for them (the Table 1 smoke sweep with `--max-parallel 2` on 2 cores: DAR runs 7.3-11.8 s each
/// instead of 1.5 s). None: one run at a time, or the user set OMP_NUM_THREADS.
pub(super) fn cpu_threads_per_run(slots: usize, cores: usize, user_set: bool) -> Option<usize> {
    (slots > 1 && !user_set).then(|| (cores / slots).max(1))
}

/// Run `exe train SPEC --quiet` for one run, its stdout and stderr appended to `<run dir>/train.log`;
/// `threads`: its CPU threads (OMP_NUM_THREADS), when it shares the machine's cores with others.
fn launch(run: &PlannedRun, gpu: Option<&str>, threads: Option<usize>, exe: &Path) -> Launched {
    let log = run.dir.join("train.log");
    let start = Instant::now();
    let failed = |exit, msg: String| Launched { exit, wall_s: start.elapsed().as_secs_f64(), failure: Some(msg), log: log.clone(), end: End::Exited };
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
    if let Some(t) = threads {
        cmd.env("OMP_NUM_THREADS", t.to_string()).env("MKL_NUM_THREADS", t.to_string());
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
    crate::train::launch::die_with_parent(&mut cmd);
    let status = cmd.stdout(out).stderr(err).spawn().and_then(|mut child| wait_passing_on_stop(&mut child));
    let wall_s = start.elapsed().as_secs_f64();
    match status {
        Ok((s, _)) if s.success() => Launched { exit: s.code(), wall_s, failure: None, log, end: End::Exited },
        Ok((s, stopped)) => {
            let tail = tail_since(&log, offset, 15);
            let code = s.code();
            // A Ctrl-C in the terminal reaches the child directly, maybe before we pass it on.
            let end = if stopped || stopped_by().is_some() {
                End::Stopped
            } else if code == Some(crate::train::lock::BUSY_EXIT) {
                End::Busy
            } else {
                End::Exited
            };
            Launched { exit: code, wall_s, failure: Some(if code.is_none() { format!("killed by a signal ({s})\n{tail}") } else { tail }), log, end }
        }
        Err(e) => {
            let _ = writeln!(file, "could not start {}: {e}", exe.display());
            Launched { exit: None, wall_s, failure: Some(format!("could not start {}: {e}", exe.display())), log, end: End::Exited }
        }
    }
}

/// Wait for `child`; once the sweep is asked to stop, pass the signal on to it (once) and keep
/// waiting. Returns its status and whether it was signalled.
fn wait_passing_on_stop(child: &mut std::process::Child) -> std::io::Result<(std::process::ExitStatus, bool)> {
    let mut passed = false;
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok((s, passed));
        }
        if let (Some(sig), false) = (stopped_by(), passed) {
            // SAFETY: kill on our own child's pid (not yet reaped, so not reused).
            unsafe { libc::kill(child.id() as libc::pid_t, sig) };
            passed = true;
        }
        std::thread::sleep(Duration::from_millis(50));
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
