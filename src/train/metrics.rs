//! metrics.jsonl: one JSON object per line, appended as the run goes. This module is its only
//! writer and its only reader.
//!
//! Writing: each row is one `write()` of the whole line on a file opened with O_APPEND, so the
//! kernel places it at the end in one piece; a row is never split by another writer or by a
//! signal between two pieces. A writer killed mid-write (or a full disk) can still leave a
//! partial last line: the next append ends that line first, so only the broken row is lost.
//!
//! Reading: a line that is not a JSON object is skipped with a warning naming the file and line
//! (on stderr, and returned for reports), never silently.
use crate::{IoContext, Result};
use serde_json::{Map, Value};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Append `row` as one line of `path` (created if missing).
pub fn append(path: &Path, row: &Map<String, Value>) -> Result<()> {
    let mut line = serde_json::to_string(row)?;
    line.push('\n');
    let f = std::fs::OpenOptions::new().create(true).append(true).read(true).open(path).at(path)?;
    let len = f.metadata().at(path)?.len();
    if len > 0 {
        let mut last = [0u8];
        f.read_exact_at(&mut last, len - 1).at(path)?;
        if last[0] != b'\n' {
            line.insert(0, '\n');
        }
    }
    crate::train::fault::io("metrics", row.get("step").and_then(Value::as_u64), path)?;
    (&f).write_all(line.as_bytes()).at(path)
}

/// Where [`set_aside_after`] keeps the rows a restarted run writes again.
pub const DISCARDED: &str = "metrics.discarded.jsonl";

/// Make `path` hold only what a restarted run keeps: the rows up to step `kept` (the checkpoint it
/// resumes from), none when it starts over (`None`). The other rows, and lines that do not parse,
/// are appended to [`DISCARDED`] beside it (an earlier attempt is never lost) before `path` is
/// replaced by its kept rows (a temporary file renamed over it, so a crash leaves one or the other).
/// Without this, a run started over on a folder with rows of an earlier attempt (its checkpoints
/// gone) would append a second curve to the first, and a report (a later row wins at a step) would
/// stitch the two. Returns how many lines were set aside.
pub fn set_aside_after(path: &Path, kept: Option<u64>) -> Result<usize> {
    let text = match std::fs::read(path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(crate::Error::io(path, e)),
    };
    let keeps = |line: &str| {
        let step = serde_json::from_str::<Value>(line).ok().and_then(|v| v.get("step").and_then(Value::as_u64));
        matches!((step, kept), (Some(s), Some(k)) if s <= k)
    };
    let (keep, aside): (Vec<&str>, Vec<&str>) = text.lines().filter(|l| !l.trim().is_empty()).partition(|l| keeps(l));
    if aside.is_empty() {
        return Ok(0);
    }
    let discarded = path.with_file_name(DISCARDED);
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&discarded).at(&discarded)?;
    f.write_all(aside.iter().map(|l| format!("{l}\n")).collect::<String>().as_bytes()).at(&discarded)?;
    f.sync_all().at(&discarded)?;
    let tmp = path.with_extension("jsonl.tmp");
    let mut t = std::fs::File::create(&tmp).at(&tmp)?;
    t.write_all(keep.iter().map(|l| format!("{l}\n")).collect::<String>().as_bytes()).at(&tmp)?;
    t.sync_all().at(&tmp)?;
    std::fs::rename(&tmp, path).at(path)?;
    Ok(aside.len())
}

/// The rows of a metrics file: (1-based line number, object); `warnings` names every line skipped.
#[derive(Debug, Default)]
pub struct Rows {
    pub rows: Vec<(usize, Map<String, Value>)>,
    pub warnings: Vec<String>,
}

