//! `attnlab bench`: time training steps (or the attention op alone) on synthetic tokens, and report
//! tokens/s, MFU (PaLM convention, pythia.md §6) and peak GPU memory. Speed goals live here, never
//! in unit tests.
use crate::attention::kinds::BenchInputs;
use crate::spec::{AttentionImpl, AttentionKind, Spec};
use crate::train::{self, optim};
use crate::Result;
use crate::kernels;

pub mod check;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::{nn::VarStore, Device, Kind, Tensor};

/// H100/H200 SXM dense bf16 peak (pythia.md §6).
pub const PEAK_FLOPS: f64 = 989e12;

#[derive(Debug, Serialize)]
pub struct TrainBench {
    pub name: String,
    /// `pythia-70m`, … or `custom`.
    pub flavor: String,
    pub attention: String,
    pub device: String,
    pub micro_batch: usize,
    pub seq_len: usize,
    pub steps: usize,
    pub step_ms: f64,
    pub tokens_per_s: f64,
    pub mfu: f64,
    pub peak_mem_gib: f64,
    pub params: i64,
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Time `steps` training steps of batch `batch_size` (one micro-batch, as the peers) after `warmup`.
pub fn train_bench(spec: &Spec, vocab: usize, warmup: usize, steps: usize) -> Result<TrainBench> {
    train_bench_traced(spec, vocab, warmup, steps, None)
}

/// `train_bench`, with the timed steps profiled into the Chrome trace `trace` when given.
pub fn train_bench_traced(spec: &Spec, vocab: usize, warmup: usize, steps: usize, trace: Option<&Path>) -> Result<TrainBench> {
    let device = crate::device::parse_device(spec.train.device.as_deref().unwrap_or("auto"))?;
    let autocast = train::use_autocast(spec, device)?;
    tch::manual_seed(spec.seed() as i64);
    let mut spec = spec.clone();
    spec.model.vocab.get_or_insert(vocab);
    let vs = VarStore::new(device);
    let model = train::run::build_model(&spec, &vs);
    let params = crate::train::named_parameters(&vs);
    let n_params: i64 = params.iter().map(|p| p.1.numel() as i64).sum();
    let [b1, b2] = spec.train.betas.expect("resolved");
    let mut opt = optim::AdamW::new(params, optim::Hyper { betas: (b1, b2), eps: 1e-8, weight_decay: 0.1 });
    let (b, t) = (spec.batch_size() as i64, spec.seq_len() as i64);
    let v = model.vocab() as i64;
    let batch = || {
        let ids = Tensor::randint(v.min(50277), [b, t + 1], (Kind::Int64, device));
        Ok((ids.narrow(1, 0, t), ids.narrow(1, 1, t)))
    };
    for _ in 0..warmup {
        let _ = train::step_once(&model, &mut opt, std::iter::once(batch()), autocast, 1.0, 1e-4, device)?;
    }
    sync(device);
    crate::kernels::reset_cuda_peak_memory(device);
    let profiling = Profiling::start(trace, device)?;
    let start = Instant::now();
    let mut last = Tensor::zeros([], (Kind::Float, device));
    for _ in 0..steps {
        last = kernels::scope("bench.step", || train::step_once(&model, &mut opt, std::iter::once(batch()), autocast, 1.0, 1e-4, device))?.0;
    }
    sync(device);
    let secs = start.elapsed().as_secs_f64();
    profiling.stop()?;
    let loss = last.double_value(&[]);
    if !loss.is_finite() {
        return Err(crate::Error::Diverged { step: steps as u64, msg: format!("bench loss {loss}") });
    }
    let tokens = (b * t) as f64 * steps as f64;
    let tps = tokens / secs;
    Ok(TrainBench {
        name: spec.name.clone().unwrap_or_default(),
        flavor: spec.model.flavor.map(|f| serde_yaml::to_string(&f).unwrap_or_default().trim().to_string()).unwrap_or_else(|| "custom".into()),
        attention: spec.attention.kind().name().into(),
        device: format!("{device:?}"),
        micro_batch: b as usize,
        seq_len: t as usize,
        steps,
        step_ms: 1e3 * secs / steps as f64,
        tokens_per_s: tps,
        mfu: model.flops_per_token(t as usize) * tps / PEAK_FLOPS,
        peak_mem_gib: crate::device::peak_memory(device) as f64 / (1u64 << 30) as f64,
        params: n_params,
    })
}

#[derive(Debug, Serialize)]
pub struct OpBench {
    pub attention: String,
    pub implementation: String,
    pub batch_heads: i64,
    pub seq_len: i64,
    pub head_dim: i64,
    pub window: i64,
    pub fwd_bwd_ms: f64,
}

/// Time the attention op alone, forward + backward, on `[b, h, t, hd]` inputs.
pub fn attention_bench(kind: AttentionKind, imp: AttentionImpl, shape: [i64; 4], window: i64, device: Device, reps: usize) -> Result<OpBench> {
    attention_bench_traced(kind, imp, shape, window, device, reps, None)
}

/// `attention_bench`, with the timed repetitions profiled into the Chrome trace `trace` when given.
pub fn attention_bench_traced(kind: AttentionKind, imp: AttentionImpl, shape: [i64; 4], window: i64, device: Device, reps: usize, trace: Option<&Path>) -> Result<OpBench> {
    let kind_t = if device.is_cuda() { Kind::BFloat16 } else { Kind::Float };
    // The inputs as the model hands them to the op: views [b, h, t, hd] of [b, t, h, hd] memory (the
    // heads op's pieces), their gradients returned to the caller rather than accumulated into leaves
    // (the model's attention inputs are not leaves): neither a layout copy nor an accumulation is
    // the op's. Before 2026-12-06 the bench took contiguous [b, h, t, hd] leaves and `backward()`.
    let [b, h, t, hd] = shape;
    let leaves: Vec<Tensor> = (0..5).map(|_| Tensor::randn([b, t, h, hd], (kind_t, device)).set_requires_grad(true)).collect();
    let go = Tensor::randn(shape, (kind_t, device));
    // The op each kind computes (uniform: DAR with window 0).
    let window = kind.op_window(window);
    let run = || {
        let x: Vec<Tensor> = leaves.iter().map(|l| l.transpose(1, 2)).collect();
        let inputs = BenchInputs { q: &x[0], k: &x[1], v: &x[2], kg: &x[3], vg: &x[4], window, imp };
        let loss = (kind.bench_op(&inputs) * &go).sum(Kind::Float);
        // Inputs an op leaves unread (vanilla's distant pair) come back undefined.
        Tensor::run_backward(&[loss], &leaves.iter().collect::<Vec<_>>(), false, false);
    };
    for _ in 0..3 {
        run();
    }
    sync(device);
    let profiling = Profiling::start(trace, device)?;
    let start = Instant::now();
    for _ in 0..reps {
        kernels::scope("bench.op", &run);
    }
    sync(device);
    let elapsed = start.elapsed();
    profiling.stop()?;
    Ok(OpBench {
        attention: kind.name().into(),
        implementation: format!("{imp:?}").to_lowercase(),
        batch_heads: shape[0] * shape[1],
        seq_len: shape[2],
        head_dim: shape[3],
        window,
        fwd_bwd_ms: 1e3 * elapsed.as_secs_f64() / reps as f64,
    })
}

/// libtorch's profiler around a timed region when a trace path is given (nothing otherwise).
struct Profiling<'a>(Option<&'a Path>);

