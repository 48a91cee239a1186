//! `attnlab bench --check`: the correctness gate every fast path passes before it is timed.
//!
//! The criterion is FlashAttention's own tests': a fast path's largest error against an exact
//! reference (fp32 on the GPU, fp64 on CPU) on the very same inputs may be at most [`FACTOR`] times
//! the largest error of PyTorch's math path *in the inputs' dtype* (bf16 on the GPU) against that
//! reference, plus a tiny floor relative to the reference's size. So a bf16 kernel is held to what
//! bf16 allows, row by row of nothing: a tiny early row whose relative error bf16 rounding of its
//! inputs already breaks no longer fails, while a wrong function (an off-by-one window, a key from
//! the future) is tens of times the bf16 error and fails. In fp64 both errors are ~1e-16 and the
//! floor (1e-9 of the reference) is the bound. Planted wrong implementations run in the same gate
//! and must fail it: the gate checks itself on the device it runs on.
use crate::attention::{self, dar_masks, masked_softmax_attention, masked_softmax_attention_in};
use crate::model::loss;
use crate::spec::{AttentionImpl, Spec};
use crate::Result;
use serde::Serialize;
use tch::{Device, Kind, Tensor};

/// A fast path may be this many times as far from the exact reference as the math path in its dtype.
pub const FACTOR: f64 = 3.0;

/// The floor of the bound, relative to the reference's largest entry.
fn floor(kind: Kind) -> f64 {
    if kind == Kind::Double {
        1e-9
    } else {
        1e-4
    }
}

/// One tensor of a check: its largest error, the math path's, the bound, and where the worst entry is.
#[derive(Debug, Clone, Serialize)]
pub struct TensorErr {
    pub name: &'static str,
    /// max |fast − exact|.
    pub err: f64,
    /// max |math in the inputs' dtype − exact|.
    pub baseline: f64,
    /// FACTOR · baseline + floor · max |exact| (or the problem's scale, when larger).
    pub bound: f64,
    /// The sequence position (or row) of the worst entry: where an off-by-one boundary shows.
    pub worst_at: i64,
}

impl TensorErr {
    pub fn within(&self) -> bool {
        self.err.is_finite() && self.err <= self.bound
    }
}

/// Compare `fast` and the in-dtype `baseline` with the `exact` reference (all promoted to fp64).
/// `positions`: the length of the axis `worst_at` reports (T for `[B, H, T, D]` heads); `scale`: the
/// problem's size the floor is relative to where the reference itself is ~0 (an exactly zero
/// gradient: dq when every query sees one key), else 0.
pub fn compare(name: &'static str, fast: &Tensor, baseline: &Tensor, exact: &Tensor, kind: Kind, positions: i64, scale: f64) -> TensorErr {
    let d = |t: &Tensor| t.to_kind(Kind::Double);
    let exact = d(exact);
    let diff = (d(fast) - &exact).abs().nan_to_num(f64::INFINITY, f64::INFINITY, f64::INFINITY).reshape([-1]);
    let worst = diff.argmax(0, false).int64_value(&[]);
    let last = exact.size().last().copied().unwrap_or(1).max(1);
    let err = diff.double_value(&[worst]);
    let baseline = (d(baseline) - &exact).abs().max().double_value(&[]);
    let bound = FACTOR * baseline + floor(kind) * exact.abs().max().double_value(&[]).max(scale);
    let row = if exact.dim() == 1 { worst } else { worst / last };
    TensorErr { name, err, baseline, bound, worst_at: row % positions.max(1) }
}

/// One row of the gate: an implementation at one shape (and window), its tensors, and the verdict.
#[derive(Debug, Serialize)]
pub struct CheckRow {
    pub implementation: String,
    pub shape: Vec<i64>,
    pub window: Option<i64>,
    pub dtype: String,
    pub tensors: Vec<TensorErr>,
    /// A deliberately wrong implementation: the row is right when it fails the bound.
    pub planted: bool,
    /// Every tensor within its bound.
    pub within: bool,
    /// The row came out as it should (`within`, or not `within` for a planted row).
    pub ok: bool,
}

impl CheckRow {
    fn new(implementation: &str, shape: &[i64], window: Option<i64>, kind: Kind, tensors: Vec<TensorErr>, planted: bool) -> Self {
        let within = tensors.iter().all(TensorErr::within);
        CheckRow { implementation: implementation.into(), shape: shape.to_vec(), window, dtype: format!("{kind:?}"), tensors, planted, within, ok: within != planted }
    }

    pub fn line(&self) -> String {
        let ratios = self.tensors.iter().map(|t| format!("{} {:.1e}/{:.1e}", t.name, t.err, t.bound)).collect::<Vec<_>>().join(" ");
        let w = self.window.map(|w| format!(" w {w:5}")).unwrap_or_default();
        let status = match (self.ok, self.planted) {
            (true, false) => "ok".to_string(),
            (true, true) => "ok (planted: fails as it must)".to_string(),
            (false, true) => "FAIL (planted wrong implementation passed: the gate cannot see it)".to_string(),
            (false, false) => {
                let at: Vec<String> = self.tensors.iter().filter(|t| !t.within()).map(|t| format!("{} at {}", t.name, t.worst_at)).collect();
                format!("(worst: {})  FAIL", at.join(", "))
            }
        };
        format!("{:20} {:?}{w} {}: err/bound {ratios}  {status}", self.implementation, self.shape, self.dtype)
    }
}

const DAR_TENSORS: [&str; 6] = ["out", "dq", "dkl", "dvl", "dkg", "dvg"];

/// Output and the gradients of all inputs of `f` for the upstream gradient `go`, in fp64.
fn run(f: &dyn Fn(&[Tensor]) -> Tensor, xs: &[Tensor], go: &Tensor) -> Vec<Tensor> {
    let o = f(xs);
    let g = Tensor::run_backward(&[(&o * go.to_kind(o.kind())).sum(o.kind())], &xs.iter().collect::<Vec<_>>(), false, false);
    let g = g.into_iter().zip(xs).map(|(g, x)| if g.defined() { g } else { x.zeros_like() });
    std::iter::once(o.detach()).chain(g).map(|t| t.to_kind(Kind::Double)).collect()
}

fn dar_reference(xs: &[Tensor], window: i64, kind: Option<Kind>) -> Tensor {
    let t = xs[0].size()[2];
    let (local, global) = dar_masks(t, window, xs[0].device());
    let parts = [(&xs[1], &xs[2], &local), (&xs[3], &xs[4], &global)];
    match kind {
        Some(k) => masked_softmax_attention_in(&xs[0], &parts, k),
        None => masked_softmax_attention(&xs[0], &parts),
    }
}

/// A fast DAR implementation at `window` in the gate, inputs of dtype `kind` on `device`.
pub fn attention_check(imp: AttentionImpl, shape: [i64; 4], window: i64, device: Device, kind: Kind) -> CheckRow {
    let fast = |xs: &[Tensor]| attention::dar(&xs[0], &xs[1], &xs[2], &xs[3], &xs[4], window, imp);
    attention_check_with(&format!("{imp:?}").to_lowercase(), &fast, shape, window, device, kind, false)
}

/// Any function of (q, k_l, v_l, k_g, v_g) `[B, H, T, hd]` in the gate against DAR at `window`: the
/// output and the gradients of all five inputs for one random upstream gradient. `planted`: a wrong
/// implementation, the row being right when it fails.
pub fn attention_check_with(name: &str, fast: &dyn Fn(&[Tensor]) -> Tensor, shape: [i64; 4], window: i64, device: Device, kind: Kind, planted: bool) -> CheckRow {
    let reference = move |xs: &[Tensor], k: Option<Kind>| dar_reference(xs, window, k);
    heads_check(name, fast, &reference, &DAR_TENSORS, shape, window, device, kind, planted)
}

