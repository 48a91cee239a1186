//! Progress bars (indicatif) that stay silent in quiet mode. Where stderr is not a terminal (a Slurm
//! log, `nohup`, a pipe), a bar is a plain line at most every `LOG_EVERY` instead of nothing, so the
//! log of a long job says how far it is.
use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle, TermLike};

const LOG_EVERY: Duration = Duration::from_secs(30);

pub fn bar(len: u64, what: &str, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_prefix(what.to_string());
    if std::io::stderr().is_terminal() {
        pb.set_style(ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed} < {eta})").expect("valid template").progress_chars("=> "));
    } else {
        pb.set_style(ProgressStyle::with_template("{prefix}: {pos}/{len} {msg} ({elapsed} elapsed, about {eta} left)").expect("valid template"));
        // Last, so that setting it up draws nothing: the first line is the first real state.
        pb.set_draw_target(ProgressDrawTarget::term_like_with_hz(Box::new(LogLines::new(LOG_EVERY)), 1));
    }
    pb
}

/// A "terminal" that writes a bar's rendering as one stderr line when at least `every` has passed
/// since the last one it wrote (the first always), and drops the rest.
#[derive(Debug)]
struct LogLines {
    every: Duration,
    last: Mutex<Option<Instant>>,
}

impl LogLines {
    fn new(every: Duration) -> LogLines {
        LogLines { every, last: Mutex::new(None) }
    }

    /// Whether a rendering arriving now is to be written (and if so, it counts as written).
    fn due(&self, line: &str) -> bool {
        if line.trim().is_empty() {
            return false;
        }
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if last.is_some_and(|t| now.duration_since(t) < self.every) {
            return false;
        }
        *last = Some(now);
        true
    }

    fn emit(&self, line: &str) -> std::io::Result<()> {
        if self.due(line) {
            eprintln!("{}", line.trim_end());
        }
        Ok(())
    }
}

impl TermLike for LogLines {
    fn width(&self) -> u16 {
        160
    }
    fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn write_line(&self, s: &str) -> std::io::Result<()> {
        self.emit(s)
    }
    fn write_str(&self, s: &str) -> std::io::Result<()> {
        self.emit(s)
    }
    fn clear_line(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines_write_the_first_rendering_then_at_most_one_per_interval() {
        let minute = Duration::from_secs(60);
        let log = LogLines::new(minute);
        assert!(!log.due("   "), "a blank rendering (a cleared line) is never written");
        assert!(log.due("wiki: 1/10"));
        assert!(!log.due("wiki: 2/10"), "a second rendering within the interval is dropped");
        // The interval has passed since the last line written.
        *log.last.lock().unwrap() = Some(Instant::now() - 2 * minute);
        assert!(log.due("wiki: 3/10"));
        assert!(!log.due("wiki: 4/10"));
    }
}