impl<'a> Profiling<'a> {
    fn start(trace: Option<&'a Path>, device: Device) -> Result<Self> {
        if trace.is_some() {
            kernels::profiler_start(device.is_cuda())?;
        }
        Ok(Profiling(trace))
    }

    /// Write the trace (the caller has synchronised the device).
    fn stop(self) -> Result<()> {
        if let Some(path) = self.0 {
            kernels::profiler_stop(path)?;
        }
        Ok(())
    }
}

/// One profiled measurement: its trace (relative to the profile directory), the repetitions in it,
/// and the measurement itself (timed under the profiler, so slower than without).
#[derive(Debug, Serialize)]
pub struct ProfiledRun<'a, R: Serialize> {
    pub trace: String,
    pub reps: usize,
    pub what: &'static str,
    pub result: &'a R,
}

/// `attnlab bench --profile DIR`: the same measurements as without it (the training step of the
/// spec; with `attention_only`, the op of vanilla and of the spec's kind at its implementation
/// `auto`), each under libtorch's profiler, one Chrome trace per measurement in `dir` and one line
/// per trace in `dir/runs.jsonl`, which scripts/profile_table.py reads. Returns the runs' lines.
pub fn profile(spec: &Spec, dir: &Path, attention_only: bool, vocab: usize, warmup: usize, steps: usize) -> Result<Vec<String>> {
    std::fs::create_dir_all(dir).map_err(|e| crate::Error::io(dir, e))?;
    let mut lines = Vec::new();
    if attention_only {
        let device = crate::device::parse_device(spec.train.device.as_deref().unwrap_or("auto"))?;
        let s = spec.shape();
        let shape = [spec.batch_size() as i64, s.heads as i64, spec.seq_len() as i64, (s.d_model / s.heads) as i64];
        let window = spec.attention.window_len().unwrap_or(128) as i64;
        let mut kinds = vec![AttentionKind::Vanilla];
        if !spec.attention.is_vanilla() {
            kinds.push(spec.attention.kind());
        }
        for kind in kinds {
            let trace = format!("op-{}.json", kind.name());
            let r = attention_bench_traced(kind, AttentionImpl::Auto, shape, window, device, steps, Some(&dir.join(&trace)))?;
            lines.push(json_line(&ProfiledRun { trace, reps: steps, what: "op", result: &r }));
        }
    } else {
        let trace = format!("step-{}.json", spec.attention.kind().name());
        let r = train_bench_traced(spec, vocab, warmup, steps, Some(&dir.join(&trace)))?;
        lines.push(json_line(&ProfiledRun { trace, reps: steps, what: "step", result: &r }));
    }
    append_runs(dir, &lines)?;
    Ok(lines)
}

