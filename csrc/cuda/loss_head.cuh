// The loss head's one kernel (issue 33): cross-entropy over bf16 / fp16 logits rows, the rows
// overwritten in place with the loss's gradient, so the fp32 logits never exist.
//
// Per row r of `logits` [N, V] (row stride `ld`): lse_r = log Σ_j exp(x_rj) computed online in fp32
// (a running max and sum per thread, then a block reduction), nll_r = lse_r − x_r,t_r, and then
// x_rj ← scale·(exp(x_rj − lse_r) − [j = t_r]). The caller's two matmuls (dh = G·W, dW = Gᵀ·h) are
// the whole backward. A target outside [0, V) gives nll = NaN (the trainer's divergence check
// names it) and no −scale term.
//
// Two kernels: `ce_grad_in_place` reads a row twice (the online log-sum-exp, then the gradient) and
// takes any V; `ce_grad_in_place_held` (rows of whole 16-byte packs, V ≤ 8·kThreads·kMaxPacks = 65,536)
// reads it once into registers, kPacks packs a thread, and writes the gradient from them: a third
// less memory traffic (a row is read once and written once), which is what the kernel waits on.
//
// Built by `make gpu-kernels` with nvcc from PyPI into .gpu/libattnlab_kernels.so, loaded at run
// time by src/kernels/cuda.rs (dlopen); the CPU build never needs it.
//
// Device code only (no ATen, no launches): csrc/cuda/emu runs it on the CPU in `make test`;
// csrc/cuda/loss_head.cu launches it.
#pragma once
#include "half.cuh"
#include <cmath>
#include <cstdint>
#include <type_traits>

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

// The row's log-sum-exp from every thread's (max, sum) pair: a warp, then a block reduction. Every
// thread gets it; its two barriers order all of the row's reads before any write after it.
__device__ __forceinline__ float block_lse(float m, float s) {
  const int tid = threadIdx.x;
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
    if (tid == 0) lse_s = m + logf(s);
  }
  __syncthreads();
  return lse_s;
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
  const int64_t t = targets[row];
  // The target's logit, read before block_lse's barriers (after them the row is overwritten).
  const float xt = tid == 0 && t >= 0 && t < V ? to_f(x[t]) : NAN;
  const float lse = block_lse(m, s);
  if (tid == 0) nll[row] = lse - xt;
  if (kVec) {
    Pack8* xv = reinterpret_cast<Pack8*>(x);
    for (int64_t i = tid; i < V / 8; i += kThreads) {
      Pack8 p = xv[i];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int64_t col = i * 8 + j;
        float g = __expf(pack_at<T>(p, j) - lse) * scale;
        if (col == t) g -= scale;
        pack_set<T>(p, j, g);
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

// The most packs a thread holds in `ce_grad_in_place_held` (64 registers of the row).
constexpr int kMaxPacks = 16;

// Calls f(std::integral_constant<int, K>{}) with the fewest packs a thread (2, 4, 8, 12 or
// kMaxPacks) that hold rows of V values in `ce_grad_in_place_held`; false, without calling it, for
// wider rows. Host code: the launches (csrc/cuda/loss_head.cu, csrc/cuda/emu/loss_head_test.cpp)
// pick their template with it, as layer_norm.cuh's with_cols does.
template <int K = 2, typename F>
bool with_packs(int64_t V, F&& f) {
  const bool wider = V > (int64_t)8 * kThreads * K;
  if constexpr (K < kMaxPacks) {
    if (wider) return with_packs<(K < 8 ? 2 * K : K + 4)>(V, f);
  }
  if (wider) return false;
  f(std::integral_constant<int, K>{});
  return true;
}

// As `ce_grad_in_place` (kVec) with the row held in registers: thread tid holds packs tid, tid +
// kThreads, … (coalesced), finds their max, then their sum of exp(x − max); the block merges the
// (max, sum) pairs; the thread holding the target's pack writes the nll; every thread writes its
// packs' gradient. V % 8 == 0, ld % 8 == 0, 16-byte aligned rows, V ≤ 8·kThreads·kPacks.
template <typename T, int kPacks>
__global__ void __launch_bounds__(kThreads) ce_grad_in_place_held(T* logits, int64_t ld, const int64_t* targets,
                                                                 int64_t V, float scale, float* nll) {
  const int64_t row = blockIdx.x;
  Pack8* xv = reinterpret_cast<Pack8*>(logits + row * ld);
  const int tid = threadIdx.x;
  const int packs = (int)(V / 8);
  Pack8 p[kPacks];
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int i = tid + k * kThreads;
    if (i < packs) {
      p[k] = xv[i];
#pragma unroll
      for (int j = 0; j < 8; ++j) m = fmaxf(m, pack_at<T>(p[k], j));
    }
  }
  float s = 0.f;
  if (m != -INFINITY) {
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      if (tid + k * kThreads < packs) {
#pragma unroll
        for (int j = 0; j < 8; ++j) s += __expf(pack_at<T>(p[k], j) - m);
      }
    }
  }
  const float lse = block_lse(m, s);
  const int64_t t = targets[row];
  const bool in_vocab = t >= 0 && t < V;
  // The target's pack lives in thread (t / 8) % kThreads, slot (t / 8) / kThreads; a target outside
  // the vocabulary: thread 0 writes NaN.
  if (in_vocab ? (int)((t / 8) % kThreads) == tid : tid == 0) {
    // Constant indices only (a runtime one would put the packs in local memory).
    float xt = NAN;
    const int slot = in_vocab ? (int)((t / 8) / kThreads) : -1, e = (int)(t % 8);
#pragma unroll
    for (int k = 0; k < kPacks; ++k)
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (k == slot && j == e) xt = pack_at<T>(p[k], j);
    nll[row] = lse - xt;
  }
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int i = tid + k * kThreads;
    if (i < packs) {
      Pack8 g{};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float v = __expf(pack_at<T>(p[k], j) - lse) * scale;
        if ((int64_t)i * 8 + j == t) v -= scale;
        pack_set<T>(g, j, v);
      }
      xv[i] = g;
    }
  }
}

}  // namespace
