//! Checkpoints: `checkpoints/<step>/` holding `model.safetensors` (Hugging Face names),
//! `optimizer.safetensors` (`exp_avg.<name>`, `exp_avg_sq.<name>`) and `state.json`.
//!
//! What makes them survive crashes, full disks and bad copies:
//! - written into `checkpoints/.tmp-<step>/`, flushed to disk (fsync of files and folders) and
//!   renamed, so a folder named by a number is complete, also after a power cut; a failed write
//!   removes its temporary folder, and a writer removes any left over at start (`resume_point`);
//! - `state.json` records the sha256 of every other file of the checkpoint, and a checkpoint is
//!   used only once they match (`verify`); one that fails is renamed `<step>.corrupt` (never
//!   deleted) and the previous complete one is used, with a warning naming both. Checkpoints
//!   written before the hashes existed are checked for complete safetensors files instead;
//! - old checkpoints beyond `keep` are renamed into a temporary folder before being deleted, so
//!   an interrupted deletion never leaves a half-deleted numbered folder.
use super::optim::AdamW;
use crate::model::neox::is_ignored_buffer;
use crate::{Error, IoContext, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use tch::{nn::VarStore, Tensor};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct State {
    /// Optimizer steps completed.
    pub step: u64,
    pub tokens: u64,
    pub elapsed_s: f64,
}

/// state.json: the state and the sha256 (hex) of each other file of the checkpoint, by file name.
/// Older checkpoints have no `sha256` (an empty map).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Stored {
    #[serde(flatten)]
    state: State,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    sha256: BTreeMap<String, String>,
    /// The sha256 of the two fields above (`Stored::checksum`), so that an edited or corrupt
    /// state.json is caught too. Absent in older checkpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    checksum: Option<String>,
}

impl Stored {
    fn checksum(&self) -> String {
        let text = serde_json::to_string(&(&self.state, &self.sha256)).expect("serializes");
        format!("{:x}", Sha256::digest(text.as_bytes()))
    }
}

const FILES: [&str; 2] = ["model.safetensors", "optimizer.safetensors"];

/// Checkpoints under `run/checkpoints` named by a step and holding a state.json, oldest first
/// (not yet verified: see `resume_point` / `newest_verified`).
pub fn list(run: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(run.join("checkpoints"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let step = e.file_name().to_str()?.parse::<u64>().ok()?;
            e.path().join("state.json").is_file().then(|| (step, e.path()))
        })
        .collect();
    out.sort();
    out
}

fn sha256_file(path: &Path) -> Result<String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).at(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).at(path)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("{:x}", h.finalize()))
}

fn fsync(path: &Path) -> Result<()> {
    std::fs::File::open(path).and_then(|f| f.sync_all()).at(path)
}

/// Check that checkpoint folder `dir` is complete and intact: state.json parses, and every file
/// it lists has its recorded sha256 (or, for a checkpoint without hashes, every safetensors file
/// is whole). The error says what is wrong.
pub fn verify(dir: &Path) -> std::result::Result<(), String> {
    let sp = dir.join("state.json");
    let text = std::fs::read_to_string(&sp).map_err(|e| format!("state.json: {e}"))?;
    let stored: Stored = serde_json::from_str(&text).map_err(|e| format!("state.json: {e}"))?;
    if stored.checksum.as_ref().is_some_and(|c| *c != stored.checksum()) {
        return Err("state.json: its checksum does not match its contents (edited or corrupt)".into());
    }
    if stored.sha256.is_empty() {
        for name in FILES {
            let p = dir.join(name);
            let f = std::fs::File::open(&p).map_err(|e| format!("{name}: {e}"))?;
            // SAFETY: read-only map of a file that writers never modify in place (they rename).
            let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| format!("{name}: {e}"))?;
            safetensors::SafeTensors::read_metadata(&map).map_err(|e| format!("{name}: not a complete safetensors file ({e})"))?;
        }
        return Ok(());
    }
    for (name, want) in &stored.sha256 {
        let got = sha256_file(&dir.join(name)).map_err(|e| format!("{name}: {e}"))?;
        if &got != want {
            return Err(format!("{name}: sha256 {} differs from the recorded {}", &got[..12], &want[..want.len().min(12)]));
        }
    }
    Ok(())
}

