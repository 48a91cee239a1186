// The launch of the routing's top-κ kernel (csrc/cuda/top_kappa.cuh says what it computes).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cstring>
#include "row_stride.cuh"
#include "top_kappa.cuh"

typedef at::Tensor* tensor;

// The κ indices of each row's highest scores, ascending (routing.rs `top_kappa`): scores fp32 on
// CUDA [.., C], unit last stride, leading dims collapsing into rows at one stride (a chunk of a
// ring of scores included), 0 < κ ≤ C ≤ 4096; *out: [.., κ] i64. For other inputs *out stays null
// and the caller's aten form applies.
extern "C" char* attnlab_top_kappa(tensor scores, int64_t kappa, tensor* out) {
  try {
    *out = nullptr;
    const at::Tensor& s = *scores;
    if (!s.is_cuda() || s.scalar_type() != at::kFloat || s.dim() == 0 || s.numel() == 0) return nullptr;
    const int64_t C = s.size(-1), ld = row_stride(s);
    if (kappa <= 0 || kappa > C || C > 4096 || ld < 0) return nullptr;
    c10::cuda::CUDAGuard guard(s.device());
    std::vector<int64_t> sizes = s.sizes().vec();
    sizes.back() = kappa;
    at::Tensor o = at::empty(sizes, s.options().dtype(at::kLong));
    const int64_t rows = s.numel() / C;
    const TopKappaParams p{s.data_ptr<float>(), rows, ld, (int)C, (int)kappa, o.data_ptr<int64_t>()};
    const int64_t smem = top_kappa_smem_bytes((int)C);
    top_kappa_rank<<<(unsigned)std::min<int64_t>(rows, 1 << 20), kTopThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    *out = new at::Tensor(o);
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
