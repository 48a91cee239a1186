// DAR's local band with the merge in its epilogue (issue 35 items 1-2; dar-kernels.md §3): query i
// attends the full-width keys j with 0 ≤ i − j < w (the band), and for i ≥ w the result is merged
// with the distant part's output and log-sum-exp (computed before, by cuDNN over K_g[:T−w] from
// Q[w:]) by their log-sum-exps:
//   lse_i = log(e^{lse_band,i} + e^{lse_far,i−w}),
//   out_i = e^{lse_band,i − lse_i}·O_band,i + e^{lse_far,i−w − lse_i}·O_far,i−w,
// written once in bf16 (out) and fp32 (lse), where the split route wrote the band's output, then
// merged in fp32 passes. The band is small (w keys a query), so each block of 64 queries visits only
// the key tiles its band touches: ⌈(w + 63) / 64⌉ + 1 of 64 keys at most, not the T/64 of causal.
//
// One block per (64 queries, b, h), four warps of 16 queries each. Per key tile: K and V in shared
// memory (two stages: the next tile's cp.async copies in flight while this one's products run),
// read back by ldmatrix (four 8×8 fragments a warp-wide load; transposed for the B operand
// of P·V, whose registers hold pairs down a column); S = Q·Kᵀ on the tensor cores (mma m16n8k16,
// Q's fragments held in registers), masked to the band, an online softmax per row in fp32 (each
// row's 64 scores spread over the four lanes of a quad), P packed to bf16 as the A operand of
// O += P·V. Inputs [B, T, H, D] bf16, D ∈ {64, 128},
// with any b / t / h strides that keep rows 16-byte aligned (multiples of 8, an aligned start) and a
// unit d stride.
//
// The backward (band_bwd_dkdv, band_bwd_dq) below. Right on the CPU (make cuda-emu-test: output,
// lse and the gradients against DAR's definition in double) and on one H100 (bench --check), where
// its first form (B fragments gathered by 16-bit shared loads) trained slower than split-merge-fused
// (BENCHMARKS.md), as did the ldmatrix form (0.96–0.97×: shared loads were not the bound); the
// two-stage form, whose global loads no longer wait in line before each tile's products, awaits its timing.
#pragma once
#include "mma.cuh"
#include <cmath>
#include <cstdint>

