// LayerNorm (and RMSNorm: RMS = true) from the fp32 residual stream straight to bf16 / fp16 (issue 33; the 410M profile's
// LayerNorms and their casts: ≈ 65 of 430 ms). Under autocast aten runs LayerNorm in fp32 and the
// next matmul casts its output down, so each LayerNorm reads and writes fp32 and a cast reads it
// again. Here the forward reads x (fp32) once, takes its statistics in two passes over registers
// (in fp32) and writes y = (x − mean)·rstd·γ + β in the half dtype; the backward reads dy (half) and
// x once, writes dx in fp32 (the residual stream's dtype), and sums dγ, dβ by column in registers
// (fp32 partials per chunk of rows, then one aten sum).
//
// The first version passed `bench --check` on one H100 (the layer-norm rows, against aten's fp32
// LayerNorm) and trained 2–6% faster (results/bench/2026-12-05-h100); this one is right on the CPU
// and waits for the gate on a GPU (only with ATTNLAB_LN_KERNEL=1 until then). That profile put the
// backward, then a dx kernel and a separate column-sum kernel reading dy and x a second time, at
// 10.6 of the 70M step's 128 ms, and the forward (a block a row, four barriers) 5.4 ms, 3.5× its
// bytes' time: both waited on memory one row at a time. Now a block loads up to 4 rows (the
// backward 2) before it sums them, and the backward reads dy and x once (≈ 0.6 of the bytes).
//
// Device code only (no ATen, no launches): csrc/cuda/emu runs it on the CPU in `make test`;
// csrc/cuda/layer_norm.cu launches it.
#pragma once
#include "half.cuh"
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerChunk = 128;
// The forward's blocks split the rows evenly over the grid the launch picks: training a block per
// kRowsPerChunk rows, a half model's inference a block per kInferRows (a block per 128 rows left a
// 16K-token prefill 128 blocks of 32 dependent steps each, 81 µs a 512-wide RMSNorm on one H200:
// ten times its bytes' time).
constexpr int kInferRows = 16;
inline int64_t infer_blocks(int64_t n) { return n > kInferRows ? (n + kInferRows - 1) / kInferRows : 1; }

// The block's sums of v[0..N), in place (every thread gets them): one pair of barriers for all N.
// `shared`: N·kThreads/32 floats.
template <int N>
__device__ void block_sums(float (&v)[N], float* shared) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] += __shfl_xor_sync(0xffffffff, v[j], off);
  }
  constexpr int warps = kThreads / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // `shared` may still be read from the previous call
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) shared[j * warps + warp] = v[j];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < N; ++j) {
    v[j] = 0.f;
    for (int w = 0; w < warps; ++w) v[j] += shared[j * warps + w];
  }
}

// The widest row the kernels take: COLS columns a thread, kThreads threads.
constexpr int kMaxCols = 32;

// Rows a block takes at once with COLS columns a thread: their loads are in flight together and
// their sums share one pair of barriers (one row at a time, a block waits on memory for each).
template <int COLS>
constexpr int kRowsAtOnce = COLS <= 2 ? 4 : COLS <= 4 ? 2 : 1;

// Blocks an SM must hold at once (registers ≤ 64 a thread up to 8 columns): left to itself, ptxas
// gave the backward 112–119 registers, two blocks an SM. The backward, which holds g and x̂ for
// each of its rows, takes half the forward's rows at once, so that 64 registers hold it unspilled.
template <int COLS>
constexpr int kMinBlocks = COLS <= 8 ? 4 : 1;

// Calls f(std::integral_constant<int, COLS>{}) with the fewest columns a thread (a power of two up
// to kMaxCols) that cover rows of d; false, without calling it, for wider rows. Host code: the
// launches (csrc/cuda/layer_norm.cu, csrc/cuda/emu/layer_norm_test.cpp) pick their template with it.
template <int COLS = 1, typename F>
bool with_cols(int64_t d, F&& f) {
  if constexpr (COLS < kMaxCols) {
    if (d > (int64_t)COLS * kThreads) return with_cols<2 * COLS>(d, f);
  }
  if (d > (int64_t)COLS * kThreads) return false;
  f(std::integral_constant<int, COLS>{});
  return true;
}

// Both kernels take a chunk of rows (the backward kRowsPerChunk, the forward its grid's share), R =
// kRowsAtOnce<COLS> at a time; thread t holds columns t, t + kThreads, … (COLS of them, COLS·kThreads
// ≥ d) of those rows in registers, so every input is read once. RMS = true is Llama's / OLMo 2's
// RMSNorm, y = x·rstd·γ with rstd = 1/√(mean(x²) + eps): the same kernels with the mean taken as 0
// and no β (beta, mean_out, mean and dbeta_part are not read or written, and may be null).

// An input as fp32: the fp32 residual stream itself, or a 16-bit value.
__device__ __forceinline__ float in_f(float x) { return x; }
template <typename H>
__device__ __forceinline__ float in_f(H x) { return to_f(x); }

