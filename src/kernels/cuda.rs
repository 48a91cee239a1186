//! Our own CUDA kernels (csrc/cuda/*.cu), built by `make gpu-kernels` into `libattnlab_kernels.so`
//! and loaded at run time: the binary builds and runs without them (CPU machines, or a GPU host where
//! the library was not carried), and every caller has an aten path that computes the same function.
//! Looked up in `$ATTNLAB_KERNELS` (a file), then next to the running binary.
use super::check;
use crate::Result;
use std::sync::OnceLock;
use tch::Tensor;
use torch_sys::C_tensor;

type CeGradInPlace = unsafe extern "C" fn(*mut C_tensor, *mut C_tensor, f64, *mut *mut C_tensor) -> *mut libc::c_char;
type Err = *mut libc::c_char;
type Handle = *mut libc::c_void;
type LayerNormHalfFn = unsafe extern "C" fn(*mut C_tensor, *mut C_tensor, *mut C_tensor, f64, *mut *mut C_tensor) -> Err;
type RmsNormHalfFn = unsafe extern "C" fn(*mut C_tensor, *mut C_tensor, f64, *mut *mut C_tensor) -> Err;
type RmsNormInferFn = unsafe extern "C" fn(*mut C_tensor, *mut C_tensor, f64, i64, *mut *mut C_tensor) -> Err;
type SiluMulFn = unsafe extern "C" fn(*mut C_tensor, *mut C_tensor, *mut *mut C_tensor) -> Err;
type AttendStepFn = unsafe extern "C" fn(*const *mut C_tensor, i64, i64, i64, i64, i64, *mut *mut C_tensor) -> Err;
type SplitRotateFn = unsafe extern "C" fn(*mut C_tensor, i64, i64, i64, *mut C_tensor, *mut C_tensor, *mut *mut C_tensor) -> Err;
type HybridMixFn = unsafe extern "C" fn(*const *mut C_tensor, i64, f64, i64, i64, i64, i64, i64, *mut *mut C_tensor) -> Err;
type PrefillScoresFn = unsafe extern "C" fn(*const *mut C_tensor, i64, i64, *mut *mut C_tensor) -> Err;
type PrefillMixFn = unsafe extern "C" fn(*const *mut C_tensor, i64, f64, i64, i64, *mut *mut C_tensor) -> Err;
type PrefillLinearFn = unsafe extern "C" fn(*const *mut C_tensor, i64, i64, i64, i64, *mut *mut C_tensor) -> Err;
type FoldChunkFn = unsafe extern "C" fn(*const *mut C_tensor, i64, i64) -> Err;
type TopKappaFn = unsafe extern "C" fn(*mut C_tensor, i64, *mut *mut C_tensor) -> Err;

/// The CUDA-graph entry points (csrc/cuda/graph.cu).
struct GraphFns {
    enter: unsafe extern "C" fn(libc::c_int, *mut Handle) -> Err,
    capture: unsafe extern "C" fn(Handle) -> Err,
    leave: unsafe extern "C" fn(Handle) -> Err,
    replay: unsafe extern "C" fn(Handle) -> Err,
    free: unsafe extern "C" fn(Handle),
}

/// The entry points of a loaded library.
struct Library {
    ce_grad_in_place: CeGradInPlace,
    /// None in a library built before the graphs (decoding then runs eagerly).
    graph: Option<GraphFns>,
    /// None in a library built before the fused decode step (csrc/cuda/attend_step.cu).
    attend_step: Option<AttendStepFn>,
    /// None in a library built before csrc/cuda/layer_norm.cu.
    layer_norm_half: Option<LayerNormHalfFn>,
    /// None in a library built before the kernels' RMSNorm form.
    rms_norm_half: Option<RmsNormHalfFn>,
    /// None in a library built before the half model's RMSNorm (`attnlab_rms_norm_infer`).
    rms_norm_infer: Option<RmsNormInferFn>,
    /// None in a library built before csrc/cuda/swiglu.cu.
    silu_mul: Option<SiluMulFn>,
    /// DAR's band kernels (csrc/cuda/dar_band.cu), handed to the split-merge op when found.
    band: bool,
    /// None in a library built before csrc/cuda/heads.cu.
    split_rotate: Option<SplitRotateFn>,
    /// None in a library built before csrc/cuda/hybrid_step.cu.
    hybrid_mix: Option<HybridMixFn>,
    /// None in a library built before csrc/cuda/hybrid_prefill.cu.
    prefill: Option<(PrefillScoresFn, PrefillMixFn)>,
    /// None in a library built before csrc/cuda/hybrid_linear.cuh.
    prefill_linear: Option<PrefillLinearFn>,
    /// None in a library built before `attnlab_hybrid_fold_chunk`.
    fold_chunk: Option<FoldChunkFn>,
    /// None in a library built before csrc/cuda/top_kappa.cu.
    top_kappa: Option<TopKappaFn>,
}

/// A tensor's handle for the library's C entry points.
fn handle(t: &Tensor) -> *mut C_tensor {
    t.as_ptr() as *mut C_tensor
}

/// [`handle`], or null for an absent tensor.
fn handle_or_null(t: Option<&Tensor>) -> *mut C_tensor {
    t.map_or(std::ptr::null_mut(), handle)
}

/// The file name `make gpu-kernels` writes (into `.gpu/`, beside the lean binary).
pub const FILE_NAME: &str = "libattnlab_kernels.so";

fn candidates() -> Vec<std::path::PathBuf> {
    let mut c: Vec<std::path::PathBuf> = std::env::var_os("ATTNLAB_KERNELS").map(Into::into).into_iter().collect();
    if let Some(dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(|p| p.to_path_buf())) {
        c.push(dir.join(FILE_NAME));
    }
    c
}