namespace {

constexpr int kBandWarps = 4;
constexpr int kBandThreads = 32 * kBandWarps;
constexpr int kBandRows = 16 * kBandWarps;  // queries a block
constexpr int kBandKeys = 64;               // keys a tile

// A [B, T, H, D] bf16 tensor by its b / t / h strides (unit d stride).
struct View {
  const __nv_bfloat16* p;
  int64_t sb, st, sh;
  __device__ __forceinline__ const __nv_bfloat16* at(int b, int64_t t, int h) const { return p + b * sb + t * st + h * sh; }
};

struct BandParams {
  View q, k, v;
  // The distant part, rows i ≥ w as rows i − w: its output [B, T − w, H, D] and lse [B, H, T − w]
  // (row stride fl_sh, batch stride fl_sb); far.p null for no merge (the band alone).
  View far;
  const float* far_lse;
  int64_t fl_sb, fl_sh;
  __nv_bfloat16* out;  // [B, T, H, D] contiguous
  float* lse;          // [B, H, T] contiguous
  int T, H, w;
  float scale;
};

// One shared tile: kBandKeys rows, each padded by 8 values (bank spread).
__host__ __device__ inline int64_t band_tile_bytes(int D) { return (int64_t)kBandKeys * (D + 8) * 2; }
// Shared memory of the forward and of band_bwd_dq: two stages of a K and a V tile.
__host__ __device__ inline int64_t band_smem_bytes(int D) { return 4 * band_tile_bytes(D); }

// Where a thread works: its warp, its quad in the warp (group, the fragments' row) and place in the
// quad (t, their column pair), and its block's (b, h).
struct Place {
  int warp, group, t, b, h;
};
__device__ __forceinline__ Place place(int H) {
  const int lane = threadIdx.x % 32;
  return {(int)threadIdx.x / 32, lane / 4, lane % 4, (int)blockIdx.y / H, (int)blockIdx.y % H};
}

// Whether query i reads key j through the band: 0 ≤ i − j < w, both inside the sequence.
__device__ __forceinline__ bool in_band(int i, int j, int w, int T) { return j <= i && i - j < w && i < T && j < T; }

// A fragments (16 rows × D) of rows row0, row0 + 8 of a [T, D] view at (b, h); zero past T.
template <int D>
__device__ __forceinline__ void load_a_rows(const View& x, int b, int h, int row0, int T, uint32_t a[D / 16][4]) {
  const int t = (threadIdx.x % 32) % 4;
  for (int kk = 0; kk < D / 16; ++kk)
    for (int r = 0; r < 4; ++r) {
      const int row = row0 + (r & 1 ? 8 : 0), col = kk * 16 + 2 * t + (r & 2 ? 8 : 0);
      a[kk][r] = row < T ? load_pair(x.at(b, row, h) + col) : 0u;
    }
}

// Shared tiles are read by ldmatrix (mma.cuh): lane 8m + r of a warp names row r of matrix m. Its
// row and column offsets here: matrices 0 / 1 rows 0–7 / 8–15 at column 0, matrices 2 / 3 the same at
// column 8 (the A fragment's four registers), or, for B fragments, the next k or n block.
__device__ __forceinline__ int ld_row() { return (threadIdx.x % 32) % 8 + 8 * ((threadIdx.x % 32) / 8 % 2); }
__device__ __forceinline__ int ld_col() { return 8 * ((threadIdx.x % 32) / 16); }

// A fragments (16 rows × D) of rows r0 .. r0 + 15 of a shared tile (r0: the warp's first row).
template <int D>
__device__ __forceinline__ void load_a_shared(const __nv_bfloat16* xs, int r0, uint32_t a[D / 16][4]) {
  constexpr int LD = D + 8;
  for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(a[kk], xs + (r0 + ld_row()) * LD + kk * 16 + ld_col());
}

// Rows n0.. of two [T, D] views into shared tiles of kBandKeys rows (zero past T) by cp.async, 16
// bytes a copy (the launcher requires 16-byte aligned rows); they land at the caller's wait.
template <int D>
__device__ __forceinline__ void load_tiles(const View& x, const View& y, int b, int h, int n0, int T, __nv_bfloat16* xs, __nv_bfloat16* ys) {
  constexpr int LD = D + 8;
  for (int i = threadIdx.x; i < kBandKeys * D / 8; i += kBandThreads) {
    const int r = i / (D / 8), c = 8 * (i % (D / 8)), j = n0 + r;
    cp_async<16>(xs + r * LD + c, j < T ? x.at(b, j, h) + c : x.p, j < T);
    cp_async<16>(ys + r * LD + c, j < T ? y.at(b, j, h) + c : y.p, j < T);
  }
}

// The key (or query) tiles a block visits, from n_first, kBandKeys apart: `tiles` of them. Each
// iteration of its loop starts the copies of the next tile into the other stage, then waits for its
// own (cp.async groups are per thread: the barrier after the wait makes every thread's visible).
__device__ __forceinline__ void wait_for_tile(int it, int tiles) {
  if (it + 1 < tiles) cp_async_wait<1>();
  else cp_async_wait<0>();
  __syncthreads();
}

// The start of iteration `it` of a loop over key tiles from n_first in two stages (the forward's
// and dQ's): the next tile's K and V copies issued into the other stage, this one's awaited. Returns
// this tile's K tile (its V tile follows).
template <int D>
__device__ __forceinline__ const __nv_bfloat16* key_tile(const View& k, const View& v, int b, int h, int n_first, int it, int tiles, int T, __nv_bfloat16* smem) {
  constexpr int TILE = kBandKeys * (D + 8);
  if (it + 1 < tiles) {
    __nv_bfloat16* next = smem + ((it + 1) & 1) * 2 * TILE;
    load_tiles<D>(k, v, b, h, n_first + (it + 1) * kBandKeys, T, next, next + TILE);
    cp_async_commit();
  }
  wait_for_tile(it, tiles);
  return smem + (it & 1) * 2 * TILE;
}

// The start of a flash loop for a warp's rows (row0, row0 + 8 of 16): the output accumulators zeroed,
// the running maxima at −inf and the sums at 0.
template <int D>
__device__ __forceinline__ void start_rows(float o[D / 8][4], float m[2], float l[2]) {
  for (int d = 0; d < D / 8; ++d)
    for (int e = 0; e < 4; ++e) o[d][e] = 0.f;
  m[0] = m[1] = -INFINITY;
  l[0] = l[1] = 0.f;
}

// Two 16-bit values as one 32-bit store (dst 4-byte aligned: an even column of an even-width row).
__device__ __forceinline__ void store_pair(__nv_bfloat16* dst, float x0, float x1) { *reinterpret_cast<uint32_t*>(dst) = pack_pair<__nv_bfloat16>(x0, x1); }

// s (16 × 64, eight C fragments) = A (16 × D, registers) · Xᵀ (X: 64 × D rows of a shared tile).
template <int D>
__device__ __forceinline__ void mma_a_xt(float s[kBandKeys / 8][4], const uint32_t a[D / 16][4], const __nv_bfloat16* xs) {
  constexpr int LD = D + 8;
  // B fragments of k blocks kk and kk + 1: rows nt·8 .. nt·8 + 7 of X, columns kk·16 (+ 8, + 16, + 24),
  // matrices 0–3 (lane 8m + r names row r at column 8m).
  const int lane = threadIdx.x % 32;
  for (int nt = 0; nt < kBandKeys / 8; ++nt) {
    for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
    for (int kk = 0; kk < D / 16; kk += 2) {
      uint32_t xb[4];
      ldmatrix_x4(xb, xs + (nt * 8 + lane % 8) * LD + kk * 16 + 8 * (lane / 8));
      mma_bf16_16816(s[nt], a[kk], xb);
      mma_bf16_16816(s[nt], a[kk + 1], xb + 2);
    }
  }
}

// Rows row0, row0 + 8 of acc (16 × D C fragments) times `scale`, plus `add` (a row view or null),
// to a contiguous [B, T, H, D] output in bf16.
template <int D>
__device__ __forceinline__ void store_rows(const float acc[D / 8][4], float scale, const View* add, int add_from, __nv_bfloat16* dst, int b, int h, int row0,
                                           int T, int H) {
  const int t = (threadIdx.x % 32) % 4;
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    if (row >= T) continue;
    const __nv_bfloat16* extra = add && add->p && row >= add_from ? add->at(b, row - add_from, h) : nullptr;
    __nv_bfloat16* o = dst + (((int64_t)b * T + row) * H + h) * D;
    for (int d = 0; d < D / 8; ++d) {
      const int col = d * 8 + 2 * t;
      float x0 = acc[d][2 * r] * scale, x1 = acc[d][2 * r + 1] * scale;
      if (extra) {
        x0 += to_f(extra[col]);
        x1 += to_f(extra[col + 1]);
      }
      store_pair(o + col, x0, x1);
    }
  }
}