/// Remove `checkpoints/.tmp-*` folders (writes and deletions a dead process left behind). Only
/// for the process holding the run directory's lock: another one may be writing them.
pub fn remove_leftovers(run: &Path) {
    for e in std::fs::read_dir(run.join("checkpoints")).into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().starts_with(".tmp-") {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Rename checkpoint `dir` to `<step>.corrupt` (or `.corrupt.2`, … if taken); returns the new path.
fn quarantine(dir: &Path) -> Result<PathBuf> {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut dest = dir.with_file_name(format!("{name}.corrupt"));
    let mut k = 2;
    while dest.exists() {
        dest = dir.with_file_name(format!("{name}.corrupt.{k}"));
        k += 1;
    }
    std::fs::rename(dir, &dest).at(dir)?;
    Ok(dest)
}

/// Where a writer resumes: removes leftover temporary folders, then returns the newest checkpoint
/// that verifies. Every newer one that fails is renamed `<step>.corrupt`, with a warning naming it
/// and the one used. None when there is no checkpoint; an error when there are only corrupt ones.
/// Call with the run directory's lock held.
pub fn resume_point(run: &Path) -> Result<Option<(u64, PathBuf)>> {
    remove_leftovers(run);
    newest(run, true)
}

/// The newest checkpoint that verifies, for readers (eval, generate): corrupt ones are skipped with
/// a warning but left in place (the run's writer renames them).
pub fn newest_verified(run: &Path) -> Result<Option<(u64, PathBuf)>> {
    newest(run, false)
}

fn newest(run: &Path, rename: bool) -> Result<Option<(u64, PathBuf)>> {
    let mut bad: Vec<String> = Vec::new();
    for (step, dir) in list(run).into_iter().rev() {
        match verify(&dir) {
            Ok(()) => {
                if !bad.is_empty() {
                    eprintln!("warning: {}; using the previous complete checkpoint {} (step {step})", bad.join("; "), dir.display());
                }
                return Ok(Some((step, dir)));
            }
            Err(why) => {
                let what = if rename {
                    let dest = quarantine(&dir)?;
                    format!("checkpoint {} is corrupt ({why}): renamed to {}", dir.display(), dest.display())
                } else {
                    format!("checkpoint {} is corrupt ({why})", dir.display())
                };
                bad.push(what);
            }
        }
    }
    if bad.is_empty() {
        return Ok(None);
    }
    Err(Error::Run { dir: run.into(), msg: format!("has no complete checkpoint left: {}; restore a checkpoint or start the run in a new directory", bad.join("; ")) })
}

pub fn save(run: &Path, vs: &VarStore, opt: &AdamW, state: &State, keep: usize) -> Result<PathBuf> {
    let dir = run.join("checkpoints");
    let tmp = dir.join(format!(".tmp-{}", state.step));
    let fin = dir.join(state.step.to_string());
    let written = write_tmp(&tmp, vs, opt, state);
    if let Err(e) = written {
        // Free what the failed write took (a full disk) and say what is still there.
        let _ = std::fs::remove_dir_all(&tmp);
        let last = list(run).pop().map_or("there is no complete checkpoint yet".to_string(), |(s, p)| format!("the last complete checkpoint is step {s} ({})", p.display()));
        return Err(Error::Run { dir: run.into(), msg: format!("writing checkpoint {} failed: {e}; nothing else changed and {last}: free the space and run again to resume", fin.display()) });
    }
    if fin.exists() {
        // Only after a resume from an older checkpoint: move the stale one aside first.
        let old = dir.join(format!(".tmp-old-{}", state.step));
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(&fin, &old).at(&fin)?;
        let _ = std::fs::remove_dir_all(&old);
    }
    // What the run wrote before this checkpoint reaches the disk before the checkpoint does (a
    // power cut must not keep a checkpoint whose earlier metrics rows were lost).
    for f in ["config.yaml", "metrics.jsonl"] {
        if let Ok(f) = std::fs::File::open(run.join(f)) {
            let _ = f.sync_all();
        }
    }
    std::fs::rename(&tmp, &fin).at(&fin)?;
    super::fault::checkpoint_stage("renamed");
    fsync(&dir)?;
    // Keep the newest `keep` (corrupt ones are not listed, so never deleted).
    let all = list(run);
    for (step, p) in all.iter().take(all.len().saturating_sub(keep)) {
        let doomed = dir.join(format!(".tmp-del-{step}"));
        if std::fs::rename(p, &doomed).is_ok() {
            super::fault::checkpoint_stage("pruning");
            let _ = std::fs::remove_dir_all(&doomed);
        }
    }
    Ok(fin)
}

/// Write the files of a checkpoint into `tmp` and flush them to disk.
fn write_tmp(tmp: &Path, vs: &VarStore, opt: &AdamW, state: &State) -> Result<()> {
    let _ = std::fs::remove_dir_all(tmp);
    std::fs::create_dir_all(tmp).at(tmp)?;
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let model = tmp.join(FILES[0]);
    Tensor::write_safetensors(&vars, &model)?;
    super::fault::checkpoint_stage("model");
    super::fault::checkpoint_pause();
    super::fault::io("checkpoint", Some(state.step), &tmp.join(FILES[1]))?;
    let mut moments: Vec<(String, Tensor)> = Vec::new();
    for s in &opt.slots {
        moments.push((format!("exp_avg.{}", s.name), s.exp_avg.shallow_clone()));
        moments.push((format!("exp_avg_sq.{}", s.name), s.exp_avg_sq.shallow_clone()));
    }
    let optf = tmp.join(FILES[1]);
    Tensor::write_safetensors(&moments, &optf)?;
    super::fault::checkpoint_stage("optimizer");
    let mut sha256 = BTreeMap::new();
    for name in FILES {
        let p = tmp.join(name);
        fsync(&p)?;
        sha256.insert(name.to_string(), sha256_file(&p)?);
    }
    super::fault::checkpoint_stage("hashed");
    let sp = tmp.join("state.json");
    let mut stored = Stored { state: state.clone(), sha256, checksum: None };
    // Over the values a reader will parse: serde_json's float parsing need not give back the very
    // f64 that was printed (elapsed_s), but parsing the same text always gives the same value.
    let read_back: Stored = serde_json::from_str(&serde_json::to_string_pretty(&stored)?)?;
    stored.checksum = Some(read_back.checksum());
    let text = serde_json::to_string_pretty(&stored)?;
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&sp).at(&sp)?;
        f.write_all(text.as_bytes()).at(&sp)?;
        f.sync_all().at(&sp)?;
    }
    super::fault::checkpoint_stage("state");
    fsync(tmp)?;
    super::fault::checkpoint_stage("synced");
    Ok(())
}