fn open(path: &std::path::Path) -> std::result::Result<Library, String> {
    let cs = std::ffi::CString::new(path.to_string_lossy().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: dlopen / dlsym with NUL-terminated names; the handle is never closed (the functions
    // live as long as the process).
    unsafe {
        let h = libc::dlopen(cs.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL);
        if h.is_null() {
            return Err(std::ffi::CStr::from_ptr(libc::dlerror()).to_string_lossy().into_owned());
        }
        let sym = libc::dlsym(h, c"attnlab_ce_grad_in_place".as_ptr());
        if sym.is_null() {
            return Err("no symbol attnlab_ce_grad_in_place (a library from another attnlab version?)".into());
        }
        let find = |name: &std::ffi::CStr| {
            let p = libc::dlsym(h, name.as_ptr());
            (!p.is_null()).then_some(p)
        };
        let graph = (|| {
            Some(GraphFns {
                enter: std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(libc::c_int, *mut Handle) -> Err>(find(c"attnlab_graph_enter")?),
                capture: std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(Handle) -> Err>(find(c"attnlab_graph_capture")?),
                leave: std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(Handle) -> Err>(find(c"attnlab_graph_leave")?),
                replay: std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(Handle) -> Err>(find(c"attnlab_graph_replay")?),
                free: std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(Handle)>(find(c"attnlab_graph_free")?),
            })
        })();
        let attend_step = find(c"attnlab_attend_step").map(|p| std::mem::transmute::<*mut libc::c_void, AttendStepFn>(p));
        let layer_norm_half = find(c"attnlab_layer_norm_half").map(|p| std::mem::transmute::<*mut libc::c_void, LayerNormHalfFn>(p));
        let rms_norm_half = find(c"attnlab_rms_norm_half").map(|p| std::mem::transmute::<*mut libc::c_void, RmsNormHalfFn>(p));
        let rms_norm_infer = find(c"attnlab_rms_norm_infer").map(|p| std::mem::transmute::<*mut libc::c_void, RmsNormInferFn>(p));
        let silu_mul = find(c"attnlab_silu_mul").map(|p| std::mem::transmute::<*mut libc::c_void, SiluMulFn>(p));
        let band = match (find(c"attnlab_dar_band_merge"), find(c"attnlab_dar_band_bwd")) {
            (Some(merge), Some(bwd)) => {
                super::set_band_kernels(merge, bwd);
                true
            }
            _ => false,
        };
        let split_rotate = find(c"attnlab_split_rotate_cuda").map(|p| std::mem::transmute::<*mut libc::c_void, SplitRotateFn>(p));
        let hybrid_mix = find(c"attnlab_hybrid_mix").map(|p| std::mem::transmute::<*mut libc::c_void, HybridMixFn>(p));
        let prefill = find(c"attnlab_hybrid_prefill_scores")
            .zip(find(c"attnlab_hybrid_prefill_mix"))
            .map(|(s, m)| (std::mem::transmute::<*mut libc::c_void, PrefillScoresFn>(s), std::mem::transmute::<*mut libc::c_void, PrefillMixFn>(m)));
        let prefill_linear = find(c"attnlab_hybrid_prefill_linear").map(|p| std::mem::transmute::<*mut libc::c_void, PrefillLinearFn>(p));
        let ce_grad_in_place = std::mem::transmute::<*mut libc::c_void, CeGradInPlace>(sym);
        let fold_chunk = find(c"attnlab_hybrid_fold_chunk").map(|p| std::mem::transmute::<*mut libc::c_void, FoldChunkFn>(p));
        let top_kappa = find(c"attnlab_top_kappa").map(|p| std::mem::transmute::<*mut libc::c_void, TopKappaFn>(p));
        Ok(Library { ce_grad_in_place, graph, attend_step, layer_norm_half, rms_norm_half, rms_norm_infer, silu_mul, band, split_rotate, hybrid_mix, prefill, prefill_linear, fold_chunk, top_kappa })
    }
}

/// The library, loaded once (by a CUDA path, so libtorch_cuda is already loaded: device parsing
/// preloads it); `None` (after one line on stderr naming where it looked) when it is not there.
fn library() -> Option<&'static Library> {
    static LIB: OnceLock<Option<Library>> = OnceLock::new();
    LIB.get_or_init(|| {
        let mut why = Vec::new();
        for p in candidates() {
            if !p.exists() {
                why.push(format!("{}: not there", p.display()));
                continue;
            }
            match open(&p) {
                Ok(lib) => return Some(lib),
                Err(e) => why.push(format!("{}: {e}", p.display())),
            }
        }
        eprintln!("attnlab: no CUDA kernel library ({}); the loss head runs through aten, slower (`make gpu-bin` builds it)", why.join("; "));
        None
    })
    .as_ref()
}

/// Whether the kernels are loaded (asks for them: the first call on a GPU host loads the library).
pub fn available() -> bool {
    library().is_some()
}

/// Cross-entropy of each row of `logits` `[N, V]` (CUDA, bf16 / fp16, unit column stride) against
/// `targets` `[N]`, the rows overwritten in place with `scale·(softmax − onehot)`: per-row losses
/// `[N]` fp32. `None` when the library is not loaded (the caller's aten path computes the same).
/// Each row is read twice (its log-sum-exp, then the gradient); with `ATTNLAB_CE_HELD=1` rows of up
/// to 65,536 values are read once into registers (csrc/cuda/loss_head.cuh): it passes `bench --check`
/// but trained 0.3–2.2% slower on one H100 (results/bench/2026-12-06b-h100), so it stays off.
pub fn ce_grad_in_place(logits: &mut Tensor, targets: &Tensor, scale: f64) -> Option<Result<Tensor>> {
    let lib = library()?;
    let p = handle;
    // SAFETY: valid tensor handles, read during the call.
    Some(new_tensor(|out| unsafe { (lib.ce_grad_in_place)(p(logits), p(targets), scale, out) }))
}

/// The tensor an entry point hands over through its last argument when `call` succeeds.
fn new_tensor(call: impl FnOnce(*mut *mut C_tensor) -> *mut libc::c_char) -> Result<Tensor> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    check(call(&mut out))?;
    // SAFETY: on success the library has written a new tensor into `out`, which we now own.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// [`new_tensor`] for an entry point that leaves its output null where it does not apply (the
/// norms outside their dtypes or widths): None then, the caller's aten form applying.
fn new_tensor_if_applies(call: impl FnOnce(*mut *mut C_tensor) -> *mut libc::c_char) -> Option<Result<Tensor>> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    match check(call(&mut out)) {
        Err(e) => Some(Err(e)),
        Ok(()) if out.is_null() => None,
        // SAFETY: on success with a non-null `out` the library has written a new tensor we now own.
        Ok(()) => Some(Ok(unsafe { Tensor::from_ptr(out) })),
    }
}