// y = (x − mean)·rstd·γ + β in T, and each row's mean and rstd (two passes over the registers).
// X: the type of x, γ and β: fp32 (the residual stream under autocast, for training), or T itself
// (a half model's inference: `attnlab_rms_norm_infer`, where mean_out and rstd_out may be null).
// ROUND_FIRST: x̂ rounded to T before γ, as HF's LlamaRMSNorm casts it back to the input dtype
// first (OLMo 2 multiplies in fp32 and casts once), so that a half model decodes as aten's form.
template <typename T, int COLS, bool RMS = false, typename X = float, bool ROUND_FIRST = false>
__global__ void __launch_bounds__(kThreads, kMinBlocks<COLS>)
    ln_forward(const X* x, const X* gamma, const X* beta, int64_t n, int64_t d, float eps, T* y, float* mean_out, float* rstd_out) {
  constexpr int R = kRowsAtOnce<COLS>;
  __shared__ float shared[R * (kThreads / 32)];
  const int64_t per = (n + gridDim.x - 1) / gridDim.x;
  const int64_t r0 = blockIdx.x * per, r1 = min(n, r0 + per);
  for (int64_t r = r0; r < r1; r += R) {
    float xv[R][COLS], mean[R], var[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      mean[i] = 0.f;
#pragma unroll
      for (int k = 0; k < COLS; ++k) {
        const int64_t c = threadIdx.x + (int64_t)k * kThreads;
        xv[i][k] = r + i < r1 && c < d ? in_f(x[(r + i) * d + c]) : 0.f;
        mean[i] += xv[i][k];
      }
    }
    if constexpr (!RMS) block_sums(mean, shared);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      mean[i] = RMS ? 0.f : mean[i] / d;
      var[i] = 0.f;
#pragma unroll
      for (int k = 0; k < COLS; ++k) {
        const float centred = threadIdx.x + (int64_t)k * kThreads < d ? xv[i][k] - mean[i] : 0.f;
        var[i] += centred * centred;
      }
    }
    block_sums(var, shared);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (r + i >= r1) break;
      const float rstd = rsqrtf(var[i] / d + eps);
#pragma unroll
      for (int k = 0; k < COLS; ++k) {
        const int64_t c = threadIdx.x + (int64_t)k * kThreads;
        if (c >= d) continue;
        const float xh = (xv[i][k] - mean[i]) * rstd;
        y[(r + i) * d + c] = from_f<T>((ROUND_FIRST ? to_f(from_f<T>(xh)) : xh) * in_f(gamma[c]) + (RMS ? 0.f : in_f(beta[c])));
      }
      if (threadIdx.x == 0 && rstd_out != nullptr) {
        if (!RMS) mean_out[r + i] = mean[i];
        rstd_out[r + i] = rstd;
      }
    }
  }
}

//   dx = rstd·(g − mean(g) − x̂·mean(g·x̂)), g = dy·γ, x̂ = (x − mean)·rstd,
// and dγ += dy·x̂, dβ += dy summed in registers over the chunk, written as the chunk's partial row.
// RMSNorm: x̂ = x·rstd and dx = rstd·(g − x̂·mean(g·x̂)) (no mean(g) term: no mean was subtracted).
template <typename T, int COLS, bool RMS = false>
__global__ void __launch_bounds__(kThreads, kMinBlocks<COLS>) ln_backward(const T* dy, const float* x, const float* gamma, const float* mean, const float* rstd,
                                                        int64_t n, int64_t d, float* dx, float* dgamma_part, float* dbeta_part) {
  constexpr int R = kRowsAtOnce<COLS> / 2 > 0 ? kRowsAtOnce<COLS> / 2 : 1;
  __shared__ float shared[2 * R * (kThreads / 32)];
  float gam[COLS], dg[COLS], db[COLS];
#pragma unroll
  for (int k = 0; k < COLS; ++k) {
    const int64_t c = threadIdx.x + (int64_t)k * kThreads;
    gam[k] = c < d ? gamma[c] : 0.f;
    dg[k] = db[k] = 0.f;
  }
  const int64_t r0 = blockIdx.x * (int64_t)kRowsPerChunk, r1 = min(n, r0 + kRowsPerChunk);
  for (int64_t r = r0; r < r1; r += R) {
    // sums[i]: Σ g of row r + i; sums[R + i]: Σ g·x̂.
    float g[R][COLS], xh[R][COLS], rs[R], sums[2 * R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const bool row = r + i < r1;
      const float mu = row && !RMS ? mean[r + i] : 0.f;
      rs[i] = row ? rstd[r + i] : 0.f;
      sums[i] = sums[R + i] = 0.f;
#pragma unroll
      for (int k = 0; k < COLS; ++k) {
        const int64_t c = threadIdx.x + (int64_t)k * kThreads;
        const bool in = row && c < d;
        const float dyv = in ? to_f(dy[(r + i) * d + c]) : 0.f;
        xh[i][k] = in ? (x[(r + i) * d + c] - mu) * rs[i] : 0.f;
        g[i][k] = dyv * gam[k];
        sums[i] += g[i][k];
        sums[R + i] += g[i][k] * xh[i][k];
        dg[k] += dyv * xh[i][k];
        db[k] += dyv;
      }
    }
    block_sums(sums, shared);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (r + i >= r1) break;
      const float ma = RMS ? 0.f : sums[i] / d, mb = sums[R + i] / d;
#pragma unroll
      for (int k = 0; k < COLS; ++k) {
        const int64_t c = threadIdx.x + (int64_t)k * kThreads;
        if (c < d) dx[(r + i) * d + c] = rs[i] * (g[i][k] - ma - xh[i][k] * mb);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < COLS; ++k) {
    const int64_t c = threadIdx.x + (int64_t)k * kThreads;
    if (c < d) {
      dgamma_part[blockIdx.x * d + c] = dg[k];
      if (!RMS) dbeta_part[blockIdx.x * d + c] = db[k];
    }
  }
}

}  // namespace
