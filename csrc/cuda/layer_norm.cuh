// LayerNorm from the fp32 residual stream straight to bf16 / fp16 (issue 33; the 410M profile's
// LayerNorms and their casts: ≈ 65 of 430 ms). Under autocast aten runs LayerNorm in fp32 and the
// next matmul casts its output down, so each LayerNorm reads and writes fp32 and a cast reads it
// again. Here one kernel per row reads x (fp32) once for its statistics (two passes over registers'
// worth of the row, in fp32) and writes y = (x − mean)·rstd·γ + β in the half dtype; the backward
// is one kernel per chunk of rows: it reads dy (half) and x once, writes dx in fp32 (the residual
// stream's dtype), and sums dγ, dβ by column in registers (fp32 partials per chunk, then one aten sum).
//
// On by default since one H100 (results/bench/2026-12-05-h100): it passed `bench --check` (the
// layer-norm rows, against aten's fp32 LayerNorm) and trained 2–6% faster. That profile put the
// backward, then a dx kernel and a separate column-sum kernel reading dy and x a second time, at
// 10.6 of the 70M step's 128 ms; the one-pass backward reads them once (≈ 0.6 of the bytes).
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

// The block's sums of a and b, in place (every thread gets both): one pair of barriers for the two.
// `shared`: 2·kThreads/32 floats.
__device__ void block_sum2(float& a, float& b, float* shared) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    a += __shfl_xor_sync(0xffffffff, a, off);
    b += __shfl_xor_sync(0xffffffff, b, off);
  }
  constexpr int warps = kThreads / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // `shared` may still be read from the previous row
  if (lane == 0) {
    shared[warp] = a;
    shared[warps + warp] = b;
  }
  __syncthreads();
  a = b = 0.f;
  for (int w = 0; w < warps; ++w) {
    a += shared[w];
    b += shared[warps + w];
  }
}

// The widest row the backward takes: COLS columns a thread, kThreads threads.
constexpr int kMaxCols = 32;

// The backward over a chunk of kRowsPerChunk rows, one row after another: thread t holds columns
// t, t + kThreads, … (COLS of them, COLS·kThreads ≥ d) of the row's dy and x̂ in registers, so each
// is read once;
//   dx = rstd·(g − mean(g) − x̂·mean(g·x̂)), g = dy·γ, x̂ = (x − mean)·rstd,
// and dγ += dy·x̂, dβ += dy summed in registers over the chunk, written as the chunk's partial row.
template <typename T, int COLS>
__global__ void __launch_bounds__(kThreads) ln_backward(const T* dy, const float* x, const float* gamma, const float* mean, const float* rstd,
                                                        int64_t n, int64_t d, float* dx, float* dgamma_part, float* dbeta_part) {
  __shared__ float shared[2 * (kThreads / 32)];
  float gam[COLS], dg[COLS], db[COLS];
#pragma unroll
  for (int k = 0; k < COLS; ++k) {
    const int64_t c = threadIdx.x + (int64_t)k * kThreads;
    gam[k] = c < d ? gamma[c] : 0.f;
    dg[k] = db[k] = 0.f;
  }
  const int64_t r0 = blockIdx.x * (int64_t)kRowsPerChunk, r1 = min(n, r0 + kRowsPerChunk);
  for (int64_t r = r0; r < r1; ++r) {
    const float mu = mean[r], rs = rstd[r];
    float g[COLS], xh[COLS], a = 0.f, b = 0.f;
#pragma unroll
    for (int k = 0; k < COLS; ++k) {
      const int64_t c = threadIdx.x + (int64_t)k * kThreads;
      const float dyv = c < d ? to_f(dy[r * d + c]) : 0.f;
      xh[k] = c < d ? (x[r * d + c] - mu) * rs : 0.f;
      g[k] = dyv * gam[k];
      a += g[k];
      b += g[k] * xh[k];
      dg[k] += dyv * xh[k];
      db[k] += dyv;
    }
    block_sum2(a, b, shared);
    const float ma = a / d, mb = b / d;
#pragma unroll
    for (int k = 0; k < COLS; ++k) {
      const int64_t c = threadIdx.x + (int64_t)k * kThreads;
      if (c < d) dx[r * d + c] = rs * (g[k] - ma - xh[k] * mb);
    }
  }
#pragma unroll
  for (int k = 0; k < COLS; ++k) {
    const int64_t c = threadIdx.x + (int64_t)k * kThreads;
    if (c < d) {
      dgamma_part[blockIdx.x * d + c] = dg[k];
      dbeta_part[blockIdx.x * d + c] = db[k];
    }
  }
}

}  // namespace