/// The full-width keys / values a fused decode step reads: `[B, H_kv, W, hd]` views of a cache's
/// buffers, slot j holding position j (`keep` 0) or a ring of `keep` slots.
pub struct FullWidth<'a> {
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub keep: i64,
}

/// DAR's distant part of a fused decode step: the latents `[B, S, r]` of key positions 0..S, read
/// through the absorbed map (`wk`, `wv` `[H_kv, hd, r]`, biases `[H_kv, hd]`; its first `rotated`
/// key dims rebuilt and turned by RoPE's fp32 tables `[S, rotated/2]`); slot s is distant, and
/// visible, iff pos − s ≥ `window`.
pub struct Distant<'a> {
    pub latents: &'a Tensor,
    pub wk: &'a Tensor,
    /// `AbsorbedKv::wk_rot`: wk's rotated rows `[H_kv·rotated, r]`, contiguous.
    pub wk_rot: &'a Tensor,
    pub wv: &'a Tensor,
    pub bk: Option<&'a Tensor>,
    pub bv: Option<&'a Tensor>,
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    pub rotated: i64,
    pub window: i64,
}

/// One new query `[B, H, 1, hd]` at the device-side position `pos` (`[1]` i64) over full-width
/// slots and / or DAR's latents, as one softmax (csrc/cuda/attend_step.cu; `cache::attend_newest`
/// and `dar::read_latents` are its aten forms). `pad` `[B]`: the rows' left padding (no key before
/// it is read).
pub struct Step<'a> {
    pub q: &'a Tensor,
    pub pos: &'a Tensor,
    pub pad: Option<&'a Tensor>,
    pub full: Option<FullWidth<'a>>,
    pub distant: Option<Distant<'a>>,
    /// The new token's own rows, not yet in the caches: the kernels read them for the slots they are
    /// to fill and the combine kernel writes them there (no index_copy before the step). `None`:
    /// the caches already hold them.
    pub fresh: Option<Fresh<'a>>,
}

/// A kernel switch: the environment variable `name` set to `0` turns it off, `1` on; unset (or
/// anything else) leaves `by_default`, so a benchmark or the gate can time or check either path.
fn switch(name: &str, by_default: bool) -> bool {
    match std::env::var(name).as_deref() {
        Ok("0") => false,
        Ok("1") => true,
        _ => by_default,
    }
}

/// Whether fused steps hand the new token over as [`Fresh`] rows (the caches written by the combine
/// kernel, no index_copy before the step); on unless `ATTNLAB_STEP_FRESH=0`. Measured for every kind
/// that has the fused step, with the same greedy tokens and its gate rows passing: vanilla and the
/// window 1.03–1.08× faster on one H100 (results/bench/2026-12-05-h100); DAR 1.01–1.13× in 8 of 8 rows
/// at 1K–64K, uniform 0.96–1.03× (median 1.00) (results/bench/2026-12-06e-h100,
/// `decode_fused{1,writes}-{a,b}.jsonl`).
pub fn fresh_enabled() -> bool {
    switch("ATTNLAB_STEP_FRESH", true)
}

/// The new token's key / value `[B, H_kv, 1, hd]` (for the full-width slots) and latent `[B, 1, r]`
/// (for DAR's), each where the step has that part.
pub struct Fresh<'a> {
    pub kv: Option<(&'a Tensor, &'a Tensor)>,
    pub latent: Option<&'a Tensor>,
}

/// Whether decode steps take the fused kernel when `ATTNLAB_FUSED_STEP` is unset: yes since it
/// passed `bench --check` on one H200 and measured faster for vanilla, the window and DAR at 1K–64K
/// (BENCHMARKS.md, results/bench/2026-12-05; uniform at 64K is the exception: 362 vs 405 tok/s).
const FUSED_STEP_BY_DEFAULT: bool = true;

/// Whether the fused decode step is there and switched on (`ATTNLAB_FUSED_STEP=1` / `0`, else
/// [`FUSED_STEP_BY_DEFAULT`]; `0` times or checks the aten step against it), for a query `[B, H, 1, hd]` on CUDA in bf16 / fp16 over
/// `kv_heads` kv heads, latents `d_down` wide (0: none): query heads per kv head the kernel is built
/// for, and shared memory within an H200's block.
pub fn step_enabled(q: &Tensor, kv_heads: i64, d_down: i64) -> bool {
    let (h, hd) = (q.size()[1], q.size()[3]);
    let g = if kv_heads > 0 && h % kv_heads == 0 { h / kv_heads } else { 0 };
    // csrc/cuda/attend_step.cu: smem_floats, and the G it is instantiated for.
    let smem_floats = g * hd + g * d_down.max(1) + g + 4 * g * d_down.max(hd) + 8 * g;
    q.device().is_cuda()
        && matches!(q.kind(), tch::Kind::BFloat16 | tch::Kind::Half)
        && matches!(g, 1 | 2 | 3 | 4 | 6 | 8)
        && smem_floats * 4 <= 200 * 1024
        && switch("ATTNLAB_FUSED_STEP", FUSED_STEP_BY_DEFAULT)
        && library().is_some_and(|l| l.attend_step.is_some())
}

/// Slots per block: about eight blocks of four warps per SM of an H200 (132 SMs), whole warps.
fn slots_per_block(slots: i64, rows: i64) -> i64 {
    let per = (slots * rows + 1055) / 1056;
    (per.max(32) + 31) / 32 * 32
}

