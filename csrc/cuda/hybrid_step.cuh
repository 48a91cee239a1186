// One decode step of the STILL / LoLCATs hybrid operator's mixing (issue 34: STILL / LoLCATs decode at
// vanilla's speed; `Hybrid::mix` over `Hybrid::step_at`'s blocks is the aten form, still.md §3 / §6):
// for the new token's query q (head h of row b), with m the max of the visible logits,
//   window slot s of the 2C-slot ring (the token at position pos − ((pos − s) mod 2C), visible iff
//   ≥ from = max(0, (⌊pos / C⌋ − 1)·C)) and selected slot j < n_sel: logit q·k / √D;
//   n_sm = γ_h·Σ e^{logit − m}·v,  z_sm = γ_h·Σ e^{logit − m}  (γ_h = 1 without γ);
//   n_lin = φ(q)·S (times the gate g), z_lin = φ(q)·z, both times e^{−m} when compensated, zero
//   without the linear branch;
//   y = (n_sm + n_lin) / (z_sm + z_lin + eps).
// One block per (b, h): the logits (a thread per slot) in shared memory, a block max and sum; then the
// block's threads split into G = ⌊threads / D⌋ groups of D, group g summing Σ e·v over every G-th slot and
// φ(q)·S over every G-th feature for its dims, and the groups' partial sums added. (A thread per output
// dim walking all 2C + cap slots, as this kernel first did, waits on a load per slot in turn: 512
// waits at still-budget's 384 + 128 slots, which made it slower than aten's ≈ 25 kernels.) φ(q)
// comes in computed, or is computed here from the query map's folded matrix (feature_map(): ≈ 18 aten
// kernels of STILL's NP-Map); the caches' writes stay where they are. The
// new token's routing score (self-saliency, a_tt or its logit) is computed from the same logits and
// written into the ring of scores, where `Hybrid::step_at` computed it by ≈ 20 more aten kernels.
//
// Device code only: csrc/cuda/emu runs it on the CPU in `make test`; csrc/cuda/hybrid_step.cu launches it.
#pragma once
#include "block.cuh"
#include "feature_map.cuh"
#include "half.cuh"
#include "score_kinds.cuh"
#include <cmath>
#include <cstdint>

