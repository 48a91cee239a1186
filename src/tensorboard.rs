//! TensorBoard event files beside metrics.jsonl, so that TensorBoard, `wandb sync --sync-tensorboard`
//! and `aim convert tensorboard` read a run's curves without attnlab.
//!
//! One file per run directory, `events.out.tfevents.attnlab` (TensorBoard reads every file whose
//! name contains `tfevents`): TFRecord framing (length, masked CRC32C of the length, an `Event`
//! protobuf, masked CRC32C of the data), first event `file_version: "brain.Event:2"`, then one
//! event per step with a `simple_value` per tag (what PyTorch's SummaryWriter writes).
//!
//! metrics.jsonl stays the source of truth. The file is derived from it so that a resumed run shows
//! one curve: the first row a process logs to a run directory rewrites the file from metrics.jsonl,
//! keeping only steps up to the newest complete checkpoint (the steps after it are trained, and
//! logged, again); later rows are appended, each tag only at steps after the last one it has.
//! `attnlab tensorboard RUN_DIR` rewrites it from everything in metrics.jsonl (last row per step
//! wins, as the report reads it), for runs made before this file existed.
use crate::{Error, IoContext, Result};
use prost::Message;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

pub const FILE_NAME: &str = "events.out.tfevents.attnlab";

/// The parts of TensorBoard's `event.proto` / `summary.proto` / `tensor.proto` that scalars use
/// (field numbers as in tensorflow/core/util/event.proto and framework/summary.proto).
pub mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Event {
        #[prost(double, tag = "1")]
        pub wall_time: f64,
        #[prost(int64, tag = "2")]
        pub step: i64,
        #[prost(oneof = "What", tags = "3, 5")]
        pub what: Option<What>,
    }

    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum What {
        #[prost(string, tag = "3")]
        FileVersion(String),
        #[prost(message, tag = "5")]
        Summary(Summary),
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Summary {
        #[prost(message, repeated, tag = "1")]
        pub value: Vec<Value>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Value {
        #[prost(string, tag = "1")]
        pub tag: String,
        #[prost(message, optional, tag = "9")]
        pub metadata: Option<SummaryMetadata>,
        #[prost(oneof = "Kind", tags = "2, 8")]
        pub value: Option<Kind>,
    }

    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Kind {
        #[prost(float, tag = "2")]
        SimpleValue(f32),
        /// tf.summary (v2) scalars: a rank-0 tensor.
        #[prost(message, tag = "8")]
        Tensor(TensorProto),
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct SummaryMetadata {
        #[prost(message, optional, tag = "1")]
        pub plugin_data: Option<PluginData>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PluginData {
        #[prost(string, tag = "1")]
        pub plugin_name: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TensorProto {
        /// DataType: 1 = float, 2 = double.
        #[prost(int32, tag = "1")]
        pub dtype: i32,
        #[prost(bytes = "vec", tag = "4")]
        pub tensor_content: Vec<u8>,
        #[prost(float, repeated, tag = "5")]
        pub float_val: Vec<f32>,
        #[prost(double, repeated, tag = "6")]
        pub double_val: Vec<f64>,
    }

    impl TensorProto {
        /// The scalar a rank-0 float / double tensor holds.
        pub fn scalar(&self) -> Option<f64> {
            match self.dtype {
                1 => self.float_val.first().map(|&v| v as f64).or_else(|| Some(f32::from_le_bytes(self.tensor_content.get(..4)?.try_into().ok()?) as f64)),
                2 => self.double_val.first().copied().or_else(|| Some(f64::from_le_bytes(self.tensor_content.get(..8)?.try_into().ok()?))),
                _ => None,
            }
        }
    }
}

/// Tag → step → value, and the elapsed seconds known at each step (for wall times).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Scalars {
    pub tags: BTreeMap<String, BTreeMap<i64, f64>>,
    pub elapsed: BTreeMap<i64, f64>,
}

impl Scalars {
    fn insert(&mut self, step: i64, tag: String, v: f64) {
        self.tags.entry(tag).or_default().insert(step, v);
    }

    pub fn points(&self) -> usize {
        self.tags.values().map(BTreeMap::len).sum()
    }
}

/// TensorBoard tags of one metrics.jsonl row (stable names; `step` and text fields are not scalars).
/// `eval/<corpus>/<metric>` keys are kept; held-out losses of the staged commands go under `eval/`
/// too; every other number is `train/<key>` (an array of numbers, `train/<key>/<i>`).
pub fn row_scalars(row: &Map<String, Value>) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for (k, v) in row {
        if k == "step" {
            continue;
        }
        let tag = if k.contains('/') {
            k.clone()
        } else if let Some((who, what)) = k.split_once('_').filter(|(w, m)| ["teacher", "student"].contains(w) && ["loss", "ppl"].contains(m)) {
            format!("eval/{who}/{what}")
        } else {
            match k.as_str() {
                "eval_loss" => "eval/held_out/loss".into(),
                "eval_ppl" => "eval/held_out/ppl".into(),
                "val_loss" => "eval/val/loss".into(),
                _ => format!("train/{k}"),
            }
        };
        match v {
            Value::Number(n) => out.extend(n.as_f64().map(|x| (tag, x))),
            Value::Array(a) => out.extend(a.iter().enumerate().filter_map(|(i, x)| Some((format!("{tag}/{i}"), x.as_f64()?)))),
            _ => {}
        }
    }
    out
}

/// Every scalar of a run directory, at steps ≤ `up_to` (all with None): metrics.jsonl rows (a later
/// row wins at the same step), then eval.json's corpora and tasks/*.json (at the model's step).
pub fn collect(dir: &Path, up_to: Option<i64>) -> Result<Scalars> {
    let mut s = Scalars::default();
    let keep = |step: i64| up_to.is_none_or(|u| step <= u);
    let mp = dir.join("metrics.jsonl");
    if mp.is_file() {
        for (i, line) in std::fs::read_to_string(&mp).at(&mp)?.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let bad = |msg: &str| Error::Data(format!("{}: line {}: {msg}", mp.display(), i + 1));
            // A line cut by a crash mid-write is the only one that may not parse: skip it.
            let Ok(Value::Object(row)) = serde_json::from_str::<Value>(line) else { continue };
            let step = row.get("step").and_then(Value::as_i64).ok_or_else(|| bad("no integer `step`"))?;
            if !keep(step) {
                continue;
            }
            if let Some(e) = row.get("elapsed_s").and_then(Value::as_f64) {
                s.elapsed.insert(step, e);
            }
            for (tag, v) in row_scalars(&row) {
                s.insert(step, tag, v);
            }
        }
    }
    let ep = dir.join("eval.json");
    if let Some(v) = read_json(&ep)? {
        if let (Some(step), Some(corpora)) = (v["step"].as_i64(), v.get("corpora")) {
            if keep(step) {
                let corpora: BTreeMap<String, crate::perplexity::CorpusResult> = serde_json::from_value(corpora.clone()).map_err(|e| Error::Data(format!("{}: {e}", ep.display())))?;
                for (name, r) in corpora {
                    for (tag, x) in r.metrics(&name) {
                        s.insert(step, tag, x);
                    }
                }
            }
        }
    }
    let mut tasks: Vec<PathBuf> = std::fs::read_dir(dir.join("tasks")).into_iter().flatten().flatten().map(|e| e.path()).collect();
    tasks.sort();
    for p in tasks.iter().filter(|p| p.extension().is_some_and(|e| e == "json")) {
        let Some(v) = read_json(p)? else { continue };
        let (Some(task), Some(step), Some(m)) = (v["task"].as_str(), v["model"]["step"].as_i64(), v["metrics"].as_object()) else { continue };
        if keep(step) {
            for (k, x) in m {
                if let Some(x) = x.as_f64() {
                    s.insert(step, format!("tasks/{task}/{}", k.replace(',', "/")), x);
                }
            }
        }
    }
    Ok(s)
}

fn read_json(p: &Path) -> Result<Option<Value>> {
    if !p.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(p).at(p)?;
    serde_json::from_str(&text).map(Some).map_err(|e| Error::Data(format!("{}: {e}", p.display())))
}

/// TFRecord framing of one serialized record.
fn record(data: &[u8]) -> Vec<u8> {
    let mask = |crc: u32| crc.rotate_right(15).wrapping_add(0xa282_ead8);
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&mask(crc32c::crc32c(&len)).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&mask(crc32c::crc32c(data)).to_le_bytes());
    out
}