/// The fused step's output `[B, H, 1, hd]`; `None` when it is not enabled ([`step_enabled`]).
pub fn attend_step(x: &Step) -> Option<Result<Tensor>> {
    let (full, d) = (x.full.as_ref(), x.distant.as_ref());
    let kv_heads = full.map_or_else(|| d.map_or(0, |d| d.wk.size()[0]), |f| f.k.size()[1]);
    if !step_enabled(x.q, kv_heads, d.map_or(0, |d| d.wk.size()[2])) {
        return None;
    }
    let f = library()?.attend_step?;
    let (p, o) = (handle, handle_or_null);
    let ts = [
        p(x.q),
        p(x.pos),
        o(x.pad),
        o(full.map(|f| f.k)),
        o(full.map(|f| f.v)),
        o(d.map(|d| d.latents)),
        o(d.map(|d| d.wk)),
        o(d.map(|d| d.wv)),
        o(d.and_then(|d| d.bk)),
        o(d.and_then(|d| d.bv)),
        o(d.map(|d| d.cos)),
        o(d.map(|d| d.sin)),
        o(x.fresh.as_ref().and_then(|f| f.kv.map(|kv| kv.0))),
        o(x.fresh.as_ref().and_then(|f| f.kv.map(|kv| kv.1))),
        o(x.fresh.as_ref().and_then(|f| f.latent)),
        o(d.map(|d| d.wk_rot)),
    ];
    let rows = x.q.size()[0] * full.map_or_else(|| d.map_or(1, |d| d.wk.size()[0]), |f| f.k.size()[1]);
    let chunk = d.map_or(32, |d| slots_per_block(d.latents.size()[1], rows));
    let ring_chunk = full.map_or(32, |f| slots_per_block(f.k.size()[2], rows));
    // SAFETY: valid tensor handles (or null where absent), read during the call.
    Some(new_tensor(|out| unsafe { f(ts.as_ptr(), d.map_or(0, |d| d.rotated), d.map_or(0, |d| d.window), full.map_or(0, |f| f.keep), chunk, ring_chunk, out) }))
}

/// LayerNorm of the fp32 residual stream `x` `[.., d]` with fp32 `weight` / `bias` `[d]`, written
/// straight in autocast's half dtype (csrc/cuda/layer_norm.cu: no fp32 output, no cast after it).
/// The rewritten kernels (chunks of rows, the backward in one pass) passed `bench --check` on one
/// H100 and trained vanilla 1.05 / 1.07 / 1.08× faster than aten's LayerNorm at 70M / 160M / 410M
/// (results/bench/2026-12-06-h100; the first version: 1.02 / 1.03 / 1.06×), so they are the
/// default; `ATTNLAB_LN_KERNEL=0` turns them off.
/// `None` (the caller's aten LayerNorm) otherwise, off CUDA, outside autocast, or for other dtypes.
pub fn layer_norm_half(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Option<Result<Tensor>> {
    if !x.device().is_cuda() || x.kind() != tch::Kind::Float || !switch("ATTNLAB_LN_KERNEL", true) {
        return None;
    }
    let f = library()?.layer_norm_half?;
    // SAFETY: valid tensor handles read during the call.
    new_tensor_if_applies(|out| unsafe { f(handle(x), handle(weight), handle(bias), eps, out) })
}

/// RMSNorm (Llama's, OLMo 2's: x·rsqrt(mean(x²) + eps)·γ) of the fp32 residual stream `x` `[.., d]`
/// with an fp32 `weight` `[d]`, written straight in autocast's half dtype: the LayerNorm kernels'
/// RMS form (csrc/cuda/layer_norm.cuh), one pass each way where aten runs a pow, a mean, an rsqrt,
/// two muls and their backward. Equal to HF's `LlamaRMSNorm` / `Olmo2RMSNorm` on fp32 input, whose
/// fp32 output autocast's next matmul casts down. On by default (it passed `bench --check` and trained
/// Llama 30M / 120M 1.31–1.35× faster on an H100, BENCHMARKS.md); `ATTNLAB_RMS_KERNEL=0` takes aten's
/// form. `None` (aten's form) where it does not apply.
pub fn rms_norm_half(x: &Tensor, weight: &Tensor, eps: f64) -> Option<Result<Tensor>> {
    if !x.device().is_cuda() || x.kind() != tch::Kind::Float || !switch("ATTNLAB_RMS_KERNEL", true) {
        return None;
    }
    let f = library()?.rms_norm_half?;
    // SAFETY: valid tensor handles read during the call.
    new_tensor_if_applies(|out| unsafe { f(handle(x), handle(weight), eps, out) })
}

/// RMSNorm of a half model's `x` (bf16 / fp16 `[.., d]` on CUDA) with a `weight` of the same dtype,
/// y in that dtype, for inference (decode, prefill, evaluation: no graph to keep): one kernel where
/// aten runs a cast, a pow, a mean, an add, an rsqrt, two muls and a cast back. `round_first`: x̂
/// rounded to the half dtype before the weight, as HF's `LlamaRMSNorm`; else one rounding after it,
/// as `Olmo2RMSNorm`. Same switch as [`rms_norm_half`]. `None` (aten's form) where it does not apply:
/// the CPU, other dtypes, a weight of another dtype, or autograd recording x or the weight.
pub fn rms_norm_infer(x: &Tensor, weight: &Tensor, eps: f64, round_first: bool) -> Option<Result<Tensor>> {
    if !x.device().is_cuda() || !matches!(x.kind(), tch::Kind::BFloat16 | tch::Kind::Half) || !switch("ATTNLAB_RMS_KERNEL", true) {
        return None;
    }
    let f = library()?.rms_norm_infer?;
    // SAFETY: valid tensor handles read during the call.
    new_tensor_if_applies(|out| unsafe { f(handle(x), handle(weight), eps, round_first as i64, out) })
}

/// SwiGLU's `silu(gate) · up` of a half model's inference (bf16 / fp16 on CUDA, one shape, leading dims
/// that collapse into rows: the halves of one stacked projection too) in one kernel
/// (csrc/cuda/swiglu.cu), rounded as aten's two ops, unless `ATTNLAB_SWIGLU_KERNEL=0`. `None` (aten's
/// form) where it does not apply: the CPU, other dtypes or layouts, or autograd recording either.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Option<Result<Tensor>> {
    if !gate.device().is_cuda() || !switch("ATTNLAB_SWIGLU_KERNEL", true) {
        return None;
    }
    let f = library()?.silu_mul?;
    // SAFETY: valid tensor handles read during the call.
    new_tensor_if_applies(|out| unsafe { f(handle(gate), handle(up), out) })
}

