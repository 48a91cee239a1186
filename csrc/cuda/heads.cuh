// GPT-NeoX's heads op as one kernel each way (issue 33: the 410M profile's heads-op backward, 24.8
// of 430 ms, is csrc/heads.cpp's five strided aten kernels per rotated piece). A fused projection x
// [B, T, H·n·hd], head-major (per head, n slices of hd), is split into n pieces [B, T, H, hd], the
// first `rotated` turned by RoPE over their first 2·half dims (half-split pairs (d, d + half), angle
// tables cos / sin [T, half] in fp32, rows `table_stride` floats apart: Llama's [T, hd] tables,
// whose first half columns are these, are read in place):
//   out_i[d] = x_i[d]·c − x_i[d+half]·s,  out_i[d+half] = x_i[d+half]·c + x_i[d]·s  (d < half),
//   out_i[d] = x_i[d]  (d ≥ 2·half, or a piece not rotated).
// The backward writes dx once: the inverse rotation (s → −s) of each piece's gradient, or a copy,
// or zeros for a piece without one. In fp32. Two kernels: `heads_rotate8` where every row and the
// rotated half are whole 16-byte chunks (hd and half multiples of 8, 16-byte aligned pointers:
// Pythia's hd 64, half 8), `heads_rotate` (one thread per pair or lone element) for the rest.
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
  int64_t table_stride;  // floats between rows of cos / sin (≥ half)
  const float* cos;  // [T, half], columns contiguous
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
      const float c = p.cos[(int64_t)t * p.table_stride + d], s = sign * p.sin[(int64_t)t * p.table_stride + d];
      out[a] = from_f<T>(xa * c - xb * s);
      out[b] = from_f<T>(xb * c + xa * s);
    } else {
      out[a] = from_f<T>(xa);
      if (pair) out[b] = from_f<T>(xb);
    }
  }
}

// Eight-wide: one thread per 16-byte chunk of a piece's row, so a warp sweeps 4 rows of hd 64 (512
// contiguous bytes) in one coalesced load and store, and the index math (32-bit: the launcher checks
// rows·n·hd/8 < 2^31) is done once per 8 values instead of once per value. In a rotated piece, chunk
// c < half/8 turns its pair (c, c + half/8) and writes both; the partner's thread has nothing to do.
template <typename T>
__global__ void __launch_bounds__(kHeadsThreads) heads_rotate8(HeadsParams p, T* x, float sign) {
  const bool forward = sign > 0;
  const uint32_t chunks = p.hd / 8, hc = p.half / 8;
  const uint32_t total = (uint32_t)p.rows * p.n * chunks;
  for (uint32_t i = blockIdx.x * kHeadsThreads + threadIdx.x; i < total; i += gridDim.x * kHeadsThreads) {
    const uint32_t c = i % chunks, rp = i / chunks;  // rp = row·n + piece
    const int piece = (int)(rp % p.n);
    const uint32_t row = rp / p.n;
    const bool rot = piece < p.rotated;
    if (rot && c >= hc && c < 2 * hc) continue;
    T* whole = x + (size_t)rp * p.hd;
    T* part = p.pieces[piece] ? static_cast<T*>(p.pieces[piece]) + (size_t)row * p.hd : nullptr;
    const T* in = forward ? whole : part;
    T* out = forward ? part : whole;
    Pack8 a{};  // all bits zero: +0 in bf16 and fp16 (a piece without a gradient)
    if (in) a = *reinterpret_cast<const Pack8*>(in + 8 * c);
    if (!rot || c >= hc) {
      *reinterpret_cast<Pack8*>(out + 8 * c) = a;
      continue;
    }
    Pack8 b{};
    if (in) b = *reinterpret_cast<const Pack8*>(in + 8 * (c + hc));
    const uint32_t t = (row / p.H) % p.T;
    const float* cs = p.cos + (size_t)t * p.table_stride + 8 * c;
    const float* sn = p.sin + (size_t)t * p.table_stride + 8 * c;
    Pack8 oa{}, ob{};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float xa = pack_at<T>(a, e), xb = pack_at<T>(b, e), co = cs[e], s = sign * sn[e];
      pack_set<T>(oa, e, xa * co - xb * s);
      pack_set<T>(ob, e, xb * co + xa * s);
    }
    *reinterpret_cast<Pack8*>(out + 8 * c) = oa;
    *reinterpret_cast<Pack8*>(out + 8 * (c + hc)) = ob;
  }
}

// Whether `heads_rotate8` applies: whole chunks, aligned pointers (x and every piece present), and
// its 32-bit flat index.
inline bool heads_rotate8_fits(const HeadsParams& p, const void* x) {
  auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  bool ok = p.hd % 8 == 0 && p.half % 8 == 0 && aligned(x) && p.rows * p.n * (p.hd / 8) < (int64_t(1) << 31);
  for (int i = 0; i < p.n; ++i) ok = ok && (!p.pieces[i] || aligned(p.pieces[i]));
  return ok;
}

}  // namespace
