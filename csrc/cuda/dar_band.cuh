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
// memory; S = Q·Kᵀ on the tensor cores (mma m16n8k16, Q's fragments held in registers), masked to
// the band, an online softmax per row in fp32 (each row's 64 scores spread over the four lanes of a
// quad), P packed to bf16 as the A operand of O += P·V. Inputs [B, T, H, D] with any b / t / h
// strides and unit d stride, bf16, D ∈ {64, 128}.
//
// Right on the CPU (make cuda-emu-test against the band-and-merge definition in double); not yet
// run on a GPU nor called by the split-merge op: issue 35's next step.
#pragma once
#include "mma.cuh"
#include <cmath>
#include <cstdint>

namespace {

constexpr int kBandWarps = 4;
constexpr int kBandThreads = 32 * kBandWarps;
constexpr int kBandRows = 16 * kBandWarps;  // queries a block
constexpr int kBandKeys = 64;               // keys a tile

struct BandParams {
  const __nv_bfloat16* q;
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  int64_t q_sb, q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st, v_sh;
  // The distant part, rows i ≥ w as rows i − w: its output [B, T − w, H, D] and lse [B, H, T − w];
  // null for no merge (the band alone).
  const __nv_bfloat16* far;
  int64_t f_sb, f_st, f_sh;
  const float* far_lse;
  int64_t fl_sb, fl_sh;
  __nv_bfloat16* out;  // [B, T, H, D], strides o_*
  int64_t o_sb, o_st, o_sh;
  float* lse;  // [B, H, T] contiguous
  int T, H, w;
  float scale;
};

// Shared memory of one block: K and V tiles, each row padded by 8 values (bank spread).
__host__ __device__ inline int64_t band_smem_bytes(int D) { return 2 * (int64_t)kBandKeys * (D + 8) * 2; }

template <int D>
__global__ void __launch_bounds__(kBandThreads) band_merge_fwd(BandParams p) {
  ATTNLAB_DYNAMIC_SHARED(__nv_bfloat16, smem);
  constexpr int LD = D + 8, KS = D / 16, DT = D / 8, NT = kBandKeys / 8;
  __nv_bfloat16* ks = smem;
  __nv_bfloat16* vs = smem + kBandKeys * LD;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, group = lane / 4, t = lane % 4;
  const int b = blockIdx.y / p.H, h = blockIdx.y % p.H;
  const int q0 = blockIdx.x * kBandRows;
  const int row0 = q0 + warp * 16 + group;  // this lane's rows: row0 and row0 + 8
  const __nv_bfloat16* q = p.q + b * p.q_sb + h * p.q_sh;
  const __nv_bfloat16* kg = p.k + b * p.k_sb + h * p.k_sh;
  const __nv_bfloat16* vg = p.v + b * p.v_sb + h * p.v_sh;

  // Q's A fragments for every 16 columns of D, zero past T.
  uint32_t qa[KS][4];
  for (int kk = 0; kk < KS; ++kk)
    for (int r = 0; r < 4; ++r) {
      const int row = row0 + (r & 1 ? 8 : 0), col = kk * 16 + 2 * t + (r & 2 ? 8 : 0);
      qa[kk][r] = row < p.T ? load_pair(q + row * p.q_st + col) : 0u;
    }
  float o[DT][4];
  for (int d = 0; d < DT; ++d)
    for (int e = 0; e < 4; ++e) o[d][e] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  const int first = max(0, q0 - (p.w - 1)), last = min(p.T, q0 + kBandRows);  // keys the block's band touches
  for (int n0 = first - first % kBandKeys; n0 < last; n0 += kBandKeys) {
    __syncthreads();  // the previous tile is no longer read
    for (int i = tid; i < kBandKeys * D / 2; i += kBandThreads) {
      const int r = i / (D / 2), c = 2 * (i % (D / 2));
      const int j = n0 + r;
      uint32_t kx = 0u, vx = 0u;
      if (j < p.T) {
        kx = load_pair(kg + j * p.k_st + c);
        vx = load_pair(vg + j * p.v_st + c);
      }
      memcpy(ks + r * LD + c, &kx, 4);
      memcpy(vs + r * LD + c, &vx, 4);
    }
    __syncthreads();
    // S = Q·Kᵀ: 16 rows × 64 keys a warp, eight n-tiles of 8 keys.
    float s[NT][4];
    for (int nt = 0; nt < NT; ++nt) {
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
      for (int kk = 0; kk < KS; ++kk) {
        const __nv_bfloat16* kr = ks + (nt * 8 + group) * LD + kk * 16 + 2 * t;
        const uint32_t kb[2] = {load_pair(kr), load_pair(kr + 8)};
        mma_bf16_16816(s[nt], qa[kk], kb);
      }
    }
    // Band mask and the online softmax, per row (e < 2: row0, else row0 + 8).
    float mx[2] = {m[0], m[1]};
    for (int nt = 0; nt < NT; ++nt)
      for (int e = 0; e < 4; ++e) {
        const int i = row0 + (e >= 2 ? 8 : 0), j = n0 + nt * 8 + 2 * t + (e & 1);
        const bool in_band = j <= i && i - j < p.w && j < p.T && i < p.T;
        s[nt][e] = in_band ? s[nt][e] * p.scale : -INFINITY;
        mx[e / 2] = fmaxf(mx[e / 2], s[nt][e]);
      }
    float f[2];
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffff, mx[r], 2));
      f[r] = mx[r] == -INFINITY ? 1.f : __expf(m[r] - mx[r]);  // m = −inf: nothing yet (f·0)
      m[r] = mx[r];
      l[r] *= f[r];
    }
    for (int d = 0; d < DT; ++d)
      for (int e = 0; e < 4; ++e) o[d][e] *= f[e / 2];
    for (int nt = 0; nt < NT; ++nt)
      for (int e = 0; e < 4; ++e) {
        const float pe = s[nt][e] == -INFINITY ? 0.f : __expf(s[nt][e] - m[e / 2]);
        s[nt][e] = pe;
        l[e / 2] += pe;
      }
    // O += P·V: P's 16 × 64 as four A fragments of 16 keys; V's B fragments from shared memory.
    for (int kc = 0; kc < kBandKeys / 16; ++kc) {
      const uint32_t pa[4] = {pack_bf16(s[2 * kc][0], s[2 * kc][1]), pack_bf16(s[2 * kc][2], s[2 * kc][3]), pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                              pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3])};
      for (int d = 0; d < DT; ++d) {
        const __nv_bfloat16* vc = vs + (kc * 16 + 2 * t) * LD + d * 8 + group;
        const __nv_bfloat16 v0 = vc[0], v1 = vc[LD], v8 = vc[8 * LD], v9 = vc[9 * LD];
        const uint32_t vb[2] = {pack_bf16(to_f(v0), to_f(v1)), pack_bf16(to_f(v8), to_f(v9))};
        mma_bf16_16816(o[d], pa, vb);
      }
    }
  }
  // The rows' sums over the quad, the band's lse, and the merge with the distant part.
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffff, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffff, l[r], 2);
  }
  for (int r = 0; r < 2; ++r) {
    const int i = row0 + 8 * r;
    if (i >= p.T) continue;
    const float lse_band = m[r] + logf(l[r]);
    float a = 1.f / l[r], c = 0.f, lse = lse_band;
    const __nv_bfloat16* far = nullptr;
    if (p.far && i >= p.w) {
      const float lf = p.far_lse[b * p.fl_sb + h * p.fl_sh + (i - p.w)];
      const float top = fmaxf(lse_band, lf);
      lse = top + logf(__expf(lse_band - top) + __expf(lf - top));
      a = __expf(lse_band - lse) / l[r];
      c = __expf(lf - lse);
      far = p.far + b * p.f_sb + (int64_t)(i - p.w) * p.f_st + h * p.f_sh;
    }
    __nv_bfloat16* out = p.out + b * p.o_sb + (int64_t)i * p.o_st + h * p.o_sh;
    for (int d = 0; d < DT; ++d) {
      const int col = d * 8 + 2 * t;
      float x0 = o[d][2 * r] * a, x1 = o[d][2 * r + 1] * a;
      if (far) {
        x0 += c * to_f(far[col]);
        x1 += c * to_f(far[col + 1]);
      }
      out[col] = from_f<__nv_bfloat16>(x0);
      out[col + 1] = from_f<__nv_bfloat16>(x1);
    }
    if (t == 0) p.lse[((int64_t)b * p.H + h) * p.T + i] = lse;
  }
}

}  // namespace