/// GPT-NeoX's heads op (`kernels::split_rotate`'s contract) by one CUDA kernel each way
/// (csrc/cuda/heads.cu) for bf16 / fp16 `x` on CUDA unless `ATTNLAB_HEADS_KERNEL=0`: the 16-byte-chunk
/// form (`heads_rotate8`) passes `bench --check` and trains vanilla Pythia 1.076 / 1.088 / 1.087×
/// faster than the aten op at 70M / 160M / 410M on one H100 (results/bench/2026-12-06b-h100).
/// `None` (the aten op) otherwise.
pub fn split_rotate(x: &Tensor, heads: i64, n: i64, rotated: i64, cos: &Tensor, sin: &Tensor) -> Option<Result<Vec<Tensor>>> {
    if !x.device().is_cuda() || !matches!(x.kind(), tch::Kind::BFloat16 | tch::Kind::Half) || n > 16 || !switch("ATTNLAB_HEADS_KERNEL", true) {
        return None;
    }
    let f = library()?.split_rotate?;
    let p = handle;
    let mut outs: Vec<*mut C_tensor> = vec![std::ptr::null_mut(); n.max(0) as usize];
    // SAFETY: valid tensor handles read during the call; on success the library hands over n new
    // tensors we then own.
    Some(check(unsafe { f(p(x), heads, n, rotated, p(cos), p(sin), outs.as_mut_ptr()) }).map(|_| outs.into_iter().map(|o| unsafe { Tensor::from_ptr(o) }).collect()))
}

/// One STILL / LoLCATs decode step's mixing (`Hybrid::mix` over `Hybrid::step_at`'s blocks) for
/// csrc/cuda/hybrid_step.cu: the new token's query `[B, H, 1, D]` and φ(q) `[B, H, 1, F]` (fp32), the
/// window ring `[B, H, 2C, D]`, Sel `[B, H, cap, D]` with its filled count `[1]`, S `[B, H, F, D]` and
/// z `[B, H, F]` (fp32), the gate `[B, H, 1, D]`, γ `[H]`, the position `[1]`; where the kernel
/// also scores the new token for routing, the ring of scores `[B, H, 2C]` (fp32) it writes that score
/// into (its slot pos mod 2C) with the score's kind; and the query map's folded matrix `[H, D, F/2]`
/// (fp32, `FeatureMap::folded_linear`) from which the kernel computes φ(q), with the norm re-injection
/// (`reinject_norm`) or without.
pub struct Mix<'a> {
    pub q: &'a Tensor,
    pub fq_folded: &'a Tensor,
    pub reinject_norm: bool,
    pub win_k: &'a Tensor,
    pub win_v: &'a Tensor,
    pub sel: Option<(&'a Tensor, &'a Tensor, &'a Tensor)>,
    pub s: &'a Tensor,
    pub z: &'a Tensor,
    /// The output gate before its sigmoid `[B, H, 1, D]` (the kernel takes σ).
    pub gate_logits: Option<&'a Tensor>,
    pub gamma: Option<&'a Tensor>,
    pub pos: &'a Tensor,
    pub chunk: i64,
    pub eps: f64,
    pub linear: bool,
    pub compensate: bool,
    pub score: Option<(&'a Tensor, KernelScore)>,
    /// The new token's key and value `[B, H, 1, D]` (q's dtype), which the kernel writes into the
    /// window ring at slot pos mod 2C before reading it; `None`: the ring holds them already.
    pub new_kv: Option<(&'a Tensor, &'a Tensor)>,
    /// One int32 counter a (row, head) `[B·H]`, zero (and left zero): the mix split over blocks, a
    /// head's slots over several at once and its linear branch in one more ([`hybrid_split_enabled`]);
    /// `None`: one block a head.
    pub arrived: Option<&'a Tensor>,
}

/// The routing scores csrc/cuda/hybrid_step.cuh and hybrid_prefill.cuh compute (the codes of
/// csrc/cuda/score_kinds.cuh): `Scorer::scores`'s over a token's C most recent keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelScore {
    SelfSaliency = 1,
    DiagAttention = 2,
    SelfLogit = 3,
}

/// Whether STILL / LoLCATs decode steps take csrc/cuda/hybrid_step.cu's mixing kernel for a query
/// `q`: on CUDA in bf16 / fp16 and the library holding it, unless `ATTNLAB_HYBRID_KERNEL=0`. It
/// passes `bench --check` and decodes STILL (budget) 2.5–2.8× and LoLCATs 1.7× faster than the
/// aten mix at 1K–64K on one H100 (results/bench/2026-12-06h-h100, `scripts/gpu_bench.sh hybrid`).
pub fn hybrid_mix_enabled(q: &Tensor) -> bool {
    q.device().is_cuda() && matches!(q.kind(), tch::Kind::BFloat16 | tch::Kind::Half) && switch("ATTNLAB_HYBRID_KERNEL", true) && hybrid_kernel_available()
}

/// Whether the mixing kernel writes the new token's key and value into the window ring itself
/// ([`Mix::new_kv`]), where `Hybrid::step_at` ran two index_copy kernels before it; on unless
/// `ATTNLAB_HYBRID_FRESH=0`. Same greedy tokens, gate rows passing both ways, and STILL (budget)
/// 1.04–1.05× / LoLCATs 1.06–1.08× faster at 1K–16K on one H100 (results/bench/2026-12-07-h100).
pub fn hybrid_fresh_enabled() -> bool {
    switch("ATTNLAB_HYBRID_FRESH", true)
}

/// Whether the mixing kernel splits a head's work over several blocks (csrc/cuda/hybrid_step.cuh's
/// hybrid_mix_split: its slots in slices of 64, its linear branch in a block of its own, the last
/// block to finish merging) where one block a head waited on each in turn; on unless
/// `ATTNLAB_HYBRID_SPLIT=0`.
pub fn hybrid_split_enabled() -> bool {
    switch("ATTNLAB_HYBRID_SPLIT", true)
}

/// Whether the library holds the hybrid mixing kernel ([`hybrid_mix`] takes it unless
/// `ATTNLAB_HYBRID_KERNEL=0`).
pub fn hybrid_kernel_available() -> bool {
    library().is_some_and(|l| l.hybrid_mix.is_some())
}

