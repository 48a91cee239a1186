// GPT-NeoX's heads op as one kernel each way (issue 33: the 410M profile's heads-op backward, 24.8
// of 430 ms, is csrc/heads.cpp's five strided aten kernels per rotated piece). A fused projection x
// [B, T, H·n·hd], head-major (per head, n slices of hd), is split into n pieces [B, T, H, hd], the
// first `rotated` turned by RoPE over their first 2·half dims (half-split pairs (d, d + half), angle
// tables cos / sin [T, half] in fp32):
//   out_i[d] = x_i[d]·c − x_i[d+half]·s,  out_i[d+half] = x_i[d+half]·c + x_i[d]·s  (d < half),
//   out_i[d] = x_i[d]  (d ≥ 2·half, or a piece not rotated).
// The backward writes dx once: the inverse rotation (s → −s) of each piece's gradient, or a copy,
// or zeros for a piece without one. One thread per (row, piece, pair or lone element), in fp32.
//
// Device code only: csrc/cuda/emu runs it on the CPU in `make test`; csrc/cuda/heads.cu launches it.
#pragma once
#include "half.cuh"
#include <cstdint>

namespace {

constexpr int kHeadsThreads = 256;

constexpr int kMaxPieces = 16;

struct HeadsParams {
  int64_t rows;  // B·T·H
  int T, H, n, rotated, hd, half;
  const float* cos;  // [T, half] contiguous
  const float* sin;
  // The pieces [rows, hd] contiguous, by value (graph-safe): written by the forward, read by the
  // backward (null: a piece without a gradient, read as zeros).
  void* pieces[kMaxPieces];
};

// The (row, piece, d) of flat index i over rows × n × (hd − half): d < half a rotated pair's first
// element, else the lone element d + half.
__device__ __forceinline__ void heads_index(const HeadsParams& p, int64_t i, int64_t& row, int& piece, int& d) {
  const int per = p.hd - p.half;
  d = (int)(i % per);
  piece = (int)((i / per) % p.n);
  row = i / ((int64_t)per * p.n);
}

// sign +1: x [rows, n, hd] → the pieces (forward); −1: the pieces' gradients → dx (backward).
template <typename T>
__global__ void __launch_bounds__(kHeadsThreads) heads_rotate(HeadsParams p, T* x, float sign) {
  const bool forward = sign > 0;
  const int64_t total = p.rows * p.n * (p.hd - p.half);
  for (int64_t i = blockIdx.x * (int64_t)kHeadsThreads + threadIdx.x; i < total; i += (int64_t)gridDim.x * kHeadsThreads) {
    int64_t row;
    int piece, d;
    heads_index(p, i, row, piece, d);
    T* whole = x + (row * p.n + piece) * p.hd;
    T* part = p.pieces[piece] ? static_cast<T*>(p.pieces[piece]) + row * p.hd : nullptr;
    const T* in = forward ? whole : part;
    T* out = forward ? part : whole;
    const bool pair = d < p.half;
    const int a = pair ? d : d + p.half, b = d + p.half;  // b: a pair's second element
    const float xa = in ? to_f(in[a]) : 0.f, xb = in && pair ? to_f(in[b]) : 0.f;
    if (pair && piece < p.rotated) {
      const int t = (int)((row / p.H) % p.T);
      const float c = p.cos[(int64_t)t * p.half + d], s = sign * p.sin[(int64_t)t * p.half + d];
      out[a] = from_f<T>(xa * c - xb * s);
      out[b] = from_f<T>(xb * c + xa * s);
    } else {
      out[a] = from_f<T>(xa);
      if (pair) out[b] = from_f<T>(xb);
    }
  }
}

}  // namespace