/// The gate for a function of `names.len() − 1` inputs `[B, H, T, hd]` against `reference` (computed
/// in fp32 / fp64 with `None`, in the inputs' dtype with `Some(kind)`).
#[allow(clippy::too_many_arguments)]
fn heads_check(name: &str, fast: &dyn Fn(&[Tensor]) -> Tensor, reference: &dyn Fn(&[Tensor], Option<Kind>) -> Tensor, names: &[&'static str], shape: [i64; 4], window: i64, device: Device, kind: Kind, planted: bool) -> CheckRow {
    tch::manual_seed(window + 17 * shape[2]);
    let inputs: Vec<Tensor> = (1..names.len()).map(|_| Tensor::randn(shape, (kind, device)).set_requires_grad(true)).collect();
    let go = Tensor::randn(shape, (kind, device));
    let exact_kind = if kind == Kind::Double { Kind::Double } else { Kind::Float };
    let fresh = |k: Kind| inputs.iter().map(|t| t.detach().to_kind(k).set_requires_grad(true)).collect::<Vec<_>>();
    let got = run(fast, &inputs, &go);
    let exact = run(&|xs: &[Tensor]| reference(xs, None), &fresh(exact_kind), &go.to_kind(exact_kind));
    let baseline = run(&|xs: &[Tensor]| reference(xs, Some(kind)), &fresh(kind), &go);
    // The output's size is the scale of every tensor's floor.
    let scale = exact[0].abs().max().double_value(&[]);
    let tensors = (0..names.len()).map(|i| compare(names[i], &got[i], &baseline[i], &exact[i], kind, shape[2], scale)).collect();
    CheckRow::new(name, &shape, Some(window), kind, tensors, planted)
}

/// The sliding-window kind (`kind: window`, keys at distance < w) and causal attention (w ≥ T)
/// through the flash kernel, against the explicit masked softmax.
pub fn flash_window_check(shape: [i64; 4], window: i64, device: Device, kind: Kind) -> CheckRow {
    let t = shape[2];
    let reference = move |xs: &[Tensor], k: Option<Kind>| {
        let band = dar_masks(t, window, xs[0].device()).0;
        masked_softmax_attention_in(&xs[0], &[(&xs[1], &xs[2], &band)], k.unwrap_or(if xs[0].kind() == Kind::Double { Kind::Double } else { Kind::Float }))
    };
    let fast = move |xs: &[Tensor]| attention::flash_heads(&xs[0], &xs[1], &xs[2], if window >= t { -1 } else { window - 1 });
    heads_check("flash-window", &fast, &reference, &["out", "dq", "dk", "dv"], shape, window, device, kind, false)
}

/// DAR one key off at the window boundary (`w + 1`: the key at distance w is read full-width): the
/// gate's own test on the device it runs on.
fn planted_wide(window: i64) -> impl Fn(&[Tensor]) -> Tensor {
    move |xs: &[Tensor]| dar_reference(xs, window + 1, Some(xs[0].kind()))
}

/// The loss head (`loss::cross_entropy_grad_in_place`: the CUDA kernel where it is loaded) against
/// full-logits autograd in fp32 / fp64: per-row losses and the logits' gradient at `[n, v]`, logits
/// of dtype `kind`, `planted`: the gradient of the wrong targets (one class off).
pub fn loss_head_check(n: i64, v: i64, device: Device, kind: Kind, planted: bool) -> CheckRow {
    tch::manual_seed(n + 31 * v);
    let logits = Tensor::randn([n, v], (kind, device)) * 3.0;
    let targets = Tensor::randint(v, [n], (Kind::Int64, device));
    let scale = 1.0 / n as f64;
    let exact_kind = if kind == Kind::Double { Kind::Double } else { Kind::Float };
    // Autograd of the summed per-row loss, scaled: the gradient the head must write.
    let autograd = |k: Kind| {
        let x = logits.to_kind(k).set_requires_grad(true);
        let nll = x.log_softmax(1, k).gather(1, &targets.unsqueeze(1), false).squeeze_dim(1).neg();
        let g = Tensor::run_backward(&[nll.sum(k) * scale], &[&x], false, false);
        (nll.detach(), g[0].shallow_clone())
    };
    let (nll_exact, g_exact) = autograd(exact_kind);
    let (nll_base, g_base) = autograd(kind);
    let used = if planted { (&targets + 1).remainder(v) } else { targets.shallow_clone() };
    let mut g = logits.copy();
    let nll = loss::cross_entropy_grad_in_place(&mut g, &used, scale);
    let tensors = vec![compare("nll", &nll, &nll_base, &nll_exact, kind, n, 0.0), compare("dlogits", &g, &g_base, &g_exact, kind, n, 0.0)];
    let name = if device.is_cuda() && crate::kernels::cuda::available() { "loss-head-kernel" } else { "loss-head-aten" };
    CheckRow::new(if planted { "loss-head-planted" } else { name }, &[n, v], None, kind, tensors, planted)
}

/// The explicit form of `kernels::split_rotate` by views and aten ops in `x`'s dtype: pieces
/// `[B, T, H, hd]` of `x` `[B, T, H·n·hd]`, the first `rotated` rotated half-split over `2·cos.size(1)`.
fn split_rotate_explicit(x: &Tensor, heads: i64, n: i64, rotated: i64, cos: &Tensor, sin: &Tensor) -> Vec<Tensor> {
    let (b, t, hd) = (x.size()[0], x.size()[1], x.size()[2] / (heads * n));
    let half = cos.size()[1];
    let (c, s) = (cos.to_kind(x.kind()).reshape([1, t, 1, half]), sin.to_kind(x.kind()).reshape([1, t, 1, half]));
    let xv = x.view([b, t, heads, n, hd]);
    (0..n)
        .map(|i| {
            let p = xv.select(3, i);
            if i >= rotated || half == 0 {
                return p;
            }
            let (x1, x2) = (p.narrow(3, 0, half), p.narrow(3, half, half));
            let mut parts = vec![&x1 * &c - &x2 * &s, &x2 * &c + &x1 * &s];
            if 2 * half < hd {
                parts.push(p.narrow(3, 2 * half, hd - 2 * half));
            }
            Tensor::cat(&parts, 3)
        })
        .collect()
}

/// GPT-NeoX's heads op (`kernels::split_rotate`: the device kernel where the library is loaded) in
/// the gate: q / k / v pieces of a `[B, T, H·3·hd]` projection with RoPE on q and k (rotary dims
/// `rot` of `hd`), and the projection's gradient, against the explicit form in fp64 on CPU. `llama`:
/// the op as Llama's q or k take it (`llama::rotated_heads`): one piece `[B, T, H·hd]` turned over
/// `rot` dims, the angle tables read in place from the first half of `[T, 2·(rot/2)]` ones.
pub fn heads_op_check(b: i64, t: i64, heads: i64, hd: i64, rot: i64, llama: bool, device: Device, kind: Kind) -> CheckRow {
    tch::manual_seed(b + 7 * t);
    let rope = crate::model::rope::Rope { dims: rot, base: 10000.0 };
    let (cos, sin) = rope.tables(0, t, device);
    let (n, rotated) = if llama { (1, 1) } else { (3, 2) };
    let (cos, sin) = if llama {
        let whole = |x: &Tensor| Tensor::cat(&[x, x], -1).narrow(-1, 0, x.size()[1]);
        (whole(&cos), whole(&sin))
    } else {
        (cos, sin)
    };
    let x = Tensor::randn([b, t, heads * n * hd], (kind, device));
    let go: Vec<Tensor> = (0..n).map(|_| Tensor::randn([b, t, heads, hd], (kind, device))).collect();
    let run = |f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Vec<Tensor>, x: &Tensor, dev: Device, k: Kind| {
        let x = x.to_device(dev).to_kind(k).set_requires_grad(true);
        let parts = f(&x, &cos.to_device(dev), &sin.to_device(dev));
        let loss = parts.iter().zip(&go).map(|(p, g)| (p * g.to_device(dev).to_kind(k)).sum(k)).fold(Tensor::zeros([], (k, dev)), |a, l| a + l);
        let dx = Tensor::run_backward(&[loss], &[&x], false, false)[0].to_kind(Kind::Double).to_device(Device::Cpu);
        let out = Tensor::cat(&parts.iter().map(|p| p.detach().to_kind(Kind::Double).to_device(Device::Cpu)).collect::<Vec<_>>(), 3);
        (out, dx)
    };
    let fast = |x: &Tensor, c: &Tensor, s: &Tensor| crate::kernels::split_rotate(x, heads, n, rotated, c, s).expect("split_rotate");
    let explicit = |x: &Tensor, c: &Tensor, s: &Tensor| split_rotate_explicit(x, heads, n, rotated, c, s);
    let (o, dx) = run(&fast, &x, device, kind);
    let (ob, dxb) = run(&explicit, &x, device, kind);
    let (oe, dxe) = run(&explicit, &x, Device::Cpu, Kind::Double);
    let scale = oe.abs().max().double_value(&[]);
    let tensors = vec![compare("qkv", &o, &ob, &oe, kind, t, scale), compare("dx", &dx, &dxb, &dxe, kind, t, scale)];
    let name = if llama { "rope-heads" } else { "heads-op" };
    CheckRow::new(name, &[b, t, heads, hd, rot], None, kind, tensors, false)
}

/// One case of the fused decode step in the gate: batch, query heads, kv heads, head dim, rotated
/// dims, d_down, slots (the span), window, whether the rows are left-padded and the k / v maps have
/// biases; `latents`: DAR (a ring of `window` slots and the latents), else vanilla (full-width keys
/// in every slot of the span).
#[derive(Clone, Copy)]
pub struct DecodeCase {
    pub latents: bool,
    pub b: i64,
    pub h: i64,
    pub hkv: i64,
    pub hd: i64,
    pub rot: i64,
    pub r: i64,
    pub span: i64,
    pub window: i64,
    pub padded: bool,
    pub bias: bool,
}

/// A one-token step by its definition, in `kind`: vanilla's full-width keys under their mask, or
/// DAR's (dar.md §3) with every distant key and value rebuilt from its latent (k = RoPE_s(Wk·c + bk),
/// v = Wv·c + bv) beside the ring's full-width keys; one masked softmax (`attend_newest`).
/// xs: q, c, wk, wv, bk, bv, cos, sin, pos, pad, full-width k, v, mask.
fn step_reference(xs: &[Tensor], c: DecodeCase, kind: Kind) -> Tensor {
    let k = |t: &Tensor| t.to_kind(kind);
    let (rk, rv) = (k(&xs[10]), k(&xs[11]));
    let full = (&rk, &rv, Some(xs[12].shallow_clone()));
    if !c.latents {
        return crate::attention::cache::attend_newest(&k(&xs[0]), &[full]);
    }
    let (q, lat, wk, wv) = (k(&xs[0]), k(&xs[1]).unsqueeze(1), k(&xs[2]), k(&xs[3]));
    let (hkv, hd, span) = (wk.size()[0], wk.size()[1], lat.size()[2]);
    let half = xs[6].size()[1];
    let keys = lat.matmul(&wk.transpose(1, 2)) + k(&xs[4]).view([1, hkv, 1, hd]);
    let (cos, sin) = (k(&xs[6]), k(&xs[7]));
    let (k1, k2, rest) = (keys.narrow(3, 0, half), keys.narrow(3, half, half), keys.narrow(3, 2 * half, hd - 2 * half));
    let keys = Tensor::cat(&[&k1 * &cos - &k2 * &sin, &k2 * &cos + &k1 * &sin, rest], 3);
    let values = lat.matmul(&wv.transpose(1, 2)) + k(&xs[5]).view([1, hkv, 1, hd]);
    let far = distant_mask(&xs, c.window, span);
    let mut parts = vec![(&keys, &values, Some(far))];
    if c.window > 0 {
        parts.insert(0, full);
    }
    crate::attention::cache::attend_newest(&q, &parts)
}

/// `[B, 1, 1, span]`: the latent slots a decode case's token reads, at distance ≥ `window` from its
/// position (xs[8]) and not before its row's padding (xs[9]).
fn distant_mask(xs: &[Tensor], window: i64, span: i64) -> Tensor {
    let slots = Tensor::arange(span, (Kind::Int64, xs[8].device()));
    (&xs[8] - &slots).ge(window).view([1, 1, 1, -1]).logical_and(&slots.view([1, 1, 1, -1]).ge_tensor(&xs[9].view([-1, 1, 1, 1])))
}

/// Random inputs of one decode case (the order `step_reference` reads), the position three
/// slots before the span's end.
fn decode_inputs(c: DecodeCase, device: Device, kind: Kind) -> Vec<Tensor> {
    tch::manual_seed(c.span + 13 * c.window + c.r);
    let pos = c.span - 3;
    let n = |shape: &[i64], s: f64| Tensor::randn(shape, (Kind::Float, device)) * s;
    let w_scale = 1.0 / (c.r as f64).sqrt();
    let bias = |s: f64| if c.bias { n(&[c.hkv, c.hd], s) } else { Tensor::zeros([c.hkv, c.hd], (Kind::Float, device)) };
    let (cos, sin) = crate::model::rope::Rope { dims: c.rot, base: 10000.0 }.tables(0, c.span, device);
    let pad_rows: Vec<i64> = (0..c.b).map(|i| if c.padded { 5 * i } else { 0 }).collect();
    let pad = Tensor::from_slice(&pad_rows).to_device(device);
    // The full-width slots: DAR's ring (slot j holds pos − ((pos − j) mod w)), or vanilla's span.
    let w = if c.latents { c.window.max(1) } else { c.span };
    let slots = Tensor::arange(w, (Kind::Int64, device));
    let slot_pos = if c.latents { crate::attention::cache::ring_positions(&Tensor::from(pos).to_device(device), &slots, w) } else { slots };
    let slot_pos = slot_pos.view([1, 1, 1, -1]);
    let ring_mask = slot_pos.ge_tensor(&pad.view([-1, 1, 1, 1])).logical_and(&slot_pos.le(pos));
    vec![
        n(&[c.b, c.h, 1, c.hd], 1.0).to_kind(kind),
        n(&[c.b, c.span, c.r], 1.0).to_kind(kind),
        n(&[c.hkv, c.hd, c.r], w_scale).to_kind(kind),
        n(&[c.hkv, c.hd, c.r], w_scale).to_kind(kind),
        bias(0.5).to_kind(kind),
        bias(0.5).to_kind(kind),
        cos,
        sin,
        Tensor::from_slice(&[pos]).to_device(device),
        pad,
        n(&[c.b, c.hkv, w, c.hd], 1.0).to_kind(kind),
        n(&[c.b, c.hkv, w, c.hd], 1.0).to_kind(kind),
        ring_mask,
    ]
}

/// The fused decode step (csrc/cuda/attend_step.cu, `kernels::cuda::attend_step`) in the gate: its
/// output against the definition in fp32, at a position three slots before the span's end (so keys
/// past the newest must be masked). `planted`: DAR told window + 1 (the key at distance w dropped),
/// vanilla one position on (a key from the future read), the row being right when it fails.
pub fn step_check(c: DecodeCase, device: Device, kind: Kind, planted: bool) -> Option<CheckRow> {
    let xs = decode_inputs(c, device, kind);
    use crate::kernels::cuda;
    let pos = if planted && !c.latents { &xs[8] + 1 } else { xs[8].shallow_clone() };
    let wk_rot = c.latents.then(|| crate::attention::AbsorbedKv::new(xs[2].shallow_clone(), None, xs[3].shallow_clone(), None, c.rot).wk_rot);
    let distant = c.latents.then(|| cuda::Distant {
        latents: &xs[1],
        wk: &xs[2],
        wk_rot: wk_rot.as_ref().expect("made with the latents"),
        wv: &xs[3],
        bk: c.bias.then_some(&xs[4]),
        bv: c.bias.then_some(&xs[5]),
        cos: &xs[6],
        sin: &xs[7],
        rotated: c.rot,
        window: c.window + i64::from(planted),
    });
    let keep = if c.latents { c.window } else { 0 };
    let step = cuda::Step {
        q: &xs[0],
        pos: &pos,
        pad: c.padded.then_some(&xs[9]),
        full: (keep > 0 || !c.latents).then(|| cuda::FullWidth { k: &xs[10], v: &xs[11], keep }),
        distant,
        fresh: None,
    };
    let name = match (c.latents, planted) {
        (true, false) => "step-fused-dar",
        (true, true) => "step-planted-dar",
        (false, false) => "step-fused-full",
        (false, true) => "step-planted-full",
    };
    // A kernel that errors is a failed row, not the end of the gate.
    let fast = match cuda::attend_step(&step)? {
        Ok(fast) => fast,
        Err(e) => return Some(failed_row(name, &e.to_string(), planted)),
    };
    let exact = step_reference(&xs, c, Kind::Float);
    let baseline = step_reference(&xs, c, kind);
    let tensors = vec![compare("out", &fast, &baseline, &exact, kind, c.h, 0.0)];
    Some(CheckRow::new(name, &[c.b, c.h, c.hkv, c.hd, c.rot, c.r, c.span], Some(c.window), kind, tensors, planted))
}

/// The fused decode step's cases: DAR at Pythia-70M's shape (a quarter of the dims rotated, biases)
/// over several blocks, a padded grouped-query Llama shape (every dim rotated, no biases), uniform
/// (no ring) over many blocks, a short span where one key's weight shows, and vanilla's full-width
/// span, plain and padded grouped-query; the planted ones must fail.
pub fn step_cases() -> Vec<(DecodeCase, bool)> {
    let pythia = DecodeCase { latents: true, b: 1, h: 12, hkv: 12, hd: 64, rot: 16, r: 128, span: 1024, window: 128, padded: false, bias: true };
    let llama = DecodeCase { latents: true, b: 2, h: 9, hkv: 3, hd: 64, rot: 64, r: 96, span: 300, window: 16, padded: true, bias: false };
    let uniform = DecodeCase { latents: true, b: 1, h: 4, hkv: 4, hd: 32, rot: 8, r: 16, span: 2100, window: 0, padded: false, bias: true };
    let short = DecodeCase { span: 40, window: 8, ..pythia };
    let vanilla = DecodeCase { latents: false, span: 4096, ..pythia };
    let vanilla_gqa = DecodeCase { latents: false, span: 50, ..llama };
    vec![
        (pythia, false),
        (llama, false),
        (uniform, false),
        (short, false),
        (short, true),
        (DecodeCase { window: 0, ..short }, true),
        (vanilla, false),
        (vanilla_gqa, false),
        (vanilla_gqa, true),
    ]
}

/// A model's decode end to end: `name` (a `bench-decode --attention` name) built random at `base`'s
/// size (bf16 on CUDA), a 256-token prefill, then 64 device-side steps (`Model::extend_hidden_at`,
/// the spans the stepper uses, the fused step where it is on) fed the same tokens; their logits
/// against the full forward's in fp32 (the model cast up), with the full forward in the model's own
/// dtype as the baseline. `planted`: each step's span one slot short, so the newest key is not read.
pub fn decode_model_check(base: &Spec, name: &str, device: Device, planted: bool) -> Result<CheckRow> {
    decode_model_check_in(base, name, device, device.is_cuda(), planted)
}

/// At their random init, attention is near uniform over hundreds of keys, so one key left out moves
/// the logits less than bf16 rounding does: a step span one slot short passed the gate on one H100
/// (3.1e-2 against a bound of 7.9e-2). Scaling the whole q / k projections to sharpen attention made
/// bf16 ties chaotic instead (errors ≈ 1 logit at the Pythia-70M shape). So the check's model is
/// given a strong score of each token for itself: every key projection gets its head's query
/// projection added (RoPE keeps q_t·k_t at any t) and both are doubled, so the newest key stands
/// out by ≈ 4·|q|²/√hd while the older keys keep random scores (planted row 12–38× its bound, the
/// honest rows at about a third of theirs: `in_bf16_the_decode_rows_pass_and_…`).
fn lean_on_self(vs: &tch::nn::VarStore, head_dim: i64) {
    tch::no_grad(|| {
        let vars = vs.variables();
        for (name, w) in &vars {
            if name.ends_with("query_key_value.weight") {
                // GPT-NeoX's fused rows: per head, its q, k and v rows.
                let per_head = w.view([w.size()[0] / (3 * head_dim), 3, head_dim, -1]);
                let _ = per_head.select(1, 1).g_add_(&per_head.select(1, 0));
                let _ = per_head.narrow(1, 0, 2).g_mul_scalar_(SELF_SCALE);
            } else if let Some(prefix) = name.strip_suffix("q_proj.weight") {
                let Some(k) = vars.get(&format!("{prefix}k_proj.weight")) else { continue };
                // Grouped heads: kv head j takes the query of the first head of its group.
                let (heads, kv_heads) = (w.size()[0] / head_dim, k.size()[0] / head_dim);
                let q = w.view([heads, head_dim, -1]).slice(0, 0, heads, heads / kv_heads.max(1));
                let _ = k.view([kv_heads, head_dim, -1]).g_add_(&q);
                for t in [w, k] {
                    let _ = t.shallow_clone().g_mul_scalar_(SELF_SCALE);
                }
            }
        }
    });
}

/// How much [`lean_on_self`] scales the query and key projections (scores × its square).
const SELF_SCALE: f64 = 2.0;

/// [`decode_model_check`] with the model in bf16 when `half` (as on CUDA; on the CPU to test the
/// gate's bf16 bounds there).
fn decode_model_check_in(base: &Spec, name: &str, device: Device, half: bool, planted: bool) -> Result<CheckRow> {
    use crate::attention::cache::StepAt;
    use crate::eval::generate::reserve;
    let (prompt, total) = (256i64, 320i64);
    let vocab = base.model.vocab.unwrap_or(50304);
    tch::manual_seed(0);
    let (mut vs, model) = crate::eval::decode_bench::bench_model(base, name, vocab, device)?;
    lean_on_self(&vs, model.head_dim());
    if half {
        vs.bfloat16();
    }
    let x = Tensor::randint(vocab as i64, [1, total], (Kind::Int64, device));
    let kind = model.head_weight().kind();
    let mut cache = model.new_cache(1, kind, device);
    reserve(&mut cache, total);
    let _ = model.extend(&mut cache, &x.narrow(1, 0, prompt));
    let mut steps = Vec::new();
    for p in prompt..total {
        model.prepare_step_at(&mut cache, p, total);
        let span = if planted { p } else { crate::eval::stepper::span_for(p, total) };
        let at = StepAt { pos: Tensor::from_slice(&[p]).to_device(device), span };
        let h = model.extend_hidden_at(&mut cache, &x.narrow(1, p, 1), &at).ok_or_else(|| crate::Error::Other(format!("{name}: no device-side decode step")))?;
        cache.advance(1);
        steps.push(tch::no_grad(|| model.logits(&h)));
    }
    let got = Tensor::cat(&steps, 1);
    let full = |m: &crate::model::Model| tch::no_grad(|| m.forward(&x)).narrow(1, prompt, total - prompt);
    let baseline = full(&model);
    vs.float();
    let exact = full(&model);
    let tensors = vec![compare("logits", &got, &baseline, &exact, kind, total - prompt, 0.0)];
    let label = format!("decode-{name}{}", if planted { "-planted" } else { "" });
    Ok(CheckRow::new(&label, &[1, total], None, kind, tensors, planted))
}

/// Which STILL / LoLCATs prefill kernels a gate row holds to account.
#[derive(Clone, Copy)]
enum PrefillKernels {
    /// The routing scores and the mix (csrc/cuda/hybrid_prefill.cu), the linear branch by aten.
    Mix,
    /// The linear branch's kernels too (csrc/cuda/hybrid_linear.cuh), fp32 SIMT products (`ATTNLAB_LINEAR_TF32=0`).
    Linear,
    /// Those with their products on the tensor cores (`ATTNLAB_LINEAR_TF32`, the default).
    LinearTf32,
}

impl PrefillKernels {
    /// The switches each arm runs under: the kernels' and their baseline's (`ATTNLAB_HYBRID_PREFILL`,
    /// `ATTNLAB_HYBRID_LINEAR`, `ATTNLAB_LINEAR_TF32`): the mix against none of the kernels; the linear
    /// branch's against the mix alone.
    fn switches(self) -> [[(&'static str, &'static str); 3]; 2] {
        let arm = |prefill, linear, tf32| [("ATTNLAB_HYBRID_PREFILL", prefill), ("ATTNLAB_HYBRID_LINEAR", linear), ("ATTNLAB_LINEAR_TF32", tf32)];
        match self {
            Self::Mix => [arm("1", "0", "0"), arm("0", "0", "0")],
            Self::Linear => [arm("1", "1", "0"), arm("1", "0", "0")],
            Self::LinearTf32 => [arm("1", "1", "1"), arm("1", "0", "0")],
        }
    }

    /// A row's name.
    fn label(self, name: &str) -> String {
        let part = match self {
            Self::Mix => "",
            Self::Linear => "-linear",
            Self::LinearTf32 => "-linear-tf32",
        };
        format!("prefill-{name}{part}-kernel")
    }
}

/// The STILL / LoLCATs prefill kernels in a bf16 model's forward pass, as [`decode_model_check`]'s
/// model: logits of 1,000 tokens (16 chunks, the selected tokens from the third, a ragged last chunk)
/// against the fp32 model, the baseline the same bf16 model without the kernels the row is about
/// ([`PrefillKernels::switches`]).
fn prefill_model_check(base: &Spec, name: &str, kernels: PrefillKernels, device: Device) -> Result<CheckRow> {
    let t = 1000i64;
    let vocab = base.model.vocab.unwrap_or(50304);
    tch::manual_seed(0);
    let (mut vs, model) = crate::eval::decode_bench::bench_model(base, name, vocab, device)?;
    lean_on_self(&vs, model.head_dim());
    vs.bfloat16();
    let x = Tensor::randint(vocab as i64, [1, t], (Kind::Int64, device));
    let kind = model.head_weight().kind();
    let full = |m: &crate::model::Model| tch::no_grad(|| m.forward(&x));
    let [with, without] = kernels.switches();
    let got = with_env(&with, || full(&model));
    let baseline = with_env(&without, || full(&model));
    // The kernels compute in another order than aten: equal logits mean they never ran (a layout
    // they refused, a library without them), which must fail the row, not pass it as aten's.
    if got.equal(&baseline) {
        return Err(crate::Error::Other("the prefill kernels did not run (outputs equal aten's bit for bit)".into()));
    }
    // Likewise the TF32 products against the SIMT ones they replace (hybrid_prefill.cu takes the SIMT
    // tiles where D or F/2 is not a multiple of 8): a row named for TF32 must have run it.
    if matches!(kernels, PrefillKernels::LinearTf32) && got.equal(&with_env(&PrefillKernels::Linear.switches()[0], || full(&model))) {
        return Err(crate::Error::Other("the TF32 products did not run (outputs equal the SIMT tiles' bit for bit)".into()));
    }
    vs.float();
    let exact = full(&model);
    let tensors = vec![compare("logits", &got, &baseline, &exact, kind, t, 0.0)];
    Ok(CheckRow::new(&kernels.label(name), &[1, t], None, kind, tensors, false))
}

/// The LayerNorm kernel (`kernels::cuda::layer_norm_half`, under bf16 autocast) against aten's
/// fp32 LayerNorm on `[n, d]`, or with `rms` its RMSNorm form (`rms_norm_half`) against RMSNorm in
/// fp32 aten ops (x·rsqrt(mean(x²) + eps)·γ): the output and the gradients of x, γ (and β) for one
/// bf16 upstream gradient. The baseline is autocast's own path (the fp32 output cast down; its
/// gradients are the fp32 ones). None where the kernel is not loaded.
pub fn layer_norm_check(n: i64, d: i64, rms: bool, device: Device) -> Option<CheckRow> {
    tch::manual_seed(n + d);
    let f32 = (Kind::Float, device);
    let x = Tensor::randn([n, d], f32) * 3.0 + 1.0;
    let (w, b) = (Tensor::randn([d], f32), Tensor::randn([d], f32));
    let go = Tensor::randn([n, d], (Kind::BFloat16, device)).to_kind(Kind::Float);
    let leaves = || if rms { vec![&x, &w] } else { vec![&x, &w, &b] }.into_iter().map(|t| t.detach().set_requires_grad(true)).collect::<Vec<_>>();
    let grads = |y: &Tensor, l: &[Tensor]| Tensor::run_backward(&[(y.to_kind(Kind::Float) * &go).sum(Kind::Float)], &l.iter().collect::<Vec<_>>(), false, false);
    let eps = 1e-5;
    let exact_in = leaves();
    let exact = if rms {
        let ms = exact_in[0].square().mean_dim(-1, true, Kind::Float);
        &exact_in[0] * (ms + eps).rsqrt() * &exact_in[1]
    } else {
        exact_in[0].layer_norm([d], Some(&exact_in[1]), Some(&exact_in[2]), eps, false)
    };
    let exact_g = grads(&exact, &exact_in);
    crate::kernels::set_autocast_bf16().ok()?;
    // The kernel is checked even where the caller turned it off (`ATTNLAB_LN_KERNEL=0`,
    // `ATTNLAB_RMS_KERNEL=0`).
    let fast_in = leaves();
    let fast = crate::kernels::autocast(true, || {
        if rms {
            with_env(&[("ATTNLAB_RMS_KERNEL", "1")], || crate::kernels::cuda::rms_norm_half(&fast_in[0], &fast_in[1], eps))
        } else {
            with_env(&[("ATTNLAB_LN_KERNEL", "1")], || crate::kernels::cuda::layer_norm_half(&fast_in[0], &fast_in[1], &fast_in[2], eps))
        }
    });
    let label = if rms { "rms-norm-kernel" } else { "layer-norm-kernel" };
    let fast = match fast? {
        Ok(fast) => fast,
        Err(e) => return Some(failed_row(label, &e.to_string(), false)),
    };
    let fast_g = grads(&fast, &fast_in);
    let kind = fast.kind();
    let mut tensors = vec![compare("out", &fast, &exact.to_kind(kind), &exact, kind, n, 0.0)];
    for (i, name) in ["dx", "dgamma", "dbeta"].into_iter().take(fast_in.len()).enumerate() {
        tensors.push(compare(name, &fast_g[i], &exact_g[i], &exact_g[i], kind, n, 0.0));
    }
    Some(CheckRow::new(label, &[n, d], None, kind, tensors, false))
}

/// The half model's RMSNorm kernel (`kernels::cuda::rms_norm_infer`: bf16 x and weight, no grad)
/// on `[n, d]` in `family`'s rounding, against RMSNorm in fp64 of the same bf16 inputs; the baseline
/// is the aten form it replaces in decode (`llama::rms_norm_aten`). None where the kernel is not loaded.
pub fn rms_norm_infer_check(n: i64, d: i64, family: crate::model::llama::Family, device: Device) -> Option<CheckRow> {
    use crate::model::llama::{rms_norm_aten, Family};
    tch::manual_seed(n + 3 * d);
    let kind = Kind::BFloat16;
    let x = (Tensor::randn([n, d], (Kind::Float, device)) * 3.0 + 1.0).to_kind(kind);
    let w = (Tensor::randn([d], (Kind::Float, device)) * 0.3 + 1.0).to_kind(kind);
    let eps = 1e-6;
    let (xd, wd) = (x.to_kind(Kind::Double), w.to_kind(Kind::Double));
    let exact = &xd * (xd.square().mean_dim(-1, true, Kind::Double) + eps).rsqrt() * wd;
    let baseline = tch::no_grad(|| rms_norm_aten(&x, &w, eps, family));
    let label = match family {
        Family::Llama => "rms-norm-infer-llama",
        Family::Olmo2 => "rms-norm-infer-olmo2",
    };
    // Checked even where the caller turned the kernels off (`ATTNLAB_RMS_KERNEL=0`).
    let fast = tch::no_grad(|| with_env(&[("ATTNLAB_RMS_KERNEL", "1")], || crate::kernels::cuda::rms_norm_infer(&x, &w, eps, family == Family::Llama)))?;
    let fast = match fast {
        Ok(fast) => fast,
        Err(e) => return Some(failed_row(label, &e.to_string(), false)),
    };
    let tensors = vec![compare("out", &fast, &baseline, &exact, kind, n, 0.0)];
    Some(CheckRow::new(label, &[n, d], None, kind, tensors, false))
}

/// SwiGLU's product kernel (`kernels::cuda::silu_mul`: bf16, no grad) on the two halves of one stacked
/// `[n, 2i]` projection, as a Llama MLP calls it, against silu(g)·u in fp64 of the same bf16 inputs;
/// the baseline is aten's two ops it replaces. None where the kernel is not loaded.
pub fn silu_mul_check(n: i64, i: i64, device: Device) -> Option<CheckRow> {
    tch::manual_seed(n + 7 * i);
    let kind = Kind::BFloat16;
    let stacked = (Tensor::randn([n, 2 * i], (Kind::Float, device)) * 2.0).to_kind(kind);
    let (g, u) = (stacked.narrow(1, 0, i), stacked.narrow(1, i, i));
    let (gd, ud) = (g.to_kind(Kind::Double), u.to_kind(Kind::Double));
    let exact = gd.silu() * ud;
    let baseline = tch::no_grad(|| g.silu() * &u);
    let label = "silu-mul-kernel";
    // Checked even where the caller turned the kernel off (`ATTNLAB_SWIGLU_KERNEL=0`).
    let fast = match tch::no_grad(|| with_env(&[("ATTNLAB_SWIGLU_KERNEL", "1")], || crate::kernels::cuda::silu_mul(&g, &u)))? {
        Ok(fast) => fast,
        Err(e) => return Some(failed_row(label, &e.to_string(), false)),
    };
    let tensors = vec![compare("out", &fast, &baseline, &exact, kind, n, 0.0)];
    Some(CheckRow::new(label, &[n, i], None, kind, tensors, false))
}

/// The routing's top-κ kernel (`kernels::cuda::top_kappa`, forced on) against aten's stable sorts
/// (`still::routing::top_kappa` with the kernel off) on fp32 scores rounded to quarters, so that many
/// rows hold ties (aten breaks them to the lower index; the kernel must too), κ 4 of C 64: the
/// indices must be equal. `ring`: the scores a decode routes, one chunk's 64 of a ring of 128 (rows
/// at a stride of 128), else a prefill's `[B, H, n, C]`. None where the kernel is not loaded.
pub fn top_kappa_check(ring: bool, device: Device) -> Option<CheckRow> {
    use crate::attention::still::top_kappa;
    tch::manual_seed(11 + ring as i64);
    let (c, kappa) = (64, 4);
    let quarters = |shape: &[i64]| (Tensor::randn(shape, (Kind::Float, device)) * 4.0).round() / 4.0;
    let scores = if ring { quarters(&[2, 8, 2 * c]).narrow(2, c, c) } else { quarters(&[2, 8, 37, c]) };
    let label = if ring { "top-kappa-kernel-ring" } else { "top-kappa-kernel" };
    let exact = with_env(&[("ATTNLAB_TOPK_KERNEL", "0")], || top_kappa(&scores, kappa));
    let fast = match with_env(&[("ATTNLAB_TOPK_KERNEL", "1")], || crate::kernels::cuda::top_kappa(&scores, kappa))? {
        Ok(fast) => fast,
        Err(e) => return Some(failed_row(label, &e.to_string(), false)),
    };
    let rows = scores.numel() as i64 / c;
    let tensors = vec![compare("indices", &fast, &exact, &exact, Kind::Float, rows, 0.0)];
    Some(CheckRow::new(label, &scores.size(), None, Kind::Float, tensors, false))
}

/// (q, k_l, v_l, k_g, v_g) `[B, H, T, hd]` with k_g, v_g cut to the T − w positions split-merge
/// reads, as a DAR layer builds them for it (`dar::distant_positions`).
fn distant_prefix(xs: &[Tensor], w: i64) -> Vec<Tensor> {
    let t = xs[0].size()[2];
    xs.iter().enumerate().map(|(i, x)| if i >= 3 { x.narrow(2, 0, t - w) } else { x.shallow_clone() }).collect()
}

/// A row for a check that could not run: its error on stderr, an infinite error in the row.
fn failed_row(label: &str, why: &str, planted: bool) -> CheckRow {
    eprintln!("{label}: could not run: {why}");
    let t = TensorErr { name: "could-not-run", err: f64::INFINITY, baseline: f64::NAN, bound: 0.0, worst_at: 0 };
    CheckRow { implementation: label.into(), shape: vec![], window: None, dtype: String::new(), tensors: vec![t], planted, within: false, ok: false }
}

/// Every fast path in the gate at the spec's shape and a ragged one, over windows inside, at and
/// beyond the sequence (bf16 on CUDA, fp64 on CPU), the planted wrong windows, and the loss head.
/// Calls `each` per row; returns how many rows did not come out as they should.
pub fn check_all(spec: &Spec, mut each: impl FnMut(&CheckRow)) -> Result<usize> {
    let device = crate::device::parse_device(spec.train.device.as_deref().unwrap_or("auto"))?;
    let kind = if device.is_cuda() { Kind::BFloat16 } else { Kind::Double };
    let s = spec.shape();
    let (t, hd) = (spec.seq_len() as i64, (s.d_model / s.heads) as i64);
    let shapes = [[spec.batch_size() as i64, s.heads as i64, t, hd], [1, 3, t / 2 + 3, hd]];
    let imps: &[AttentionImpl] = if device.is_cuda() {
        &[AttentionImpl::Sdpa, AttentionImpl::SplitMerge, AttentionImpl::SplitMergeCudnn, AttentionImpl::SplitMergeFused, AttentionImpl::SplitMergeBand]
    } else {
        &[AttentionImpl::Sdpa, AttentionImpl::BandSplit]
    };
    let mut failed = 0;
    let mut note = |r: CheckRow| {
        failed += usize::from(!r.ok);
        each(&r);
    };
    for shape in shapes {
        for w in [0, 1, 4, 64, 128, 256, shape[2], shape[2] + 5] {
            for &imp in imps {
                if imp == AttentionImpl::SplitMergeBand {
                    // Its rows must test the band kernels, not the split-merge-fused it falls back to.
                    if !matches!(shape[3], 64 | 128) {
                        continue;
                    }
                    if !crate::kernels::cuda::band_available(&[&Tensor::zeros(shape, (kind, device))]) {
                        note(failed_row("splitmergeband", "the band kernels are not in the CUDA kernel library (make gpu-kernels)", false));
                        continue;
                    }
                }
                note(attention_check(imp, shape, w, device, kind));
            }
            if device.is_cuda() && 0 < w && w < shape[2] {
                // Training's route as a DAR layer takes it: distant keys of the T − w positions
                // read (dar::distant_positions), their gradients unpadded.
                let prefix = move |xs: &[Tensor]| {
                    let xs = distant_prefix(xs, w);
                    attention::dar(&xs[0], &xs[1], &xs[2], &xs[3], &xs[4], w, AttentionImpl::SplitMergeFused)
                };
                note(attention_check_with("splitmergefused-prefix", &prefix, shape, w, device, kind, false));
            }
        }
        if device.is_cuda() {
            for w in [1, 4, 128, shape[2]] {
                note(flash_window_check(shape, w, device, kind));
            }
        }
        for w in [4, (shape[2] / 2).min(64)] {
            note(attention_check_with("planted-wide", &planted_wide(w), shape, w, device, kind, true));
        }
    }
    let (n, v) = if device.is_cuda() { (4096, spec.model.vocab.unwrap_or(50304) as i64) } else { (64, 97) };
    for planted in [false, true] {
        note(loss_head_check(n, v, device, kind, planted));
    }
    if device.is_cuda() {
        // The row held in registers (ATTNLAB_CE_HELD=1, csrc/cuda/loss_head.cuh), at the spec's
        // vocabulary and at a narrower one.
        with_env(&[("ATTNLAB_CE_HELD", "1")], || {
            for (v, planted) in [(v, false), (v, true), (16_000, false)] {
                let mut row = loss_head_check(n, v, device, kind, planted);
                row.implementation += "-held";
                note(row);
            }
        });
    }
    if device.is_cuda() {
        // The step's loops (csrc/cuda/attend_step.cu): the default, one slot per warp everywhere
        // (ATTNLAB_STEP_SCALAR), the latents four slots at a time (ATTNLAB_STEP_BATCHED), and those
        // with RoPE absorbed into the query (ATTNLAB_STEP_ROPE=absorbed), and every head's scores
        // over a chunk of latents as one tensor-core product (ATTNLAB_STEP_MMA; the default from
        // 8,192 latent slots on, so the loops' rows say =0), whether or not decoding takes the fused
        // step by default.
        let loops: [(&str, &[(&str, &str)]); 5] = [
            ("", &[]),
            ("-scalar", &[("ATTNLAB_STEP_SCALAR", "1"), ("ATTNLAB_STEP_MMA", "0")]),
            ("-batched", &[("ATTNLAB_STEP_BATCHED", "1"), ("ATTNLAB_STEP_MMA", "0")]),
            ("-rope-absorbed", &[("ATTNLAB_STEP_ROPE", "absorbed"), ("ATTNLAB_STEP_MMA", "0")]),
            ("-mma", &[("ATTNLAB_STEP_MMA", "1")]),
        ];
        with_env(&[("ATTNLAB_FUSED_STEP", "1")], || {
            for (suffix, vars) in loops {
                with_env(vars, || {
                    for (case, planted) in step_cases() {
                        if let Some(mut row) = step_check(case, device, kind, planted) {
                            row.implementation += suffix;
                            note(row);
                        }
                    }
                });
            }
        });
    }
    if device.is_cuda() {
        // A kind that cannot run this check (an error or a refused op) is a failed row, not the end
        // of the gate.
        let decode_row = |name: &str, planted: bool, suffix: &str| {
            let row = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| decode_model_check(spec, name, device, planted)));
            let mut row = match row {
                Ok(Ok(row)) => row,
                Ok(Err(e)) => failed_row(&format!("decode-{name}"), &e.to_string(), planted),
                Err(_) => failed_row(&format!("decode-{name}"), "panicked (message above)", planted),
            };
            row.implementation += suffix;
            row
        };
        // Every kind with the new token written into the caches before the step
        // (ATTNLAB_STEP_FRESH=0), then the kinds of the fused step with it handed over fresh (=1: the
        // caches written by the combine kernel), whichever of the two decoding takes by default;
        // DAR's with the RoPE-absorbed loop too (ATTNLAB_STEP_ROPE=absorbed), and with the latents on
        // the tensor cores (ATTNLAB_STEP_MMA=1), written first and fresh.
        let cases = ["vanilla", "window", "dar", "uniform", "still-budget", "lolcats"].map(|n| (n, false));
        // The hybrids here through aten's mix and aten's fold of a routed chunk (the kernels' rows
        // follow: the mixing kernel's, each folding its routed chunk by the state kernel,
        // ATTNLAB_HYBRID_FOLD=1, the default), which CUDA takes with ATTNLAB_HYBRID_KERNEL=0 and ATTNLAB_HYBRID_FOLD=0.
        with_env(&[("ATTNLAB_STEP_FRESH", "0"), ("ATTNLAB_HYBRID_KERNEL", "0"), ("ATTNLAB_HYBRID_FOLD", "0")], || {
            for (name, planted) in cases.into_iter().chain([("vanilla", true)]) {
                note(decode_row(name, planted, ""));
            }
        });
        let fresh = [
            (&["vanilla", "window", "dar", "uniform"][..], "-fresh", &[("ATTNLAB_STEP_FRESH", "1")][..]),
            (&["dar", "uniform"], "-absorbed-fresh", &[("ATTNLAB_STEP_FRESH", "1"), ("ATTNLAB_STEP_ROPE", "absorbed"), ("ATTNLAB_STEP_MMA", "0")]),
            (&["dar", "uniform"], "-mma", &[("ATTNLAB_STEP_FRESH", "0"), ("ATTNLAB_STEP_MMA", "1")]),
            (&["dar", "uniform"], "-mma-fresh", &[("ATTNLAB_STEP_FRESH", "1"), ("ATTNLAB_STEP_MMA", "1")]),
        ];
        for (names, suffix, vars) in fresh {
            with_env(vars, || names.iter().for_each(|name| note(decode_row(name, false, suffix))));
        }
        // The hybrids with their mixing kernel (csrc/cuda/hybrid_step.cu, the default; ATTNLAB_HYBRID_KERNEL=1).
        let hybrid = crate::kernels::cuda::hybrid_kernel_available();
        // Each with its scalar loads (ATTNLAB_HYBRID_VEC=0) and with its 16-byte ones (the default, `-hybrid-vec`),
        // the new key / value written into the window by the kernel (the default) or before it by
        // index_copy (ATTNLAB_HYBRID_FRESH=0, `-hybrid-written`), a head's work split over blocks (the
        // default) or in one block (ATTNLAB_HYBRID_SPLIT=0, `-hybrid-one-block`).
        let variants = [("0", "1", "1", "-hybrid-kernel"), ("1", "1", "1", "-hybrid-vec"), ("0", "0", "1", "-hybrid-written"), ("1", "1", "0", "-hybrid-one-block")];
        for (vec, fresh, split, suffix) in variants {
            with_env(&[("ATTNLAB_HYBRID_KERNEL", "1"), ("ATTNLAB_HYBRID_VEC", vec), ("ATTNLAB_HYBRID_FRESH", fresh), ("ATTNLAB_HYBRID_SPLIT", split), ("ATTNLAB_HYBRID_FOLD", "1")], || {
                for name in ["still-budget", "lolcats"] {
                    note(if hybrid { decode_row(name, false, suffix) } else { failed_row(&format!("decode-{name}{suffix}"), "the hybrid mixing kernel is not in the CUDA kernel library (make gpu-kernels)", false) });
                }
            });
        }
        // The prefill kernels (csrc/cuda/hybrid_prefill.cu; the decode rows above prefill their prompts by
        // the default's kernels), the linear branch's (hybrid_linear.cuh) and their TF32 products (off by
        // default until these rows pass on a GPU).
        let arms = [PrefillKernels::Mix, PrefillKernels::Linear, PrefillKernels::LinearTf32];
        for (kernels, name) in arms.into_iter().flat_map(|k| ["still-budget", "lolcats"].map(|n| (k, n))) {
            let label = kernels.label(name);
            let row = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| prefill_model_check(spec, name, kernels, device)));
            note(match row {
                Ok(Ok(row)) => row,
                Ok(Err(e)) => failed_row(&label, &e.to_string(), false),
                Err(_) => failed_row(&label, "panicked (message above)", false),
            });
        }
    }
    if device.is_cuda() {
        // At the Pythia-70M width the kernels hold 2, 3 and 10 columns a thread (templates 2, 4, 16).
        for (n, d) in [(4096, s.d_model as i64), (1000, 768), (64, 2500)] {
            if let Some(row) = layer_norm_check(n, d, false, device) {
                note(row);
            }
        }
        // RMSNorm at SmolLM2-135M's width (576: 3 columns a thread, template 4) and Llama-1B's (2048).
        for (n, d) in [(4096, 576), (1000, 2048), (64, 96)] {
            if let Some(row) = layer_norm_check(n, d, true, device) {
                note(row);
            }
        }
        // The half model's RMSNorm (decode), both roundings: one row (decode), a prefill's rows.
        for (n, d) in [(1, 576), (4096, 576), (300, 2048)] {
            for family in [crate::model::llama::Family::Llama, crate::model::llama::Family::Olmo2] {
                if let Some(row) = rms_norm_infer_check(n, d, family, device) {
                    note(row);
                }
            }
        }
        // SwiGLU's product (a Llama MLP's inference): one row, a prefill's rows at SmolLM2-135M's
        // intermediate width (16-byte loads), and a width they cannot take (one value at a time).
        for (n, i) in [(1, 1536), (4096, 1536), (300, 36)] {
            if let Some(row) = silu_mul_check(n, i, device) {
                note(row);
            }
        }
        // The routing's top-κ in one kernel: a prefill's chunks (scores with many ties), and a
        // decode's one chunk inside its ring of 2C scores.
        for ring in [false, true] {
            if let Some(row) = top_kappa_check(ring, device) {
                note(row);
            }
        }
    }
    let (b, tt) = if device.is_cuda() { (4, 2048) } else { (2, 9) };
    // The aten form (csrc/heads.cpp), which CUDA takes with ATTNLAB_HEADS_KERNEL=0.
    with_env(&[("ATTNLAB_HEADS_KERNEL", "0")], || {
        for rot in [hd / 4, hd] {
            note(heads_op_check(b, tt, s.heads as i64, hd, rot, false, device, kind));
        }
        note(heads_op_check(b, tt, s.heads as i64, hd, hd, true, device, kind));
    });
    if device.is_cuda() {
        // The same op by csrc/cuda/heads.cu's kernels (ATTNLAB_HEADS_KERNEL=1; the default): a quarter and all of the dims rotated (16-byte chunks,
        // `heads_rotate8`), and 4 (a rotated half of 2: the one-element kernel).
        let heads = crate::kernels::cuda::heads_kernel_available();
        with_env(&[("ATTNLAB_HEADS_KERNEL", "1")], || {
            // Llama's q / k (`rope-heads`): one piece, every dim, the tables read in place.
            for (rot, llama) in [(hd / 4, false), (hd, false), (4, false), (hd, true)] {
                if !heads {
                    note(failed_row("heads-op-kernel", "the heads kernels are not in the CUDA kernel library (make gpu-kernels)", false));
                    continue;
                }
                let mut row = heads_op_check(b, tt, s.heads as i64, hd, rot, llama, device, kind);
                row.implementation += "-kernel";
                note(row);
            }
        });
    }
    Ok(failed)
}