template <int D>
__global__ void __launch_bounds__(kBandThreads) band_merge_fwd(BandParams p) {
  ATTNLAB_DYNAMIC_SHARED(__nv_bfloat16, smem);
  constexpr int LD = D + 8, NT = kBandKeys / 8, TILE = kBandKeys * LD;
  const auto [warp, group, t, b, h] = place(p.H);
  const int q0 = blockIdx.x * kBandRows;
  const int row0 = q0 + warp * 16 + group;  // this lane's rows: row0 and row0 + 8
  const int first = max(0, q0 - (p.w - 1)), last = min(p.T, q0 + kBandRows);  // keys the block's band touches
  const int n_first = first - first % kBandKeys, tiles = (last - n_first + kBandKeys - 1) / kBandKeys;
  load_tiles<D>(p.k, p.v, b, h, n_first, p.T, smem, smem + TILE);  // stage 0: K, V
  cp_async_commit();
  uint32_t qa[D / 16][4];
  load_a_rows<D>(p.q, b, h, row0, p.T, qa);
  float o[D / 8][4], m[2], l[2];
  start_rows<D>(o, m, l);
  for (int it = 0; it < tiles; ++it) {
    const int n0 = n_first + it * kBandKeys;
    const __nv_bfloat16* ks = key_tile<D>(p.k, p.v, b, h, n_first, it, tiles, p.T, smem);
    const __nv_bfloat16* vs = ks + TILE;
    float s[NT][4];
    mma_a_xt<D>(s, qa, ks);  // S = Q·Kᵀ: 16 rows × 64 keys a warp
    // The band mask (e < 2: row0, else row0 + 8), then the online softmax.
    for (int nt = 0; nt < NT; ++nt)
      for (int e = 0; e < 4; ++e) {
        const int i = row0 + (e >= 2 ? 8 : 0), j = n0 + nt * 8 + 2 * t + (e & 1);
        s[nt][e] = in_band(i, j, p.w, p.T) ? s[nt][e] * p.scale : -INFINITY;
      }
    online_softmax<NT, D / 8>(s, m, l, o);
    mma_p_x<__nv_bfloat16, kBandKeys, D>(o, s, vs);  // O += P·V
    __syncthreads();  // this stage is read: the tile after next may be copied into it
  }
  // The rows' sums over the quad, the band's lse, and the merge with the distant part.
  for (int r = 0; r < 2; ++r) l[r] = quad_sum(l[r]);
  for (int r = 0; r < 2; ++r) {
    const int i = row0 + 8 * r;
    if (i >= p.T) continue;
    const float lse_band = m[r] + logf(l[r]);
    float a = 1.f / l[r], c = 0.f, lse = lse_band;
    const __nv_bfloat16* far = nullptr;
    if (p.far.p && i >= p.w) {
      const float lf = p.far_lse[b * p.fl_sb + h * p.fl_sh + (i - p.w)];
      const float top = fmaxf(lse_band, lf);
      lse = top + logf(__expf(lse_band - top) + __expf(lf - top));
      a = __expf(lse_band - lse) / l[r];
      c = __expf(lf - lse);
      far = p.far.at(b, i - p.w, h);
    }
    __nv_bfloat16* out = p.out + (((int64_t)b * p.T + i) * p.H + h) * D;
    for (int d = 0; d < D / 8; ++d) {
      const int col = d * 8 + 2 * t;
      float x0 = o[d][2 * r] * a, x1 = o[d][2 * r + 1] * a;
      if (far) {
        x0 += c * to_f(far[col]);
        x1 += c * to_f(far[col + 1]);
      }
      store_pair(out + col, x0, x1);
    }
    if (t == 0) p.lse[((int64_t)b * p.H + h) * p.T + i] = lse;
  }
}

