//! Running model-written Python (MBPP's pass@1) in a sandboxed subprocess.
//!
//! Each program runs as `python3 -I -` (isolated mode: no user site-packages, no PYTHON* variables)
//! with the code on stdin and:
//! - a fresh scratch directory (deleted afterwards) as cwd and HOME, and an environment cleared to
//!   PATH, HOME, LANG (no proxies, no credentials);
//! - its own process group, killed as a whole (SIGKILL) on timeout and again after it exits, so
//!   forked children die with it;
//! - rlimits set in the child before exec: RLIMIT_CPU (CPU seconds), RLIMIT_AS (address space),
//!   RLIMIT_NPROC (the user's current process count + a small margin: stops fork bombs),
//!   RLIMIT_FSIZE (largest file it may write), RLIMIT_CORE 0;
//! - no network: a new network namespace (only a down loopback inside): `unshare(CLONE_NEWUSER |
//!   CLONE_NEWNET)` as an ordinary user, `unshare(CLONE_NEWNET)` as root. Where the kernel refuses,
//!   the program runs without network isolation and `Outcome::network_isolated` says so;
//! - as root (containers, GPU hosts), the program runs as `nobody` (uid/gid 65534, no supplementary
//!   groups): root ignores RLIMIT_NPROC and could read every file.
//!
//! Not a full jail: as an ordinary user the program runs with that user's uid and could read that
//! user's files by absolute path. Run untrusted evaluations on a machine without secrets.
use crate::{Error, Result};
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Wall-clock limit; the process group is killed when it passes.
    pub wall: Duration,
    /// RLIMIT_CPU in seconds.
    pub cpu_s: u64,
    /// RLIMIT_AS in bytes.
    pub memory_bytes: u64,
    /// Processes the program may add beyond the user's current count (RLIMIT_NPROC).
    pub extra_processes: u64,
    /// RLIMIT_FSIZE in bytes.
    pub file_bytes: u64,
}

impl Default for Limits {
    /// HF `code_eval` uses a 3 s timeout; we allow 10 s wall and CPU, 1 GiB, 8 processes, 16 MiB files.
    fn default() -> Self {
        Limits { wall: Duration::from_secs(10), cpu_s: 10, memory_bytes: 1 << 30, extra_processes: 8, file_bytes: 16 << 20 }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Passed,
    /// Non-zero exit (an assertion, an exception, a syntax error).
    Failed,
    /// Killed at the wall-clock limit.
    Timeout,
    /// Ended by a signal (RLIMIT_CPU sends SIGXCPU / SIGKILL).
    Killed,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Outcome {
    pub status: Status,
    pub seconds: f64,
    pub network_isolated: bool,
    /// The end of stderr (for debugging failures).
    pub stderr_tail: String,
    /// The program's process group (killed when it ended).
    #[serde(skip)]
    pub pgid: i32,
}

/// The uid the program runs as: ours, or `nobody` (65534) when we are root — root ignores
/// RLIMIT_NPROC and could read every file, so the sandbox drops to an unprivileged uid.
fn sandbox_uid() -> (u32, bool) {
    let euid = unsafe { libc::geteuid() };
    if euid == 0 {
        (NOBODY, true)
    } else {
        (euid, false)
    }
}

const NOBODY: u32 = 65534;

/// Tasks (processes and threads) whose real uid is `uid`: what RLIMIT_NPROC counts.
pub fn user_tasks(uid: u32) -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0 };
    let mut n = 0;
    for e in dir.flatten() {
        if !e.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(s) = std::fs::read_to_string(e.path().join("status")) else { continue };
        let field = |name: &str| s.lines().find(|l| l.starts_with(name)).and_then(|l| l.split_whitespace().nth(1)).and_then(|x| x.parse::<u64>().ok());
        if field("Uid:") == Some(u64::from(uid)) {
            n += field("Threads:").unwrap_or(1);
        }
    }
    n
}