/// Copy weights from a safetensors file into `vs` (HF GPT-NeoX buffers skipped, `lm_head` read as
/// `embed_out`): every variable must be present with its shape; other extras are errors.
pub fn load_weights(vs: &VarStore, file: &Path) -> Result<()> {
    let tensors = crate::model::weights::read_safetensors(file)?;
    let mut by_name: HashMap<String, Tensor> = tensors.into_iter().filter(|(n, _)| !is_ignored_buffer(n)).collect();
    // transformers ≥ 5 names GPT-NeoX's head `lm_head` in memory; checkpoints say `embed_out`.
    if vs.variables().contains_key("embed_out.weight") && !by_name.contains_key("embed_out.weight") {
        if let Some(t) = by_name.remove("lm_head.weight") {
            by_name.insert("embed_out.weight".into(), t);
        }
    }
    crate::model::weights::copy_into(vs, by_name, file).map_err(|e| match (e, spec_of(file)) {
        (Error::Data(m), Some(spec)) => Error::Data(format!("{m}: the checkpoint's tensors disagree with the model {} describes", spec.display())),
        (e, _) => e,
    })
}

/// The run's config.yaml of a checkpoint file `run/checkpoints/<step>/<file>`, if there is one.
fn spec_of(file: &Path) -> Option<PathBuf> {
    let spec = file.ancestors().nth(3)?.join("config.yaml");
    spec.is_file().then_some(spec)
}