// The backward of the band given the merged output O and lse (the split route's identity: with the
// final O and lse, each part's stock backward is exact for its own keys): D_i = Σ dO_i·O_i,
// P_ij = e^{s_ij − lse_i} on the band, dS_ij = P_ij·(dO_i·v_j − D_i);
//   dQ_i = scale·Σ_j dS_ij·k_j plus the distant part's dQ for i ≥ w (band_bwd_dq: a block per 64
//   queries, the key tiles of their band; the split route's scatter-add in its epilogue; it also
//   writes each row's D), then dV_j = Σ_i P_ij·dO_i and dK_j = scale·Σ_i dS_ij·q_i (band_bwd_dkdv: a
//   block per 64 keys, the query tiles that see them, their D read back). No atomics: every
//   gradient row is written once, in bf16.
struct BandBwdParams {
  View q, k, v, out, dout;
  const float* lse;  // [B, H, T] contiguous (the merged one)
  View far_dq;       // the distant part's dQ [B, T − w, H, D] (rows i ≥ w as i − w), or p = null
  __nv_bfloat16 *dq, *dk, *dv;  // [B, T, H, D] contiguous
  float* dd;  // [B, H, T] contiguous: D_i, written by band_bwd_dq, read by band_bwd_dkdv (launched after it)
  int T, H, w;
  float scale;
};

// Shared memory of the backward (dkdv's, the larger): the block's K and V tiles, and two stages of a
// query tile's Q, dO, lse and D.
__host__ __device__ inline int64_t band_bwd_smem_bytes(int D) { return 6 * band_tile_bytes(D) + 4 * kBandKeys * (int64_t)sizeof(float); }