fn summary_event(wall_time: f64, step: i64, values: &[(String, f64)]) -> proto::Event {
    let value = values.iter().map(|(tag, v)| proto::Value { tag: tag.clone(), metadata: None, value: Some(proto::Kind::SimpleValue(*v as f32)) }).collect();
    proto::Event { wall_time, step, what: Some(proto::What::Summary(proto::Summary { value })) }
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// The bytes of an event file holding `s`: one event per step, tags sorted. Wall times are the run's
/// start (config.yaml's modification time, else `t0`) plus the elapsed seconds logged at that step.
pub fn encode(s: &Scalars, t0: f64) -> Vec<u8> {
    let mut by_step: BTreeMap<i64, Vec<(String, f64)>> = BTreeMap::new();
    for (tag, pts) in &s.tags {
        for (&step, &v) in pts {
            by_step.entry(step).or_default().push((tag.clone(), v));
        }
    }
    let mut out = record(&proto::Event { wall_time: t0, step: 0, what: Some(proto::What::FileVersion("brain.Event:2".into())) }.encode_to_vec());
    let mut wall = t0;
    for (step, values) in by_step {
        // Wall times never go back (elapsed_s is missing on some rows).
        wall = wall.max(t0 + s.elapsed.range(..=step).next_back().map_or(0.0, |e| *e.1));
        out.extend(record(&summary_event(wall, step, &values).encode_to_vec()));
    }
    out
}

fn start_time(dir: &Path) -> f64 {
    let mtime = std::fs::metadata(dir.join("config.yaml")).and_then(|m| m.modified()).ok();
    mtime.and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or_else(now, |d| d.as_secs_f64())
}

/// Write `dir/events.out.tfevents.attnlab` holding `s` (atomically: a temporary file renamed).
pub fn write(dir: &Path, s: &Scalars) -> Result<PathBuf> {
    let path = dir.join(FILE_NAME);
    let tmp = dir.join(format!(".{FILE_NAME}.tmp"));
    std::fs::write(&tmp, encode(s, start_time(dir))).at(&tmp)?;
    std::fs::rename(&tmp, &path).at(&path)?;
    Ok(path)
}

/// `attnlab tensorboard`: rewrite a run directory's event file from all of its metrics.jsonl.
pub fn regenerate(dir: &Path) -> Result<(PathBuf, Scalars)> {
    if !dir.join("metrics.jsonl").is_file() {
        return Err(Error::Run { dir: dir.into(), msg: "has no metrics.jsonl".into() });
    }
    let s = collect(dir, None)?;
    Ok((write(dir, &s)?, s))
}

/// After `attnlab eval` wrote eval.json or tasks/*.json: rebuild the run's event file so that the
/// new numbers show (a warning, never an error, on failure; nothing for a run without metrics.jsonl).
pub fn refresh(dir: &Path) {
    if dir.join("metrics.jsonl").is_file() {
        if let Err(e) = regenerate(dir) {
            eprintln!("warning: TensorBoard event file in {}: {e}", dir.display());
        }
    }
}

/// Run directories (folders holding metrics.jsonl) at or below `root`, sorted.
pub fn find_runs(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if root.join("metrics.jsonl").is_file() {
        out.push(root.to_path_buf());
    }
    let mut subs: Vec<PathBuf> = std::fs::read_dir(root).into_iter().flatten().flatten().map(|e| e.path()).filter(|p| p.is_dir() && !p.ends_with("checkpoints")).collect();
    subs.sort();
    for s in subs {
        out.extend(find_runs(&s));
    }
    out
}

/// `attnlab tensorboard DIR…`: regenerate the event file of every run directory at or below each
/// of `dirs`, calling `each` with the file and its scalars; a folder with no run below it is an error.
pub fn regenerate_below(dirs: &[PathBuf], mut each: impl FnMut(&Path, &Scalars)) -> Result<()> {
    for d in dirs {
        let runs = find_runs(d);
        if runs.is_empty() {
            return Err(Error::Other(format!("{}: no run directory (a folder with metrics.jsonl) at or below it", d.display())));
        }
        for r in runs {
            let (path, s) = regenerate(&r)?;
            each(&path, &s);
        }
    }
    Ok(())
}

/// Per run directory of this process: the last step written for each tag.
static LIVE: Mutex<BTreeMap<PathBuf, BTreeMap<String, i64>>> = Mutex::new(BTreeMap::new());

/// The metrics.jsonl hook (called before the row is appended; only rank 0 logs). Tracker output
/// never stops a run: a failure is a warning, and `attnlab tensorboard` can rebuild the file.
/// `newest_checkpoint` is the step of the run's newest checkpoint (`train::checkpoint::list`), asked
/// once per run directory and process.
pub fn log_row(dir: &Path, row: &Map<String, Value>, newest_checkpoint: impl FnOnce() -> Option<u64>) {
    if let Err(e) = try_log_row(dir, row, newest_checkpoint) {
        eprintln!("warning: TensorBoard event file in {}: {e}", dir.display());
    }
}

fn try_log_row(dir: &Path, row: &Map<String, Value>, newest_checkpoint: impl FnOnce() -> Option<u64>) -> Result<()> {
    let Some(step) = row.get("step").and_then(Value::as_i64) else { return Ok(()) };
    let mut live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
    let last = match live.entry(dir.to_path_buf()) {
        std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
        std::collections::btree_map::Entry::Vacant(v) => {
            // First row of this process: what survives of earlier sessions is what the newest
            // checkpoint covers (-1: none, the run starts over).
            let up_to = newest_checkpoint().map_or(-1, |s| s as i64);
            let s = collect(dir, Some(up_to))?;
            write(dir, &s)?;
            v.insert(s.tags.iter().filter_map(|(t, p)| Some((t.clone(), *p.keys().next_back()?))).collect())
        }
    };
    let values: Vec<(String, f64)> = row_scalars(row).into_iter().filter(|(t, _)| last.get(t).is_none_or(|&s| step > s)).collect();
    if values.is_empty() {
        return Ok(());
    }
    let path = dir.join(FILE_NAME);
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&path).at(&path)?;
    f.write_all(&record(&summary_event(now(), step, &values).encode_to_vec())).at(&path)?;
    for (t, _) in values {
        last.insert(t, step);
    }
    Ok(())
}

