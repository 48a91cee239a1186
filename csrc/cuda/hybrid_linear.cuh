// The linear branch of the STILL / LoLCATs prefill (still.md §2–§3; the aten form is the "linear part"
// of `Hybrid::prefill` in src/attention/still/chunked.rs), in fp32, the branch's compute kind. Where
// aten ran ≈ 60 kernels a layer over [B, H, n, C, ·] fp32 copies (casts, pads, norms, softmaxes, a
// cumsum, masked products), three kernels:
//
// hybrid_linear_states: a block per (chunk c, b·H + h). φ(k_t) of the chunk's C = 64 keys by the
//   folded map (u = k·W'_h, W'_h = the Householder reflection folded into W_h: FeatureMap::folded_linear;
//   u re-scaled to ‖k‖ / ‖u‖ where the map re-injects the norm; φ = clamp_min(softmax(u) ⊕ softmax(−u),
//   1e-12)), each row times keep_t (0 for a selected token, whose key is in Sel instead; 0 past T), then
//   the chunk's contribution to the state, ΔS_c = Σ_t φ(k_t)ᵀ v_t [F, D] and Δz_c = Σ_t φ(k_t) [F].
// hybrid_linear_scan: in place, S_c = Σ_{j ≤ c − 2} ΔS_j and z_c likewise: what query chunk c reads
//   (chunks c − 1 and c are its softmax window); S_{n−1} is the decode cache's state.
// hybrid_linear_query: a block per (c, b·H + h). φ(q_t) by q's map, n_t = φ(q_t)·S_c [D] and
//   z_t = φ(q_t)·z_c, for every row of the padded sequence (hybrid_prefill_mix reads them).
//
// Products by fp32 register tiles of 4 × 4 a thread from shared memory (the maps and states from L1 /
// L2), rows read 16 bytes at a time (ATTNLAB_LINEAR_TF32=0); or, the default, the kernels' Tf32 form (where D and
// F/2 are multiples of 8), on the tensor cores: mma.sync m16n8k8, a warp a 16 × 8·NT tile, operands
// rounded to TF32 (2⁻¹¹ relative, a rounding aten's fp32 matmuls lack but far below that of the bf16
// q, k, v both start from), fp32 accumulation. The SIMT tiles are bound by shared memory (they ran at
// a fifth of the fp32 rate, H200, 16K); the TF32 form passed the GPU gate and took the three kernels
// from 4.8 to 2.8 ms at 16K (one H200, BENCHMARKS.md).
// Device code only: csrc/cuda/emu runs it on the CPU in `make test`; csrc/cuda/hybrid_prefill.cu launches it.
#pragma once
#include "dar_band.cuh"
#include "feature_map.cuh"
#include <cassert>
#include <cmath>
#include <cstdint>