/// Add `lines` to `dir/runs.jsonl` (what scripts/profile_table.py reads).
fn append_runs(dir: &Path, lines: &[String]) -> Result<()> {
    let runs = dir.join("runs.jsonl");
    let mut text = std::fs::read_to_string(&runs).unwrap_or_default();
    lines.iter().for_each(|l| text.push_str(&format!("{l}\n")));
    std::fs::write(&runs, text).map_err(|e| crate::Error::io(&runs, e))
}

/// `attention_bench` for every attention kind and implementation at the spec's shape; `each` gets
/// every row and the first row's (vanilla's) time.
pub fn bench_all(spec: &Spec, reps: usize, mut each: impl FnMut(&OpBench, f64)) -> Result<()> {
    let device = crate::device::parse_device(spec.train.device.as_deref().unwrap_or("auto"))?;
    let s = spec.shape();
    let hd = (s.d_model / s.heads) as i64;
    let shape = [spec.batch_size() as i64, s.heads as i64, spec.seq_len() as i64, hd];
    let window = spec.attention.window_len().unwrap_or(128) as i64;
    let imps: Vec<AttentionImpl> = if device.is_cuda() {
        vec![AttentionImpl::Auto, AttentionImpl::SplitMergeFused, AttentionImpl::SplitMergeBand, AttentionImpl::SplitMerge, AttentionImpl::Sdpa]
    } else {
        vec![AttentionImpl::Auto, AttentionImpl::BandSplit, AttentionImpl::Sdpa, AttentionImpl::Reference]
    };
    let mut base_ms = None;
    // The table keeps vanilla and the bottleneck kinds (the DAR paper's); `attention_bench` times the others.
    for kind in AttentionKind::ALL.into_iter().filter(|k| k.is_vanilla() || k.has_bottleneck()) {
        for &imp in &imps {
            if kind.is_vanilla() && !matches!(imp, AttentionImpl::Auto | AttentionImpl::Reference) {
                continue;
            }
            let r = attention_bench(kind, imp, shape, window, device, reps)?;
            let base = *base_ms.get_or_insert(r.fwd_bwd_ms);
            each(&r, base);
        }
    }
    Ok(())
}

/// What `attnlab bench` measures.
#[derive(Debug, Clone)]
pub enum BenchMode {
    /// `profile`: the training step (or with `attention_only` the op) under libtorch's profiler,
    /// traces in `dir`.
    Profile { dir: PathBuf, attention_only: bool, vocab: usize, warmup: usize, steps: usize },
    /// Training steps (`train_bench`) with `vocab` rows when the spec does not fix them.
    Steps { vocab: usize, warmup: usize, steps: usize },
    /// The attention op alone, `reps` timed repetitions per kind and implementation (`bench_all`).
    AttentionOnly { reps: usize },
    /// The correctness gate: every fast attention path and the loss head (`check::check_all`).
    Check,
}

/// A result as one JSON line.
pub fn json_line(r: &impl Serialize) -> String {
    serde_json::to_string(r).expect("bench rows serialize")
}