fn set_limit(resource: libc::__rlimit_resource_t, value: u64) -> std::io::Result<()> {
    let lim = libc::rlimit { rlim_cur: value as libc::rlim_t, rlim_max: value as libc::rlim_t };
    if unsafe { libc::setrlimit(resource, &lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn check(r: libc::c_int) -> std::io::Result<()> {
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn command(scratch: &std::path::Path, limits: Limits, nproc: u64, isolate_network: bool) -> Command {
    let mut cmd = Command::new("python3");
    cmd.args(["-I", "-"])
        .current_dir(scratch)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", scratch)
        .env("LANG", "C.UTF-8")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0);
    let cpu = limits.cpu_s.max(1);
    let (uid, drop_root) = sandbox_uid();
    unsafe {
        cmd.pre_exec(move || {
            // Only async-signal-safe calls here: we are between fork and exec.
            if drop_root {
                // Root may make a network namespace directly, then becomes `nobody`.
                if isolate_network {
                    check(libc::unshare(libc::CLONE_NEWNET))?;
                }
                check(libc::setgroups(0, std::ptr::null()))?;
                check(libc::setgid(uid))?;
                check(libc::setuid(uid))?;
            } else if isolate_network {
                check(libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNET))?;
            }
            set_limit(libc::RLIMIT_CPU, cpu)?;
            set_limit(libc::RLIMIT_AS, limits.memory_bytes)?;
            set_limit(libc::RLIMIT_FSIZE, limits.file_bytes)?;
            set_limit(libc::RLIMIT_CORE, 0)?;
            set_limit(libc::RLIMIT_NPROC, nproc)?;
            Ok(())
        });
    }
    cmd
}

/// Run `program` under `limits`.
pub fn run_python(program: &str, limits: Limits) -> Result<Outcome> {
    let scratch = tempfile::Builder::new().prefix("attnlab-sandbox-").tempdir().map_err(|e| Error::Other(format!("sandbox scratch directory: {e}")))?;
    let (uid, drop_root) = sandbox_uid();
    if drop_root {
        // `nobody` must be able to work in its scratch directory.
        let c = std::ffi::CString::new(scratch.path().as_os_str().as_encoded_bytes()).map_err(|e| Error::Other(format!("sandbox: {e}")))?;
        if unsafe { libc::chown(c.as_ptr(), uid, uid) } != 0 {
            return Err(Error::Other(format!("sandbox: chown {}: {}", scratch.path().display(), std::io::Error::last_os_error())));
        }
    }
    let nproc = user_tasks(uid) + limits.extra_processes;
    let t0 = Instant::now();
    let (mut child, isolated) = match command(scratch.path(), limits, nproc, true).spawn() {
        Ok(c) => (c, true),
        // EPERM / EINVAL / ENOSPC: no unprivileged user namespaces here; run without them.
        Err(_) => (command(scratch.path(), limits, nproc, false).spawn().map_err(|e| Error::Other(format!("sandbox: cannot start python3: {e}")))?, false),
    };
    let pgid = child.id() as i32;
    let kill_group = || unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    };
    if let Some(mut stdin) = child.stdin.take() {
        // A program that dies at once closes the pipe: that is its result, not our error.
        let _ = stdin.write_all(program.as_bytes());
    }
    // Read stderr on a thread so a chatty program cannot block on a full pipe.
    let mut stderr = child.stderr.take();
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(s) = stderr.as_mut() {
            let _ = std::io::Read::read_to_end(&mut std::io::Read::take(s, 1 << 20), &mut buf);
        }
        buf
    });
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) if t0.elapsed() >= limits.wall => break None,
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => {
                kill_group();
                return Err(Error::Other(format!("sandbox: waiting for python3: {e}")));
            }
        }
    };
    // Kill the whole group either way: children a program forked must not outlive it.
    kill_group();
    let _ = child.wait();
    let seconds = t0.elapsed().as_secs_f64();
    let err = reader.join().unwrap_or_default();
    let text = String::from_utf8_lossy(&err);
    let stderr_tail: String = text.chars().rev().take(400).collect::<Vec<_>>().into_iter().rev().collect();
    let status = match status {
        None => Status::Timeout,
        Some(st) if st.success() => Status::Passed,
        Some(st) if st.code().is_none() => Status::Killed,
        Some(_) => Status::Failed,
    };
    Ok(Outcome { status, seconds, network_isolated: isolated, stderr_tail, pgid })
}

