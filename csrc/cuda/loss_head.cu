// The loss head's one kernel (issue 33): cross-entropy over bf16 / fp16 logits rows, the rows
// overwritten in place with the loss's gradient, so the fp32 logits never exist.
//
// Per row r of `logits` [N, V] (row stride `ld`): lse_r = log Σ_j exp(x_rj) computed online in fp32
// (a running max and sum per thread, then a block reduction), nll_r = lse_r − x_r,t_r, and then
// x_rj ← scale·(exp(x_rj − lse_r) − [j = t_r]). The caller's two matmuls (dh = G·W, dW = Gᵀ·h) are
// the whole backward. A target outside [0, V) gives nll = NaN (the trainer's divergence check
// names it) and no −scale term.
//
// Built by `make gpu-kernels` with nvcc from PyPI into .gpu/libattnlab_kernels.so, loaded at run
// time by src/kernels/cuda.rs (dlopen); the CPU build never needs it.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include "half.cuh"
#include <cmath>
#include <cstring>

namespace {

constexpr int kThreads = 512;

// (m, s) represents s·e^m; merging keeps the larger max.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  if (m2 > m) {
    s = s * __expf(m - m2) + s2;
    m = m2;
  } else if (m2 != -INFINITY) {
    s += s2 * __expf(m2 - m);
  }
}

__device__ __forceinline__ void add(float& m, float& s, float x) {
  if (x > m) {
    s = s * __expf(m - x) + 1.f;
    m = x;
  } else {
    s += __expf(x - m);
  }
}

template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads) ce_grad_in_place(T* logits, int64_t ld, const int64_t* targets,
                                                            int64_t V, float scale, float* nll) {
  const int64_t row = blockIdx.x;
  T* x = logits + row * ld;
  const int tid = threadIdx.x;
  float m = -INFINITY, s = 0.f;
  if (kVec) {
    const Pack8* xv = reinterpret_cast<const Pack8*>(x);
    for (int64_t i = tid; i < V / 8; i += kThreads) {
      Pack8 p = xv[i];
#pragma unroll
      for (int j = 0; j < 8; ++j) add(m, s, pack_at<T>(p, j));
    }
  } else {
    for (int64_t i = tid; i < V; i += kThreads) add(m, s, to_f(x[i]));
  }
  // Warp, then block reduction of (m, s).
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    float m2 = __shfl_xor_sync(0xffffffff, m, off), s2 = __shfl_xor_sync(0xffffffff, s, off);
    merge(m, s, m2, s2);
  }
  __shared__ float sm[kThreads / 32], ss[kThreads / 32];
  __shared__ float lse_s;
  if ((tid & 31) == 0) {
    sm[tid >> 5] = m;
    ss[tid >> 5] = s;
  }
  __syncthreads();
  if (tid < 32) {
    m = tid < kThreads / 32 ? sm[tid] : -INFINITY;
    s = tid < kThreads / 32 ? ss[tid] : 0.f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      float m2 = __shfl_xor_sync(0xffffffff, m, off), s2 = __shfl_xor_sync(0xffffffff, s, off);
      merge(m, s, m2, s2);
    }
    if (tid == 0) {
      const float lse = m + logf(s);
      lse_s = lse;
      const int64_t t = targets[row];
      // Read before any thread overwrites the row (the barrier below orders it).
      nll[row] = (t >= 0 && t < V) ? lse - to_f(x[t]) : NAN;
    }
  }
  __syncthreads();
  const float lse = lse_s;
  const int64_t t = targets[row];
  if (kVec) {
    Pack8* xv = reinterpret_cast<Pack8*>(x);
    for (int64_t i = tid; i < V / 8; i += kThreads) {
      Pack8 p = xv[i];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int64_t col = i * 8 + j;
        float g = __expf(pack_at<T>(p, j) - lse) * scale;
        if (col == t) g -= scale;
        T out = from_f<T>(g);
        p.v[j] = *reinterpret_cast<uint16_t*>(&out);
      }
      xv[i] = p;
    }
  } else {
    for (int64_t i = tid; i < V; i += kThreads) {
      float g = __expf(to_f(x[i]) - lse) * scale;
      if (i == t) g -= scale;
      x[i] = from_f<T>(g);
    }
  }
}

template <typename T>
void launch(at::Tensor& logits, const at::Tensor& targets, double scale, at::Tensor& nll) {
  const int64_t n = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  T* ptr = reinterpret_cast<T*>(logits.data_ptr());
  const bool vec = V % 8 == 0 && ld % 8 == 0 && reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t* tg = targets.data_ptr<int64_t>();
  float* out = nll.data_ptr<float>();
  if (vec) {
    ce_grad_in_place<T, true><<<n, kThreads, 0, stream>>>(ptr, ld, tg, V, static_cast<float>(scale), out);
  } else {
    ce_grad_in_place<T, false><<<n, kThreads, 0, stream>>>(ptr, ld, tg, V, static_cast<float>(scale), out);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

typedef at::Tensor* tensor;

// logits [N, V] bf16 / fp16 on CUDA, unit column stride (overwritten with the gradient); targets [N]
// int64; nll_out: a new [N] fp32 tensor of per-row losses. Errors come back as strings.
extern "C" char* attnlab_ce_grad_in_place(tensor logits, tensor targets, double scale, tensor* nll_out) {
  try {
    at::Tensor& x = *logits;
    TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.stride(1) == 1, "logits must be a CUDA [N, V] matrix with unit column stride");
    TORCH_CHECK(x.size(0) < (int64_t{1} << 31), "too many rows for one launch");
    at::Tensor t = targets->to(x.device(), at::kLong).contiguous();
    TORCH_CHECK(t.dim() == 1 && t.size(0) == x.size(0), "targets must be [N] for logits [N, V]");
    c10::cuda::CUDAGuard guard(x.device());
    at::Tensor nll = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
    if (x.size(0) > 0) {
      if (x.scalar_type() == at::kBFloat16) {
        launch<__nv_bfloat16>(x, t, scale, nll);
      } else if (x.scalar_type() == at::kHalf) {
        launch<__half>(x, t, scale, nll);
      } else {
        TORCH_CHECK(false, "logits must be bf16 or fp16, not ", x.scalar_type());
      }
    }
    *nll_out = new at::Tensor(nll);
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
