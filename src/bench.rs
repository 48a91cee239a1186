//! `attnlab bench`: time training steps (or the attention op alone) on synthetic tokens, and report
//! tokens/s, MFU (PaLM convention, pythia.md §6) and peak GPU memory. Speed goals live here, never
//! in unit tests.
use crate::attention;
use crate::attention::kinds::BenchInputs;
use crate::spec::{AttentionImpl, AttentionKind, Spec};
use crate::train::{self, optim};
use crate::Result;
use crate::kernels;
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
    let mk = || Tensor::randn(shape, (kind_t, device)).set_requires_grad(true);
    let (q, kl, vl, kg, vg) = (mk(), mk(), mk(), mk(), mk());
    let go = Tensor::randn(shape, (kind_t, device));
    // The op each kind computes (uniform: DAR with window 0).
    let window = kind.op_window(window);
    let inputs = BenchInputs { q: &q, k: &kl, v: &vl, kg: &kg, vg: &vg, window, imp };
    let run = || {
        let o = kind.bench_op(&inputs);
        (o * &go).sum(Kind::Float).backward();
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
    let runs = dir.join("runs.jsonl");
    let mut text = std::fs::read_to_string(&runs).unwrap_or_default();
    lines.iter().for_each(|l| text.push_str(&format!("{l}\n")));
    std::fs::write(&runs, text).map_err(|e| crate::Error::io(&runs, e))?;
    Ok(lines)
}

#[derive(Debug, Serialize)]
pub struct CheckRow {
    pub implementation: String,
    pub shape: [i64; 4],
    pub window: i64,
    /// Per-row relative error (`row_rel_err`) of the output and of each input gradient
    /// (q, k_l, v_l, k_g, v_g).
    pub rel_err: [f64; 6],
    /// Sequence position of the worst row of each (where an off-by-one boundary shows).
    pub worst_pos: [i64; 6],
    pub pass: bool,
}

/// Per-row relative error of `fast` against `reference` (same shape; a row is the last axis: one
/// query's output or gradient, one key's gradient): ‖fast_r − ref_r‖₂ / max(‖ref_r‖₂, floor), and the
/// index of the worst row. One global max would let a large row hide a wrong small one; the floor
/// (1e-3 × the mean row norm) keeps rows the reference leaves at zero held to (near) zero.
pub fn row_rel_err(fast: &Tensor, reference: &Tensor) -> (f64, i64) {
    let last = reference.size().last().copied().unwrap_or(1);
    let rows = |t: &Tensor| t.to_kind(Kind::Double).reshape([-1, last]);
    let (a, b) = (rows(fast), rows(reference));
    let norm = |t: &Tensor| t.square().sum_dim_intlist([-1i64].as_slice(), false, Kind::Double).sqrt();
    let ref_norm = norm(&b);
    let floor = (1e-3 * ref_norm.mean(Kind::Double).double_value(&[])).max(f64::MIN_POSITIVE);
    let err = norm(&(a - &b)) / ref_norm.clamp_min(floor);
    // NaN anywhere is the worst row.
    let err = err.nan_to_num(f64::INFINITY, f64::INFINITY, f64::INFINITY);
    let worst = err.argmax(0, false).int64_value(&[]);
    (err.double_value(&[worst]), worst)
}

/// Compare a fast DAR implementation with the reference on the same (device-dtype) inputs.
pub fn attention_check(imp: AttentionImpl, shape: [i64; 4], window: i64, device: Device, tol: f64) -> CheckRow {
    let fast = |xs: &[Tensor]| attention::dar(&xs[0], &xs[1], &xs[2], &xs[3], &xs[4], window, imp);
    attention_check_with(&format!("{imp:?}").to_lowercase(), &fast, shape, window, device, tol)
}

