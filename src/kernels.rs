//! Rust side of csrc/attn_ops.cpp: aten ops that tch 0.24 does not wrap. Each call returns the C++
//! exception text as an error instead of aborting.
pub mod cuda;

use crate::{Error, Result};
use tch::{Device, Tensor};
use torch_sys::C_tensor;

extern "C" {
    fn attnlab_set_autocast_bf16() -> *mut libc::c_char;
    fn attnlab_autocast_enter(prev: *mut i32) -> *mut libc::c_char;
    fn attnlab_autocast_leave(restore: i32) -> *mut libc::c_char;
    fn attnlab_fused_adamw(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        exp_avgs: *const *mut C_tensor,
        exp_avg_sqs: *const *mut C_tensor,
        steps: *const *mut C_tensor,
        n: i64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
    ) -> *mut libc::c_char;
    fn attnlab_clip_grad_norm(grads: *const *mut C_tensor, n: i64, max_norm: f64, norm_out: *mut *mut C_tensor) -> *mut libc::c_char;
    fn attnlab_dar_split_merge(q: *mut C_tensor, kl: *mut C_tensor, vl: *mut C_tensor, kg: *mut C_tensor, vg: *mut C_tensor, window: i64, backend: i64, fused: i32, out: *mut *mut C_tensor) -> *mut libc::c_char;
    fn attnlab_set_band_kernels(merge: *mut libc::c_void, bwd: *mut libc::c_void);
    fn attnlab_dar_band_split(q: *mut C_tensor, kl: *mut C_tensor, vl: *mut C_tensor, kg: *mut C_tensor, vg: *mut C_tensor, window: i64, out: *mut *mut C_tensor) -> *mut libc::c_char;
    fn attnlab_cuda_peak_memory(device: i64, reset: i32, out: *mut i64) -> *mut libc::c_char;
    fn attnlab_profiler_start(cuda: i32) -> *mut libc::c_char;
    fn attnlab_profiler_stop(path: *const libc::c_char, device_events: *mut i64) -> *mut libc::c_char;
    fn attnlab_scope_push(name: *const libc::c_char) -> *mut libc::c_char;
    fn attnlab_scope_pop() -> *mut libc::c_char;
    fn attnlab_cuda_free_memory(device: i64, out: *mut i64) -> *mut libc::c_char;
    fn attnlab_flash_attention(q: *mut C_tensor, k: *mut C_tensor, v: *mut C_tensor, window_left: i64, out: *mut *mut C_tensor) -> *mut libc::c_char;
    fn attnlab_split_rotate(x: *mut C_tensor, heads: i64, n: i64, rotated: i64, cos: *mut C_tensor, sin: *mut C_tensor, outs: *mut *mut C_tensor) -> *mut libc::c_char;
}

fn check(err: *mut libc::c_char) -> Result<()> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: the shim returns a strdup'ed NUL-terminated string that we own and free here.
    let msg = unsafe { std::ffi::CStr::from_ptr(err) }.to_string_lossy().into_owned();
    unsafe { libc::free(err as *mut libc::c_void) };
    Err(Error::Kernel(msg.lines().next().unwrap_or("").to_string()))
}

fn ptrs(ts: &[&Tensor]) -> Vec<*mut C_tensor> {
    ts.iter().map(|t| t.as_ptr() as *mut C_tensor).collect()
}

/// Make CUDA autocast produce bf16 (its default is fp16).
pub fn set_autocast_bf16() -> Result<()> {
    check(unsafe { attnlab_set_autocast_bf16() })
}

/// Run `f` under CUDA autocast when `enabled` (bf16 after `set_autocast_bf16`); a plain call otherwise.
/// Same semantics as `tch::autocast`, through the non-deprecated libtorch API.
pub fn autocast<T>(enabled: bool, f: impl FnOnce() -> T) -> T {
    if !enabled {
        return f();
    }
    let mut prev = 0;
    check(unsafe { attnlab_autocast_enter(&mut prev) }).expect("autocast enter");
    let out = f();
    check(unsafe { attnlab_autocast_leave(prev) }).expect("autocast leave");
    out
}

/// Slices of one AdamW parameter group, all the same length.
pub struct AdamwGroup<'a> {
    pub params: Vec<&'a Tensor>,
    pub grads: Vec<&'a Tensor>,
    pub exp_avgs: Vec<&'a Tensor>,
    pub exp_avg_sqs: Vec<&'a Tensor>,
    pub steps: Vec<&'a Tensor>,
}