/// The step's output `[B, H, 1, D]` by csrc/cuda/hybrid_step.cu; `None` when not enabled
/// ([`hybrid_mix_enabled`]).
pub fn hybrid_mix(m: &Mix) -> Option<Result<Tensor>> {
    if !hybrid_mix_enabled(m.q) {
        return None;
    }
    let f = library()?.hybrid_mix?;
    let (p, o) = (handle, handle_or_null);
    // The kernel also takes φ(q) computed (fmap kind 0, null matrix); this crate hands it the matrix.
    let fmap_kind = 1 + m.reinject_norm as i64;
    let ts = [
        p(m.q),
        std::ptr::null_mut(),
        p(m.win_k),
        p(m.win_v),
        o(m.sel.map(|s| s.0)),
        o(m.sel.map(|s| s.1)),
        o(m.sel.map(|s| s.2)),
        p(m.s),
        p(m.z),
        o(m.gate_logits),
        o(m.gamma),
        p(m.pos),
        o(m.score.map(|s| s.0)),
        p(m.fq_folded),
        o(m.new_kv.map(|kv| kv.0)),
        o(m.new_kv.map(|kv| kv.1)),
        o(m.arrived),
    ];
    let score_kind = m.score.map_or(0, |s| s.1 as i64);
    // SAFETY: valid tensor handles (or null where absent), read during the call (the ring of scores
    // and, with new_kv, the window ring written).
    // The gate always comes before its sigmoid from this crate (the kernel also takes its values).
    Some(new_tensor(|out| unsafe { f(ts.as_ptr(), m.chunk, m.eps, m.linear as i64, m.compensate as i64, score_kind, fmap_kind, 1, out) }))
}

/// The STILL / LoLCATs prefill kernels' chunk (csrc/cuda/hybrid_prefill.cuh: a chunk is one tile of
/// keys and one block of queries).
pub const PREFILL_CHUNK: i64 = 64;

/// Whether a STILL / LoLCATs prefill of q, k, v `[B, H, T, D]` may take csrc/cuda/hybrid_prefill.cu's
/// kernels: on CUDA in bf16, chunks of [`PREFILL_CHUNK`], D 64 or 128, rows 16-byte aligned, the
/// library holding them; on by default since the GPU gate passed them (`ATTNLAB_HYBRID_PREFILL=0`
/// turns them off: STILL / LoLCATs prefill 1.4–2.6× faster at 1K–64K on one H100). The kernels have
/// no backward: the caller takes the mixing kernel only where nothing it reads records a gradient.
pub fn hybrid_prefill_enabled(q: &Tensor, k: &Tensor, v: &Tensor, chunk: i64) -> bool {
    let fits = |x: &Tensor| {
        let s = x.stride();
        x.kind() == tch::Kind::BFloat16 && x.size() == q.size() && s[3] == 1 && s[..3].iter().all(|s| s % 8 == 0) && x.data_ptr() as usize % 16 == 0
    };
    q.device().is_cuda()
        && chunk == PREFILL_CHUNK
        && matches!(q.size()[3], 64 | 128)
        && [q, k, v].into_iter().all(fits)
        && switch("ATTNLAB_HYBRID_PREFILL", true)
        && library().is_some_and(|l| l.prefill.is_some())
}

/// Every token's routing score `[B, H, n·C]` (fp32, the sequence padded to whole chunks) over its C
/// most recent keys, by csrc/cuda/hybrid_prefill.cu (`Scorer::scores` over the window logits is the
/// aten form); `None` where the library lacks it.
pub fn hybrid_prefill_scores(q: &Tensor, k: &Tensor, chunk: i64, score: KernelScore) -> Option<Result<Tensor>> {
    let (f, _) = library()?.prefill?;
    let ts = [handle(q), handle(k)];
    // SAFETY: valid tensor handles, read during the call.
    Some(new_tensor(|out| unsafe { f(ts.as_ptr(), chunk, score as i64, out) }))
}

/// What the prefill's mixing kernel takes besides q, k, v `[B, H, T, D]`.
pub struct PrefillMix<'a> {
    /// The selected positions `[B, H, cap]` (i64, q's device) and, per query chunk, how many of them
    /// it sees (`[n]` int32 on the host: a prefix, the slots being in chunk order).
    pub sel: Option<(&'a Tensor, &'a Tensor)>,
    /// The linear numerator `[B, H, n·C, D]` and denominator `[B, H, n·C]`, fp32 contiguous, before
    /// compensation; `None`: no linear branch.
    pub linear: Option<(&'a Tensor, &'a Tensor)>,
    /// The gate g `[B, H, T, D]` (bf16, unit last stride) that multiplies the linear numerator in the
    /// kernel; `None`: no gate, or one already applied.
    pub gate: Option<&'a Tensor>,
    pub gamma: Option<&'a Tensor>,
    pub chunk: i64,
    pub eps: f64,
    pub compensate: bool,
    pub phantom_chunk0_keys: bool,
}

/// The prefill's output `[B, H, T, D]` (bf16): softmax over each query's window and selected tokens,
/// merged with the linear terms, by csrc/cuda/hybrid_prefill.cu (`Hybrid::prefill`'s groups of
/// masked logit blocks are the aten form); `None` where the library lacks it.
pub fn hybrid_prefill_mix(q: &Tensor, k: &Tensor, v: &Tensor, m: &PrefillMix) -> Option<Result<Tensor>> {
    let (_, f) = library()?.prefill?;
    let o = handle_or_null;
    let ts = [handle(q), handle(k), handle(v), o(m.sel.map(|s| s.0)), o(m.sel.map(|s| s.1)), o(m.linear.map(|l| l.0)), o(m.linear.map(|l| l.1)), o(m.gamma), o(m.gate)];
    // SAFETY: valid tensor handles (or null where absent), read during the call.
    Some(new_tensor(|out| unsafe { f(ts.as_ptr(), m.chunk, m.eps, m.compensate as i64, m.phantom_chunk0_keys as i64, out) }))
}