/// `attention_check` of any function of (q, k_l, v_l, k_g, v_g) against the fp32 reference (fp64 on
/// CPU) at `window`: output and the gradients of all five inputs for one random upstream gradient.
/// Pass if every per-row relative error < `tol`. Tests hand it planted wrong implementations.
pub fn attention_check_with(name: &str, fast: &dyn Fn(&[Tensor]) -> Tensor, shape: [i64; 4], window: i64, device: Device, tol: f64) -> CheckRow {
    let kind = if device.is_cuda() { Kind::BFloat16 } else { Kind::Double };
    tch::manual_seed(window + 17 * shape[2]);
    let inputs: Vec<Tensor> = (0..5).map(|_| Tensor::randn(shape, (kind, device)).set_requires_grad(true)).collect();
    let go = Tensor::randn(shape, (kind, device));
    // bf16 kernels are checked against an fp32 reference, fp64 ones against fp64; errors in fp64.
    let exact = if kind == Kind::Double { Kind::Double } else { Kind::Float };
    let run = |f: &dyn Fn(&[Tensor]) -> Tensor, xs: &[Tensor]| {
        let o = f(xs);
        let g = Tensor::run_backward(&[(&o.to_kind(exact) * go.to_kind(exact)).sum(exact)], &xs.iter().collect::<Vec<_>>(), false, false);
        let g = g.into_iter().zip(xs).map(|(g, x)| if g.defined() { g } else { x.zeros_like() });
        std::iter::once(o.detach()).chain(g).map(|t| t.to_kind(Kind::Double)).collect::<Vec<_>>()
    };
    let got = run(fast, &inputs);
    // The reference computes from the very same values.
    let ref_inputs: Vec<Tensor> = inputs.iter().map(|t| t.detach().to_kind(exact).set_requires_grad(true)).collect();
    let reference = run(&|xs: &[Tensor]| attention::dar(&xs[0], &xs[1], &xs[2], &xs[3], &xs[4], window, AttentionImpl::Reference), &ref_inputs);
    let (mut rel_err, mut worst_pos) = ([0.0; 6], [0; 6]);
    for (i, (a, b)) in got.iter().zip(&reference).enumerate() {
        let (e, row) = row_rel_err(a, b);
        rel_err[i] = e;
        worst_pos[i] = row % shape[2];
    }
    CheckRow { implementation: name.to_string(), shape, window, pass: rel_err.iter().all(|e| e.is_finite() && *e < tol), rel_err, worst_pos }
}

