//! `attnlab bench`: time training steps (or the attention op alone) on synthetic tokens, and report
//! tokens/s, MFU (PaLM convention, pythia.md §6) and peak GPU memory. Speed goals live here, never
//! in unit tests.
use crate::attention;
use crate::spec::{AttentionImpl, AttentionKind, Spec};
use crate::train::{self, optim};
use crate::Result;
use serde::Serialize;
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
    let start = Instant::now();
    let mut last = Tensor::zeros([], (Kind::Float, device));
    for _ in 0..steps {
        last = train::step_once(&model, &mut opt, std::iter::once(batch()), autocast, 1.0, 1e-4, device)?.0;
    }
    sync(device);
    let secs = start.elapsed().as_secs_f64();
    let loss = last.double_value(&[]);
    if !loss.is_finite() {
        return Err(crate::Error::Diverged { step: steps as u64, msg: format!("bench loss {loss}") });
    }
    let tokens = (b * t) as f64 * steps as f64;
    let tps = tokens / secs;
    Ok(TrainBench {
        name: spec.name.clone().unwrap_or_default(),
        flavor: spec.model.flavor.map(|f| serde_yaml::to_string(&f).unwrap_or_default().trim().to_string()).unwrap_or_else(|| "custom".into()),
        attention: spec.attention.kind.name().into(),
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
    let kind_t = if device.is_cuda() { Kind::BFloat16 } else { Kind::Float };
    let mk = || Tensor::randn(shape, (kind_t, device)).set_requires_grad(true);
    let (q, kl, vl, kg, vg) = (mk(), mk(), mk(), mk(), mk());
    let go = Tensor::randn(shape, (kind_t, device));
    // The op each kind computes (uniform: DAR with window 0).
    let window = kind.op_window(window);
    let run = || {
        let o = match kind {
            AttentionKind::Vanilla => attention::causal(&q, &kl, &vl, imp),
            AttentionKind::Dar | AttentionKind::Uniform => attention::dar(&q, &kl, &vl, &kg, &vg, window, imp),
            AttentionKind::Window => attention::window::forward(&q, &kl, &vl, window, None, imp),
        };
        (o * &go).sum(Kind::Float).backward();
    };
    for _ in 0..3 {
        run();
    }
    sync(device);
    let start = Instant::now();
    for _ in 0..reps {
        run();
    }
    sync(device);
    Ok(OpBench {
        attention: kind.name().into(),
        implementation: format!("{imp:?}").to_lowercase(),
        batch_heads: shape[0] * shape[1],
        seq_len: shape[2],
        head_dim: shape[3],
        window,
        fwd_bwd_ms: 1e3 * start.elapsed().as_secs_f64() / reps as f64,
    })
}

#[derive(Debug, Serialize)]
pub struct CheckRow {
    pub implementation: String,
    pub shape: [i64; 4],
    pub window: i64,
    /// Max |error| relative to the reference's max |value|, for the output and each input gradient.
    pub rel_err: [f64; 6],
    pub pass: bool,
}

/// Compare a fast DAR implementation with the fp32 reference on the same (device-dtype) inputs:
/// output and the gradients of q, k_l, v_l, k_g, v_g. Pass if every relative error < `tol`.
pub fn attention_check(imp: AttentionImpl, shape: [i64; 4], window: i64, device: Device, tol: f64) -> CheckRow {
    let kind = if device.is_cuda() { Kind::BFloat16 } else { Kind::Double };
    tch::manual_seed(window + 17 * shape[2]);
    let inputs: Vec<Tensor> = (0..5).map(|_| Tensor::randn(shape, (kind, device)).set_requires_grad(true)).collect();
    let go = Tensor::randn(shape, (kind, device));
    // bf16 kernels are checked against an fp32 reference, fp64 ones against fp64; errors in fp64.
    let exact = if kind == Kind::Double { Kind::Double } else { Kind::Float };
    let run = |imp: AttentionImpl, xs: &[Tensor]| {
        let o = attention::dar(&xs[0], &xs[1], &xs[2], &xs[3], &xs[4], window, imp);
        let g = Tensor::run_backward(&[(&o.to_kind(exact) * go.to_kind(exact)).sum(exact)], &xs.iter().collect::<Vec<_>>(), false, false);
        let g = g.into_iter().zip(xs).map(|(g, x)| if g.defined() { g } else { x.zeros_like() });
        std::iter::once(o.detach()).chain(g).map(|t| t.to_kind(Kind::Double)).collect::<Vec<_>>()
    };
    let fast = run(imp, &inputs);
    // The reference computes from the very same values.
    let ref_inputs: Vec<Tensor> = inputs.iter().map(|t| t.detach().to_kind(exact).set_requires_grad(true)).collect();
    let reference = run(AttentionImpl::Reference, &ref_inputs);
    let mut rel_err = [0.0; 6];
    for (i, (a, b)) in fast.iter().zip(&reference).enumerate() {
        let scale = b.abs().max().double_value(&[]).max(1e-6);
        rel_err[i] = (a - b).abs().max().double_value(&[]) / scale;
    }
    CheckRow { implementation: format!("{imp:?}").to_lowercase(), shape, window, pass: rel_err.iter().all(|e| e.is_finite() && *e < tol), rel_err }
}

/// Every fast path against the reference at the spec's shape and a ragged one, over windows inside,
/// at and beyond the sequence (bf16 kernels vs fp32 on CUDA: 3e-2 relative; fp64 on CPU: 1e-9).
/// Calls `each` per row; returns how many failed.
pub fn check_all(spec: &Spec, mut each: impl FnMut(&CheckRow)) -> Result<usize> {
    let device = crate::device::parse_device(spec.train.device.as_deref().unwrap_or("auto"))?;
    let s = spec.shape();
    let (t, hd) = (spec.seq_len() as i64, (s.d_model / s.heads) as i64);
    let shapes = [[spec.batch_size() as i64, s.heads as i64, t, hd], [1, 3, t / 2 + 3, hd]];
    let imps: &[AttentionImpl] = if device.is_cuda() { &[AttentionImpl::Sdpa, AttentionImpl::SplitMerge, AttentionImpl::SplitMergeCudnn] } else { &[AttentionImpl::Sdpa] };
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
    let window = spec.attention.window.unwrap_or(128);
    let imps: Vec<AttentionImpl> = if device.is_cuda() { vec![AttentionImpl::Auto, AttentionImpl::SplitMerge, AttentionImpl::Sdpa] } else { vec![AttentionImpl::Auto, AttentionImpl::Reference] };
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
#[derive(Debug, Clone, Copy)]
pub enum BenchMode {
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
        format!("{:18} {:?} w {:5}: rel err out/dq/dkl/dvl/dkg/dvg {e}  {}", self.implementation, self.shape, self.window, if self.pass { "ok" } else { "FAIL" })
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
        let mut r = CheckRow { implementation: "sdpa".into(), shape: [1, 2, 8, 4], window: 4, rel_err: [1e-10; 6], pass: true };
        assert!(r.line().starts_with("sdpa               [1, 2, 8, 4] w     4: rel err") && r.line().ends_with("  ok"), "{}", r.line());
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