// A query tile's rows n0.. of Q and dO, and their lse and D (zeros past T), into one stage of
// band_bwd_dkdv's shared memory by cp.async.
template <int D>
__device__ __forceinline__ void load_query_tile(const BandBwdParams& p, int b, int h, int n0, __nv_bfloat16* qs, float* lse_s) {
  load_tiles<D>(p.q, p.dout, b, h, n0, p.T, qs, qs + kBandKeys * (D + 8));
  for (int r = threadIdx.x; r < kBandKeys; r += kBandThreads) {
    const int i = n0 + r;
    const int64_t row = ((int64_t)b * p.H + h) * p.T + i;
    cp_async<4>(lse_s + r, i < p.T ? p.lse + row : p.lse, i < p.T);
    cp_async<4>(lse_s + kBandKeys + r, i < p.T ? p.dd + row : p.dd, i < p.T);
  }
}

template <int D>
__global__ void __launch_bounds__(kBandThreads) band_bwd_dkdv(BandBwdParams p) {
  ATTNLAB_DYNAMIC_SHARED(__nv_bfloat16, smem);
  constexpr int LD = D + 8, NT = kBandKeys / 8, TILE = kBandKeys * LD;
  // The block's own keys and values (read as A fragments when needed, not held in registers), then
  // two stages of a query tile's Q and dO, and of its lse and D.
  __nv_bfloat16* ks = smem;
  __nv_bfloat16* vs = ks + TILE;
  float* lse_base = reinterpret_cast<float*>(smem + 6 * TILE);
  const auto [warp, group, t, b, h] = place(p.H);
  const int k0 = blockIdx.x * kBandKeys, key0 = k0 + warp * 16 + group;  // this lane's keys: key0, key0 + 8
  const int last = min(p.T, k0 + kBandKeys + p.w - 1);  // queries that see a key of the block
  const int tiles = (last - k0 + kBandKeys - 1) / kBandKeys;
  load_tiles<D>(p.k, p.v, b, h, k0, p.T, ks, vs);
  load_query_tile<D>(p, b, h, k0, smem + 2 * TILE, lse_base);  // one group with the block's K, V
  cp_async_commit();
  float dk[D / 8][4], dv[D / 8][4];
  for (int d = 0; d < D / 8; ++d)
    for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = 0.f;
  for (int it = 0; it < tiles; ++it) {
    const int n0 = k0 + it * kBandKeys;
    if (it + 1 < tiles) {
      const int next = (it + 1) & 1;
      load_query_tile<D>(p, b, h, n0 + kBandKeys, smem + (2 + 2 * next) * TILE, lse_base + 2 * kBandKeys * next);
      cp_async_commit();
    }
    wait_for_tile(it, tiles);
    const __nv_bfloat16* qs = smem + (2 + 2 * (it & 1)) * TILE;
    const __nv_bfloat16* dos = qs + TILE;
    const float* lse_s = lse_base + 2 * kBandKeys * (it & 1);
    const float* dd_s = lse_s + kBandKeys;
    float s[NT][4], dp[NT][4];
    {
      uint32_t a[D / 16][4];
      load_a_shared<D>(ks, warp * 16, a);
      mma_a_xt<D>(s, a, qs);  // Sᵀ: keys × queries
      load_a_shared<D>(vs, warp * 16, a);
      mma_a_xt<D>(dp, a, dos);  // dPᵀ = V·dOᵀ
    }
    for (int nt = 0; nt < NT; ++nt)
      for (int e = 0; e < 4; ++e) {
        const int j = key0 + (e >= 2 ? 8 : 0), c = nt * 8 + 2 * t + (e & 1), i = n0 + c;
        const float pe = in_band(i, j, p.w, p.T) ? __expf(s[nt][e] * p.scale - lse_s[c]) : 0.f;
        s[nt][e] = pe;
        dp[nt][e] = pe * (dp[nt][e] - dd_s[c]);
      }
    mma_p_x<__nv_bfloat16, kBandKeys, D>(dv, s, dos);  // dV += Pᵀ·dO
    mma_p_x<__nv_bfloat16, kBandKeys, D>(dk, dp, qs);  // dK += dSᵀ·Q (scaled at the end)
    __syncthreads();  // this stage is read: the tile after next may be copied into it
  }
  store_rows<D>(dv, 1.f, nullptr, 0, p.dv, b, h, key0, p.T, p.H);
  store_rows<D>(dk, p.scale, nullptr, 0, p.dk, b, h, key0, p.T, p.H);
}