/// MBPP's check program (HF code_eval): the completion, a newline, then the test asserts.
pub fn mbpp_program(completion: &str, tests: &str) -> String {
    format!("{completion}\n{tests}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Live (not zombie) processes whose process group is `pgid`.
    fn live_in_group(pgid: i32) -> usize {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
            .filter(|s| {
                // pid (comm) state ppid pgrp …; comm may hold spaces, so split after the last ')'.
                let rest: Vec<&str> = s.rsplit_once(')').map_or("", |x| x.1).split_whitespace().collect();
                rest.len() > 2 && rest[0] != "Z" && rest[2].parse::<i32>().ok() == Some(pgid)
            })
            .count()
    }

    fn quick() -> Limits {
        Limits { wall: Duration::from_millis(1500), cpu_s: 1, memory_bytes: 512 << 20, extra_processes: 8, file_bytes: 1 << 20 }
    }

    #[test]
    fn passes_a_correct_solution_and_fails_a_wrong_one() {
        let tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0";
        let ok = run_python(&mbpp_program("def add(a, b):\n    return a + b", tests), quick()).unwrap();
        assert_eq!(ok.status, Status::Passed, "{ok:?}");
        let bad = run_python(&mbpp_program("def add(a, b):\n    return a * b", tests), quick()).unwrap();
        assert_eq!(bad.status, Status::Failed, "{bad:?}");
        assert!(bad.stderr_tail.contains("AssertionError"), "{bad:?}");
        let syntax = run_python("def f(:\n", quick()).unwrap();
        assert_eq!(syntax.status, Status::Failed);
    }

    /// A busy loop is stopped by RLIMIT_CPU (1 s) or the wall limit (1.5 s), well within 3 s.
    #[test]
    fn kills_an_infinite_loop() {
        let t0 = Instant::now();
        let o = run_python("while True:\n    pass\n", quick()).unwrap();
        assert!(matches!(o.status, Status::Killed | Status::Timeout), "{o:?}");
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        // A sleeping loop uses no CPU: only the wall limit stops it.
        let o = run_python("import time\nwhile True:\n    time.sleep(0.01)\n", quick()).unwrap();
        assert_eq!(o.status, Status::Timeout, "{o:?}");
        assert!(o.seconds < 2.5, "{o:?}");
    }

    /// A fork bomb hits RLIMIT_NPROC, is killed with its whole process group, and leaves no process behind.
    #[test]
    fn kills_a_fork_bomb() {
        let bomb = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n";
        let t0 = Instant::now();
        let o = run_python(bomb, quick()).unwrap();
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        assert!(matches!(o.status, Status::Killed | Status::Timeout), "{o:?}");
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(live_in_group(o.pgid), 0, "processes of the bomb's group outlived it");
    }

    /// Writes land in the scratch directory, which is removed; files beyond RLIMIT_FSIZE fail.
    #[test]
    fn scratch_cwd_environment_and_file_limit() {
        let probe = "import os\nassert os.path.basename(os.getcwd()).startswith('attnlab-sandbox-')\nassert os.environ.get('HOME') == os.getcwd()\nassert 'HTTP_PROXY' not in os.environ and 'https_proxy' not in os.environ\nopen('x', 'w').write('hi')\n";
        let o = run_python(probe, quick()).unwrap();
        assert_eq!(o.status, Status::Passed, "{o:?}");
        let big = run_python("open('big', 'wb').write(b'0' * (4 << 20))\n", quick()).unwrap();
        assert_ne!(big.status, Status::Passed, "a 4 MiB write must exceed the 1 MiB RLIMIT_FSIZE");
        if o.network_isolated {
            let net = run_python("import socket\ns = socket.socket()\ns.settimeout(0.5)\ns.connect(('1.1.1.1', 80))\n", quick()).unwrap();
            assert_eq!(net.status, Status::Failed, "connect must fail inside the network namespace: {net:?}");
        }
    }
}