namespace {

constexpr int kMixThreads = 256;

struct MixParams {
  const void* q;  // [B, H, 1, D]: strides q_sb, q_sh, unit d
  int64_t q_sb, q_sh;
  const float* phi;  // φ(q) [B, H, 1, F]: strides phi_sb, phi_sh, unit f; or null with fmap
  int64_t phi_sb, phi_sh;
  // Or φ(q) computed here (feature_map()): the query map's linear part W'_h [H, D, F/2] (fp32,
  // contiguous; STILL's Householder reflection folded in), with the norm re-injection or without.
  const float* fmap;
  int fmap_reinject;
  const void* wk;  // the window ring [B, H, 2C, D], strides w_sb, w_sh, w_ss, unit d
  const void* wv;
  int64_t w_sb, w_sh, w_ss;
  const void* sk;  // Sel [B, H, cap, D] (cap 0: none), strides s_sb, s_sh, s_ss, unit d
  const void* sv;
  int64_t s_sb, s_sh, s_ss;
  const int64_t* n_sel;  // [1]: Sel's filled slots
  const float* S;        // [B, H, F, D] contiguous
  const float* z;        // [B, H, F] contiguous
  const void* g;         // gate [B, H, 1, D] (strides g_sb, g_sh) or null
  int64_t g_sb, g_sh;
  const float* gamma;  // [H] or null
  const int64_t* pos;  // [1]: the new token's position
  int H, C, cap, D, F;
  float eps, scale;
  int linear, compensate;
  void* y;  // [B, H, 1, D] contiguous, q's dtype
  // The new token's routing score, written at its ring slot pos mod 2C of `score` [B, H, 2C] (fp32,
  // strides sc_sb, sc_sh, unit slot) when score_kind is not kScoreNone.
  float* score;
  int64_t sc_sb, sc_sh;
  int score_kind;
  // The new token's key and value [B, H, 1, D] (strides nk_sb, nk_sh and nv_sb, nv_sh, unit d), or
  // null: each block first writes its head's into the ring at slot pos mod 2C, where `Hybrid::step_at`
  // ran an index_copy for each before the step.
  const void* new_k;
  const void* new_v;
  int64_t nk_sb, nk_sh, nv_sb, nv_sh;
  // The gate handed over before its sigmoid (σ taken here: one aten kernel a layer fewer).
  int gate_sigmoid;
  // hybrid_mix_split only: slots a softmax block takes (`per`), its blocks a head (`slices`, then
  // one block for the linear branch where there is one), their partial results (`part` [B·H][slices]
  // [D + 2]: the slice's max, its sum of exponentials, its Σ e·v; `lin_out` [B·H][D + 1]: φ(q)·z,
  // then φ(q)·S times the gate), and one arrival counter a head (`arrived` [B·H], zero between
  // launches: the last block to arrive combines the others' results and sets it back to zero).
  int per, slices;
  float* part;
  float* lin_out;
  int* arrived;
  // Keys and values read 8 dims (16 bytes) at a time (`mix_vec_fits`; the launch's default where it
  // fits, ATTNLAB_HYBRID_VEC=0 turns it off): a key's logit in 8 loads in flight instead of 8 rounds of 8, and the weighted sums
  // (and φ(q)·S) by kMixThreads / (D / 8) groups of slots (features), 8 dims a thread.
  int vec;
};

// Whether the 16-byte path takes these buffers: D a multiple of 8 (and D / 8 ≤ the block), every row
// of the keys and values 16-byte aligned. Host code: the launches set `vec` by it.
inline bool mix_vec_fits(const MixParams& p) {
  auto aligned = [](const void* x) { return reinterpret_cast<uintptr_t>(x) % 16 == 0; };
  bool ok = p.D % 8 == 0 && p.D / 8 <= kMixThreads && aligned(p.wk) && aligned(p.wv);
  ok = ok && p.w_ss % 8 == 0 && p.w_sh % 8 == 0 && p.w_sb % 8 == 0;
  if (p.cap) ok = ok && aligned(p.sk) && aligned(p.sv) && p.s_ss % 8 == 0 && p.s_sh % 8 == 0 && p.s_sb % 8 == 0;
  return ok;
}

// The new token's routing score (score_kind) from the logits e[] of the ring's 2C slots (every slot of
// W visible, so finite), written by thread 0. Block-wide: every thread calls it.
__device__ __forceinline__ void routing_score(const MixParams& p, const float* e, int64_t pos, int b, int h, float* red) {
  const int W2 = 2 * p.C, self = (int)(pos % W2);
  const int64_t first = max((int64_t)0, pos - p.C + 1);
  auto recent = [&](int i) { return slot_position(pos, i, W2) >= first; };
  float ma = -INFINITY, mb = -INFINITY;
  for (int i = threadIdx.x; i < W2; i += kMixThreads)
    if (recent(i)) {
      ma = fmaxf(ma, e[i]);
      if (i != self) mb = fmaxf(mb, e[i]);
    }
  ma = block_reduce<kMixThreads, true>(ma, red);
  mb = block_reduce<kMixThreads, true>(mb, red);
  float sa = 0.f, sb = 0.f;
  for (int i = threadIdx.x; i < W2; i += kMixThreads)
    if (recent(i)) {
      sa += expf(e[i] - ma);
      if (i != self) sb += expf(e[i] - mb);
    }
  sa = block_reduce<kMixThreads, false>(sa, red);
  sb = block_reduce<kMixThreads, false>(sb, red);
  float sc = p.score_kind == kScoreSelfLogit ? e[self] : expf(e[self] - ma) / sa;
  if (p.score_kind == kScoreSelfSaliency) {
    float part = 0.f;
    for (int i = threadIdx.x; i < W2; i += kMixThreads)
      if (recent(i)) {
        const float a = expf(e[i] - ma) / sa, bq = i != self && sb > 0.f ? expf(e[i] - mb) / sb : 0.f;
        part += a * logf((a + kScoreEps) / (bq + kScoreEps));
      }
    sc = block_reduce<kMixThreads, false>(part, red);
  }
  if (threadIdx.x == 0) p.score[b * p.sc_sb + h * p.sc_sh + self] = sc;
  __syncthreads();  // every read of e[] done before the caller overwrites it with the weights
}

// φ(q) from u = qr·W'_h already in phi[0, F/2) (f2 = this thread's share of ‖u‖², over the f it
// wrote): clamp_min([softmax(u) ⊕ softmax(−u)], 1e-12), u first rescaled to ‖qr‖ with the norm
// re-injection (feature_maps.rs). Block-wide.
__device__ __forceinline__ void feature_softmax(const MixParams& p, const float* qr, float* phi, float f2, float* red) {
  const int Fh = p.F / 2;
  float x2 = 0.f;
  for (int d = threadIdx.x; d < p.D; d += kMixThreads) x2 += qr[d] * qr[d];
  float scale = 1.f;
  if (p.fmap_reinject) {
    f2 = block_reduce<kMixThreads, false>(f2, red);
    x2 = block_reduce<kMixThreads, false>(x2, red);
    scale = sqrtf(x2) / fmaxf(sqrtf(f2), 1e-12f);
  }
  // Each thread reads back only the u it wrote, until the reductions' barriers.
  float mp = -INFINITY, mn = -INFINITY;
  for (int f = threadIdx.x; f < Fh; f += kMixThreads) mp = fmaxf(mp, phi[f] * scale), mn = fmaxf(mn, -phi[f] * scale);
  mp = block_reduce<kMixThreads, true>(mp, red);
  mn = block_reduce<kMixThreads, true>(mn, red);
  float sp = 0.f, sn = 0.f;
  for (int f = threadIdx.x; f < Fh; f += kMixThreads) sp += expf(phi[f] * scale - mp), sn += expf(-phi[f] * scale - mn);
  sp = block_reduce<kMixThreads, false>(sp, red);
  sn = block_reduce<kMixThreads, false>(sn, red);
  for (int f = threadIdx.x; f < Fh; f += kMixThreads) {
    const float u = phi[f] * scale;
    phi[f] = fmaxf(expf(u - mp) / sp, 1e-12f);
    phi[Fh + f] = fmaxf(expf(-u - mn) / sn, 1e-12f);
  }
  __syncthreads();  // φ complete before any thread reads it
}

// φ(q) = clamp_min([softmax(u) ⊕ softmax(−u)], 1e-12) of the raw query qr[D] into phi[F] (feature_maps.rs):
// f = qr·W'_h, u = f / max(‖f‖, 1e-12)·‖qr‖ with the re-injection, else u = f. Block-wide.
__device__ __forceinline__ void feature_map(const MixParams& p, const float* qr, int h, float* phi, float* red) {
  const int Fh = p.F / 2;
  const float* W = p.fmap + (int64_t)h * p.D * Fh;
  float f2 = 0.f;
  for (int f = threadIdx.x; f < Fh; f += kMixThreads) {
    float u = 0.f;
#pragma unroll 8
    for (int d = 0; d < p.D; ++d) u += qr[d] * W[(int64_t)d * Fh + f];
    phi[f] = u;
    f2 += u * u;
  }
  feature_softmax(p, qr, phi, f2, red);
}

// Groups of threads hybrid_mix_split's linear block splits qr·W' over (its dims d), and the floats of
// shared memory their partial products take.
__host__ __device__ inline int fmap_groups(int F) {
  const int Fh = F / 2 > 0 ? F / 2 : 1;
  return kMixThreads / Fh > 1 ? kMixThreads / Fh : 1;
}
__host__ __device__ inline int64_t fmap_scratch_floats(int F) { return (int64_t)(F / 2) * fmap_groups(F); }

// feature_map with its product split over fmap_groups(F) groups of dims (`scratch`: fmap_scratch_floats),
// so that a thread's loads of W' are about D / groups, all in flight, not D in rounds of 8; and its
// norms and softmaxes by warp 0 alone, by shuffles (two block barriers in all, where feature_softmax
// takes up to twelve). Block-wide.
__device__ __forceinline__ void feature_map_split(const MixParams& p, const float* qr, int h, float* phi, float* scratch) {
  const int Fh = p.F / 2, DG = fmap_groups(p.F), per_d = (p.D + DG - 1) / DG;
  const float* W = p.fmap + (int64_t)h * p.D * Fh;
  for (int t = threadIdx.x; t < Fh * DG; t += kMixThreads) {
    const int f = t % Fh, d0 = (t / Fh) * per_d, d1 = min(p.D, d0 + per_d);
    float u = 0.f;
#pragma unroll 16
    for (int d = d0; d < d1; ++d) u += qr[d] * W[(int64_t)d * Fh + f];
    scratch[t] = u;
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    // Each lane reads back only the u it wrote.
    float f2 = 0.f, x2 = 0.f;
    for (int f = lane; f < Fh; f += 32) {
      float u = 0.f;
      for (int g = 0; g < DG; ++g) u += scratch[g * Fh + f];
      phi[f] = u;
      f2 += u * u;
    }
    for (int d = lane; d < p.D; d += 32) x2 += qr[d] * qr[d];
    const float scale = p.fmap_reinject ? sqrtf(warp_sum(x2)) / fmaxf(sqrtf(warp_sum(f2)), 1e-12f) : 1.f;
    feature_softmax_warp(phi, Fh, scale);
  }
  __syncthreads();  // φ complete before any thread reads it
}

// q·k (q already scaled) of one key row.
template <typename T>
__device__ __forceinline__ float mix_logit(const MixParams& p, const float* qs, const T* k) {
  float s = 0.f;
  if (p.vec) {
    const Pack8* kp = reinterpret_cast<const Pack8*>(k);
#pragma unroll 8
    for (int c = 0; c < p.D / 8; ++c) {
      const Pack8 pk = kp[c];
#pragma unroll
      for (int j = 0; j < 8; ++j) s += qs[8 * c + j] * pack_at<T>(pk, j);
    }
  } else {
#pragma unroll 8
    for (int d = 0; d < p.D; ++d) s += qs[d] * to_f(k[d]);
  }
  return s;
}

// Slot i's row of head (b, h): the window ring's (win) for i < 2C, else Sel's (sel).
template <typename T>
__device__ __forceinline__ const T* mix_row(const MixParams& p, const void* win, const void* sel, int b, int h, int i) {
  const int W2 = 2 * p.C;
  if (i < W2) return static_cast<const T*>(win) + b * p.w_sb + h * p.w_sh + (int64_t)i * p.w_ss;
  return static_cast<const T*>(sel) + b * p.s_sb + h * p.s_sh + (int64_t)(i - W2) * p.s_ss;
}

// The gate's value of one dim: σ of what came in where it came in before its sigmoid.
template <typename T>
__device__ __forceinline__ float gate_value(const MixParams& p, T g) {
  const float x = to_f(g);
  return p.gate_sigmoid ? 1.f / (1.f + __expf(-x)) : x;
}

template <typename T>
__global__ void __launch_bounds__(kMixThreads) hybrid_mix(MixParams p) {
  ATTNLAB_DYNAMIC_SHARED(float, sh);
  const int W2 = 2 * p.C, n = W2 + p.cap;
  float* qs = sh;           // [D]
  float* phi = qs + p.D;    // [F]
  float* e = phi + p.F;     // [2C + cap]: logits, then their exponentials
  float* red = e + n;       // [kMixThreads / 32]
  const int b = blockIdx.x / p.H, h = blockIdx.x % p.H;
  if (p.new_k) {
    // Only this block reads its head's ring; the barrier makes the writes visible to its threads.
    const int64_t slot = *p.pos % W2;
    T* rk = static_cast<T*>(const_cast<void*>(p.wk)) + b * p.w_sb + h * p.w_sh + slot * p.w_ss;
    T* rv = static_cast<T*>(const_cast<void*>(p.wv)) + b * p.w_sb + h * p.w_sh + slot * p.w_ss;
    const T* nk = static_cast<const T*>(p.new_k) + b * p.nk_sb + h * p.nk_sh;
    const T* nv = static_cast<const T*>(p.new_v) + b * p.nv_sb + h * p.nv_sh;
    for (int d = threadIdx.x; d < p.D; d += kMixThreads) rk[d] = nk[d], rv[d] = nv[d];
    __syncthreads();
  }
  const T* q = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh;
  for (int d = threadIdx.x; d < p.D; d += kMixThreads) qs[d] = to_f(q[d]) * p.scale;
  if (p.fmap) {
    float* qr = red + kMixThreads / 32;  // [D], free until the groups' partial sums
    for (int d = threadIdx.x; d < p.D; d += kMixThreads) qr[d] = to_f(q[d]);
    __syncthreads();
    feature_map(p, qr, h, phi, red);
  } else {
    for (int f = threadIdx.x; f < p.F; f += kMixThreads) phi[f] = p.phi[b * p.phi_sb + h * p.phi_sh + f];
    __syncthreads();
  }
  const int64_t pos = *p.pos, from = max((int64_t)0, (pos / p.C - 1) * p.C), n_sel = p.cap ? *p.n_sel : 0;
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < n; i += kMixThreads) {
    const bool vis = i < W2 ? slot_position(pos, i, W2) >= from : i - W2 < n_sel;
    const float s = vis ? mix_logit<T>(p, qs, mix_row<T>(p, p.wk, p.sk, b, h, i)) : -INFINITY;
    e[i] = s;
    mx = fmaxf(mx, s);
  }
  const float m = block_reduce<kMixThreads, true>(mx, red);  // its barriers also publish e[]
  if (p.score_kind != kScoreNone) routing_score(p, e, pos, b, h, red);
  float part = 0.f;
  for (int i = threadIdx.x; i < n; i += kMixThreads) {
    const float x = e[i] == -INFINITY ? 0.f : __expf(e[i] - m);
    e[i] = x;
    part += x;
  }
  const float gam = p.gamma ? p.gamma[h] : 1.f;
  const float z_sm = block_reduce<kMixThreads, false>(part, red) * gam;  // its barriers also publish e[]
  float z_part = 0.f;
  const float* z = p.z + ((int64_t)b * p.H + h) * p.F;
  if (p.linear)
    for (int f = threadIdx.x; f < p.F; f += kMixThreads) z_part += phi[f] * z[f];
  const float z_lin = block_reduce<kMixThreads, false>(z_part, red);
  const float lin_scale = p.linear ? (p.compensate ? __expf(-m) : 1.f) : 0.f;
  const float den = z_sm + z_lin * lin_scale + p.eps;
  const float* S = p.S + ((int64_t)b * p.H + h) * p.F * p.D;
  const T* wv = static_cast<const T*>(p.wv) + b * p.w_sb + h * p.w_sh;
  const T* sv = p.cap ? static_cast<const T*>(p.sv) + b * p.s_sb + h * p.s_sh : nullptr;
  // Thread t < G·D: group t / D, dim t % D (with D wider than the block, G = 1 and a thread takes
  // every kMixThreads-th dim). A masked slot's weight is 0: its value is read (the buffers hold
  // every slot) and not added, so stale memory cannot turn into NaN. The 16-byte path: thread
  // t < G·(D / 8) sums 8 dims (chunk t mod D/8) over every G-th slot and feature, G = kMixThreads / (D / 8).
  const int G = p.vec ? kMixThreads / (p.D / 8) : max(1, kMixThreads / p.D);
  float* num_part = red + kMixThreads / 32;  // [G·D]
  float* lin_part = num_part + G * p.D;      // [G·D]
  if (p.vec) {
    const int chunks = p.D / 8;
    for (int t = threadIdx.x; t < G * chunks; t += kMixThreads) {
      const int g = t / chunks, c = t % chunks;
      float num[8] = {}, lin[8] = {};
#pragma unroll 4
      for (int i = g; i < W2; i += G) {
        const float x = e[i];
        if (x == 0.f) continue;
        const Pack8 pv = *reinterpret_cast<const Pack8*>(wv + (int64_t)i * p.w_ss + 8 * c);
#pragma unroll
        for (int j = 0; j < 8; ++j) num[j] += x * pack_at<T>(pv, j);
      }
#pragma unroll 4
      for (int i = W2 + g; i < n; i += G) {
        const float x = e[i];
        if (x == 0.f) continue;
        const Pack8 pv = *reinterpret_cast<const Pack8*>(sv + (int64_t)(i - W2) * p.s_ss + 8 * c);
#pragma unroll
        for (int j = 0; j < 8; ++j) num[j] += x * pack_at<T>(pv, j);
      }
      if (p.linear) {
#pragma unroll 4
        for (int f = g; f < p.F; f += G) {
          const float ph = phi[f];
          const float* row = S + (int64_t)f * p.D + 8 * c;
#pragma unroll
          for (int j = 0; j < 8; ++j) lin[j] += ph * row[j];
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        num_part[g * p.D + 8 * c + j] = num[j];
        lin_part[g * p.D + 8 * c + j] = lin[j];
      }
    }
  }
  for (int t = threadIdx.x; !p.vec && t < G * p.D; t += kMixThreads) {
    const int g = t / p.D, d = t % p.D;
    float num = 0.f;
#pragma unroll 4
    for (int i = g; i < W2; i += G) {
      const float x = e[i], v = to_f(wv[(int64_t)i * p.w_ss + d]);
      num += x != 0.f ? x * v : 0.f;
    }
#pragma unroll 4
    for (int i = W2 + g; i < n; i += G) {
      const float x = e[i], v = to_f(sv[(int64_t)(i - W2) * p.s_ss + d]);
      num += x != 0.f ? x * v : 0.f;
    }
    float lin = 0.f;
    if (p.linear) {
#pragma unroll 4
      for (int f = g; f < p.F; f += G) lin += phi[f] * S[(int64_t)f * p.D + d];
    }
    num_part[t] = num;
    lin_part[t] = lin;
  }
  __syncthreads();
  const T* gate = p.g ? static_cast<const T*>(p.g) + b * p.g_sb + h * p.g_sh : nullptr;
  T* y = static_cast<T*>(p.y) + ((int64_t)b * p.H + h) * p.D;
  for (int d = threadIdx.x; d < p.D; d += kMixThreads) {
    float num = 0.f, lin = 0.f;
    for (int g = 0; g < G; ++g) num += num_part[g * p.D + d], lin += lin_part[g * p.D + d];
    if (gate) lin *= gate_value(p, gate[d]);
    y[d] = from_f<T>((num * gam + lin * lin_scale) / den);
  }
}

// Shared memory of one block: q, φ(q), the weights, the reduction's partials, then the groups' partial
// numerators and linear terms (G·D each: at most max(kMixThreads, D), or 8·kMixThreads on the 16-byte
// path), where the raw q sits while φ(q) is computed.
__host__ __device__ inline int64_t mix_smem_floats(int D, int F, int C, int cap, bool vec) {
  const int G = vec ? kMixThreads / (D / 8) : (kMixThreads / D > 1 ? kMixThreads / D : 1);
  const int64_t gd = (int64_t)G * D;  // ≥ D: room for the raw q first
  return (int64_t)D + F + 2 * C + cap + kMixThreads / 32 + 2 * gd;
}

// ---- The mix split over blocks (hybrid_mix_split: the launch's choice where the caller hands the
// arrival counters; hybrid_mix above is one block a head) ----
// Block (r, b·H + h) for r < slices: slice r's slots, their logits, max m_r, l_r = Σ e^{logit − m_r}
// and num_r = Σ e^{logit − m_r}·v; with a routing score, slice 0 is the whole window ring (the score
// reads every recent logit; it is computed there as hybrid_mix does) and the others split Sel. Block
// r = slices (with the linear branch): φ(q), φ(q)·z and φ(q)·S times the gate. Each block counts
// itself in; the head's last to arrive merges, M = max m_r, weights e^{m_r − M}:
//   y = (γ·Σ w_r·num_r + lin·s) / (γ·Σ w_r·l_r + z_lin·s + eps),  s = e^{−M} (compensated) or 1,
// the formula of hybrid_mix with the sums taken in parts. One block a head waits on its slots and
// φ(q) in turn (≈ 22 µs a layer at STILL's budget shape on one H100); here they are 1 + ⌈slots /
// per⌉ blocks at once.

// Slice r's slots [begin, end) of the n = 2C + cap; `whole_window`: slice 0 is the ring's 2C.
struct MixSlice {
  int begin, end;
};
__host__ __device__ inline MixSlice mix_slice(int r, int W2, int n, int per, bool whole_window) {
  const int b = whole_window ? (r == 0 ? 0 : W2 + (r - 1) * per) : r * per;
  const int e = whole_window && r == 0 ? W2 : b + per;
  return {b, e < n ? e : n};
}
__host__ __device__ inline int mix_slices(int W2, int n, int per, bool whole_window) {
  return whole_window ? 1 + (n - W2 + per - 1) / per : (n + per - 1) / per;
}
__host__ __device__ inline int mix_widest_slice(int W2, int per, bool whole_window) { return whole_window && W2 > per ? W2 : per; }

// Groups of slots (softmax blocks) or of features (the linear block) a block's threads split into:
// kMixThreads / (D / 8) of 8 dims a thread on the 16-byte path, else ⌊kMixThreads / D⌋ (at least 1)
// of one dim a thread.
__host__ __device__ inline int mix_groups(int D, bool vec) { return vec ? kMixThreads / (D / 8) : (kMixThreads / D > 1 ? kMixThreads / D : 1); }

// Shared memory of one hybrid_mix_split block, in floats: the larger of a softmax block's (q, the
// slice's logits and weights, the reduction's partials, the groups' Σ e·v) and the linear block's (φ(q), the raw
// q, the partials, the product's scratch, the groups' φ·S).
__host__ __device__ inline int64_t mix_split_smem_floats(int D, int F, int C, int per, bool whole_window, bool vec) {
  const int64_t gd = (int64_t)mix_groups(D, vec) * D;
  const int64_t softmax = D + mix_widest_slice(2 * C, per, whole_window) + kMixThreads / 32 + gd;
  const int64_t linear = F + D + kMixThreads / 32 + fmap_scratch_floats(F) + (int64_t)mix_groups(D, D % 8 == 0 && D / 8 <= kMixThreads) * D;
  return softmax > linear ? softmax : linear;
}

// 8 consecutive values of a row as floats: one 16-byte load of 16-bit ones, or 8 floats.
template <typename T>
__device__ __forceinline__ void load8(const T* r, float* x) {
  const Pack8 pv = *reinterpret_cast<const Pack8*>(r);
#pragma unroll
  for (int k = 0; k < 8; ++k) x[k] = pack_at<T>(pv, k);
}
__device__ __forceinline__ void load8(const float* r, float* x) {
#pragma unroll
  for (int k = 0; k < 8; ++k) x[k] = r[k];
}
__device__ __forceinline__ float as_f(float x) { return x; }
template <typename T>
__device__ __forceinline__ float as_f(T x) { return to_f(x); }

// Σ_i weight[i]·row(i)[d] over i < n by the block's mix_groups(D, wide) groups of threads (group g
// every G-th i; 8 dims a thread where `wide`, else one), into out[g·D + d]: the caller adds the groups
// after a barrier. A weight of 0 reads nothing.
template <typename RowFn>
__device__ __forceinline__ void grouped_sums(int n, int D, bool wide, const float* weight, RowFn row, float* out) {
  const int G = mix_groups(D, wide);
  if (wide) {
    const int chunks = D / 8;
    for (int t = threadIdx.x; t < G * chunks; t += kMixThreads) {
      const int g = t / chunks, c = t % chunks;
      float acc[8] = {};
#pragma unroll 4
      for (int i = g; i < n; i += G) {
        const float x = weight[i];
        if (x == 0.f) continue;
        float v[8];
        load8(row(i) + 8 * c, v);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] += x * v[k];
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) out[g * D + 8 * c + k] = acc[k];
    }
  } else {
    for (int t = threadIdx.x; t < G * D; t += kMixThreads) {
      const int g = t / D, d = t % D;
      float acc = 0.f;
#pragma unroll 4
      for (int i = g; i < n; i += G) {
        const float x = weight[i];
        if (x != 0.f) acc += x * as_f(row(i)[d]);
      }
      out[t] = acc;
    }
  }
}