/// Restore model, optimizer moments and step counter from a checkpoint folder.
pub fn load(dir: &Path, vs: &VarStore, opt: &mut AdamW) -> Result<State> {
    load_weights(vs, &dir.join("model.safetensors"))?;
    let f = dir.join("optimizer.safetensors");
    let moments: HashMap<String, Tensor> = crate::model::weights::read_safetensors(&f)?.into_iter().collect();
    tch::no_grad(|| -> Result<()> {
        for s in &mut opt.slots {
            for (key, dst) in [(format!("exp_avg.{}", s.name), &mut s.exp_avg), (format!("exp_avg_sq.{}", s.name), &mut s.exp_avg_sq)] {
                let src = moments.get(&key).ok_or_else(|| Error::Data(format!("{}: missing {key}", f.display())))?;
                if src.size() != dst.size() || !src.is_floating_point() || src.isfinite().all().int64_value(&[]) == 0 {
                    return Err(Error::Data(format!("{}: {key} has shape {:?} ({:?}), the parameter {:?}: expected finite moments of the parameter's shape", f.display(), src.size(), src.kind(), dst.size())));
                }
                dst.f_copy_(src)?;
            }
        }
        Ok(())
    })?;
    let sp = dir.join("state.json");
    let state: State = serde_json::from_str(&std::fs::read_to_string(&sp).at(&sp)?).map_err(|e| Error::Data(format!("{}: {e}", sp.display())))?;
    // A folder renamed by hand (or a state.json copied from another) would resume at the wrong step.
    if let Some(named) = dir.file_name().and_then(|n| n.to_str()).and_then(|n| n.parse::<u64>().ok()) {
        if named != state.step {
            return Err(Error::Data(format!("{}: step {} but the checkpoint folder is named {named}", sp.display(), state.step)));
        }
    }
    opt.set_steps_done(state.step);
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// A VarStore with two parameters and its AdamW, values depending on `seed`.
    fn model(seed: f64) -> (VarStore, AdamW) {
        let vs = VarStore::new(Device::Cpu);
        let root = vs.root();
        let _a = (&root / "a").var("weight", &[4, 3], tch::nn::Init::Const(seed));
        let _b = (&root / "b").var("bias", &[5], tch::nn::Init::Const(seed + 0.5));
        let params = crate::train::named_parameters(&vs);
        let opt = AdamW::new(params, super::super::optim::Hyper { betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1 });
        tch::no_grad(|| {
            for s in &opt.slots {
                let _ = s.exp_avg.shallow_clone().fill_(seed * 2.0);
            }
        });
        (vs, opt)
    }

    fn save_at(run: &Path, step: u64, keep: usize) -> PathBuf {
        let (vs, opt) = model(step as f64);
        save(run, &vs, &opt, &State { step, tokens: step * 10, elapsed_s: 1.0 }, keep).unwrap()
    }

    /// state.json's checksum holds for elapsed times whose decimal form does not parse back to the
    /// very same f64 (a real run's, not 1.0).
    #[test]
    fn the_state_checksum_holds_for_any_elapsed_time() {
        let tmp = tempfile::tempdir().unwrap();
        let (vs, opt) = model(1.0);
        let mut x = 0.1f64;
        for step in 1..200u64 {
            x = x * 1.37 + 1.0 / 3.0 + (step as f64).sqrt() * 1e-7;
            let dir = save(tmp.path(), &vs, &opt, &State { step, tokens: step, elapsed_s: x }, 1).unwrap();
            assert_eq!(verify(&dir), Ok(()), "elapsed_s {x:e}");
        }
    }

    fn weight(vs: &VarStore) -> f64 {
        vs.variables()["a.weight"].double_value(&[0, 0])
    }

    /// The run's checkpoint at step 7 (weights, moments, state) as loaded into a fresh model.
    fn loaded(run: &Path) -> std::result::Result<(State, Vec<f64>), String> {
        let (_, dir) = newest_verified(run).map_err(|e| e.to_string())?.ok_or("no checkpoint")?;
        let (vs, mut opt) = model(0.0);
        let st = load(&dir, &vs, &mut opt).map_err(|e| e.to_string())?;
        let mut values: Vec<f64> = Vec::new();
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for t in vars.iter().map(|v| &v.1).chain(opt.slots.iter().flat_map(|s| [&s.exp_avg, &s.exp_avg_sq])) {
            values.extend(Vec::<f64>::try_from(t.to_kind(tch::Kind::Double).view([-1])).unwrap());
        }
        Ok((st, values))
    }

    /// Random single defects of each file of a checkpoint: the checkpoint is refused naming the
    /// file, or (a defect that changes nothing) it loads as it was saved.
    #[test]
    fn mutated_checkpoints_are_refused_or_load_as_saved() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path();
        let dir = save_at(run, 7, 3);
        let (want_state, want) = loaded(run).unwrap();
        for (k, file) in ["model.safetensors", "optimizer.safetensors", "state.json"].into_iter().enumerate() {
            let original = std::fs::read(dir.join(file)).unwrap();
            let t = crate::testutil::mutate::run(&format!("checkpoint {file}"), &original, &dir.join(file), 0..original.len(), 38 + k as u64, 200, 1 << 28, |_| match loaded(run) {
                Ok((st, got)) if got == want && (st.step, st.tokens, st.elapsed_s) == (want_state.step, want_state.tokens, want_state.elapsed_s) => Ok(crate::testutil::mutate::Loaded::Same),
                Ok((st, _)) => Ok(crate::testutil::mutate::Loaded::Differs(format!("{st:?}"))),
                Err(e) => Err(e),
            });
            assert!(t.refused > t.tried * 9 / 10, "{file}: {t:?}");
            std::fs::write(dir.join(file), &original).unwrap();
        }
    }

    /// A checkpoint whose tensors do not fit the model the run's spec builds names both; a state.json
    /// whose step is not its folder's is refused.
    #[test]
    fn a_checkpoint_that_disagrees_with_the_spec_names_both() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path();
        std::fs::write(run.join("config.yaml"), "model: {}\n").unwrap();
        let dir = save_at(run, 4, 2);
        let vs = VarStore::new(Device::Cpu);
        let _a = (&vs.root() / "a").var("weight", &[4, 4], tch::nn::Init::Const(0.0));
        let _b = (&vs.root() / "b").var("bias", &[5], tch::nn::Init::Const(0.0));
        let e = load_weights(&vs, &dir.join("model.safetensors")).unwrap_err().to_string();
        assert!(e.contains("checkpoints/4/model.safetensors: a.weight has shape [4, 3], model wants [4, 4]") && e.contains(&format!("disagree with the model {} describes", run.join("config.yaml").display())), "{e}");
        let moved = run.join("checkpoints/5");
        std::fs::rename(&dir, &moved).unwrap();
        let (vs, mut opt) = model(0.0);
        let e = load(&moved, &vs, &mut opt).unwrap_err().to_string();
        assert!(e.contains("state.json: step 4 but the checkpoint folder is named 5"), "{e}");
    }

    /// The environment variable that makes `a_hundred_kills…` a checkpoint writer instead of the test:
    /// `RUN_DIR,FIRST_STEP,STAGE_OR_-,SAVES_BEFORE_STAGE`.
    const WRITER: &str = "ATTNLAB_TEST_CHECKPOINT_WRITER";

    /// The child side of the kill test: save steps FIRST_STEP.. into RUN_DIR (keep 2) until killed,
    /// arming `checkpoint-die-at=STAGE` after SAVES_BEFORE_STAGE saves. It says "writing" on stdout
    /// before its first save, so the parent times its kills from there and not from process start.
    fn write_until_killed(args: &str) -> ! {
        let f: Vec<&str> = args.split(',').collect();
        let (run, next, before): (&Path, u64, u64) = (Path::new(f[0]), f[1].parse().unwrap(), f[3].parse().unwrap());
        let stage = (f[2] != "-").then_some(f[2]);
        println!("writing");
        use std::io::Write;
        std::io::stdout().flush().unwrap();
        for step in next.. {
            if let (Some(stage), true) = (stage, step == next + before) {
                // This process runs this one test on one thread: nothing else reads the environment.
                std::env::set_var("ATTNLAB_FAULT_INJECT", format!("checkpoint-die-at={stage}"));
            }
            let (vs, opt) = model(step as f64);
            if save(run, &vs, &opt, &State { step, tokens: step * 10, elapsed_s: 1.0 }, 2).is_err() || step > next + 10_000 {
                std::process::exit(3);
            }
        }
        unreachable!()
    }

    /// 100 SIGKILLs of a process writing checkpoints (keep 2), every one inside or around a write:
    /// 40 aimed at each stage of the write in turn (`checkpoint-die-at`, on the writer's first to
    /// third save), 60 at random times of a loop of saves. After each: every numbered checkpoint is
    /// complete and verifies, none is renamed corrupt, no temporary folder is left once a writer
    /// starts (`resume_point`), the newest holds exactly what was saved for its step, and the next
    /// writer resumes after it; at the end the writes reach the last step.
    ///
    /// The writer is this test binary run again (this test, with `WRITER` set), not a fork: a fork
    /// of the multi-threaded test harness can inherit a lock another test's thread held, and hang.
    #[test]
    fn a_hundred_kills_inside_checkpoint_writes_leave_only_complete_checkpoints() {
        use rand::{Rng, SeedableRng};
        use std::io::BufRead;
        use std::os::unix::process::ExitStatusExt;
        if let Ok(args) = std::env::var(WRITER) {
            write_until_killed(&args);
        }
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(38);
        let (mut aimed, mut timed, mut progress) = (0, 0, 0u64);
        let expect = |step: u64| {
            let (vs, opt) = model(step as f64);
            let mut v: Vec<f64> = Vec::new();
            for t in vs.variables().values().chain(opt.slots.iter().map(|s| &s.exp_avg)) {
                v.extend(Vec::<f64>::try_from(t.to_kind(tch::Kind::Double).view([-1])).unwrap());
            }
            v.sort_by(f64::total_cmp);
            v
        };
        let this_test = "train::checkpoint::tests::a_hundred_kills_inside_checkpoint_writes_leave_only_complete_checkpoints";
        for kill in 0..100 {
            let next = resume_point(run).unwrap().map_or(1, |(s, _)| s + 1);
            let stage = (kill < 40).then(|| super::super::fault::CHECKPOINT_STAGES[kill % 7]);
            let before = rng.random_range(0..3u64);
            let delay = std::time::Duration::from_micros(rng.random_range(0..6000));
            let mut child = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", this_test, "--nocapture", "--test-threads=1", "-q"])
                .env(WRITER, format!("{},{next},{},{before}", run.display(), stage.unwrap_or("-")))
                .env_remove("ATTNLAB_FAULT_INJECT")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
            let mut line = String::new();
            while !line.contains("writing") {
                line.clear();
                assert!(out.read_line(&mut line).unwrap() > 0, "kill {kill}: the writer ended before it started writing");
            }
            let status = if stage.is_none() {
                std::thread::sleep(delay);
                child.kill().unwrap();
                child.wait().unwrap()
            } else {
                // It kills itself; a writer that does not within 60 s is stopped and fails the test.
                let t0 = std::time::Instant::now();
                loop {
                    if let Some(s) = child.try_wait().unwrap() {
                        break s;
                    }
                    if t0.elapsed().as_secs() >= 60 {
                        child.kill().unwrap();
                        child.wait().unwrap();
                        panic!("kill {kill} ({stage:?}): the writer did not reach the stage in 60 s");
                    }
                    std::thread::sleep(std::time::Duration::from_micros(500));
                }
            };
            assert_eq!(status.signal(), Some(libc::SIGKILL), "kill {kill} ({stage:?}): the writer ended with {status}");
            if stage.is_some() { aimed += 1 } else { timed += 1 }
            // What a kill leaves: complete numbered checkpoints, and maybe temporary folders.
            for (step, dir) in list(run) {
                assert_eq!(verify(&dir), Ok(()), "kill {kill} ({stage:?}) left checkpoint {step} incomplete");
            }
            let (step, dir) = match resume_point(run).unwrap() {
                Some(c) => c,
                None => continue,
            };
            let names: Vec<String> = std::fs::read_dir(run.join("checkpoints")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
            assert!(names.iter().all(|n| n.parse::<u64>().is_ok()), "kill {kill} ({stage:?}): {names:?} after resume_point");
            let (vs, mut opt) = model(0.0);
            let st = load(&dir, &vs, &mut opt).unwrap();
            let mut got: Vec<f64> = Vec::new();
            for t in vs.variables().values().chain(opt.slots.iter().map(|s| &s.exp_avg)) {
                got.extend(Vec::<f64>::try_from(t.to_kind(tch::Kind::Double).view([-1])).unwrap());
            }
            got.sort_by(f64::total_cmp);
            assert_eq!((st.step, st.tokens), (step, step * 10));
            assert!(got == expect(step), "kill {kill}: checkpoint {step} holds other values");
            assert!(step + 1 >= next, "kill {kill}: resumed at {step}, before the previous resume point {next}");
            progress = step;
        }
        assert_eq!((aimed, timed), (40, 60));
        assert!(progress > 20, "the kills left the writes at step {progress}");
    }

    #[test]
    fn state_json_records_the_files_sha256_and_a_checkpoint_round_trips() {
        let _rng = crate::testutil::rng();
        let tmp = tempfile::tempdir().unwrap();
        let dir = save_at(tmp.path(), 7, 3);
        let stored: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("state.json")).unwrap()).unwrap();
        for f in FILES {
            assert_eq!(stored["sha256"][f].as_str().unwrap(), sha256_file(&dir.join(f)).unwrap());
        }
        assert_eq!(verify(&dir), Ok(()));
        let (vs, mut opt) = model(0.0);
        let st = load(&dir, &vs, &mut opt).unwrap();
        assert_eq!((st.step, st.tokens, weight(&vs), opt.steps_done()), (7, 70, 7.0, 7));
        assert_eq!(opt.slots[0].exp_avg.double_value(&[0, 0]), 14.0);
    }

    #[test]
    fn a_corrupt_newest_checkpoint_is_renamed_and_the_previous_one_used() {
        let _rng = crate::testutil::rng();
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path();
        for s in [4, 8, 12] {
            save_at(run, s, 3);
        }
        // 12: model cut short (a copy that stopped, a bad disk); 8: one flipped byte in the
        // optimizer moments, which the safetensors header alone would not notice.
        let m12 = run.join("checkpoints/12/model.safetensors");
        let len = std::fs::metadata(&m12).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&m12).unwrap().set_len(len / 2).unwrap();
        let o8 = run.join("checkpoints/8/optimizer.safetensors");
        let mut bytes = std::fs::read(&o8).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        std::fs::write(&o8, bytes).unwrap();
        assert!(verify(&run.join("checkpoints/12")).unwrap_err().contains("model.safetensors"));
        assert!(verify(&run.join("checkpoints/8")).unwrap_err().contains("optimizer.safetensors"));

        // A reader skips them and leaves them in place.
        assert_eq!(newest_verified(run).unwrap().unwrap().0, 4);
        assert!(run.join("checkpoints/12").is_dir());
        // The writer renames them (never deletes) and resumes from 4.
        let (step, dir) = resume_point(run).unwrap().unwrap();
        assert_eq!((step, dir.clone()), (4, run.join("checkpoints/4")));
        assert_eq!(std::fs::metadata(run.join("checkpoints/12.corrupt/model.safetensors")).unwrap().len(), len / 2);
        assert!(run.join("checkpoints/8.corrupt/optimizer.safetensors").is_file());
        assert_eq!(list(run).iter().map(|c| c.0).collect::<Vec<_>>(), [4]);
        let (vs, mut opt) = model(0.0);
        assert_eq!(load(&dir, &vs, &mut opt).unwrap().step, 4);
        assert_eq!(weight(&vs), 4.0);
        // Pruning to `keep` never touches the corrupt ones; a second corrupt 12 gets its own name.
        save_at(run, 12, 1);
        std::fs::OpenOptions::new().write(true).open(run.join("checkpoints/12/state.json")).unwrap().set_len(3).unwrap();
        assert_eq!(resume_point(run).unwrap_err().to_string().contains("no complete checkpoint left"), true);
        assert!(run.join("checkpoints/12.corrupt.2/state.json").is_file() && run.join("checkpoints/8.corrupt").is_dir());
    }

    #[test]
    fn only_corrupt_checkpoints_give_a_clear_error_and_none_is_not_an_error() {
        let _rng = crate::testutil::rng();
        let tmp = tempfile::tempdir().unwrap();
        assert!(resume_point(tmp.path()).unwrap().is_none());
        let dir = save_at(tmp.path(), 3, 2);
        std::fs::write(dir.join("model.safetensors"), b"").unwrap();
        let err = resume_point(tmp.path()).unwrap_err().to_string();
        assert!(err.contains("no complete checkpoint left") && err.contains("checkpoints/3") && err.contains("3.corrupt"), "{err}");
    }

    #[test]
    fn checkpoints_without_hashes_still_load_and_truncated_ones_are_caught() {
        let _rng = crate::testutil::rng();
        let tmp = tempfile::tempdir().unwrap();
        let dir = save_at(tmp.path(), 5, 2);
        // As written before the hashes existed.
        std::fs::write(dir.join("state.json"), r#"{"step": 5, "tokens": 50, "elapsed_s": 1.0}"#).unwrap();
        assert_eq!(verify(&dir), Ok(()));
        assert_eq!(resume_point(tmp.path()).unwrap().unwrap().0, 5);
        let (vs, mut opt) = model(0.0);
        assert_eq!(load(&dir, &vs, &mut opt).unwrap().step, 5);
        let p = dir.join("optimizer.safetensors");
        let len = std::fs::metadata(&p).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(len - 4).unwrap();
        assert!(verify(&dir).unwrap_err().contains("not a complete safetensors file"));
    }

    #[test]
    fn leftovers_are_removed_at_start_and_a_failed_write_leaves_nothing_behind() {
        let _rng = crate::testutil::rng();
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path();
        save_at(run, 2, 2);
        std::fs::create_dir_all(run.join("checkpoints/.tmp-4")).unwrap();
        std::fs::write(run.join("checkpoints/.tmp-4/model.safetensors"), b"half").unwrap();
        assert_eq!(resume_point(run).unwrap().unwrap().0, 2);
        assert!(!run.join("checkpoints/.tmp-4").exists());

        // A full disk in the middle of writing step 4 (injected; lib tests run on one thread).
        std::env::set_var("ATTNLAB_FAULT_INJECT", "enospc-checkpoint=4");
        let (vs, opt) = model(4.0);
        let err = save(run, &vs, &opt, &State { step: 4, tokens: 0, elapsed_s: 0.0 }, 2);
        std::env::remove_var("ATTNLAB_FAULT_INJECT");
        let err = err.unwrap_err().to_string();
        assert!(err.contains("No space left on device") && err.contains("checkpoints/4") && err.contains("last complete checkpoint is step 2"), "{err}");
        let names: Vec<String> = std::fs::read_dir(run.join("checkpoints")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        assert_eq!(names, ["2"]);
        assert_eq!(verify(&run.join("checkpoints/2")), Ok(()));
    }
}