/// The prefill's linear branch (csrc/cuda/hybrid_linear.cuh): q, k, v `[B, H, T, D]` as
/// [`hybrid_prefill_enabled`] takes them; the feature maps of q and k as folded matrices `[H, D, F/2]`
/// fp32 (`FeatureMap::folded_linear`) with their norm re-injection; `keep` `[B, H, n·C]` fp32, 0 where
/// a token is selected (its key in Sel, not in the state).
pub struct PrefillLinear<'a> {
    pub q_map: (&'a Tensor, bool),
    pub k_map: (&'a Tensor, bool),
    pub keep: Option<&'a Tensor>,
    pub chunk: i64,
}

/// What [`hybrid_prefill_linear`] returns, all fp32: `n_lin` `[B, H, n·C, D]` and `z_lin` `[B, H, n·C]`
/// (φ(q_t)·S and φ(q_t)·z of the state of chunks ≤ c − 2, no gate), and the state after the sequence
/// (`s` `[B, H, F, D]`, `z` `[B, H, F]`: chunks ≤ n − 3, the decode cache's).
pub struct LinearTerms {
    pub n_lin: Tensor,
    pub z_lin: Tensor,
    pub s: Tensor,
    pub z: Tensor,
}

/// The linear terms of a STILL / LoLCATs prefill by csrc/cuda/hybrid_linear.cuh (the aten form is
/// `Hybrid::prefill`'s linear part), unless `ATTNLAB_HYBRID_LINEAR=0` (the GPU gate's rows
/// `prefill-*-linear-kernel` of `scripts/gpu_bench.sh check` pass them); `None` where off or the
/// library lacks them. No backward.
pub fn hybrid_prefill_linear(q: &Tensor, k: &Tensor, v: &Tensor, m: &PrefillLinear) -> Option<Result<LinearTerms>> {
    if !switch("ATTNLAB_HYBRID_LINEAR", true) {
        return None;
    }
    let f = library()?.prefill_linear?;
    let ts = [handle(q), handle(k), handle(v), handle(m.q_map.0), handle(m.k_map.0), handle_or_null(m.keep)];
    let mut out: [*mut C_tensor; 4] = [std::ptr::null_mut(); 4];
    // SAFETY: valid tensor handles (or null where absent), read during the call; on success the
    // library has written four new tensors into `out`, which we then own.
    // Their products on the tensor cores (TF32; `ATTNLAB_LINEAR_TF32=0`: fp32 SIMT tiles): the gate's
    // rows `prefill-*-linear-tf32-kernel` pass them, and STILL / LoLCATs prefill 1.13–1.35× faster
    // (one H200, 1K–64K, BENCHMARKS.md).
    let tf32 = switch("ATTNLAB_LINEAR_TF32", true) as i64;
    Some(check(unsafe { f(ts.as_ptr(), m.chunk, m.q_map.1 as i64, m.k_map.1 as i64, tf32, out.as_mut_ptr()) }).map(|()| {
        let [n_lin, z_lin, s, z] = out.map(|t| unsafe { Tensor::from_ptr(t) });
        LinearTerms { n_lin, z_lin, s, z }
    }))
}

/// Whether [`hybrid_fold_chunk`] takes a chunk of keys `k` `[B, H, C, D]` into a state `s` with a key
/// map of `half` = F/2 features: bf16 keys on CUDA, C 64, D 64 or 128, rows on 16 bytes, an fp32
/// state, F/2 a multiple of 4 up to 128, the library holding the kernel, and `ATTNLAB_HYBRID_FOLD`
/// not 0. On by default: it passed the gate's `-hybrid-*` decode rows on one H100 and cut a STILL
/// (budget) decode call's fixed cost from 9.4 to 5.5 ms at 4K (LoLCATs 7.6 → 3.6), its step unchanged
/// (BENCHMARKS.md, results/bench/2026-12-07g-h100/dtiming.md). Its state products round as the
/// prefill's do (TF32 unless `ATTNLAB_LINEAR_TF32=0`), so greedy tokens of random-weight models can
/// differ from aten's fold.
pub fn hybrid_fold_available(k: &Tensor, s: &Tensor, half: i64) -> bool {
    let (size, stride) = (k.size(), k.stride());
    k.device().is_cuda()
        && k.kind() == tch::Kind::BFloat16
        && s.kind() == tch::Kind::Float
        && size.len() == 4
        && size[2] == 64
        && matches!(size[3], 64 | 128)
        && stride[3] == 1
        && stride[..3].iter().all(|x| x % 8 == 0)
        && (k.data_ptr() as usize).is_multiple_of(16)
        && half % 4 == 0
        && half <= 128
        && switch("ATTNLAB_HYBRID_FOLD", true)
        && library().is_some_and(|l| l.fold_chunk.is_some())
}

/// One chunk routed in decode folded into the state in place (csrc/cuda/hybrid_prefill.cu, by the
/// prefill's `hybrid_linear_states`, its TF32 products unless `ATTNLAB_LINEAR_TF32=0`):
/// s += Σ_t keep_t·φ(k_t)ᵀ v_t, z += Σ_t keep_t·φ(k_t) for keys and values `[B, H, C, D]`, the key
/// map folded `[H, D, F/2]` fp32 with its norm re-injection, `keep` `[B, H, C]` fp32 (0 for a token
/// sent to Sel; None: every token), s `[B, H, F, D]` and z `[B, H, F]` fp32 contiguous. Where
/// [`hybrid_fold_available`] says no, `None` (the caller's aten form applies).
pub fn hybrid_fold_chunk(k: &Tensor, v: &Tensor, k_map: (&Tensor, bool), keep: Option<&Tensor>, s: &Tensor, z: &Tensor) -> Option<Result<()>> {
    if !hybrid_fold_available(k, s, k_map.0.size().last().copied().unwrap_or(0)) {
        return None;
    }
    let f = library()?.fold_chunk?;
    let ts = [handle(k), handle(v), handle(k_map.0), handle_or_null(keep), handle(s), handle(z)];
    let tf32 = switch("ATTNLAB_LINEAR_TF32", true) as i64;
    // SAFETY: valid tensor handles (or null where absent); s and z are written in place.
    Some(check(unsafe { f(ts.as_ptr(), k_map.1 as i64, tf32) }))
}

/// The routing's top-κ (`still::routing::top_kappa`: the indices of each row's κ highest scores,
/// ties to the lower index, ascending) in one kernel (csrc/cuda/top_kappa.cu) where aten runs two
/// sorts, for fp32 scores `[.., C]` on CUDA whose leading dims collapse into rows at one stride, with
/// `ATTNLAB_TOPK_KERNEL=1`: off by default until the GPU gate's `top-kappa-kernel` rows have passed
/// and a prefill has been timed with it (written in the twenty-fourth session, no device lent).
/// `None` (the caller's aten form) otherwise.
pub fn top_kappa(scores: &Tensor, kappa: i64) -> Option<Result<Tensor>> {
    if !scores.device().is_cuda() || !switch("ATTNLAB_TOPK_KERNEL", false) {
        return None;
    }
    let f = library()?.top_kappa?;
    // SAFETY: a valid tensor handle read during the call.
    new_tensor_if_applies(|out| unsafe { f(handle(scores), kappa, out) })
}

/// Whether the library holds the heads op's kernels ([`split_rotate`] takes them unless
/// `ATTNLAB_HEADS_KERNEL=0`).
pub fn heads_kernel_available() -> bool {
    library().is_some_and(|l| l.split_rotate.is_some())
}

/// Whether DAR's split-merge can take its local part from our band kernels (`GlobalBackend::Band`):
/// heads `[B, H, T, hd]` on CUDA in bf16, hd 64 or 128, B·H within one launch, every row starting on
/// 16 bytes (csrc/cuda/dar_band.cu loads them 16 bytes at a time), the library loaded with them.
pub fn band_available(heads: &[&Tensor]) -> bool {
    let aligned = |t: &Tensor| (t.data_ptr() as usize).is_multiple_of(16) && t.stride()[..3].iter().all(|s| s % 8 == 0) && t.stride()[3] == 1;
    let Some(q) = heads.first() else { return false };
    let s = q.size();
    q.device().is_cuda() && q.kind() == tch::Kind::BFloat16 && matches!(s[3], 64 | 128) && s[0] * s[1] <= 65535 && heads.iter().all(|t| aligned(t)) && library().is_some_and(|l| l.band)
}

/// `ATTNLAB_GRAPH_WARM_ONCE=1`: a decode step's graph is captured without the eager warm-up step
/// where this process has already captured the same step (same model, batch, span and sampling,
/// on the one side stream every capture takes), and replayed once instead: a decode call's fixed
/// cost is mostly its capture (≈ 5 ms on one H100, BENCHMARKS.md). Off until timed on a GPU, with
/// the `graphs` phase's equal greedy tokens.
pub fn graph_warm_once() -> bool {
    switch("ATTNLAB_GRAPH_WARM_ONCE", false)
}

/// Whether decode steps may be captured as CUDA graphs: the library has them and
/// `ATTNLAB_CUDA_GRAPHS` is not `0` (set it to time or check the eager step against the graphed one).
pub fn graphs_enabled() -> bool {
    std::env::var("ATTNLAB_CUDA_GRAPHS").map_or(true, |v| v != "0") && library().is_some_and(|l| l.graph.is_some())
}

fn panic_text(e: &Box<dyn std::any::Any + Send>) -> String {
    let msg = e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_else(|| "a panic".into());
    format!("while capturing: {}", msg.lines().next().unwrap_or(""))
}

/// A captured CUDA graph (PyTorch's `at::cuda::CUDAGraph`, with its private memory pool): the
/// kernels one call of a closure launched, relaunched by [`Graph::replay`] on the same buffers.
pub struct Graph {
    handle: Handle,
    fns: &'static GraphFns,
}

impl Graph {
    /// Run `step` once eagerly on a side stream (the warm-up capture needs: its effects are real),
    /// then capture a second call of it (recorded, not run); with `warm` false only the capture
    /// (nothing has run: the caller replays the graph once for the step's effects). `step` must not
    /// read device values back to the host nor copy host data to the device, and must allocate what
    /// it returns anew (inputs and outputs of the graph are tensors made before, written in place).
    /// None when graphs are not enabled ([`graphs_enabled`]); the warm-up call has then not run either.
    pub fn capture(device: usize, warm: bool, mut step: impl FnMut()) -> Option<Result<Graph>> {
        if !graphs_enabled() {
            return None;
        }
        let fns = library()?.graph.as_ref()?;
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: the shim's protocol (csrc/cuda/graph.cu): enter → eager step → capture → step →
        // leave, on this thread; `leave` restores the stream on every path, `free` owns the handle.
        Some((|| unsafe {
            check((fns.enter)(device as libc::c_int, &mut handle))?;
            let graph = Graph { handle, fns };
            // A panic inside (a tch op refused during capture) must still end the capture and
            // restore the stream: caught here and returned as the error.
            let run = |step: &mut dyn FnMut()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(step)).map_err(|e| crate::Error::Kernel(panic_text(&e)));
            let mut laps = CaptureLaps::from_env(device);
            let warmed = if warm { run(&mut step) } else { Ok(()) };
            laps.lap();
            let began = warmed.and_then(|_| check((fns.capture)(handle)));
            let recorded = began.and_then(|_| run(&mut step));
            laps.lap();
            let left = check((fns.leave)(handle));
            laps.lap();
            laps.report();
            recorded.and(left).map(|_| graph)
        })())
    }

    /// Launch the captured kernels again, on the current stream.
    pub fn replay(&self) -> Result<()> {
        // SAFETY: a handle from a successful capture, not freed before drop.
        check(unsafe { (self.fns.replay)(self.handle) })
    }
}