// A softmax block: slice r's (m_r, l_r, num_r) into p.part.
template <typename T>
__device__ __forceinline__ void mix_slice_block(const MixParams& p, int b, int h, int r, float* sh) {
  const int W2 = 2 * p.C, n = W2 + p.cap;
  const bool whole = p.score_kind != kScoreNone;
  const MixSlice sl = mix_slice(r, W2, n, p.per, whole);
  const int len = sl.end - sl.begin;
  const int widest = mix_widest_slice(W2, p.per, whole);
  float* qs = sh;                            // [D]
  float* e = qs + p.D;                       // [widest slice]: logits, then their exponentials
  float* red = e + widest;                   // [kMixThreads / 32]
  float* num_part = red + kMixThreads / 32;  // [G·D]
  const int64_t pos = *p.pos;
  if (p.new_k) {
    // Only the block whose slice holds the new token's slot reads it.
    const int slot = (int)(pos % W2);
    if (slot >= sl.begin && slot < sl.end) {
      T* rk = static_cast<T*>(const_cast<void*>(p.wk)) + b * p.w_sb + h * p.w_sh + slot * p.w_ss;
      T* rv = static_cast<T*>(const_cast<void*>(p.wv)) + b * p.w_sb + h * p.w_sh + slot * p.w_ss;
      const T* nk = static_cast<const T*>(p.new_k) + b * p.nk_sb + h * p.nk_sh;
      const T* nv = static_cast<const T*>(p.new_v) + b * p.nv_sb + h * p.nv_sh;
      for (int d = threadIdx.x; d < p.D; d += kMixThreads) rk[d] = nk[d], rv[d] = nv[d];
    }
  }
  const T* q = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh;
  for (int d = threadIdx.x; d < p.D; d += kMixThreads) qs[d] = to_f(q[d]) * p.scale;
  __syncthreads();  // q and the new rows visible to every thread of the block
  const int64_t from = max((int64_t)0, (pos / p.C - 1) * p.C), n_sel = p.cap ? *p.n_sel : 0;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < len; j += kMixThreads) {
    const int i = sl.begin + j;
    const bool vis = i < W2 ? slot_position(pos, i, W2) >= from : i - W2 < n_sel;
    const float s = vis ? mix_logit<T>(p, qs, mix_row<T>(p, p.wk, p.sk, b, h, i)) : -INFINITY;
    e[j] = s;
    mx = fmaxf(mx, s);
  }
  const float m = block_reduce<kMixThreads, true>(mx, red);  // its barriers also publish e[]
  // The whole block scores the new token (one warp alone was 3–7% slower for STILL's decode on one
  // H100: BENCHMARKS.md, kernelsab); routing_score's last barrier guards e[] for the weights below.
  if (whole && r == 0) routing_score(p, e, pos, b, h, red);
  float part = 0.f;
  for (int j = threadIdx.x; j < len; j += kMixThreads) {
    const float x = e[j] == -INFINITY ? 0.f : __expf(e[j] - m);
    e[j] = x;
    part += x;
  }
  const float l = block_reduce<kMixThreads, false>(part, red);  // its barriers also publish e[]
  // Σ e·v by groups of slots as hybrid_mix's; a weight of 0 (a masked slot) reads nothing.
  const int G = mix_groups(p.D, p.vec);
  grouped_sums(
      len, p.D, p.vec, e, [&](int j) { return mix_row<T>(p, p.wv, p.sv, b, h, sl.begin + j); }, num_part);
  __syncthreads();
  float* out = p.part + ((int64_t)(b * p.H + h) * p.slices + r) * (p.D + 2);
  for (int d = threadIdx.x; d < p.D; d += kMixThreads) {
    float num = 0.f;
    for (int g = 0; g < G; ++g) num += num_part[g * p.D + d];
    out[2 + d] = num;
  }
  if (threadIdx.x == 0) out[0] = m, out[1] = l;
}