template <int D>
__global__ void __launch_bounds__(kBandThreads) band_bwd_dq(BandBwdParams p) {
  ATTNLAB_DYNAMIC_SHARED(__nv_bfloat16, smem);
  constexpr int LD = D + 8, NT = kBandKeys / 8, TILE = kBandKeys * LD;
  const auto [warp, group, t, b, h] = place(p.H);
  const int q0 = blockIdx.x * kBandRows, row0 = q0 + warp * 16 + group;
  const int first = max(0, q0 - (p.w - 1)), last = min(p.T, q0 + kBandRows);
  const int n_first = first - first % kBandKeys, tiles = (last - n_first + kBandKeys - 1) / kBandKeys;
  load_tiles<D>(p.k, p.v, b, h, n_first, p.T, smem, smem + TILE);  // stage 0, in flight while D is summed
  cp_async_commit();
  uint32_t qa[D / 16][4], da[D / 16][4];
  load_a_rows<D>(p.q, b, h, row0, p.T, qa);
  load_a_rows<D>(p.dout, b, h, row0, p.T, da);
  // The rows' lse and D = Σ dO·O: each lane sums its columns, the quad adds them up.
  float lse[2], dd[2];
  for (int r = 0; r < 2; ++r) {
    const int i = row0 + 8 * r;
    float x = 0.f;
    if (i < p.T) {
      const __nv_bfloat16 *o = p.out.at(b, i, h), *g = p.dout.at(b, i, h);
      const int cols[4] = {0, 1, 8, 9};  // this lane's columns of each 16 (the A fragments')
      for (int kk = 0; kk < D / 16; ++kk)
        for (int c = 0; c < 4; ++c) x += to_f(o[kk * 16 + 2 * t + cols[c]]) * to_f(g[kk * 16 + 2 * t + cols[c]]);
    }
    x = quad_sum(x);
    dd[r] = x;
    lse[r] = i < p.T ? p.lse[((int64_t)b * p.H + h) * p.T + i] : 0.f;
    if (t == 0 && i < p.T) p.dd[((int64_t)b * p.H + h) * p.T + i] = x;  // for band_bwd_dkdv
  }
  float dq[D / 8][4];
  for (int d = 0; d < D / 8; ++d)
    for (int e = 0; e < 4; ++e) dq[d][e] = 0.f;
  for (int it = 0; it < tiles; ++it) {
    const int n0 = n_first + it * kBandKeys;
    const __nv_bfloat16* ks = key_tile<D>(p.k, p.v, b, h, n_first, it, tiles, p.T, smem);
    const __nv_bfloat16* vs = ks + TILE;
    float s[NT][4], dp[NT][4];
    mma_a_xt<D>(s, qa, ks);   // S = Q·Kᵀ
    mma_a_xt<D>(dp, da, vs);  // dP = dO·Vᵀ
    for (int nt = 0; nt < NT; ++nt)
      for (int e = 0; e < 4; ++e) {
        const int r = e >= 2 ? 1 : 0, i = row0 + 8 * r, j = n0 + nt * 8 + 2 * t + (e & 1);
        const float pe = in_band(i, j, p.w, p.T) ? __expf(s[nt][e] * p.scale - lse[r]) : 0.f;
        dp[nt][e] = pe * (dp[nt][e] - dd[r]);
      }
    mma_p_x<__nv_bfloat16, kBandKeys, D>(dq, dp, ks);  // dQ += dS·K (scaled at the end)
    __syncthreads();  // this stage is read: the tile after next may be copied into it
  }
  store_rows<D>(dq, p.scale, &p.far_dq, p.w, p.dq, b, h, row0, p.T, p.H);
}

}  // namespace
