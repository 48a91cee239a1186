//! One writer per run directory: an exclusive advisory `flock` on `<run>/lock`, taken before the
//! first write and held until the process ends. The kernel drops the lock when the process dies
//! (any signal, SIGKILL included), so a crash never leaves a stale lock to clean up by hand. The
//! file holds the holder's pid and host, for the message a second writer gets.
//!
//! Writers (`train`, `linearize`, `finetune`) take it through `RunDir::prepare` /
//! `stages::prepare_dir`; readers (`eval`, `report`, `generate`) never do. Under data parallelism
//! only rank 0 prepares the directory, so rank 0 holds it. flock works on local disks and on NFSv4
//! (Linux maps it onto NFS byte-range locks), which is what cluster home and scratch file systems are.
use crate::{Error, IoContext, Result};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The lock file's name inside a run directory.
pub const FILE: &str = "lock";

/// Exit status of a command refused because another process holds the run directory
/// (EX_TEMPFAIL: try again later). `attnlab sweep` reports such a run as busy, not failed.
pub const BUSY_EXIT: i32 = 75;

/// A held lock; dropping it (or the process ending) releases it.
#[derive(Debug)]
pub struct RunLock {
    file: File,
    pub path: PathBuf,
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    if unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) } != 0 {
        return "unknown host".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// `flock(fd, op | LOCK_NB)`: Ok(true) when taken, Ok(false) when another open file holds it.
fn try_flock(file: &File, op: libc::c_int) -> std::io::Result<bool> {
    loop {
        // SAFETY: a valid open descriptor; flock has no memory effects.
        if unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) } == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => return Ok(false),
            Some(libc::EINTR) => continue,
            _ => return Err(e),
        }
    }
}

/// What the lock file says about its holder ("pid 123 on host node7"), or a placeholder while the
/// holder has not written it yet.
fn describe_holder(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let text = text.trim();
    if text.is_empty() {
        "pid unknown: it is starting".into()
    } else {
        text.to_string()
    }
}

/// The error for a run directory another process holds, naming it by its absolute path (on a
/// cluster a relative one does not say which directory).
pub fn busy(dir: &Path, holder: String) -> Error {
    Error::Busy { dir: dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf()), holder }
}

impl RunLock {
    /// Take the lock of run directory `dir` (which must exist), or fail at once with
    /// `Error::Busy` naming the directory and the holder's pid and host.
    pub fn try_acquire(dir: &Path) -> Result<RunLock> {
        let path = dir.join(FILE);
        // Never truncate on open: the file's text is the current holder's until we own the lock.
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).at(&path)?;
        if !try_flock(&file, libc::LOCK_EX).at(&path)? {
            return Err(busy(dir, describe_holder(&path)));
        }
        let me = format!("pid {} on host {}\n", std::process::id(), hostname());
        file.set_len(0).at(&path)?;
        file.write_all_at(me.as_bytes(), 0).at(&path)?;
        (&file).flush().at(&path)?;
        Ok(RunLock { file, path })
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        // Closing the descriptor releases the lock; the file stays (deleting it would let a third
        // process lock a fresh inode while a second one still waits on the old).
        // SAFETY: a valid descriptor.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// Who holds `dir`'s lock now ("pid 123 on host node7"), or None when nobody does. Probes with a
/// shared lock that is released at once, so it never blocks a writer for longer than the probe.
pub fn holder(dir: &Path) -> Option<String> {
    let path = dir.join(FILE);
    let file = File::open(&path).ok()?;
    match try_flock(&file, libc::LOCK_SH) {
        Ok(true) => None, // dropped (closed) right here: released
        Ok(false) => Some(describe_holder(&path)),
        Err(_) => None,
    }
}

/// Locks this process holds, one per run directory (by canonical path): a writer keeps its lock
/// for the life of the process, and taking it again for the same directory (a run trained twice in
/// one process, as the resume tests do) is a no-op.
static HELD: Mutex<Vec<(PathBuf, RunLock)>> = Mutex::new(Vec::new());

/// Hold `dir`'s lock until this process ends (see `RunLock::try_acquire` for the errors).
pub fn hold(dir: &Path) -> Result<()> {
    let key = dir.canonicalize().at(dir)?;
    let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    if held.iter().any(|(p, _)| *p == key) {
        return Ok(());
    }
    let lock = RunLock::try_acquire(dir)?;
    held.push((key, lock));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_writer_is_refused_naming_dir_pid_and_host_until_the_first_lets_go() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        assert_eq!(holder(dir), None, "no lock file: nobody holds it");
        let first = RunLock::try_acquire(dir).unwrap();
        let me = format!("pid {} on host {}", std::process::id(), hostname());
        assert_eq!(holder(dir).as_deref(), Some(me.as_str()));
        // A second open file description conflicts, even in the same process (flock semantics).
        let err = RunLock::try_acquire(dir).unwrap_err();
        assert!(matches!(err, Error::Busy { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains(&dir.display().to_string()) && msg.contains(&me), "{msg}");
        // The probe took and released a shared lock: the holder is unaffected.
        assert!(RunLock::try_acquire(dir).is_err());
        drop(first);
        assert_eq!(holder(dir), None);
        let again = RunLock::try_acquire(dir).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join(FILE)).unwrap().trim(), me);
        drop(again);
    }

    #[test]
    fn hold_is_reentrant_within_a_process_and_blocks_other_lockers() {
        let tmp = tempfile::tempdir().unwrap();
        hold(tmp.path()).unwrap();
        hold(tmp.path()).unwrap();
        assert!(matches!(RunLock::try_acquire(tmp.path()), Err(Error::Busy { .. })));
    }

    #[test]
    fn a_lock_held_by_another_process_is_reported_busy() {
        // util-linux `flock` holds the lock from a separate process, as a second `attnlab train`
        // would see it (-o: only flock itself holds it, not its `sleep`).
        let tmp = tempfile::tempdir().unwrap();
        let lockfile = tmp.path().join(FILE);
        let Ok(mut child) = std::process::Command::new("flock").arg("-o").arg(&lockfile).args(["sleep", "30"]).spawn() else {
            eprintln!("skipped: no `flock` utility");
            return;
        };
        let t = std::time::Instant::now();
        while holder(tmp.path()).is_none() && t.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let err = RunLock::try_acquire(tmp.path());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(matches!(err, Err(Error::Busy { .. })), "{err:?}");
        // The holder died: the kernel released its lock, no stale lock left. (flock's child shares
        // the lock between its fork and closing the descriptor (-o): allow it that moment, which a
        // loaded machine can stretch.)
        let t = std::time::Instant::now();
        while holder(tmp.path()).is_some() && t.elapsed().as_secs() < 5 {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(holder(tmp.path()), None);
        RunLock::try_acquire(tmp.path()).unwrap();
    }
}