/// Every event of a TFRecord event file, checking both CRCs of each record.
pub fn read_events(path: &Path) -> Result<Vec<proto::Event>> {
    let bytes = std::fs::read(path).at(path)?;
    let bad = |at: usize, msg: &str| Error::Data(format!("{}: record at byte {at}: {msg}", path.display()));
    let mask = |crc: u32| crc.rotate_right(15).wrapping_add(0xa282_ead8);
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let header = bytes.get(at..at + 12).ok_or_else(|| bad(at, "truncated header"))?;
        let len = u64::from_le_bytes(header[..8].try_into().expect("8 bytes")) as usize;
        if mask(crc32c::crc32c(&header[..8])) != u32::from_le_bytes(header[8..12].try_into().expect("4 bytes")) {
            return Err(bad(at, "length CRC mismatch"));
        }
        let data = bytes.get(at + 12..at + 12 + len).ok_or_else(|| bad(at, "truncated data"))?;
        let crc = bytes.get(at + 12 + len..at + 16 + len).ok_or_else(|| bad(at, "truncated data CRC"))?;
        if mask(crc32c::crc32c(data)) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(bad(at, "data CRC mismatch"));
        }
        out.push(proto::Event::decode(data).map_err(|e| bad(at, &e.to_string()))?);
        at += 16 + len;
    }
    Ok(out)
}