// The linear block: φ(q)·z and φ(q)·S times the gate into p.lin_out.
template <typename T>
__device__ __forceinline__ void mix_linear_block(const MixParams& p, int b, int h, float* sh) {
  float* phi = sh;                                 // [F]
  float* qr = phi + p.F;                           // [D]
  float* red = qr + p.D;                           // [kMixThreads / 32]
  float* scratch = red + kMixThreads / 32;         // [fmap_scratch_floats(F)]
  float* lin_part = scratch + fmap_scratch_floats(p.F);  // [G·D]
  if (p.fmap) {
    const T* q = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh;
    for (int d = threadIdx.x; d < p.D; d += kMixThreads) qr[d] = to_f(q[d]);
    __syncthreads();
    feature_map_split(p, qr, h, phi, scratch);
  } else {
    for (int f = threadIdx.x; f < p.F; f += kMixThreads) phi[f] = p.phi[b * p.phi_sb + h * p.phi_sh + f];
    __syncthreads();
  }
  const int64_t bh = (int64_t)b * p.H + h;
  const float* z = p.z + bh * p.F;
  float z_part = 0.f;
  for (int f = threadIdx.x; f < p.F; f += kMixThreads) z_part += phi[f] * z[f];
  const float z_lin = block_reduce<kMixThreads, false>(z_part, red);
  const float* S = p.S + bh * p.F * p.D;
  const bool wide = p.D % 8 == 0 && p.D / 8 <= kMixThreads;
  const int G = mix_groups(p.D, wide);
  grouped_sums(
      p.F, p.D, wide, phi, [&](int f) { return S + (int64_t)f * p.D; }, lin_part);
  __syncthreads();
  const T* gate = p.g ? static_cast<const T*>(p.g) + b * p.g_sb + h * p.g_sh : nullptr;
  float* out = p.lin_out + bh * (p.D + 1);
  for (int d = threadIdx.x; d < p.D; d += kMixThreads) {
    float lin = 0.f;
    for (int g = 0; g < G; ++g) lin += lin_part[g * p.D + d];
    out[1 + d] = gate ? lin * gate_value(p, gate[d]) : lin;
  }
  if (threadIdx.x == 0) out[0] = z_lin;
}