impl TrainBench {
    pub fn line(&self) -> String {
        let r = self;
        format!(
            "{} ({}), micro-batch {} × T {} on {}: {:.1} ms/step, {:.0} tokens/s, MFU {:.1}%, peak {:.2} GiB, {} params",
            r.name, r.attention, r.micro_batch, r.seq_len, r.device, r.step_ms, r.tokens_per_s, 100.0 * r.mfu, r.peak_mem_gib, r.params
        )
    }
}

impl OpBench {
    /// A table line; `base_ms`: vanilla's time, which the line compares against.
    pub fn line(&self, base_ms: f64) -> String {
        let r = self;
        format!("{:8} {:10} B·H {} T {} hd {} w {:4}: {:8.3} ms fwd+bwd ({:.2}× vanilla)", r.attention, r.implementation, r.batch_heads, r.seq_len, r.head_dim, r.window, r.fwd_bwd_ms, r.fwd_bwd_ms / base_ms)
    }
}

/// `attnlab bench`: measure `mode`, handing `line` every result as it comes (a JSON line with
/// `json`, else a table line). `Check` is an error when any check failed, after all were shown.
pub fn bench_command(spec: &Spec, mode: BenchMode, json: bool, mut line: impl FnMut(String)) -> Result<()> {
    fn pick<R: Serialize>(json: bool, r: &R, text: impl FnOnce() -> String) -> String {
        if json { json_line(r) } else { text() }
    }
    match mode {
        BenchMode::Check => {
            let failed = check::check_all(spec, |r| line(pick(json, r, || r.line())))?;
            if failed > 0 {
                return Err(crate::Error::Other(format!("{failed} checks failed")));
            }
        }
        BenchMode::Profile { dir, attention_only, vocab, warmup, steps } => {
            for l in profile(spec, &dir, attention_only, vocab, warmup, steps)? {
                line(l);
            }
        }
        BenchMode::AttentionOnly { reps } => bench_all(spec, reps, |r, base| line(pick(json, r, || r.line(base))))?,
        BenchMode::Steps { vocab, warmup, steps } => {
            let r = train_bench(spec, vocab, warmup, steps)?;
            line(pick(json, &r, || r.line()));
        }
    }
    Ok(())
}

/// `attnlab bench-decode`'s rows: read back from an earlier `--json` run's output (`from`), or
/// measured with random weights at the size of the spec `src` names, for the `--attention` list
/// `attention`, each (attention, length) `repeats` times, interleaved; `each` gets every measured row
/// as it comes.
#[allow(clippy::too_many_arguments)]
#[allow(clippy::too_many_arguments)]
pub fn decode_rows(
    from: Option<&std::path::Path>,
    src: &crate::spec::SpecSource,
    attention: &str,
    lengths: &[i64],
    new_tokens: usize,
    repeats: usize,
    vocab: usize,
    profile: Option<&Path>,
    each: impl FnMut(&crate::eval::generate::DecodeBench),
) -> Result<Vec<crate::eval::generate::DecodeBench>> {
    use crate::eval::decode_bench;
    if let Some(f) = from {
        return decode_bench::read_rows(&std::fs::read_to_string(f).map_err(|e| crate::Error::io(f, e))?);
    }
    let base = src.load()?;
    let device = crate::device::parse_device(base.train.device.as_deref().unwrap_or("auto"))?;
    eprintln!("random-initialised weights and random prompt tokens: cache memory and speed only, not quality");
    if let Some(dir) = profile {
        std::fs::create_dir_all(dir).map_err(|e| crate::Error::io(dir, e))?;
    }
    use crate::eval::generate::Traced;
    let part = Traced::from_env();
    let rows = decode_bench::run(&base, &decode_bench::split_names(attention), lengths, new_tokens, repeats, vocab, device, profile.map(|d| (d, part)), each)?;
    if let Some(dir) = profile {
        // One line per trace for scripts/profile_table.py: a repetition is one decode step, or the
        // one prefill where that was traced.
        let lines: Vec<String> = rows
            .iter()
            .map(|r| {
                let reps = match part {
                    Traced::Decode => r.steps.max(1) as usize,
                    Traced::Prefill => 1,
                };
                json_line(&ProfiledRun { trace: decode_bench::trace_name(part, &r.attention, r.context, r.repeat), reps, what: part.name(), result: r })
            })
            .collect();
        append_runs(dir, &lines)?;
    }
    Ok(rows)
}