/// The scalars of an event file, tag → (step, value) in file order (simple values and rank-0
/// float / double tensors).
pub fn read_scalars(path: &Path) -> Result<BTreeMap<String, Vec<(i64, f64)>>> {
    let mut out: BTreeMap<String, Vec<(i64, f64)>> = BTreeMap::new();
    for e in read_events(path)? {
        if let Some(proto::What::Summary(s)) = e.what {
            for v in s.value {
                let x = match &v.value {
                    Some(proto::Kind::SimpleValue(x)) => Some(*x as f64),
                    Some(proto::Kind::Tensor(t)) => t.scalar(),
                    None => None,
                };
                if let Some(x) = x {
                    out.entry(v.tag).or_default().push((e.step, x));
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tensorboard")
    }

    /// The file TensorBoard's own writer produced (scripts/make_tensorboard_fixture.py) decodes to
    /// the scalars the script wrote (listed in expected.json), simple values and v2 tensors alike.
    #[test]
    fn decodes_tensorboards_own_event_file() {
        let _rng = crate::testutil::rng();
        let expected: BTreeMap<String, Vec<(i64, f64)>> = serde_json::from_str(&std::fs::read_to_string(fixture().join("expected.json")).unwrap()).unwrap();
        let events = read_events(&fixture().join("events.out.tfevents.fixture")).unwrap();
        assert!(matches!(&events[0].what, Some(proto::What::FileVersion(v)) if v == "brain.Event:2"));
        let got = read_scalars(&fixture().join("events.out.tfevents.fixture")).unwrap();
        assert_eq!(got.keys().collect::<Vec<_>>(), expected.keys().collect::<Vec<_>>());
        for (tag, pts) in &expected {
            assert_eq!(got[tag].len(), pts.len(), "{tag}");
            for ((s1, v1), (s2, v2)) in got[tag].iter().zip(pts) {
                // simple_value is a float32.
                assert!(s1 == s2 && (v1 - v2).abs() <= 1e-6 * v2.abs().max(1.0), "{tag}: ({s1}, {v1}) vs ({s2}, {v2})");
            }
        }
        // Our encoding of the same scalars is TensorBoard's, byte for byte, for the simple values
        // (same framing, field order and float32 values; its file has the same wall times).
        let ours = encode_simple_like_fixture(&expected);
        let theirs = std::fs::read(fixture().join("events.out.tfevents.simple")).unwrap();
        assert_eq!(ours, theirs);
    }

    /// The simple-value tags of the fixture, one event per (step, tag) as the script writes them,
    /// with the script's wall time (step + 1000.5) and file-version event at 1000.0.
    fn encode_simple_like_fixture(expected: &BTreeMap<String, Vec<(i64, f64)>>) -> Vec<u8> {
        let mut out = record(&proto::Event { wall_time: 1000.0, step: 0, what: Some(proto::What::FileVersion("brain.Event:2".into())) }.encode_to_vec());
        let pts = &expected["simple/loss"];
        for (step, v) in pts {
            out.extend(record(&summary_event(1000.5 + *step as f64, *step, &[("simple/loss".into(), *v)]).encode_to_vec()));
        }
        out
    }

    #[test]
    fn written_file_reads_back_and_a_resume_keeps_one_curve() {
        let _rng = crate::testutil::rng();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let row = |v: Value| v.as_object().unwrap().clone();
        let log = |v: Value| {
            let r = row(v);
            log_row(dir, &r, || crate::train::checkpoint::list(dir).last().map(|c| c.0));
            let mut f = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("metrics.jsonl")).unwrap();
            writeln!(f, "{}", Value::Object(r)).unwrap();
        };
        for step in 1..=6 {
            log(json!({"step": step, "loss": 10.0 - step as f64, "lr": 0.1, "grad_norm": 1.5, "tokens_per_s": 100.0, "elapsed_s": step as f64}));
        }
        log(json!({"step": 4, "eval/wiki/ppl": 33.0, "eval/wiki/loss": 3.5, "tokens": 400}));
        let got = read_scalars(&dir.join(FILE_NAME)).unwrap();
        assert_eq!(got["train/loss"], (1..=6).map(|s| (s, 10.0 - s as f64)).collect::<Vec<_>>());
        assert_eq!(got["eval/wiki/ppl"], vec![(4, 33.0)]);
        assert_eq!(got["train/tokens"], vec![(4, 400.0)]);
        assert!(got.keys().all(|k| k.starts_with("train/") || k.starts_with("eval/")), "{:?}", got.keys());

        // A new process resumes from a checkpoint at step 4: steps 5, 6 are logged again (other
        // values: a curve with a duplicate would show them twice).
        LIVE.lock().unwrap().remove(dir);
        std::fs::create_dir_all(dir.join("checkpoints/4")).unwrap();
        std::fs::write(dir.join("checkpoints/4/state.json"), "{}").unwrap();
        for step in 5..=8 {
            log(json!({"step": step, "loss": 20.0 - step as f64, "elapsed_s": step as f64}));
        }
        let got = read_scalars(&dir.join(FILE_NAME)).unwrap();
        let want: Vec<(i64, f64)> = (1..=4).map(|s| (s, 10.0 - s as f64)).chain((5..=8).map(|s| (s, 20.0 - s as f64))).collect();
        assert_eq!(got["train/loss"], want);
        // Rebuilding from metrics.jsonl (last row per step wins) gives the same curve.
        let (path, s) = regenerate(dir).unwrap();
        assert_eq!(read_scalars(&path).unwrap()["train/loss"], want);
        assert_eq!(s.tags["train/loss"].len(), 8);
        // Wall times never decrease.
        let walls: Vec<f64> = read_events(&path).unwrap().iter().map(|e| e.wall_time).collect();
        assert!(walls.windows(2).all(|w| w[0] <= w[1]), "{walls:?}");
    }

    #[test]
    fn tag_names_and_corrupt_files() {
        let _rng = crate::testutil::rng();
        let r = json!({"step": 3, "stage": 1, "loss": 1.0, "val_loss": 2.0, "eval_loss": 3.0, "teacher_ppl": 4.0, "at": "start", "attn_mse_per_layer": [0.5, 0.25], "eval/x/ppl": 5.0});
        let tags: BTreeMap<String, f64> = row_scalars(r.as_object().unwrap()).into_iter().collect();
        let want: BTreeMap<String, f64> = [("train/stage", 1.0), ("train/loss", 1.0), ("eval/val/loss", 2.0), ("eval/held_out/loss", 3.0), ("eval/teacher/ppl", 4.0), ("train/attn_mse_per_layer/0", 0.5), ("train/attn_mse_per_layer/1", 0.25), ("eval/x/ppl", 5.0)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        assert_eq!(tags, want);
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("e");
        let mut bytes = encode(&Scalars { tags: [("a".to_string(), [(1, 2.0)].into())].into(), elapsed: BTreeMap::new() }, 0.0);
        std::fs::write(&p, &bytes).unwrap();
        assert_eq!(read_scalars(&p).unwrap()["a"], vec![(1, 2.0)]);
        let n = bytes.len();
        bytes[n - 6] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        assert!(read_events(&p).unwrap_err().to_string().contains("data CRC mismatch"));
        std::fs::write(&p, &bytes[..n - 2]).unwrap();
        assert!(read_events(&p).unwrap_err().to_string().contains("truncated"));
    }
}