/// One in-place AdamW update with aten's fused kernel (`_fused_adamw_`).
pub fn fused_adamw(g: &AdamwGroup, lr: f64, betas: (f64, f64), weight_decay: f64, eps: f64) -> Result<()> {
    let n = g.params.len();
    assert!([g.grads.len(), g.exp_avgs.len(), g.exp_avg_sqs.len(), g.steps.len()].iter().all(|&l| l == n));
    let (p, gr, m, v, s) = (ptrs(&g.params), ptrs(&g.grads), ptrs(&g.exp_avgs), ptrs(&g.exp_avg_sqs), ptrs(&g.steps));
    check(unsafe {
        attnlab_fused_adamw(p.as_ptr(), gr.as_ptr(), m.as_ptr(), v.as_ptr(), s.as_ptr(), n as i64, lr, betas.0, betas.1, weight_decay, eps)
    })
}

/// Clip gradients in place to a global L2 norm of `max_norm` (no clipping when ≤ 0) without a host
/// synchronisation; returns the pre-clip global norm as a 0-dim tensor.
pub fn clip_grad_norm(grads: &[&Tensor], max_norm: f64) -> Result<Tensor> {
    let g = ptrs(grads);
    let mut out: *mut C_tensor = std::ptr::null_mut();
    check(unsafe { attnlab_clip_grad_norm(g.as_ptr(), g.len() as i64, max_norm, &mut out) })?;
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// Kernels that compute the two parts of DAR's split-merge construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GlobalBackend {
    /// FlashAttention-2 for both parts (CUDA, bf16/fp16).
    Flash = 0,
    /// Flash sliding window for the local part, cuDNN for the global part (CUDA, bf16/fp16).
    Cudnn = 1,
    /// Explicit matmuls with the kernels' conventions, any device and dtype: the split-merge glue
    /// (merge, backward seeds, scatter) tested exactly in fp64 on CPU.
    Math = 2,
    /// cuDNN for the global part, our band kernels for the local part with the merge in their
    /// epilogue (csrc/cuda/dar_band.cu; CUDA, bf16, head dim 64 / 128, the kernel library loaded:
    /// [`cuda::band_available`]).
    Band = 3,
}

/// Hands the split-merge op (csrc/dar_attention.cpp, backend 3) the band kernels' entry points of
/// the CUDA kernel library (`cuda`, when it loads it).
pub(crate) fn set_band_kernels(merge: *mut libc::c_void, bwd: *mut libc::c_void) {
    // SAFETY: two function pointers of the library, which is never unloaded.
    unsafe { attnlab_set_band_kernels(merge, bwd) }
}