namespace {

constexpr int kLinThreads = 256;
constexpr int kLinChunk = 64;

struct LinearParams {
  View q, k, v;       // [B, T, H, D] views, as PrefillParams'
  int T, H, n, D, Fh;  // φ has F = 2·Fh features; D and Fh multiples of 4 (of 8 with tf32)
  const float* wq;     // q's folded map [H, D, Fh], contiguous
  const float* wk;     // k's
  int reinject_q, reinject_k;
  const float* keep;   // [B, H, n·C]: 1 where the token's key enters the state, 0 where selected; null: all
  float* state;        // [B, H, n, F, D]: ΔS, then (after the scan) S
  float* zstate;       // [B, H, n, F]
  float* n_lin;        // [B, H, n·C, D]
  float* z_lin;        // [B, H, n·C]
};

// Row strides of the shared tiles, by how a warp reads them: lane 4·g + t reads (row g, column t) of
// a tile read by rows (an A operand), (row t, column g) of one read by columns (a transposed A, or a B
// operand); a stride ≡ 4, resp. 8 (mod 32) puts the 32 reads in 32 banks (for widths that are
// multiples of 32; others are as right, only slower). Every row starts on 16 bytes (load4).
__host__ __device__ inline int lin_ld_rows(int width) { return width + 4; }
__host__ __device__ inline int lin_ld_cols(int width) { return width + 8; }
__host__ __device__ inline int64_t linear_smem_bytes(int D, int Fh) { return (int64_t)kLinChunk * (lin_ld_cols(D) + lin_ld_cols(2 * Fh)) * sizeof(float); }

// Four consecutive floats from a 16-byte aligned address, as one load on the GPU: the SIMT products
// read a tile row's 4-float pieces, so the shared-memory wavefronts a product costs fall from 12 per
// 512 FMAs (scalar) to 3.
__device__ __forceinline__ void load4(const float* p, float out[4]) {
#ifdef ATTNLAB_CUDA_EMU
  assert(reinterpret_cast<uintptr_t>(p) % 16 == 0);
  for (int i = 0; i < 4; ++i) out[i] = p[i];
#else
  const float4 v = *reinterpret_cast<const float4*>(p);
  out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
#endif
}

// Rows c·C .. c·C + C − 1 of x (zeros past T) into xs [C][ld] as fp32.
__device__ __forceinline__ void lin_load_rows(const View& x, int b, int h, int c, int T, int D, float* xs, int ld) {
  for (int i = threadIdx.x; i < kLinChunk * D; i += kLinThreads) {
    const int r = i / D, d = i % D, t = c * kLinChunk + r;
    xs[r * ld + d] = t < T ? to_f(x.at(b, t, h)[d]) : 0.f;
  }
}

// a(m, k) of a tile x stored row-major (rows of `ld` floats), resp. stored transposed (x[k][m]);
// quad: a(m0 .. m0 + 3, k), for the SIMT tiles (by one 16-byte load from the transposed form).
struct RowsAt {
  const float* x;
  int ld;
  __device__ __forceinline__ float operator()(int m, int k) const { return x[m * ld + k]; }
  __device__ __forceinline__ void quad(int m0, int k, float a[4]) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = x[(m0 + i) * ld + k];
  }
};
struct ColsAt {
  const float* x;
  int ld;
  __device__ __forceinline__ float operator()(int m, int k) const { return x[k * ld + m]; }
  __device__ __forceinline__ void quad(int m0, int k, float a[4]) const { load4(x + k * ld + m0, a); }
};

// out [M][N] (rows of `ldo` floats) = Σ_{k < K} a(m, k)·w[k][n], a 4 × 4 register tile of (m, n) a
// thread (M, N multiples of 4); w's rows of `ldw` floats start on 16 bytes. Block-wide, no barrier.
template <typename A>
__device__ __forceinline__ void tile_product_simt(int M, int N, int K, A a_at, const float* w, int64_t ldw, float* out, int64_t ldo) {
  const int nt = N / 4;
  for (int tile = threadIdx.x; tile < (M / 4) * nt; tile += kLinThreads) {
    const int m0 = 4 * (tile / nt), n0 = 4 * (tile % nt);
    float acc[4][4] = {};
    for (int k = 0; k < K; ++k) {
      float a[4], b[4];
      a_at.quad(m0, k, a);
      load4(w + k * ldw + n0, b);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) out[(m0 + i) * ldo + n0 + j] = acc[i][j];
  }
}

// out [M][N] (rows of `ldo` floats) = Σ_{k < K} a(m, k)·w[k][n] (w's rows `ldw` floats apart), a warp
// a 16 × 8·NT tile; M a multiple of 16, N of 8·NT, K of 8. Block-wide, no barrier.
template <int NT, typename A>
__device__ __forceinline__ void tile_product_tf32(int M, int N, int K, A a_at, const float* w, int64_t ldw, float* out, int64_t ldo) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, nt = N / (8 * NT);
  for (int tile = threadIdx.x / 32; tile < (M / 16) * nt; tile += kLinThreads / 32) {
    const int m0 = 16 * (tile / nt), n0 = 8 * NT * (tile % nt);
    float acc[NT][4] = {};
    for (int k = 0; k < K; k += 8) {
      const uint32_t a[4] = {to_tf32(a_at(m0 + g, k + t)), to_tf32(a_at(m0 + g + 8, k + t)), to_tf32(a_at(m0 + g, k + t + 4)),
                             to_tf32(a_at(m0 + g + 8, k + t + 4))};
      const float* w0 = w + (int64_t)(k + t) * ldw + n0 + g;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint32_t b[2] = {to_tf32(w0[8 * j]), to_tf32(w0[4 * ldw + 8 * j])};
        mma_tf32_1688(acc[j], a, b);
      }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      float* o = out + (int64_t)(m0 + g) * ldo + n0 + 8 * j + 2 * t;
      o[0] = acc[j][0], o[1] = acc[j][1];
      o[8 * ldo] = acc[j][2], o[8 * ldo + 1] = acc[j][3];
    }
  }
}

