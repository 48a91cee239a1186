// LayerNorm from the fp32 residual stream straight to bf16 / fp16 (issue 33; the 410M profile's
// LayerNorms and their casts: ≈ 65 of 430 ms). Under autocast aten runs LayerNorm in fp32 and the
// next matmul casts its output down, so each LayerNorm reads and writes fp32 and a cast reads it
// again. Here one kernel per row reads x (fp32) once for its statistics (two passes over registers'
// worth of the row, in fp32) and writes y = (x − mean)·rstd·γ + β in the half dtype; the backward
// reads dy (half) and x, writes dx in fp32 (the residual stream's dtype), and sums dγ, dβ by column
// over chunks of rows (fp32 partials, then one aten sum).
//
// Right on the CPU (make cuda-emu-test), not yet run on a GPU: only taken with ATTNLAB_LN_KERNEL=1 (src/kernels/cuda.rs), and held by
// `bench --check` (the layer-norm rows) against aten's fp32 LayerNorm.
//
// Device code only (no ATen, no launches): csrc/cuda/emu runs it on the CPU in `make test`;
// csrc/cuda/layer_norm.cu launches it.
#pragma once
#include "half.cuh"
#include <cmath>
#include <cstdint>

namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerChunk = 128;

// The block's sum of x (every thread gets it).
__device__ float block_sum(float x, float* shared) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffff, x, off);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // `shared` may still be read from the previous call
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  float s = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) s += shared[w];
  return s;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) ln_forward(const float* x, const float* gamma, const float* beta, int64_t d, float eps, T* y,
                                                       float* mean_out, float* rstd_out) {
  __shared__ float shared[kThreads / 32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * d;
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < d; i += kThreads) s += xr[i];
  const float mean = block_sum(s, shared) / d;
  float v = 0.f;
  for (int64_t i = threadIdx.x; i < d; i += kThreads) {
    const float c = xr[i] - mean;
    v += c * c;
  }
  const float rstd = rsqrtf(block_sum(v, shared) / d + eps);
  T* yr = y + row * d;
  for (int64_t i = threadIdx.x; i < d; i += kThreads) yr[i] = from_f<T>((xr[i] - mean) * rstd * gamma[i] + beta[i]);
  if (threadIdx.x == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// dx = rstd·(g − mean(g) − x̂·mean(g·x̂)), g = dy·γ, x̂ = (x − mean)·rstd.
template <typename T>
__global__ void __launch_bounds__(kThreads) ln_backward_dx(const T* dy, const float* x, const float* gamma, const float* mean,
                                                           const float* rstd, int64_t d, float* dx) {
  __shared__ float shared[kThreads / 32];
  const int64_t row = blockIdx.x;
  const T* dyr = dy + row * d;
  const float* xr = x + row * d;
  const float mu = mean[row], rs = rstd[row];
  float a = 0.f, b = 0.f;
  for (int64_t i = threadIdx.x; i < d; i += kThreads) {
    const float g = to_f(dyr[i]) * gamma[i];
    a += g;
    b += g * (xr[i] - mu) * rs;
  }
  a = block_sum(a, shared) / d;
  b = block_sum(b, shared) / d;
  float* dxr = dx + row * d;
  for (int64_t i = threadIdx.x; i < d; i += kThreads) {
    const float xhat = (xr[i] - mu) * rs;
    dxr[i] = rs * (to_f(dyr[i]) * gamma[i] - a - xhat * b);
  }
}

// Partial column sums over a chunk of rows: dγ += dy·x̂, dβ += dy; one thread per column.
template <typename T>
__global__ void __launch_bounds__(kThreads) ln_backward_params(const T* dy, const float* x, const float* mean, const float* rstd, int64_t n,
                                                               int64_t d, float* dgamma_part, float* dbeta_part) {
  const int64_t col = blockIdx.x * (int64_t)kThreads + threadIdx.x;
  if (col >= d) return;
  const int64_t r0 = blockIdx.y * (int64_t)kRowsPerChunk, r1 = min(n, r0 + kRowsPerChunk);
  float g = 0.f, bsum = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    const float dyv = to_f(dy[r * d + col]);
    g += dyv * (x[r * d + col] - mean[r]) * rstd[r];
    bsum += dyv;
  }
  dgamma_part[blockIdx.y * d + col] = g;
  dbeta_part[blockIdx.y * d + col] = bsum;
}

}  // namespace