/// `ATTNLAB_DECODE_TIMING=1`: a capture's three parts on stderr — the eager warm-up step (synced; ≈ 0
/// where `ATTNLAB_GRAPH_WARM_ONCE` skipped it),
/// the recorded step (host time alone: nothing runs, and no sync is allowed while capturing) and the
/// capture's end (PyTorch's graph instantiation, then the streams rejoined; synced): which of them a
/// decode call's fixed cost is.
struct CaptureLaps {
    device: Option<usize>,
    at: std::time::Instant,
    ms: Vec<f64>,
}

impl CaptureLaps {
    fn from_env(device: usize) -> Self {
        let on = std::env::var("ATTNLAB_DECODE_TIMING").as_deref() == Ok("1");
        CaptureLaps { device: on.then_some(device), at: std::time::Instant::now(), ms: Vec::new() }
    }

    /// Synced only outside the capture: after the warm-up (lap 1) and after the end (lap 3).
    fn lap(&mut self) {
        let Some(d) = self.device else { return };
        if self.ms.len() != 1 {
            tch::Cuda::synchronize(d as i64);
        }
        self.ms.push(self.at.elapsed().as_secs_f64() * 1e3);
        self.at = std::time::Instant::now();
    }

    fn report(&self) {
        if let [warm, record, end] = self.ms[..] {
            eprintln!("attnlab graph capture: warm-up step {warm:.3} ms, recorded step {record:.3} ms (host), end {end:.3} ms");
        }
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: the handle was made by `enter` and is freed once.
        unsafe { (self.fns.free)(self.handle) }
    }
}