// By the SIMT tiles, or with tf32 the widest tensor-core tiles N allows (a warp's A fragment serves NT products).
template <typename A>
__device__ __forceinline__ void tile_product(bool tf32, int M, int N, int K, A a_at, const float* w, int64_t ldw, float* out, int64_t ldo) {
  if (!tf32) tile_product_simt(M, N, K, a_at, w, ldw, out, ldo);
  else if (N % 32 == 0) tile_product_tf32<4>(M, N, K, a_at, w, ldw, out, ldo);
  else if (N % 16 == 0) tile_product_tf32<2>(M, N, K, a_at, w, ldw, out, ldo);
  else tile_product_tf32<1>(M, N, K, a_at, w, ldw, out, ldo);
}

// φ of the C rows of xs (rows `ldx` floats apart) into phi [C][ldp] by the folded map W [D, Fh]
// (global). Block-wide.
__device__ __forceinline__ void lin_features(bool tf32, const float* xs, int ldx, int D, int Fh, const float* W, bool reinject, float* phi, int ldp) {
  tile_product(tf32, kLinChunk, Fh, D, RowsAt{xs, ldx}, W, Fh, phi, ldp);  // u = x·W
  __syncthreads();
  // A warp a row: the norm re-injection, then softmax(±u) over the Fh features.
  const int lane = threadIdx.x % 32;
  for (int r = threadIdx.x / 32; r < kLinChunk; r += kLinThreads / 32) {
    float* u = phi + r * ldp;
    float scale = 1.f;
    if (reinject) {
      float f2 = 0.f, x2 = 0.f;
      for (int j = lane; j < Fh; j += 32) f2 += u[j] * u[j];
      for (int d = lane; d < D; d += 32) x2 += xs[r * ldx + d] * xs[r * ldx + d];
      scale = sqrtf(warp_sum(x2)) / fmaxf(sqrtf(warp_sum(f2)), 1e-12f);
    }
    feature_softmax_warp(u, Fh, scale);
  }
  __syncthreads();
}

// Tf32: the products on the tensor cores (a kernel each way: registers allotted to the one path taken).
template <bool Tf32>
__global__ void __launch_bounds__(kLinThreads) hybrid_linear_states(LinearParams p) {
  ATTNLAB_DYNAMIC_SHARED(float, sh);
  const int c = blockIdx.x, bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
  const int D = p.D, Fh = p.Fh, F = 2 * Fh, ldk = lin_ld_rows(D), ldv = lin_ld_cols(D), ldp = lin_ld_cols(F);
  float* xs = sh;                           // [C][ldk]: k, then v [C][ldv]
  float* phi = xs + kLinChunk * ldv;        // [C][ldp], read by columns below
  lin_load_rows(p.k, b, h, c, p.T, D, xs, ldk);
  __syncthreads();
  lin_features(Tf32, xs, ldk, D, Fh, p.wk + (int64_t)h * D * Fh, p.reinject_k, phi, ldp);
  // keep_t on every row (0 past T), and v over k (lin_features' last barrier: every read of k done).
  for (int i = threadIdx.x; i < kLinChunk * F; i += kLinThreads) {
    const int r = i / F, t = c * kLinChunk + r;
    const float keep = t >= p.T ? 0.f : p.keep ? p.keep[(int64_t)bh * p.n * kLinChunk + t] : 1.f;
    if (keep != 1.f) phi[r * ldp + i % F] *= keep;
  }
  lin_load_rows(p.v, b, h, c, p.T, D, xs, ldv);
  __syncthreads();
  // ΔS [F][D] = Σ_t φ[t]ᵀ v[t]; Δz [F] = Σ_t φ[t].
  tile_product(Tf32, F, D, kLinChunk, ColsAt{phi, ldp}, xs, ldv, p.state + ((int64_t)bh * p.n + c) * F * D, D);
  float* dz = p.zstate + ((int64_t)bh * p.n + c) * F;
  for (int f = threadIdx.x; f < F; f += kLinThreads) {
    float s = 0.f;
    for (int t = 0; t < kLinChunk; ++t) s += phi[t * ldp + f];
    dz[f] = s;
  }
}

