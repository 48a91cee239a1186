//! Progress bars (indicatif) that stay silent in quiet mode and when stderr is not a terminal.
use indicatif::{ProgressBar, ProgressStyle};

pub fn bar(len: u64, what: &str, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_style(ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed} < {eta})").expect("valid template").progress_chars("=> "));
    pb.set_prefix(what.to_string());
    pb
}
