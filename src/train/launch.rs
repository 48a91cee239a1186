//! `attnlab train --gpus 0,1`: start one worker process per device (this same executable with the
//! same arguments, torchrun-style environment) and watch them. The first worker to fail stops the
//! others, and the error names it, how it ended and the checkpoint a re-run resumes from.
use super::checkpoint;
use crate::{Error, Result};
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// Device names of `--gpus` / `train.devices` entries: `0` → `cuda:0`; `cuda:N` and `cpu` as is.
pub fn device_names(list: &[String]) -> Result<Vec<String>> {
    list.iter()
        .map(|d| {
            let d = d.trim();
            if d == "cpu" || d.strip_prefix("cuda:").is_some_and(|n| n.parse::<u32>().is_ok()) {
                Ok(d.to_string())
            } else if d.parse::<u32>().is_ok() {
                Ok(format!("cuda:{d}"))
            } else {
                Err(Error::Other(format!("device `{d}` in --gpus / train.devices: use a GPU index (0), cuda:N, or cpu")))
            }
        })
        .collect()
}

/// Make `cmd`'s child get SIGTERM when the thread that spawns it (and waits for it) ends, which
/// is when this process dies (the data-parallel launcher and `attnlab sweep` use it).
pub fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: getpid before the fork; prctl, getppid and _exit are async-signal-safe, as
    // pre_exec requires.
    let parent = unsafe { libc::getpid() };
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            // The parent died between fork and prctl: the signal will never come.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

/// A free TCP port on loopback for rank 0's store (the kernel picks it; released at once).
fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| Error::Other(format!("no free port for the rendezvous: {e}")))?;
    Ok(l.local_addr().map_err(|e| Error::Other(e.to_string()))?.port())
}

/// Run `exe args` once per device with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT
/// set (and CUDA_VISIBLE_DEVICES pinning each GPU worker to its GPU), until all succeed or one fails.
/// `run_dir` is named in the failure message with its newest complete checkpoint.
pub fn launch(exe: &Path, args: &[std::ffi::OsString], devices: &[String], run_dir: Option<&Path>) -> Result<()> {
    // Rank 0 takes the run directory's lock; refuse before starting any worker when it is taken.
    if let Some(holder) = run_dir.and_then(super::lock::holder) {
        return Err(super::lock::busy(run_dir.expect("checked"), holder));
    }
    let port = free_port()?;
    let world = devices.len();
    // A GPU index means the parent's numbering: map it through the parent's CUDA_VISIBLE_DEVICES.
    let visible: Option<Vec<String>> = std::env::var("CUDA_VISIBLE_DEVICES").ok().map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
    let mut children: Vec<(usize, String, Child)> = Vec::new();
    for (rank, dev) in devices.iter().enumerate() {
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string());
        if let Some(i) = dev.strip_prefix("cuda:") {
            let gpu = match &visible {
                Some(v) => v.get(i.parse::<usize>().expect("checked")).cloned().ok_or_else(|| Error::Other(format!("{dev}: CUDA_VISIBLE_DEVICES lists only {} GPUs", v.len())))?,
                None => i.to_string(),
            };
            cmd.env("CUDA_VISIBLE_DEVICES", gpu);
        }
        // A worker must not outlive the launcher (killed by `timeout`, the batch system or a
        // crash): the kernel sends it SIGTERM when the launcher dies.
        die_with_parent(&mut cmd);
        match cmd.spawn() {
            Ok(c) => children.push((rank, dev.clone(), c)),
            Err(e) => {
                stop_all(&mut children);
                return Err(Error::Other(format!("could not start worker {rank} ({}): {e}", exe.display())));
            }
        }
    }
    let mut running = world;
    loop {
        for i in 0..children.len() {
            let (rank, dev) = (children[i].0, children[i].1.clone());
            let status = match children[i].2.try_wait() {
                Ok(Some(s)) => s,
                Ok(None) => continue,
                Err(e) => {
                    stop_all(&mut children);
                    return Err(Error::Other(format!("lost track of worker {rank}: {e}")));
                }
            };
            children[i].0 = usize::MAX; // reaped
            if status.success() {
                running -= 1;
                continue;
            }
            let pid = children[i].2.id();
            stop_all(&mut children);
            use std::os::unix::process::ExitStatusExt;
            let how = match (status.code(), status.signal()) {
                (Some(c), _) => format!("exited with status {c}"),
                (None, Some(s)) => format!("was killed by signal {s}"),
                _ => "ended".into(),
            };
            let resume = match run_dir {
                Some(d) => match checkpoint::list(d).pop() {
                    Some((s, _)) => format!("; the last complete checkpoint is step {s} in {}: run the same command again to resume (with any number of workers dividing the global batch)", d.display()),
                    None => format!("; {} has no complete checkpoint yet", d.display()),
                },
                None => String::new(),
            };
            return Err(Error::Other(format!("data-parallel worker rank {rank} (pid {pid}, {dev}) {how}; stopped the other {} worker(s){resume}", world - 1)));
        }
        children.retain(|c| c.0 != usize::MAX);
        if running == 0 {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SIGTERM every live worker, then SIGKILL whatever is left after 5 s.
fn stop_all(children: &mut [(usize, String, Child)]) {
    let live = |c: &&mut (usize, String, Child)| c.0 != usize::MAX;
    for c in children.iter_mut().filter(live) {
        unsafe { libc::kill(c.2.id() as i32, libc::SIGTERM) };
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for c in children.iter_mut().filter(live) {
        while Instant::now() < deadline && matches!(c.2.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.2.kill();
        let _ = c.2.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The child of a thread that ends gets SIGTERM (PR_SET_PDEATHSIG fires when the spawning
    /// thread ends; a process's death ends all its threads), so no worker outlives its launcher.
    #[test]
    fn a_child_gets_sigterm_when_its_spawning_thread_ends() {
        use std::os::unix::process::ExitStatusExt;
        let mut child = std::thread::spawn(|| {
            let mut cmd = Command::new("sleep");
            cmd.arg("30");
            die_with_parent(&mut cmd);
            cmd.spawn().unwrap()
        })
        .join()
        .unwrap();
        let t = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if t.elapsed() > Duration::from_secs(10) {
                child.kill().unwrap();
                panic!("the child outlived the thread that started it");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(status.signal(), Some(libc::SIGTERM));
    }
}