// One thread an element of a head's state (F·D of S, then F of z), along the chunks: S_c = the sum of
// ΔS_j over j ≤ c − 2, written over ΔS_c once it is read. Loads a group of chunks ahead, so that a
// thread has several in flight: the loop is bound by their latency, not by bandwidth (8 ahead it took
// 1.2 ms of a 16K STILL prefill's 11.9 on an H200, ≈ 7× its bytes' time; 32 ahead is untimed).
__global__ void __launch_bounds__(kLinThreads) hybrid_linear_scan(LinearParams p) {
  const int F = 2 * p.Fh, FD = F * p.D;
  const int e = blockIdx.x * kLinThreads + threadIdx.x, bh = blockIdx.y;
  if (e >= FD + F) return;
  float* x = e < FD ? p.state + (int64_t)bh * p.n * FD + e : p.zstate + (int64_t)bh * p.n * F + (e - FD);
  const int64_t stride = e < FD ? FD : F;
  constexpr int kAhead = 32;
  float below = 0.f, prev = 0.f;  // Σ ΔS_j over j ≤ c − 2, and ΔS_{c−1}
  for (int c0 = 0; c0 < p.n; c0 += kAhead) {
    float cur[kAhead];
#pragma unroll
    for (int i = 0; i < kAhead; ++i) cur[i] = c0 + i < p.n ? x[(c0 + i) * stride] : 0.f;
#pragma unroll
    for (int i = 0; i < kAhead; ++i) {
      if (c0 + i < p.n) x[(c0 + i) * stride] = below;
      below += prev;
      prev = cur[i];
    }
  }
}

template <bool Tf32>
__global__ void __launch_bounds__(kLinThreads) hybrid_linear_query(LinearParams p) {
  ATTNLAB_DYNAMIC_SHARED(float, sh);
  const int c = blockIdx.x, bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
  const int D = p.D, Fh = p.Fh, F = 2 * Fh, ldq = lin_ld_rows(D), ldp = lin_ld_rows(F);
  float* xs = sh;                        // [C][ldq]
  float* phi = xs + kLinChunk * ldq;     // [C][ldp], read by rows below
  lin_load_rows(p.q, b, h, c, p.T, D, xs, ldq);
  __syncthreads();
  lin_features(Tf32, xs, ldq, D, Fh, p.wq + (int64_t)h * D * Fh, p.reinject_q, phi, ldp);
  const float* S = p.state + ((int64_t)bh * p.n + c) * F * D;
  const float* z = p.zstate + ((int64_t)bh * p.n + c) * F;
  const int64_t row0 = (int64_t)bh * p.n * kLinChunk + (int64_t)c * kLinChunk;
  tile_product(Tf32, kLinChunk, D, F, RowsAt{phi, ldp}, S, D, p.n_lin + row0 * D, D);  // n [C][D] = φ·S
  for (int r = threadIdx.x; r < kLinChunk; r += kLinThreads) {
    float s = 0.f;
    for (int f = 0; f < F; ++f) s += phi[r * ldp + f] * z[f];
    p.z_lin[row0 + r] = s;
  }
}

}  // namespace