/// Every fast path against the reference at the spec's shape and a ragged one, over windows inside,
/// at and beyond the sequence (per-row relative error; bf16 kernels vs fp32 on CUDA: 3e-2; fp64 on CPU: 1e-9).
/// Calls `each` per row; returns how many failed.
pub fn check_all(spec: &Spec, mut each: impl FnMut(&CheckRow)) -> Result<usize> {
    let device = crate::device::parse_device(spec.train.device.as_deref().unwrap_or("auto"))?;
    let s = spec.shape();
    let (t, hd) = (spec.seq_len() as i64, (s.d_model / s.heads) as i64);
    let shapes = [[spec.batch_size() as i64, s.heads as i64, t, hd], [1, 3, t / 2 + 3, hd]];
    let imps: &[AttentionImpl] = if device.is_cuda() {
        &[AttentionImpl::Sdpa, AttentionImpl::SplitMerge, AttentionImpl::SplitMergeCudnn, AttentionImpl::SplitMergeFused]
    } else {
        &[AttentionImpl::Sdpa]
    };
    let tol = if device.is_cuda() { 3e-2 } else { 1e-9 };
    let mut failed = 0;
    for shape in shapes {
        for w in [0, 1, 4, 64, 128, 256, shape[2], shape[2] + 5] {
            for &imp in imps {
                let r = attention_check(imp, shape, w, device, tol);
                failed += usize::from(!r.pass);
                each(&r);
            }
        }
    }
    Ok(failed)
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
        vec![AttentionImpl::Auto, AttentionImpl::SplitMergeFused, AttentionImpl::SplitMerge, AttentionImpl::Sdpa]
    } else {
        vec![AttentionImpl::Auto, AttentionImpl::Reference]
    };
    let mut base_ms = None;
    // The table keeps vanilla and the bottleneck kinds (the DAR paper's); `attention_bench` times the others.
    for kind in AttentionKind::ALL.into_iter().filter(|k| k.is_vanilla() || k.has_bottleneck()) {
        for &imp in &imps {
            if kind.is_vanilla() && imp != AttentionImpl::Auto && device.is_cuda() {
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
    /// Every fast DAR path against the reference (`check_all`).
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

impl CheckRow {
    pub fn line(&self) -> String {
        let e = self.rel_err.iter().map(|e| format!("{e:.1e}")).collect::<Vec<_>>().join(" ");
        // A failure names the sequence position of each tensor's worst row.
        let status = if self.pass { "ok".to_string() } else { format!("(worst rows at t {:?})  FAIL", self.worst_pos) };
        format!("{:18} {:?} w {:5}: per-row rel err out/dq/dkl/dvl/dkg/dvg {e}  {status}", self.implementation, self.shape, self.window)
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
            let failed = check_all(spec, |r| line(pick(json, r, || r.line())))?;
            if failed > 0 {
                return Err(crate::Error::Other(format!("{failed} attention checks failed")));
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
pub fn decode_rows(
    from: Option<&std::path::Path>,
    src: &crate::spec::SpecSource,
    attention: &str,
    lengths: &[i64],
    new_tokens: usize,
    repeats: usize,
    vocab: usize,
    each: impl FnMut(&crate::eval::generate::DecodeBench),
) -> Result<Vec<crate::eval::generate::DecodeBench>> {
    use crate::eval::decode_bench;
    if let Some(f) = from {
        return decode_bench::read_rows(&std::fs::read_to_string(f).map_err(|e| crate::Error::io(f, e))?);
    }
    let base = src.load()?;
    let device = crate::device::parse_device(base.train.device.as_deref().unwrap_or("auto"))?;
    eprintln!("random-initialised weights and random prompt tokens: cache memory and speed only, not quality");
    decode_bench::run(&base, &decode_bench::split_names(attention), lengths, new_tokens, repeats, vocab, device, each)
}

/// A measured bench-decode row as a progress line.
pub fn decode_line(r: &crate::eval::generate::DecodeBench) -> String {
    format!(
        "{:12} context {:6} (run {}): cache {:>12} bytes ({:8.1} B/token), prefill {:7.3}s, decode {:8.1} tokens/s",
        r.attention, r.context, r.repeat + 1, r.cache_bytes, r.cache_bytes_per_token, r.prefill_s, r.decode_tokens_per_s
    )
}

#[cfg(test)]
mod line_tests {
    use super::*;

    #[test]
    fn check_lines_say_ok_or_fail_and_json_lines_parse() {
        let mut r = CheckRow { implementation: "sdpa".into(), shape: [1, 2, 8, 4], window: 4, rel_err: [1e-10; 6], worst_pos: [0; 6], pass: true };
        assert!(r.line().starts_with("sdpa               [1, 2, 8, 4] w     4: per-row rel err") && r.line().ends_with("  ok"), "{}", r.line());
        r.pass = false;
        assert!(r.line().ends_with("FAIL"));
        let v: serde_json::Value = serde_json::from_str(&json_line(&r)).unwrap();
        assert_eq!(v["pass"], false);
        let op = OpBench { attention: "dar".into(), implementation: "auto".into(), batch_heads: 8, seq_len: 64, head_dim: 16, window: 4, fwd_bwd_ms: 3.0 };
        assert!(op.line(2.0).ends_with("(1.50× vanilla)"), "{}", op.line(2.0));
    }

    #[test]
    fn check_mode_shows_every_window_and_fails_with_the_count_of_failures() {
        let spec = crate::spec::SpecSource { sets: vec!["train.device=cpu".into(), "data.seq_len=16".into()], ..Default::default() }.load().unwrap();
        let mut lines = Vec::new();
        let r = bench_command(&spec, BenchMode::Check, false, |l| lines.push(l));
        // 2 shapes × 8 windows × 1 CPU implementation.
        assert_eq!(lines.len(), 16, "{lines:?}");
        let failed = lines.iter().filter(|l| l.ends_with("FAIL")).count();
        assert_eq!(failed + lines.iter().filter(|l| l.ends_with("  ok")).count(), 16, "{lines:?}");
        // On CPU the fast path (SDPA, fp64) must equal the fp64 reference within 1e-9.
        assert_eq!(failed, 0, "{lines:?}");
        match r {
            Ok(()) => assert_eq!(failed, 0),
            Err(e) => assert_eq!(e.to_string(), format!("{failed} attention checks failed")),
        }
    }
}

#[cfg(test)]
mod check_tests {
    use super::*;
    use crate::attention::{dar_masks, masked_softmax_attention};

    fn rows(v: &[f64], n: i64) -> Tensor {
        Tensor::from_slice(v).view([-1, n])
    }

    /// A wrong small row next to a large one: 0.5 off in a row of norm √2 is 35% per row, while one
    /// global max (0.5 / 1000) would call it 5e-4.
    #[test]
    fn per_row_error_sees_a_small_row_that_a_global_max_hides() {
        let reference = rows(&[1000.0, 0.0, 1.0, 1.0], 2);
        let fast = rows(&[1000.0, 0.0, 1.5, 1.0], 2);
        let (e, row) = row_rel_err(&fast, &reference);
        assert!((e - 0.5 / 2f64.sqrt()).abs() < 1e-12 && row == 1, "{e} at row {row}");
        assert_eq!(row_rel_err(&reference, &reference), (0.0, 0));
    }

    /// Rows the reference leaves at zero are judged against 1e-3 of the mean row norm, not 0/0; an
    /// all-zero reference (k_l's gradient at w = 0) passes only exact zeros; NaN is the worst.
    #[test]
    fn zero_rows_are_held_to_zero_and_nan_fails() {
        let reference = rows(&[3.0, 4.0, 0.0, 0.0], 2); // row norms 5 and 0: floor 1e-3 · 2.5
        let (e, row) = row_rel_err(&rows(&[3.0, 4.0, 0.0, 1e-6], 2), &reference);
        assert!((e - 1e-6 / 2.5e-3).abs() < 1e-12 && row == 1, "{e} at row {row}");
        let zeros = Tensor::zeros([3, 2], (Kind::Double, Device::Cpu));
        assert_eq!(row_rel_err(&zeros, &zeros).0, 0.0);
        assert!(row_rel_err(&rows(&[0.0, 0.0, 0.0, 1e-30, 0.0, 0.0], 2), &zeros).0 > 1.0);
        let (e, row) = row_rel_err(&rows(&[3.0, 4.0, f64::NAN, 0.0], 2), &reference);
        assert!(e.is_infinite() && row == 1, "{e} at row {row}");
    }

    /// Planted wrong implementations fail `attention_check_with` wherever they compute another
    /// function, and the fast path passes, at windows 0, 1, inside, T − 1, T and T + 5:
    /// `wide` (the reference at w + 1), `narrow` (at w − 1), `peek` (the local band one key into the
    /// future: distance −1 counts as local). w ± 1 is the same function once both are ≥ T (and at w = 0
    /// for `narrow`); there the check must pass, and `peek` must still fail.
    #[test]
    fn planted_off_by_one_window_boundaries_fail_the_check() {
        let (t, dev) = (12i64, Device::Cpu);
        let shape = [1, 2, t, 8];
        let reference_at = |w: i64| move |xs: &[Tensor]| crate::attention::dar(&xs[0], &xs[1], &xs[2], &xs[3], &xs[4], w, AttentionImpl::Reference);
        for w in [0, 1, 4, t - 1, t, t + 5] {
            let fast = attention_check(AttentionImpl::Sdpa, shape, w, dev, 1e-9);
            assert!(fast.pass, "sdpa: {}", fast.line());
            let wide = attention_check_with("wide", &reference_at(w + 1), shape, w, dev, 1e-9);
            assert_eq!(wide.pass, w >= t, "{}", wide.line());
            let narrow = attention_check_with("narrow", &reference_at((w - 1).max(0)), shape, w, dev, 1e-9);
            assert_eq!(narrow.pass, w == 0 || w > t, "{}", narrow.line());
            let peek = move |xs: &[Tensor]| {
                let (_, global) = dar_masks(t, w, dev);
                let i = Tensor::arange(t, (Kind::Int64, dev)).unsqueeze(1);
                let dist = i - Tensor::arange(t, (Kind::Int64, dev)).unsqueeze(0);
                let local = dist.ge(-1).logical_and(&dist.lt(w));
                masked_softmax_attention(&xs[0], &[(&xs[1], &xs[2], &local), (&xs[3], &xs[4], &global)])
            };
            let peek = attention_check_with("peek", &peek, shape, w, dev, 1e-9);
            assert!(!peek.pass, "{}", peek.line());
            // The failing rows are real errors, far above fp64 rounding.
            for r in [&wide, &narrow, &peek].into_iter().filter(|r| !r.pass) {
                assert!(r.rel_err.iter().cloned().fold(0.0, f64::max) > 1e-3, "{}", r.line());
            }
        }
    }

    /// `bench --profile` on CPU: one trace per measurement with the bench's and the model's named
    /// scopes in it (a CUDA run adds the kernels), listed in runs.jsonl.
    #[test]
    fn profile_mode_writes_traces_with_the_named_scopes() {
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

    /// Split-merge on heads `[B, H, T, hd]` through the C++ op with the kernels' math (CPU, fp64).
    fn split_merge_math(xs: &[Tensor], w: i64, fused: bool) -> Tensor {
        let bthd = |x: &Tensor| x.transpose(1, 2);
        kernels::dar_split_merge(&bthd(&xs[0]), &bthd(&xs[1]), &bthd(&xs[2]), &bthd(&xs[3]), &bthd(&xs[4]), w, kernels::GlobalBackend::Math, fused).unwrap().transpose(1, 2)
    }

    /// The split-merge glue of csrc/dar_attention.cpp (log-sum-exp merge, each part's backward fed
    /// the merged O and lse, dQ summed, dK_g / dV_g scattered), unfused and fused (issue 28), with
    /// the kernels' math on CPU in fp64: output and all five input gradients equal the reference per
    /// row to 1e-9, for w at both ends of 0 < w < T and between, with B > 1 (strided narrows).
    #[test]
    fn split_merge_glue_is_exact_in_fp64() {
        let (t, shape) = (11i64, [2, 3, 11, 8]);
        for w in [1, 4, t - 1] {
            for fused in [false, true] {
                let f = move |xs: &[Tensor]| split_merge_math(xs, w, fused);
                let r = attention_check_with(if fused { "fused" } else { "unfused" }, &f, shape, w, Device::Cpu, 1e-9);
                assert!(r.pass, "{}", r.line());
            }
        }
        // The same check fails the op run one key off (w − 1 against the reference at w).
        let f = |xs: &[Tensor]| split_merge_math(xs, 3, true);
        let r = attention_check_with("fused at w 3", &f, shape, 4, Device::Cpu, 1e-9);
        assert!(!r.pass, "{}", r.line());
    }
}