/// `f` with the environment variables `vars` set (the kernels' switches, which they read at each
/// call, so that the gate checks a path whether or not it is the default), then the caller's values
/// back: a switch the caller set, e.g. `ATTNLAB_LN_KERNEL=0`, stays theirs for the rows after.
fn with_env<R>(vars: &[(&str, &str)], f: impl FnOnce() -> R) -> R {
    let before: Vec<_> = vars.iter().map(|(k, _)| std::env::var_os(k)).collect();
    for (k, v) in vars {
        std::env::set_var(k, v);
    }
    let r = f();
    for ((k, _), old) in vars.iter().zip(before).rev() {
        match old {
            Some(v) => std::env::set_var(k, v),
            None => std::env::remove_var(k),
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{bench_command, json_line, BenchMode};
    use crate::kernels;

    #[test]
    fn the_decode_gates_reference_equals_dars_absorbed_step() {
        // The fused kernel's reference (keys rebuilt) against `dar::read_latents` (the aten step the
        // kernel fuses), fp64: so a GPU failure of the gate is the kernel's, not the reference's.
        let _rng = crate::testutil::rng();
        for (case, _) in step_cases().into_iter().filter(|(c, planted)| !planted && c.latents) {
            let c = DecodeCase { span: case.span.min(70), window: case.window.min(9), ..case };
            let xs = decode_inputs(c, Device::Cpu, Kind::Double);
            let reference = step_reference(&xs, c, Kind::Double);
            let a = crate::attention::AbsorbedKv::new(xs[2].shallow_clone(), Some(xs[4].shallow_clone()), xs[3].shallow_clone(), Some(xs[5].shallow_clone()), c.rot);
            let far = distant_mask(&xs, c.window, c.span);
            let ring = (xs[10].shallow_clone(), xs[11].shallow_clone(), xs[12].shallow_clone());
            let aten = crate::attention::dar::read_latents(&xs[0], (c.window > 0).then_some(&ring), &xs[1], &far, &a, &xs[6].to_kind(Kind::Double), &xs[7].to_kind(Kind::Double));
            let d = (&reference - &aten).abs().max().double_value(&[]);
            assert!(d < 1e-10, "case h {} hkv {} rot {} w {}: reference vs read_latents {d:e}", c.h, c.hkv, c.rot, c.window);
            // And the case is not degenerate: the distant keys move the output.
            let ring_only = crate::attention::cache::attend_newest(&xs[0], &[(&xs[10], &xs[11], Some(xs[12].shallow_clone()))]);
            if c.window > 0 {
                assert!((&reference - ring_only).abs().max().double_value(&[]) > 1e-2);
            }
        }
    }

    #[test]
    fn decode_model_rows_pass_and_the_planted_short_span_fails() {
        // On the CPU the model is fp32 and so is its baseline: the bound is the floor, which the
        // device-side steps meet and a step that misses the newest key does not.
        let _rng = crate::testutil::rng();
        let spec = crate::spec::SpecSource { sets: vec!["train.device=cpu".into(), "model.vocab=64".into()], ..Default::default() }.load().unwrap();
        for name in ["vanilla", "dar"] {
            let row = decode_model_check(&spec, name, Device::Cpu, false).unwrap();
            assert!(row.ok && row.within, "{}", row.line());
        }
        let planted = decode_model_check(&spec, "vanilla", Device::Cpu, true).unwrap();
        assert!(planted.ok && !planted.within, "{}", planted.line());
    }

    #[test]
    fn in_bf16_the_decode_rows_pass_and_the_planted_short_span_still_fails() {
        // The GPU's regime on the CPU: model and baseline in bf16, so the bound is bf16 rounding's
        // (3× the full forward's own error), not the fp32 floor. A random model's near-uniform
        // attention hid the missing newest key under that bound on one H100.
        let _rng = crate::testutil::rng();
        let spec = crate::spec::SpecSource { sets: vec!["train.device=cpu".into(), "model.vocab=64".into()], ..Default::default() }.load().unwrap();
        for name in ["vanilla", "window", "dar", "uniform", "still-budget", "lolcats"] {
            let row = decode_model_check_in(&spec, name, Device::Cpu, true, false).unwrap();
            assert!(row.ok && row.within && row.dtype == "BFloat16", "{}", row.line());
        }
        let planted = decode_model_check_in(&spec, "vanilla", Device::Cpu, true, true).unwrap();
        assert!(planted.ok && !planted.within, "{}", planted.line());
    }

    #[test]
    fn check_lines_say_ok_or_fail_and_json_lines_parse() {
        let t = |err: f64| TensorErr { name: "dq", err, baseline: 1e-3, bound: 3e-3, worst_at: 7 };
        let r = CheckRow::new("sdpa", &[1, 2, 8, 4], Some(4), Kind::BFloat16, vec![t(1e-3)], false);
        assert!(r.line().starts_with("sdpa                 [1, 2, 8, 4] w     4 BFloat16: err/bound dq 1.0e-3/3.0e-3") && r.line().ends_with("  ok"), "{}", r.line());
        let bad = CheckRow::new("sdpa", &[1, 2, 8, 4], Some(4), Kind::BFloat16, vec![t(1e-2)], false);
        assert!(bad.line().ends_with("(worst: dq at 7)  FAIL"), "{}", bad.line());
        let planted = CheckRow::new("wide", &[1, 2, 8, 4], Some(4), Kind::BFloat16, vec![t(1e-2)], true);
        assert!(planted.ok && planted.line().contains("planted: fails as it must"));
        let v: serde_json::Value = serde_json::from_str(&json_line(&bad)).unwrap();
        assert_eq!((v["ok"].clone(), v["tensors"][0]["bound"].clone()), (false.into(), 3e-3.into()));
        // NaN is never within a bound.
        assert!(!t(f64::NAN).within());
    }

    #[test]
    fn check_mode_shows_every_window_and_fails_with_the_count_of_failures() {
        let _rng = crate::testutil::rng();
        let spec = crate::spec::SpecSource { sets: vec!["train.device=cpu".into(), "data.seq_len=16".into()], ..Default::default() }.load().unwrap();
        let mut lines = Vec::new();
        let r = bench_command(&spec, BenchMode::Check, false, |l| lines.push(l));
        // 2 shapes × (8 windows × 2 CPU implementations (SDPA, band-split) + 2 planted) + 2 loss-head
        // rows + 2 heads rows + Llama's RoPE heads (`rope-heads`).
        assert_eq!(lines.len(), 41, "{lines:?}");
        assert!(lines.iter().any(|l| l.starts_with("rope-heads") && l.ends_with("  ok")), "{lines:?}");
        let failed = lines.iter().filter(|l| l.contains("FAIL")).count();
        assert_eq!(failed, 0, "{lines:?}");
        assert_eq!(lines.iter().filter(|l| l.ends_with("planted: fails as it must)")).count(), 5, "{lines:?}");
        assert!(r.is_ok());
    }

    /// The gate's calibration in bf16 (on CPU): SDPA, whose early rows broke the old per-row relative
    /// bound, passes at every window; DAR one key off (w ± 1) and a key from the future fail.
    #[test]
    fn bf16_gate_passes_sdpa_and_fails_planted_off_by_one_windows() {
        let _rng = crate::testutil::rng();
        let (t, dev) = (40i64, Device::Cpu);
        let shape = [2, 3, t, 16];
        for w in [1, 4, 17, t - 1] {
            let fast = attention_check(AttentionImpl::Sdpa, shape, w, dev, Kind::BFloat16);
            assert!(fast.ok, "{}", fast.line());
            let wide = attention_check_with("wide", &planted_wide(w), shape, w, dev, Kind::BFloat16, true);
            assert!(wide.ok, "{}", wide.line());
            let narrow = move |xs: &[Tensor]| dar_reference(xs, w - 1, Some(Kind::BFloat16));
            let narrow = attention_check_with("narrow", &narrow, shape, w, dev, Kind::BFloat16, true);
            assert!(narrow.ok, "{}", narrow.line());
            let peek = attention_check_with("peek", &peek(t, w), shape, w, dev, Kind::BFloat16, true);
            assert!(peek.ok, "{}", peek.line());
        }
    }

    /// The local band one key into the future (distance −1 counts as local).
    fn peek(t: i64, w: i64) -> impl Fn(&[Tensor]) -> Tensor {
        move |xs: &[Tensor]| {
            let dev = xs[0].device();
            let (_, global) = dar_masks(t, w, dev);
            let i = Tensor::arange(t, (Kind::Int64, dev)).unsqueeze(1);
            let dist = i - Tensor::arange(t, (Kind::Int64, dev)).unsqueeze(0);
            let local = dist.ge(-1).logical_and(&dist.lt(w));
            masked_softmax_attention_in(&xs[0], &[(&xs[1], &xs[2], &local), (&xs[3], &xs[4], &global)], xs[0].kind())
        }
    }

    /// In fp64 the bound is the floor: planted wrong implementations fail wherever they compute another
    /// function, and the fast path passes, at windows 0, 1, inside, T − 1, T and T + 5:
    /// `wide` (w + 1), `narrow` (w − 1), `peek`. w ± 1 is the same function once both are ≥ T (and at
    /// w = 0 for `narrow`); there the planted row must pass the bound (and so is not ok as planted).
    #[test]
    fn planted_off_by_one_window_boundaries_fail_the_check() {
        let _rng = crate::testutil::rng();
        let (t, dev) = (12i64, Device::Cpu);
        let shape = [1, 2, t, 8];
        for w in [0, 1, 4, t - 1, t, t + 5] {
            let fast = attention_check(AttentionImpl::Sdpa, shape, w, dev, Kind::Double);
            assert!(fast.ok, "sdpa: {}", fast.line());
            let wide = attention_check_with("wide", &planted_wide(w), shape, w, dev, Kind::Double, true);
            assert_eq!(wide.within, w >= t, "{}", wide.line());
            let narrow = move |xs: &[Tensor]| dar_reference(xs, (w - 1).max(0), None);
            let narrow = attention_check_with("narrow", &narrow, shape, w, dev, Kind::Double, true);
            assert_eq!(narrow.within, w == 0 || w > t, "{}", narrow.line());
            let peek = attention_check_with("peek", &peek(t, w), shape, w, dev, Kind::Double, true);
            assert!(peek.ok, "{}", peek.line());
            // The failing rows are real errors, far above fp64 rounding.
            for r in [&wide, &narrow, &peek].into_iter().filter(|r| !r.within) {
                assert!(r.tensors.iter().map(|t| t.err).fold(0.0, f64::max) > 1e-3, "{}", r.line());
            }
        }
    }

    #[test]
    fn with_env_gives_the_callers_switches_back() {
        let (set, unset) = ("ATTNLAB_TEST_WITH_ENV_SET", "ATTNLAB_TEST_WITH_ENV_UNSET");
        std::env::set_var(set, "0");
        std::env::remove_var(unset);
        let inside = with_env(&[(set, "1"), (unset, "1")], || (std::env::var(set).unwrap(), std::env::var(unset).unwrap()));
        assert_eq!(inside, ("1".to_string(), "1".to_string()));
        assert_eq!(std::env::var(set).as_deref(), Ok("0"), "the caller's value is back");
        assert!(std::env::var_os(unset).is_none(), "a switch the caller never set is gone again");
        std::env::remove_var(set);
    }

    /// The loss head's aten path in the gate: within the bound in fp64 and in bf16 on CPU, and the
    /// planted wrong targets fail it in both.
    #[test]
    fn loss_head_passes_the_gate_and_wrong_targets_fail_it() {
        let _rng = crate::testutil::rng();
        for kind in [Kind::Double, Kind::BFloat16] {
            let r = loss_head_check(33, 50, Device::Cpu, kind, false);
            assert!(r.ok, "{}", r.line());
            let p = loss_head_check(33, 50, Device::Cpu, kind, true);
            assert!(p.ok && !p.within, "{}", p.line());
        }
    }

    /// Split-merge on heads `[B, H, T, hd]` through the C++ op with the kernels' math (CPU, fp64).
    fn split_merge_math(xs: &[Tensor], w: i64, fused: bool) -> Tensor {
        let bthd = |x: &Tensor| x.transpose(1, 2);
        kernels::dar_split_merge(&bthd(&xs[0]), &bthd(&xs[1]), &bthd(&xs[2]), &bthd(&xs[3]), &bthd(&xs[4]), w, kernels::GlobalBackend::Math, fused).unwrap().transpose(1, 2)
    }

    /// Stand-ins for csrc/cuda/dar_band.cu's two entry points, on CPU in fp64 with their contract
    /// (inputs [B, T, H, D]; the band is the keys at distance < w; the distant part given as its
    /// output [B, T − w, H, D] and lse [B, H, T − w], merged by log-sum-exp; the backward from the
    /// merged output and lse, the distant dQ added to rows ≥ w), by explicit masked scores.
    mod band_standin {
        use tch::{Kind, Tensor};
        use torch_sys::C_tensor;

        fn arg(p: *mut C_tensor) -> Option<Tensor> {
            // SAFETY: the op hands over pointers to live tensors (or null), read during the call.
            (!p.is_null()).then(|| unsafe { Tensor::clone_from_ptr(p) })
        }
        fn give(mut t: Tensor, out: *mut *mut C_tensor) {
            // SAFETY: the op takes the new at::Tensor over (and deletes it).
            unsafe { *out = t.as_mut_ptr() };
            std::mem::forget(t);
        }
        /// Band scores [B, H, T, T] (−inf outside 0 ≤ i − j < w) of heads-first q, k.
        fn band_scores(q: &Tensor, k: &Tensor, w: i64) -> Tensor {
            let t = q.size()[2];
            let i = Tensor::arange(t, (Kind::Int64, q.device())).view([t, 1]);
            let dist = &i - i.view([1, t]);
            let band = dist.ge(0).logical_and(&dist.lt(w));
            (q.matmul(&k.transpose(-2, -1)) / (q.size()[3] as f64).sqrt()).masked_fill(&band.logical_not(), f64::NEG_INFINITY)
        }
        pub extern "C" fn merge(q: *mut C_tensor, k: *mut C_tensor, v: *mut C_tensor, far: *mut C_tensor, far_lse: *mut C_tensor, w: i64, out: *mut *mut C_tensor, lse: *mut *mut C_tensor) -> *mut libc::c_char {
            let h = |p| arg(p).unwrap().transpose(1, 2);
            let (q, k, v) = (h(q), h(k), h(v));
            let s = band_scores(&q, &k, w);
            let l_band = s.logsumexp([-1], false);
            let mut o = s.softmax(-1, Kind::Double).matmul(&v);
            let mut l = l_band.copy();
            if let (Some(far), Some(far_lse)) = (arg(far), arg(far_lse)) {
                let n = far.size()[1];
                let (lb, ob) = (l_band.narrow(2, w, n), o.narrow(2, w, n));
                let merged = lb.logaddexp(&far_lse);
                let mixed = &ob * (&lb - &merged).exp().unsqueeze(-1) + far.transpose(1, 2) * (&far_lse - &merged).exp().unsqueeze(-1);
                o = Tensor::cat(&[o.narrow(2, 0, w), mixed], 2);
                l = Tensor::cat(&[l_band.narrow(2, 0, w), merged], 2);
            }
            give(o.transpose(1, 2).contiguous(), out);
            give(l.contiguous(), lse);
            std::ptr::null_mut()
        }
        #[allow(clippy::too_many_arguments)]
        pub extern "C" fn bwd(q: *mut C_tensor, k: *mut C_tensor, v: *mut C_tensor, out: *mut C_tensor, dout: *mut C_tensor, lse: *mut C_tensor, far_dq: *mut C_tensor, w: i64, dq: *mut *mut C_tensor, dk: *mut *mut C_tensor, dv: *mut *mut C_tensor) -> *mut libc::c_char {
            let h = |p| arg(p).unwrap().transpose(1, 2);
            let (q, k, v, o, g) = (h(q), h(k), h(v), h(out), h(dout));
            let scale = 1.0 / (q.size()[3] as f64).sqrt();
            let p = (band_scores(&q, &k, w) - arg(lse).unwrap().unsqueeze(-1)).exp();
            let dd = (&g * &o).sum_dim_intlist([-1i64].as_slice(), true, Kind::Double);
            let ds = &p * (g.matmul(&v.transpose(-2, -1)) - dd);
            let mut gq = ds.matmul(&k) * scale;
            if let Some(f) = arg(far_dq) {
                let n = f.size()[1];
                gq = Tensor::cat(&[gq.narrow(2, 0, w), gq.narrow(2, w, n) + f.transpose(1, 2)], 2);
            }
            give(gq.transpose(1, 2).contiguous(), dq);
            give((ds.transpose(-2, -1).matmul(&q) * scale).transpose(1, 2).contiguous(), dk);
            give(p.transpose(-2, -1).matmul(&g).transpose(1, 2).contiguous(), dv);
            std::ptr::null_mut()
        }
    }

    /// Backend 3's glue in csrc/dar_attention.cpp (the distant part first, the band-and-merge
    /// kernel's out and lse kept for the backward, the distant backward fed them, the distant dQ
    /// handed to the band's dQ, dK_g / dV_g padded) with stand-in band kernels of the CUDA ones'
    /// contract, on CPU in fp64: output and all five gradients equal the reference, and one key off
    /// fails.
    #[test]
    fn split_merge_band_glue_is_exact_in_fp64() {
        let _rng = crate::testutil::rng();
        kernels::set_band_kernels(band_standin::merge as *mut libc::c_void, band_standin::bwd as *mut libc::c_void);
        let band = |w: i64| {
            move |xs: &[Tensor]| {
                let bthd = |x: &Tensor| x.transpose(1, 2);
                kernels::dar_split_merge(&bthd(&xs[0]), &bthd(&xs[1]), &bthd(&xs[2]), &bthd(&xs[3]), &bthd(&xs[4]), w, kernels::GlobalBackend::Band, true).unwrap().transpose(1, 2)
            }
        };
        let (t, shape) = (11i64, [2, 3, 11, 8]);
        for w in [1, 4, t - 1] {
            let r = attention_check_with("split-merge-band (stand-in kernels)", &band(w), shape, w, Device::Cpu, Kind::Double, false);
            assert!(r.ok, "{}", r.line());
        }
        let r = attention_check_with("split-merge-band at w 3", &band(3), shape, 4, Device::Cpu, Kind::Double, false);
        assert!(!r.ok, "{}", r.line());
    }

    /// The split-merge glue of csrc/dar_attention.cpp (log-sum-exp merge, each part's backward fed
    /// the merged O and lse, dQ summed, dK_g / dV_g scattered), unfused and fused, with the kernels'
    /// math on CPU in fp64: output and all five input gradients equal the reference, for w at both
    /// ends of 0 < w < T and between, with B > 1 (strided narrows). The math backend holds its
    /// backward to the CUDA kernels' input contract (dO and O of one layout; the fused path once
    /// handed cuDNN a dO transposed against O and got dq / dk_g wrong on the GPU only), so a glue
    /// that breaks it fails here.
    #[test]
    fn split_merge_glue_is_exact_in_fp64() {
        let _rng = crate::testutil::rng();
        let (t, shape) = (11i64, [2, 3, 11, 8]);
        for w in [1, 4, t - 1] {
            for fused in [false, true] {
                let f = move |xs: &[Tensor]| split_merge_math(xs, w, fused);
                let r = attention_check_with(if fused { "fused" } else { "unfused" }, &f, shape, w, Device::Cpu, Kind::Double, false);
                assert!(r.ok, "{}", r.line());
                // K_g / V_g of only the T − w positions the distant part reads (what a DAR layer
                // builds on the GPU): the same output and gradients (the rows past them get none).
                let f = move |xs: &[Tensor]| split_merge_math(&distant_prefix(xs, w), w, fused);
                let r = attention_check_with("distant prefix", &f, shape, w, Device::Cpu, Kind::Double, false);
                assert!(r.ok, "{}", r.line());
            }
        }
        // The same check fails the op run one key off (w − 1 against the reference at w).
        let f = |xs: &[Tensor]| split_merge_math(xs, 3, true);
        let r = attention_check_with("fused at w 3", &f, shape, 4, Device::Cpu, Kind::Double, false);
        assert!(!r.ok, "{}", r.line());
    }
}