template <typename T>
__global__ void __launch_bounds__(kMixThreads) hybrid_mix_split(MixParams p) {
  ATTNLAB_DYNAMIC_SHARED(float, sh);
  __shared__ int merges;
  const int bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
  if ((int)blockIdx.x < p.slices) mix_slice_block<T>(p, b, h, blockIdx.x, sh);
  else mix_linear_block<T>(p, b, h, sh);
  // Count in, once every thread's results are visible device-wide; the head's last block merges.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) merges = atomicAdd(p.arrived + bh, 1) == p.slices + p.linear - 1;
  __syncthreads();
  if (!merges) return;
  __threadfence();
  // The others' results through L2 (__ldcg): this multiprocessor's L1 may hold none of them fresh.
  const float* part = p.part + (int64_t)bh * p.slices * (p.D + 2);
  const int stride = p.D + 2;
  float M = -INFINITY;
  for (int r = 0; r < p.slices; ++r) M = fmaxf(M, __ldcg(part + r * stride));
  auto weight = [&](int r) {
    const float mr = __ldcg(part + r * stride);
    return mr == -INFINITY ? 0.f : __expf(mr - M);
  };
  float z_sm = 0.f;
  for (int r = 0; r < p.slices; ++r) z_sm += weight(r) * __ldcg(part + r * stride + 1);
  const float gam = p.gamma ? p.gamma[h] : 1.f;
  const float lin_scale = p.linear ? (p.compensate ? __expf(-M) : 1.f) : 0.f;
  const float* lin = p.lin_out + (int64_t)bh * (p.D + 1);
  const float z_lin = p.linear ? __ldcg(lin) : 0.f;
  const float den = z_sm * gam + z_lin * lin_scale + p.eps;
  T* y = static_cast<T*>(p.y) + (int64_t)bh * p.D;
  for (int d = threadIdx.x; d < p.D; d += kMixThreads) {
    float num = 0.f;
    for (int r = 0; r < p.slices; ++r) num += weight(r) * __ldcg(part + r * stride + 2 + d);
    y[d] = from_f<T>((num * gam + (p.linear ? __ldcg(lin + 1 + d) * lin_scale : 0.f)) / den);
  }
  if (threadIdx.x == 0) p.arrived[bh] = 0;  // for the next launch
}

}  // namespace