/// Read `path` (a missing file has no rows). Malformed lines are skipped; each is warned about on
/// stderr and listed in `warnings` as "<file> line N: …".
pub fn read(path: &Path) -> Result<Rows> {
    let mut out = Rows::default();
    let text = match std::fs::read(path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(crate::Error::io(path, e)),
    };
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(line) {
            Ok(Value::Object(obj)) => out.rows.push((i + 1, obj)),
            other => {
                let why = match other {
                    Err(e) => format!("not JSON ({e})"),
                    Ok(_) => "not a JSON object".into(),
                };
                let w = format!("{} line {}: {why}; line skipped", path.display(), i + 1);
                eprintln!("warning: {w}");
                out.warnings.push(w);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn set_aside_keeps_rows_up_to_the_resume_step_and_moves_the_rest() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("metrics.jsonl");
        assert_eq!(set_aside_after(&p, Some(3)).unwrap(), 0, "missing file: nothing to move");
        std::fs::write(&p, "{\"step\": 0}\n{\"step\": 2, \"loss\": 1.5}\n\n{\"step\": 4}\n{\"step\": 2, \"eval\": 1}\n{\"step\": 5, \"lo").unwrap();
        assert_eq!(set_aside_after(&p, Some(2)).unwrap(), 2);
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "{\"step\": 0}\n{\"step\": 2, \"loss\": 1.5}\n{\"step\": 2, \"eval\": 1}\n");
        let d = tmp.path().join(DISCARDED);
        assert_eq!(std::fs::read_to_string(&d).unwrap(), "{\"step\": 4}\n{\"step\": 5, \"lo\n");
        assert_eq!(set_aside_after(&p, Some(2)).unwrap(), 0, "nothing past the step any more");
        // Starting over: every row goes, after the ones set aside before.
        assert_eq!(set_aside_after(&p, None).unwrap(), 3);
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "");
        assert_eq!(std::fs::read_to_string(&d).unwrap().lines().count(), 5);
        append(&p, &obj(json!({"step": 1}))).unwrap();
        assert_eq!(read(&p).unwrap().rows.len(), 1);
    }

    #[test]
    fn malformed_lines_are_skipped_with_a_warning_naming_file_and_line() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("metrics.jsonl");
        assert!(read(&p).unwrap().rows.is_empty(), "missing file: no rows");
        // Line 2 is two rows interleaved by two writers; line 4 is valid JSON but not an object.
        std::fs::write(&p, "{\"step\": 1, \"loss\": 3.0}\n{\"step\": 2, \"lo{\"step\": 2, \"loss\": 2.9}ss\": 2.5}\n\n[1, 2]\n{\"step\": 3, \"loss\": 2.0}\n").unwrap();
        let r = read(&p).unwrap();
        assert_eq!(r.rows.iter().map(|(l, o)| (*l, o["step"].as_u64().unwrap())).collect::<Vec<_>>(), [(1, 1), (5, 3)]);
        assert_eq!(r.warnings.len(), 2, "{:?}", r.warnings);
        assert!(r.warnings[0].contains(&p.display().to_string()) && r.warnings[0].contains("line 2"), "{:?}", r.warnings);
        assert!(r.warnings[1].contains("line 4") && r.warnings[1].contains("not a JSON object"), "{:?}", r.warnings);
    }

    #[test]
    fn an_append_after_a_torn_last_line_starts_a_new_line() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("metrics.jsonl");
        append(&p, &obj(json!({"step": 1, "loss": 3.0}))).unwrap();
        // A writer killed mid-row left this without its newline.
        std::fs::OpenOptions::new().append(true).open(&p).unwrap().write_all(b"{\"step\": 2, \"lo").unwrap();
        append(&p, &obj(json!({"step": 2, "loss": 2.5}))).unwrap();
        let r = read(&p).unwrap();
        assert_eq!(r.rows.iter().map(|(_, o)| o["loss"].as_f64().unwrap()).collect::<Vec<_>>(), [3.0, 2.5]);
        assert_eq!(r.warnings.len(), 1);
        assert!(r.warnings[0].contains("line 2"));
    }

    #[test]
    fn concurrent_appenders_never_interleave_within_a_line() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("metrics.jsonl");
        // Long rows (several KB) make a multi-write row split visibly if the write were not one piece.
        let pad = "x".repeat(3000);
        std::thread::scope(|s| {
            for t in 0..4 {
                let (p, pad) = (&p, &pad);
                s.spawn(move || {
                    for i in 0..200 {
                        append(p, &obj(json!({"step": i, "thread": t, "pad": pad}))).unwrap();
                    }
                });
            }
        });
        let r = read(&p).unwrap();
        assert!(r.warnings.is_empty(), "{:?}", &r.warnings[..r.warnings.len().min(3)]);
        assert_eq!(r.rows.len(), 800);
    }
}