/// DAR attention by split-merge with an exact custom backward (csrc/dar_attention.cpp). Inputs
/// `[B, T, H, D]`, `0 < window < T`; the result carries its autograd graph. `fused` (experimental):
/// the merge in one pass in place and a backward without copies of dO, O, dK_g, dV_g.
#[allow(clippy::too_many_arguments)]
pub fn dar_split_merge(q: &Tensor, kl: &Tensor, vl: &Tensor, kg: &Tensor, vg: &Tensor, window: i64, backend: GlobalBackend, fused: bool) -> Result<Tensor> {
    let p = |t: &Tensor| t.as_ptr() as *mut C_tensor;
    let mut out: *mut C_tensor = std::ptr::null_mut();
    check(unsafe { attnlab_dar_split_merge(p(q), p(kl), p(vl), p(kg), p(vg), window, backend as i64, fused as i32, &mut out) })?;
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// DAR attention on the CPU by split-merge with an exact custom backward (csrc/dar_band.cpp): the
/// local band by blocks against the keys their band touches, the distant keys by libtorch's CPU
/// flash attention (causal, shifted), merged by log-sum-exp. Heads `[B, H, T, D]`, float or double,
/// `0 < window < T`; the result carries its autograd graph.
pub fn dar_band_split(q: &Tensor, kl: &Tensor, vl: &Tensor, kg: &Tensor, vg: &Tensor, window: i64) -> Result<Tensor> {
    let p = |t: &Tensor| t.as_ptr() as *mut C_tensor;
    let mut out: *mut C_tensor = std::ptr::null_mut();
    check(unsafe { attnlab_dar_band_split(p(q), p(kl), p(vl), p(kg), p(vg), window, &mut out) })?;
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// Whether the flash kernels take these inputs: CUDA, fp16 / bf16, head dim a multiple of 8, ≤ 256.
pub fn flash_supported(q: &Tensor) -> bool {
    let hd = q.size().last().copied().unwrap_or(0);
    q.device().is_cuda() && matches!(q.kind(), tch::Kind::BFloat16 | tch::Kind::Half) && hd % 8 == 0 && hd <= 256
}

/// Causal flash attention (csrc/flash.cpp) over `[B, T, H, D]` inputs with a left window
/// (`window_left < 0`: unbounded; else query i reads keys `i − window_left ..= i`), with its backward.
pub fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, window_left: i64) -> Result<Tensor> {
    let p = |t: &Tensor| t.as_ptr() as *mut C_tensor;
    let mut out: *mut C_tensor = std::ptr::null_mut();
    check(unsafe { attnlab_flash_attention(p(q), p(k), p(v), window_left, &mut out) })?;
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// The `n` pieces `[B, T, H, hd]` of a head-major fused projection `x` `[B, T, H·n·hd]`, the first
/// `rotated` rotated by RoPE (half-split over the first `2·cos.size(1)` dims; `cos`, `sin` `[T, r/2]`)
/// (csrc/heads.cpp): each piece written once, and one gradient of `x` written once in the backward;
/// on CUDA one kernel each way ([`cuda::split_rotate`]; `ATTNLAB_HEADS_KERNEL=0`: the aten op).
pub fn split_rotate(x: &Tensor, heads: i64, n: i64, rotated: i64, cos: &Tensor, sin: &Tensor) -> Result<Vec<Tensor>> {
    if let Some(r) = cuda::split_rotate(x, heads, n, rotated, cos, sin) {
        return r;
    }
    let p = |t: &Tensor| t.as_ptr() as *mut C_tensor;
    let mut outs: Vec<*mut C_tensor> = vec![std::ptr::null_mut(); n.max(0) as usize];
    check(unsafe { attnlab_split_rotate(p(x), heads, n, rotated, p(cos), p(sin), outs.as_mut_ptr()) })?;
    Ok(outs.into_iter().map(|o| unsafe { Tensor::from_ptr(o) }).collect())
}

/// Peak bytes allocated by the CUDA caching allocator (torch.cuda.max_memory_allocated); `None` on CPU.
pub fn cuda_peak_memory(device: Device) -> Option<u64> {
    cuda_peak(device, false)
}

/// Reset the CUDA allocator's peak statistic (no-op on CPU).
pub fn reset_cuda_peak_memory(device: Device) {
    let _ = cuda_peak(device, true);
}

fn cuda_peak(device: Device, reset: bool) -> Option<u64> {
    let Device::Cuda(i) = device else { return None };
    let mut out = 0i64;
    check(unsafe { attnlab_cuda_peak_memory(i as i64, reset as i32, &mut out) }).ok()?;
    Some(out as u64)
}

/// Start libtorch's profiler (csrc/profile.cpp): CPU ops, and CUDA kernels / copies when `cuda`.
pub fn profiler_start(cuda: bool) -> Result<()> {
    check(unsafe { attnlab_profiler_start(cuda as i32) })
}

/// Stop the profiler and write its Chrome trace to `path`; returns how many device events (kernels,
/// copies) it holds. An error when CUDA was profiled and no kernel was seen.
pub fn profiler_stop(path: &std::path::Path) -> Result<i64> {
    let c = std::ffi::CString::new(path.to_string_lossy().as_bytes()).map_err(|e| Error::Other(format!("trace path {}: {e}", path.display())))?;
    let mut n = 0i64;
    check(unsafe { attnlab_profiler_stop(c.as_ptr(), &mut n) })?;
    Ok(n)
}

/// Run `f` inside a named scope: a user annotation in a profiler trace, under which
/// scripts/profile_table.py files the kernels `f` launches. Costs a thread-local check otherwise.
pub fn scope<T>(name: &str, f: impl FnOnce() -> T) -> T {
    struct Open;
    impl Drop for Open {
        fn drop(&mut self) {
            check(unsafe { attnlab_scope_pop() }).expect("scope pop");
        }
    }
    let c = std::ffi::CString::new(name).expect("scope names have no NUL");
    check(unsafe { attnlab_scope_push(c.as_ptr()) }).expect("scope push");
    let _open = Open;
    f()
}

/// Bytes a new allocation on a CUDA `device` can still get (free on the device + cached unused by
/// the caching allocator); `None` on CPU or when the allocator cannot tell.
pub fn cuda_free_memory(device: Device) -> Option<u64> {
    let Device::Cuda(i) = device else { return None };
    let mut out = 0i64;
    check(unsafe { attnlab_cuda_free_memory(i as i64, &mut out) }).ok()?;
    Some(out as u64)
}