/// A measured bench-decode row as a progress line.
pub fn decode_line(r: &crate::eval::generate::DecodeBench) -> String {
    format!(
        "{:12} context {:6} (run {}): cache {:>12} bytes ({:8.1} B/token), prefill {:7.3}s, decode {:8.1} tokens/s",
        r.attention, r.context, r.repeat + 1, r.cache_bytes, r.cache_bytes_per_token, r.prefill_s, r.decode_tokens_per_s
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_lines_compare_with_vanilla() {
        let op = OpBench { attention: "dar".into(), implementation: "auto".into(), batch_heads: 8, seq_len: 64, head_dim: 16, window: 4, fwd_bwd_ms: 3.0 };
        assert!(op.line(2.0).ends_with("(1.50× vanilla)"), "{}", op.line(2.0));
    }

    /// `bench --profile` on CPU: one trace per measurement with the bench's and the model's named
    /// scopes in it (a CUDA run adds the kernels), listed in runs.jsonl.
    #[test]
    fn profile_mode_writes_traces_with_the_named_scopes() {
        let _rng = crate::testutil::rng();
        let sets = ["train.device=cpu", "data.seq_len=16", "train.batch_size=2", "attention={kind: dar, d_down: 8, window: 4}"];
        let spec = crate::spec::SpecSource { sets: sets.iter().map(|s| s.to_string()).collect(), ..Default::default() }.load().unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let mut lines = Vec::new();
        bench_command(&spec, BenchMode::Profile { dir: tmp.path().into(), attention_only: true, vocab: 64, warmup: 1, steps: 2 }, true, |l| lines.push(l)).unwrap();
        bench_command(&spec, BenchMode::Profile { dir: tmp.path().into(), attention_only: false, vocab: 64, warmup: 1, steps: 2 }, true, |l| lines.push(l)).unwrap();
        let runs = std::fs::read_to_string(tmp.path().join("runs.jsonl")).unwrap();
        assert_eq!(runs.lines().collect::<Vec<_>>(), lines);
        let names = |trace: &str| -> Vec<String> {
            let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(tmp.path().join(trace)).unwrap()).unwrap();
            v["traceEvents"].as_array().unwrap().iter().filter_map(|e| e["name"].as_str().map(String::from)).collect()
        };
        let count = |names: &[String], n: &str| names.iter().filter(|x| *x == n).count();
        let traces: Vec<String> = lines.iter().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["trace"].as_str().unwrap().to_string()).collect();
        assert_eq!(traces, ["op-vanilla.json", "op-dar.json", "step-dar.json"]);
        let op = names("op-dar.json");
        assert_eq!(count(&op, "bench.op"), 2, "{op:?}");
        assert!(op.iter().any(|n| n.starts_with("aten::")), "{op:?}");
        let step = names("step-dar.json");
        assert_eq!(count(&step, "bench.step"), 2);
        // The tiny model's layers, once per step each (spec default layers).
        let layers = spec.shape().layers;
        assert_eq!(count(&step, "dar.distant_kv"), 2 * layers, "{step:?}");
        assert_eq!(count(&step, "attn.op"), 2 * layers);
    }

    /// `bench-decode --profile` on CPU: one trace per row with its decode steps and not its prefill
    /// (one embedding lookup a step: a traced prefill would add one), listed in runs.jsonl with the
    /// steps as repetitions.
    #[test]
    fn decode_profile_traces_the_steps_alone() {
        let _rng = crate::testutil::rng();
        let src = crate::spec::SpecSource { sets: vec!["train.device=cpu".into()], ..Default::default() };
        let tmp = tempfile::tempdir().unwrap();
        let rows = decode_rows(None, &src, "vanilla,dar", &[24], 5, 1, 64, Some(tmp.path()), |_| {}).unwrap();
        let runs: Vec<serde_json::Value> = std::fs::read_to_string(tmp.path().join("runs.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(runs.len(), 2);
        for (run, row) in runs.iter().zip(&rows) {
            let trace = run["trace"].as_str().unwrap();
            assert_eq!(trace, format!("decode-{}-24-r0.json", row.attention));
            assert!(row.steps > 0 && run["reps"].as_i64() == Some(row.steps), "{run}");
            let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(tmp.path().join(trace)).unwrap()).unwrap();
            let embeddings = v["traceEvents"].as_array().unwrap().iter().filter(|e| e["name"] == "aten::embedding").count() as i64;
            assert_eq!(embeddings, row.steps, "{trace}");
        }
    }
}
