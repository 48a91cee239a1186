// The launch of SwiGLU's product kernel (csrc/cuda/swiglu.cuh says what it computes).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cstring>
#include "row_stride.cuh"
#include "swiglu.cuh"

namespace {

template <typename T>
void launch(const SwigluParams& p, cudaStream_t stream) {
  const bool vec = swiglu_vec_fits(p);
  const int64_t items = p.rows * (vec ? p.cols / 8 : p.cols);
  const int64_t blocks = std::min<int64_t>((items + kSwigluThreads - 1) / kSwigluThreads, 65535 * 8);
  if (vec) silu_mul<T, true><<<blocks, kSwigluThreads, 0, stream>>>(p);
  else silu_mul<T, false><<<blocks, kSwigluThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

typedef at::Tensor* tensor;

// y = silu(gate)·up for a half model's inference: gate and up bf16 / fp16 of one shape [.., cols] on
// CUDA, unit last stride, leading dims collapsing into rows (views into one stacked projection
// included); y contiguous in their dtype. Where autograd would need the graph, or for other
// dtypes, devices or layouts, *out stays null and the caller's aten form applies.
extern "C" char* attnlab_silu_mul(tensor gate, tensor up, tensor* out) {
  try {
    *out = nullptr;
    const at::Tensor &g = *gate, &u = *up;
    const at::ScalarType kind = g.scalar_type();
    if (!g.is_cuda() || (kind != at::kBFloat16 && kind != at::kHalf) || u.scalar_type() != kind || u.device() != g.device() || u.sizes() != g.sizes()) return nullptr;
    if (at::GradMode::is_enabled() && (g.requires_grad() || u.requires_grad())) return nullptr;
    const int64_t g_ld = row_stride(g), u_ld = row_stride(u);
    if (g_ld < 0 || u_ld < 0 || g.numel() == 0) return nullptr;
    c10::cuda::CUDAGuard guard(g.device());
    at::Tensor y = at::empty(g.sizes(), g.options().memory_format(at::MemoryFormat::Contiguous));
    const int64_t cols = g.size(-1);
    const SwigluParams p{g.data_ptr(), u.data_ptr(), y.data_ptr(), g.numel() / cols, cols, g_ld, u_ld};
    auto stream = c10::cuda::getCurrentCUDAStream();
    if (kind == at::kBFloat16) launch<__nv_bfloat16>(p, stream);
    else launch<__half>(p, stream);
    *out = new at::Tensor(y);
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
