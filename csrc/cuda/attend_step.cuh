// A one-token decode step as two kernels (issue 34 items 2-3): the new query attends full-width
// cached keys / values (vanilla's whole cache, or the window's / DAR's ring of recent ones) and, for
// DAR / uniform, the latents of every distant token, in one softmax, the latents read through the
// absorbed k / v map (dar.md §3; `dar::read_latents` and `cache::attend_newest` are the aten forms).
//
// Per query head h (of kv head k = h / g) at the step's position p:
//   distant slot s (visible iff p − s ≥ w and s ≥ pad[b]):
//     score = scale · (qw_h · c_s + β_h + q_rot,h · RoPE_s(kr_s + bk_rot)),
//     qw_h = q_h[rot:] · Wk[k][rot:, :] (the unrotated dims folded into latent space), β_h = q_h[rot:] · bk[rot:],
//     kr_s = Wk[k][:rot, :] · c_s (one cuBLAS matmul before the kernel: tensor cores, every slot;
//     or, ATTNLAB_STEP_ROPE=absorbed, no kr: the rotated dims through per-pair query vectors, rope_terms);
//   full-width slot j: score = scale · q_h · k_j, visible iff the position it holds (j itself, or for
//   a ring of `keep` slots p − ((p − j) mod keep)) is in [pad[b], p].
// With latents, step_qw first computes qw and β of every head once a step (fp32). The partial
// kernel: one block per (row b, kv head, chunk of slots, distant or full-width); four warps each
// take every fourth slot with an online softmax, then merge. It writes (max, sum) and Σ p·c_s
// (distant, r wide) or Σ p·v_j (full width, hd wide), unnormalised.
// Or, from 8,192 latent slots on (attend_step.cu: kMmaFromSlots; ATTNLAB_STEP_MMA=1 / 0: always /
// never; MLA-style: a latent is shared by every head of the layer), the distant
// chunks by step_latent_mma and only the full-width ones by step_partial (from chunk0 = nchunks on):
// one block per (chunk, b, 16 query heads) reads each latent of its chunk once for all its heads.
// Its four warps take 16-slot tiles in turn (a tile in shared memory by 16-byte loads, read back
// by ldmatrix): the scores S[heads, slots] = QW·Cᵀ on the tensor cores (mma m16n8k16, fp32
// accumulate; QW as 16-bit hi + lo, two mmas, 4–5× closer than hi alone), β and the rotated dims
// from kr added per (head, slot) by FMAs, an online softmax per head row, P in 16 bits and
// O[heads, r] += P·C by mma. Writes the same ml / acc as step_partial's latent chunks, so the
// combine kernel is unchanged. Taken for r in
// latent_mma_kernel's list (multiples of 16 up to 256) with 16-byte aligned latent rows; bf16 by the
// bf16 mma, fp16 by the f16 one; any H (above 16, a block per 16 heads, each re-reading the chunk).
// The combine kernel merges the chunks: pc_h = Σ p·c / L and extra_h = (Σ p_far / L)·bv + Σ p·v / L,
// and the output is pc · Wvᵀ + extra (one batched matmul after it; extra alone without latents; in
// the combine kernel itself with ATTNLAB_STEP_ROPE=absorbed). Nothing is read back to the host, and
// every shape depends on the span alone, so a CUDA graph captures it.
//
// Device code only (no ATen, no launches): csrc/cuda/emu runs it on the CPU in `make test`;
// csrc/cuda/attend_step.cu launches it.
#pragma once
#include "block.cuh"
#include "mma.cuh"
#include <cmath>
#include <cstdint>

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// Head h's partial softmaxes of the block's warps merged (wm [kWarps][heads]: each warp's running
// max): M = max over the warps, returned Σ_w e^{m_w − M}·x[w·x_stride] over the warps that saw a
// slot (0, and M = −inf, when none did).
__device__ __forceinline__ float merge_warps(const float* wm, int heads, int h, const float* x, int x_stride, float& M) {
  M = -INFINITY;
  for (int w = 0; w < kWarps; ++w) M = fmaxf(M, wm[w * heads + h]);
  float sum = 0.f;
  if (M != -INFINITY) {
    for (int w = 0; w < kWarps; ++w) {
      const float mw = wm[w * heads + h];
      if (mw != -INFINITY) sum += __expf(mw - M) * x[w * x_stride];
    }
  }
  return sum;
}

struct Params {
  // q [B, H, hd]: strides of b and h, unit d stride.
  const void* q;
  int64_t q_sb, q_sh;
  // Latents [B, S, r] and their rotated keys kr [B, S, Hkv·rot]: unit last stride.
  const void* c;
  int64_t c_sb, c_ss;
  const void* kr;
  int64_t kr_sb, kr_ss;
  const void* wk;  // [Hkv, hd, r] contiguous
  const void* bk;  // [Hkv, hd] contiguous, or null
  const float* cos;  // [S, rot/2], row stride cs_s, unit column stride
  const float* sin;
  int64_t cs_s;
  const int64_t* pos;  // [1]: the new token's position
  const int64_t* pad;  // [B] left padding, or null
  int64_t window;
  // Full-width keys / values [B, Hkv, W, hd] (unit d stride): slot j holds position j (keep 0) or
  // is a ring of `keep` slots.
  const void* rk;
  const void* rv;
  int64_t r_sb, r_sh, r_ss, keep;
  int W;
  int vec;  // full-width rows read as 16-byte packs (hd in {32, 64, 128, 256}, aligned)
  int batched;  // latents four slots per warp at a time (else one: ATTNLAB_STEP_SCALAR); needs r ≤ 256
  // Batched loop only: a distant key's rotated dims scored through per-pair query vectors in shared
  // memory (rope_terms) instead of kr, which is then not read (nor computed by the launcher).
  int rope_absorbed;
  int S, r, hd, rot, g, hkv, chunk, nchunks, ring_chunk, nring;
  float scale;
  // The new token's key / value [B, Hkv, 1, hd] (unit d stride, rows 16-byte aligned) and latent
  // [B, 1, r], or null: the slots that are to hold them are read from here instead of the cache, and
  // the combine kernel writes them into the cache (one kernel, not an index_copy each before).
  const void* new_k;
  const void* new_v;
  int64_t nk_sb, nk_sh;
  const void* new_c;
  int64_t nc_sb;
  float* ml;    // [B, H, nchunks + nring, 2]
  float* acc;   // [B, H, nchunks, r]
  float* accv;  // [B, H, nring, hd]
  // step_partial's first block is chunk `chunk0` (nchunks: the ring's blocks alone, the latents'
  // taken by step_latent_mma; else 0).
  int chunk0;
  // qw [B, H, r] and β [B, H] in fp32, written by step_qw for the latent blocks of both paths.
  float* qw;
  float* qbeta;
};

// Dynamic shared memory, in floats: qs [G][hd], qw [G][r], beta [G], wacc [kWarps][G][width],
// wm / wl [kWarps][G]; with the rotated dims absorbed (`absorbed_rot` = rot, else 0) also
// rq [G][rot][r] and rb [G][rot] (rope_terms).
__host__ __device__ inline int64_t smem_floats(int g, int r, int hd, int absorbed_rot = 0) {
  const int width = r > hd ? r : hd;
  return (int64_t)g * hd + (int64_t)g * r + g + (int64_t)kWarps * g * width + 2 * kWarps * g + (int64_t)g * absorbed_rot * r + (int64_t)g * absorbed_rot;
}

// The rotated dims of a distant key read without rebuilding it (dar.md §3, RoPE's half-split pairs):
// with k = Wk·c + bk and pair (i, i + half) turned by angle θ_i(s),
//   q·RoPE_s(k) over the pair = cos θ_i(s)·(a_i·c + α_i) + sin θ_i(s)·(b_i·c + β_i),
//   a_i = q_i·W_i + q_{i+half}·W_{i+half},  b_i = q_{i+half}·W_i − q_i·W_{i+half}  (rows of Wk, r wide),
//   α_i = q_i·bk_i + q_{i+half}·bk_{i+half},  β_i = q_{i+half}·bk_i − q_i·bk_{i+half};
// rq[h] holds a_0.. a_{half−1}, b_0.. b_{half−1}, rb[h] the α and β, computed once per block. Each
// slot then costs rot·r FMAs spread over the lanes that hold its latent, and no kr.
template <typename T, int G>
__device__ __forceinline__ void rope_terms(const Params& p, int kvh, const float* qs, float* rq, float* rb) {
  const int half = p.rot / 2;
  const T* wk = static_cast<const T*>(p.wk) + (int64_t)kvh * p.hd * p.r;
  const T* bk = p.bk ? static_cast<const T*>(p.bk) + (int64_t)kvh * p.hd : nullptr;
  for (int idx = threadIdx.x; idx < G * p.rot * p.r; idx += kThreads) {
    const int h = idx / (p.rot * p.r), i = (idx / p.r) % p.rot, j = idx % p.r, pi = i % half;
    const float qa = qs[h * p.hd + pi], qb = qs[h * p.hd + pi + half];
    const float wa = to_f(wk[(int64_t)pi * p.r + j]), wb = to_f(wk[(int64_t)(pi + half) * p.r + j]);
    rq[idx] = i < half ? qa * wa + qb * wb : qb * wa - qa * wb;
  }
  for (int idx = threadIdx.x; idx < G * p.rot; idx += kThreads) {
    const int h = idx / p.rot, i = idx % p.rot, pi = i % half;
    const float qa = qs[h * p.hd + pi], qb = qs[h * p.hd + pi + half];
    const float ba = bk ? to_f(bk[pi]) : 0.f, bb = bk ? to_f(bk[pi + half]) : 0.f;
    rb[idx] = i < half ? qa * ba + qb * bb : qb * ba - qa * bb;
  }
}

// The slot of the full-width cache that holds position `newest` once it is written.
__device__ __forceinline__ int64_t newest_slot(int64_t newest, int64_t keep) { return keep > 0 ? newest % keep : newest; }

// Full-width slot s's key (or value) row of kv head kvh: the new token's own row for the slot it
// is to be written into (p.new_k / new_v), else the cache's.
template <typename T>
__device__ __forceinline__ const T* full_row(const Params& p, const void* cache, const void* fresh, int b, int kvh, int64_t s, int64_t newest) {
  if (fresh && s == newest_slot(newest, p.keep)) return static_cast<const T*>(fresh) + b * p.nk_sb + (int64_t)kvh * p.nk_sh;
  return static_cast<const T*>(cache) + b * p.r_sb + (int64_t)kvh * p.r_sh + s * p.r_ss;
}

// Latent slot s's row: the new token's own latent for slot `newest` (p.new_c), else the cache's.
template <typename T>
__device__ __forceinline__ const T* latent_row(const Params& p, int b, int64_t s, int64_t newest) {
  if (p.new_c && s == newest) return static_cast<const T*>(p.new_c) + b * p.nc_sb;
  return static_cast<const T*>(p.c) + b * p.c_sb + s * p.c_ss;
}

// Fold one score into a running (max m, sum l) of exponentials: f scales what was accumulated
// (0 on the first score, m = −inf), w weighs the new slot.
__device__ __forceinline__ void fold_score(float& m, float& l, float score, float& f, float& w) {
  if (score > m) {
    f = __expf(m - score);
    l = l * f + 1.f;
    m = score;
    w = 1.f;
  } else {
    f = 1.f;
    w = __expf(score - m);
    l += w;
  }
}

// q_h · RoPE(k) over one rotated pair (i, i + half) of a head's query qh: k's halves k1, k2 turned
// by (cs, sn).
__device__ __forceinline__ float rope_pair_dot(const float* qh, int i, int half, float k1, float k2, float cs, float sn) {
  return qh[i] * (k1 * cs - k2 * sn) + qh[i + half] * (k2 * cs + k1 * sn);
}

// Full-width slots [begin, end) of one warp's share, memory-bound: each slot read by a group of
// hd/8 lanes with one 16-byte load of its key and one of its value per lane, several slots in
// flight per lane (kUnroll), q and the running output in registers. On return every lane holds the
// warp's (m, l) per head, and lanes of the first group have written the warp's Σ p·v (unnormalised)
// to acc[h * width + d].
template <typename T, int G>
__device__ __forceinline__ void full_width_slots(const Params& p, int b, int kvh, int begin, int end, int64_t newest, int64_t pad, const float* qs,
                                 float* m, float* l, float* acc, int width) {
  constexpr int kUnroll = 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int L = p.hd / 8, groups = 32 / L, gi = lane / L, e0 = (lane % L) * 8;
  float q[G][8], o[G][8];
#pragma unroll
  for (int h = 0; h < G; ++h) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      q[h][e] = qs[h * p.hd + e0 + e];
      o[h][e] = 0.f;
    }
  }
  const int stride = kWarps * groups;
  // The loop's bound is the warp's (not the group's): every lane takes part in every shuffle.
  for (int base = begin + warp * groups; base < end; base += stride * kUnroll) {
    Pack8 k[kUnroll], v[kUnroll];
    bool vis[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int s = base + gi + u * stride;
      const int64_t at = slot_position(newest, s, p.keep);
      vis[u] = s < end && at >= pad && at <= newest;
      if (vis[u]) {
        k[u] = *reinterpret_cast<const Pack8*>(full_row<T>(p, p.rk, p.new_k, b, kvh, s, newest) + e0);
        v[u] = *reinterpret_cast<const Pack8*>(full_row<T>(p, p.rv, p.new_v, b, kvh, s, newest) + e0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int h = 0; h < G; ++h) {
        float part = 0.f;
        if (vis[u]) {
#pragma unroll
          for (int e = 0; e < 8; ++e) part += q[h][e] * pack_at<T>(k[u], e);
        }
        for (int off = 1; off < L; off <<= 1) part += __shfl_xor_sync(0xffffffff, part, off);
        if (!vis[u]) continue;
        float f, w;
        fold_score(m[h], l[h], part * p.scale, f, w);
#pragma unroll
        for (int e = 0; e < 8; ++e) o[h][e] = o[h][e] * f + w * pack_at<T>(v[u], e);
      }
    }
  }
  // Merge the groups of the warp (lanes e0 apart by multiples of L hold the same columns).
#pragma unroll
  for (int h = 0; h < G; ++h) {
    for (int off = L; off < 32; off <<= 1) {
      const float m2 = __shfl_xor_sync(0xffffffff, m[h], off), l2 = __shfl_xor_sync(0xffffffff, l[h], off);
      const float M = fmaxf(m[h], m2);
      const float a = m[h] == -INFINITY ? 0.f : __expf(m[h] - M), c = m2 == -INFINITY ? 0.f : __expf(m2 - M);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[h][e] = o[h][e] * a + __shfl_xor_sync(0xffffffff, o[h][e], off) * c;
      l[h] = l[h] * a + l2 * c;
      m[h] = M;
    }
    if (gi == 0) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[h * width + e0 + e] = o[h][e];
    }
  }
}

// Distant slots [begin, end) of one warp's share: four slots per iteration, their latents loaded
// into registers together (lanes over d_down, r ≤ 256) and read there for the scores and for Σ p·c,
// the scores reduced, then one online-softmax update per head for the four, which reads and writes
// the warp's Σ p·c (acc, in shared memory) once. The rotated dims come from kr, or with
// p.rope_absorbed from the latents through rq / rb (rope_terms).
template <typename T, int G>
__device__ __forceinline__ void latent_slots(const Params& p, int b, int kvh, int begin, int end, int64_t newest, int64_t pad, const float* qs,
                                             const float* qw, const float* beta, const float* rq, const float* rb, float* m, float* l, float* acc,
                                             int width) {
  constexpr int U = 4, JL = 8;  // slots at a time; latent dims a lane holds (r ≤ 32·JL)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, half = p.rot / 2;
  const T* kr = p.rope_absorbed ? nullptr : static_cast<const T*>(p.kr) + b * p.kr_sb + (int64_t)kvh * p.rot;
  const T* bk = p.bk ? static_cast<const T*>(p.bk) + (int64_t)kvh * p.hd : nullptr;
  for (int base = begin + warp; base < end; base += kWarps * U) {
    int s[U];
    bool vis[U], any = false;
    float part[U][G];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      s[u] = base + u * kWarps;
      vis[u] = s[u] < end && newest - s[u] >= p.window && s[u] >= pad;
      any |= vis[u];
#pragma unroll
      for (int h = 0; h < G; ++h) part[u][h] = 0.f;
    }
    if (!any) continue;  // the same for every lane of the warp
    float x[U][JL];  // x[u][jj] = c[s_u][lane + 32·jj]
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const T* c = latent_row<T>(p, b, s[u], newest);
#pragma unroll
      for (int jj = 0; jj < JL; ++jj) {
        const int j = lane + 32 * jj;
        x[u][jj] = vis[u] && j < p.r ? to_f(c[j]) : 0.f;
      }
    }
    if (p.rot < p.hd) {
#pragma unroll
      for (int jj = 0; jj < JL; ++jj) {
        const int j = lane + 32 * jj;
        if (j >= p.r) break;
#pragma unroll
        for (int h = 0; h < G; ++h) {
          const float w = qw[h * p.r + j];
#pragma unroll
          for (int u = 0; u < U; ++u) part[u][h] += w * x[u][jj];
        }
      }
    }
    if (p.rope_absorbed) {
      for (int i = 0; i < half; ++i) {
        float cs[U], sn[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          cs[u] = vis[u] ? p.cos[(int64_t)s[u] * p.cs_s + i] : 0.f;
          sn[u] = vis[u] ? p.sin[(int64_t)s[u] * p.cs_s + i] : 0.f;
        }
#pragma unroll
        for (int h = 0; h < G; ++h) {
          const float* a = rq + ((int64_t)h * p.rot + i) * p.r;
          const float* bq = a + (int64_t)half * p.r;
#pragma unroll
          for (int jj = 0; jj < JL; ++jj) {
            const int j = lane + 32 * jj;
            if (j >= p.r) break;
            const float aj = a[j], bj = bq[j];
#pragma unroll
            for (int u = 0; u < U; ++u) part[u][h] += x[u][jj] * (cs[u] * aj + sn[u] * bj);
          }
          // The biases' share, once per slot (lane 0; the warp sum adds it in).
          if (lane == 0) {
#pragma unroll
            for (int u = 0; u < U; ++u) part[u][h] += cs[u] * rb[h * p.rot + i] + sn[u] * rb[h * p.rot + half + i];
          }
        }
      }
    } else {
      for (int i = lane; i < half; i += 32) {
        const float b1 = bk ? to_f(bk[i]) : 0.f, b2 = bk ? to_f(bk[i + half]) : 0.f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (!vis[u]) continue;
          const T* k = kr + (int64_t)s[u] * p.kr_ss;
          const float k1 = to_f(k[i]) + b1, k2 = to_f(k[i + half]) + b2;
          const float cs = p.cos[(int64_t)s[u] * p.cs_s + i], sn = p.sin[(int64_t)s[u] * p.cs_s + i];
#pragma unroll
          for (int h = 0; h < G; ++h) part[u][h] += rope_pair_dot(qs + h * p.hd, i, half, k1, k2, cs, sn);
        }
      }
    }
#pragma unroll
    for (int h = 0; h < G; ++h) {
      float score[U], mx = m[h];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        score[u] = (warp_sum(part[u][h]) + beta[h]) * p.scale;
        if (vis[u]) mx = fmaxf(mx, score[u]);
      }
      const float f = __expf(m[h] - mx);  // 0 while nothing was seen (m = −inf)
      float e[U], sum = 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        e[u] = vis[u] ? __expf(score[u] - mx) : 0.f;
        sum += e[u];
      }
      l[h] = l[h] * f + sum;
      m[h] = mx;
      float* a = acc + h * width;
#pragma unroll
      for (int jj = 0; jj < JL; ++jj) {
        const int j = lane + 32 * jj;
        if (j >= p.r) break;
        float v = a[j] * f;
#pragma unroll
        for (int u = 0; u < U; ++u) v += e[u] * x[u][jj];
        a[j] = v;
      }
    }
  }
}

template <typename T, int G>
__global__ void __launch_bounds__(kThreads) step_partial(Params p) {
  ATTNLAB_DYNAMIC_SHARED(float, sh);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int kvh = blockIdx.y % p.hkv, b = blockIdx.y / p.hkv;
  const int chunk = (int)blockIdx.x + p.chunk0;
  const bool ring = chunk >= p.nchunks;
  const int H = p.hkv * G, width = p.r > p.hd ? p.r : p.hd;
  float* qs = sh;
  float* qw = qs + G * p.hd;
  float* beta = qw + G * p.r;
  float* wacc = beta + G;
  float* wm = wacc + kWarps * G * width;
  float* wl = wm + kWarps * G;
  float* rq = wl + kWarps * G;         // with p.rope_absorbed: [G][rot][r]
  float* rb = rq + G * p.rot * p.r;    // and [G][rot]
  const T* q = static_cast<const T*>(p.q);
  for (int i = tid; i < G * p.hd; i += kThreads) {
    const int h = i / p.hd, d = i % p.hd;
    qs[i] = to_f(q[b * p.q_sb + (int64_t)(kvh * G + h) * p.q_sh + d]);
  }
  for (int i = tid; i < kWarps * G * width; i += kThreads) wacc[i] = 0.f;
  __syncthreads();
  const int n_acc = ring ? p.hd : p.r;  // the width of what the block accumulates
  if (!ring) {
    // qw and β of the block's heads, from step_qw (run before this kernel).
    const int64_t head0 = (int64_t)b * H + kvh * G;
    for (int i = tid; i < G * p.r; i += kThreads) qw[i] = p.qw[head0 * p.r + i];
    if (tid < G) beta[tid] = p.qbeta[head0 + tid];
    if (p.rope_absorbed) rope_terms<T, G>(p, kvh, qs, rq, rb);
    __syncthreads();
  }
  float m[G], l[G];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
  }
  float* my_acc = wacc + warp * G * width;
  const int begin = ring ? (chunk - p.nchunks) * p.ring_chunk : chunk * p.chunk;
  const int end = ring ? min(p.W, begin + p.ring_chunk) : min(p.S, begin + p.chunk);
  const int64_t newest = *p.pos;
  const int64_t pad = p.pad ? p.pad[b] : 0;
  const int half = p.rot / 2;
  const T* bk = p.bk ? static_cast<const T*>(p.bk) + (int64_t)kvh * p.hd : nullptr;
  const bool scalar = ring ? !p.vec : !p.batched;
  if (ring && p.vec) full_width_slots<T, G>(p, b, kvh, begin, end, newest, pad, qs, m, l, my_acc, width);
  if (!ring && p.batched) latent_slots<T, G>(p, b, kvh, begin, end, newest, pad, qs, qw, beta, rq, rb, m, l, my_acc, width);
  for (int s = begin + warp; s < end && scalar; s += kWarps) {
    float part[G];
#pragma unroll
    for (int h = 0; h < G; ++h) part[h] = 0.f;
    const T* sv;  // what the scores read (key or latent), and what the block accumulates (value or latent)
    const T* av;
    if (ring) {
      const int64_t at = slot_position(newest, s, p.keep);
      if (at < pad || at > newest) continue;
      sv = full_row<T>(p, p.rk, p.new_k, b, kvh, s, newest);
      av = full_row<T>(p, p.rv, p.new_v, b, kvh, s, newest);
      for (int d = lane; d < p.hd; d += 32) {
        const float k = to_f(sv[d]);
#pragma unroll
        for (int h = 0; h < G; ++h) part[h] += qs[h * p.hd + d] * k;
      }
    } else {
      if (newest - s < p.window || s < pad) continue;
      sv = latent_row<T>(p, b, s, newest);
      av = sv;
      if (p.rot < p.hd) {
        for (int j = lane; j < p.r; j += 32) {
          const float c = to_f(sv[j]);
#pragma unroll
          for (int h = 0; h < G; ++h) part[h] += qw[h * p.r + j] * c;
        }
      }
      const T* kr = static_cast<const T*>(p.kr) + b * p.kr_sb + (int64_t)s * p.kr_ss + (int64_t)kvh * p.rot;
      for (int i = lane; i < half; i += 32) {
        float k1 = to_f(kr[i]), k2 = to_f(kr[i + half]);
        if (bk) {
          k1 += to_f(bk[i]);
          k2 += to_f(bk[i + half]);
        }
        const float cs = p.cos[(int64_t)s * p.cs_s + i], sn = p.sin[(int64_t)s * p.cs_s + i];
#pragma unroll
        for (int h = 0; h < G; ++h) part[h] += rope_pair_dot(qs + h * p.hd, i, half, k1, k2, cs, sn);
      }
    }
#pragma unroll
    for (int h = 0; h < G; ++h) {
      float f, e;
      fold_score(m[h], l[h], (warp_sum(part[h]) + (ring ? 0.f : beta[h])) * p.scale, f, e);
      float* a = my_acc + h * width;
      for (int j = lane; j < n_acc; j += 32) a[j] = a[j] * f + e * to_f(av[j]);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < G; ++h) {
      wm[warp * G + h] = m[h];
      wl[warp * G + h] = l[h];
    }
  }
  __syncthreads();
  // Merge the warps: each (head, column) by one thread.
  for (int i = tid; i < G * n_acc; i += kThreads) {
    const int h = i / n_acc, j = i % n_acc;
    float M;
    const float sum = merge_warps(wm, G, h, wacc + h * width + j, G * width, M);
    const int64_t head = (int64_t)b * H + kvh * G + h;
    if (ring) {
      p.accv[(head * p.nring + chunk - p.nchunks) * p.hd + j] = sum;
    } else {
      p.acc[(head * p.nchunks + chunk) * p.r + j] = sum;
    }
  }
  if (tid < G) {
    const int h = tid;
    float M;
    const float L = merge_warps(wm, G, h, wl + h, G, M);
    const int64_t head = (int64_t)b * H + kvh * G + h;
    float* o = p.ml + (head * (p.nchunks + p.nring) + chunk) * 2;
    o[0] = M;
    o[1] = L;
  }
}

// ---- The distant part on the tensor cores (ATTNLAB_STEP_MMA=1; the header comment says how) ----

constexpr int kMmaHeads = 16;  // query heads a block: the mma's M
constexpr int kMmaSlots = 16;  // distant slots a warp's tile: two n blocks of 8 for S, the k of P·C

// qw_h = q_h[rot:] · Wk[k][rot:, :] and β_h = q_h[rot:] · bk[k][rot:] of query head h (kv head k),
// fp32, one block per (b, h): computed once a step for every latent path (step_partial's latent
// blocks and step_latent_mma's read it), not by each block. A thread takes a pack of 8 columns and
// every `groups`-th dim d, so its loads are independent and it waits on memory about
// (hd − rot) / groups times (groups = 8 at r = 128), not hd − rot; the groups' partial rows are
// summed in shared memory. (One thread per column over every d, as each of step_partial's blocks
// did before: 11 µs a layer on one H100 at Pythia-70M's shape.)
template <typename T>
__global__ void __launch_bounds__(kThreads) step_qw(Params p) {
  constexpr int kPack = 8;
  __shared__ float part[kThreads * kPack];
  const int H = p.hkv * p.g, b = blockIdx.x / H, h = blockIdx.x % H, kvh = h / p.g;
  const T* q = static_cast<const T*>(p.q) + b * p.q_sb + (int64_t)h * p.q_sh;
  const T* wk = static_cast<const T*>(p.wk) + (int64_t)kvh * p.hd * p.r;
  float* qw = p.qw + (int64_t)blockIdx.x * p.r;
  // P packs of columns; with P < kThreads, `groups` threads share a pack, each over its own dims.
  const int P = (p.r + kPack - 1) / kPack, groups = P >= kThreads ? 1 : kThreads / P;
  for (int task = threadIdx.x; task < P * groups; task += kThreads) {
    const int c0 = (task % P) * kPack, grp = task / P;
    float s[kPack];
#pragma unroll
    for (int i = 0; i < kPack; ++i) s[i] = 0.f;
#pragma unroll 4
    for (int d = p.rot + grp; d < p.hd; d += groups) {
      const float qd = to_f(q[d]);
      const T* row = wk + (int64_t)d * p.r + c0;
#pragma unroll
      for (int i = 0; i < kPack; ++i) {
        if (c0 + i < p.r) s[i] += qd * to_f(row[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kPack; ++i) {
      if (c0 + i >= p.r) break;
      if (groups == 1) {
        qw[c0 + i] = s[i];
      } else {
        part[grp * P * kPack + c0 + i] = s[i];
      }
    }
  }
  if (groups > 1) {
    __syncthreads();
    for (int j = threadIdx.x; j < p.r; j += kThreads) {
      float sum = 0.f;
      for (int grp = 0; grp < groups; ++grp) sum += part[grp * P * kPack + j];
      qw[j] = sum;
    }
  }
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float sb = 0.f;
    if (p.bk) {
      const T* bk = static_cast<const T*>(p.bk) + (int64_t)kvh * p.hd;
      for (int d = p.rot + lane; d < p.hd; d += 32) sb += to_f(q[d]) * to_f(bk[d]);
    }
    sb = warp_sum(sb);
    if (lane == 0) p.qbeta[blockIdx.x] = sb;
  }
}

// Dynamic shared memory of step_latent_mma, in bytes: qw's hi and lo parts [16][r + 8] (16-bit; rows
// padded by 8 values so that ldmatrix's eight rows fall in different banks), the rotated query dims
// and the key bias of their kv head [16][rot] and β [16] (fp32); then the warps' latent tiles
// [kWarps][16][r + 8] (16-bit) or, once the slots are done, in the same bytes their partial outputs
// [kWarps][16][r] (fp32); then their (m, l) [kWarps][16] each.
__host__ __device__ inline int64_t mma_work_bytes(int r) {
  const int64_t tiles = (int64_t)kWarps * kMmaSlots * (r + 8) * 2, merge = (int64_t)kWarps * kMmaHeads * r * 4;
  return tiles > merge ? tiles : merge;
}
__host__ __device__ inline int64_t mma_smem_bytes(int r, int rot) {
  return 2 * (int64_t)kMmaHeads * (r + 8) * 2 + 2 * (int64_t)kMmaHeads * rot * 4 + kMmaHeads * 4 + mma_work_bytes(r) + 2 * kWarps * kMmaHeads * 4;
}

// One warp's tile: latent rows s0 .. s0 + 15 into `tile` [16][R + 8] by 16-byte loads, all of them
// issued before any is stored; rows outside the visible [lo, hi) zero (an unwritten cache row may
// hold NaNs, and P·C multiplies it by 0).
template <typename T, int R>
__device__ __forceinline__ void load_latent_tile(const Params& p, int b, int s0, int64_t lo, int64_t hi, int64_t newest, T* tile) {
  constexpr int LD = R + 8, PR = R / 8, U = kMmaSlots * PR / 32;  // packs a row; a lane
  const int lane = threadIdx.x & 31;
  Pack8 x[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int i = lane + 32 * u, s = s0 + i / PR;
    x[u] = Pack8{};
    if (s >= lo && s < hi) x[u] = *reinterpret_cast<const Pack8*>(latent_row<T>(p, b, s, newest) + 8 * (i % PR));
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int i = lane + 32 * u;
    *reinterpret_cast<Pack8*>(tile + (i / PR) * LD + 8 * (i % PR)) = x[u];
  }
}

// s (16 heads × 16 slots, two C fragments) = QW · Cᵀ over the tile's latents, QW as hi + lo (two
// mmas each: qw in 16 bits alone would lose its low bits). A fragments by ldmatrix (matrices 0 / 1:
// rows 0–7 / 8–15 at column 0, 2 / 3 the same at column 8); B fragments of both n blocks by one
// ldmatrix (matrix m: slots 8·(m / 2) + 0..7 at column 8·(m % 2)).
template <typename T, int R>
__device__ __forceinline__ void latent_scores(const T* qwh, const T* qwl, const T* tile, float s[2][4]) {
  constexpr int LD = R + 8;
  const int lane = threadIdx.x & 31;
  const int a_row = lane % 8 + 8 * ((lane / 8) % 2), a_col = 8 * (lane / 16);
  const int b_row = lane % 8 + 8 * (lane / 16), b_col = 8 * ((lane / 8) % 2);
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < R / 16; ++kk) {
    uint32_t ah[4], al[4], cb[4];
    ldmatrix_x4(ah, qwh + a_row * LD + kk * 16 + a_col);
    ldmatrix_x4(al, qwl + a_row * LD + kk * 16 + a_col);
    ldmatrix_x4(cb, tile + b_row * LD + kk * 16 + b_col);
    mma_16816<T>(s[0], ah, cb);
    mma_16816<T>(s[0], al, cb);
    mma_16816<T>(s[1], ah, cb + 2);
    mma_16816<T>(s[1], al, cb + 2);
  }
}

// The rest of each score of the lane's fragments (head row group (+ 8), slot 2t (+ 1, + 8, + 9)):
// β_h and the rotated dims q_rot,h · RoPE_s(kr_s + bk_rot) by fp32 FMAs (rot is small), scaled; −inf
// for slots outside the visible [lo, hi). Rows past the block's heads (rows) keep S alone: zero.
// Pair by pair, the loads of all eight scores (kr's two halves each, cos / sin of the four slots)
// are issued before any is used: one wait on memory a pair, not one a pair and score.
template <typename T>
__device__ __forceinline__ void finish_scores(const Params& p, int b, int h0, int rows, int s0, int64_t lo, int64_t hi, const float* qrot,
                                              const float* bkr, const float* beta, float s[2][4]) {
  const int lane = threadIdx.x & 31, group = lane / 4, t = lane % 4, half = p.rot / 2;
  const T* kr[2][4];
  bool rope[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = group + (e >= 2 ? 8 : 0), slot = s0 + nt * 8 + 2 * t + (e & 1);
      const bool visible = slot >= lo && slot < hi;
      rope[nt][e] = visible && row < rows && half > 0;
      kr[nt][e] = rope[nt][e] ? static_cast<const T*>(p.kr) + b * p.kr_sb + (int64_t)slot * p.kr_ss + (int64_t)((h0 + row) / p.g) * p.rot : nullptr;
      s[nt][e] = visible ? s[nt][e] + beta[row] : -INFINITY;
    }
  // The lane's four slots: nt · 8 + 2t + (0, 1).
  const float* cs[2][2];
  const float* sn[2][2];
  bool slot_rope[2][2];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int o = 0; o < 2; ++o) {
      const int slot = s0 + nt * 8 + 2 * t + o;
      slot_rope[nt][o] = rope[nt][o] || rope[nt][o + 2];
      cs[nt][o] = p.cos + (int64_t)slot * p.cs_s;
      sn[nt][o] = p.sin + (int64_t)slot * p.cs_s;
    }
  for (int i = 0; i < half; ++i) {
    float k1[2][4], k2[2][4], c[2][2], n[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        k1[nt][e] = rope[nt][e] ? to_f(kr[nt][e][i]) : 0.f;
        k2[nt][e] = rope[nt][e] ? to_f(kr[nt][e][i + half]) : 0.f;
      }
#pragma unroll
      for (int o = 0; o < 2; ++o) {
        c[nt][o] = slot_rope[nt][o] ? cs[nt][o][i] : 0.f;
        n[nt][o] = slot_rope[nt][o] ? sn[nt][o][i] : 0.f;
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (!rope[nt][e]) continue;
        const int row = group + (e >= 2 ? 8 : 0);
        const float* bh = bkr + row * p.rot;
        s[nt][e] += rope_pair_dot(qrot + row * p.rot, i, half, k1[nt][e] + bh[i], k2[nt][e] + bh[i + half], c[nt][e & 1], n[nt][e & 1]);
      }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] *= p.scale;
}

// One block per (chunk of distant slots, row b, 16 query heads): every latent of the chunk read once
// for the block's heads. Four warps take its 16-slot tiles in turn, each with its own tile in shared
// memory and its own online softmax; the warps' results merged at the end into the same partial
// outputs as step_partial's latent blocks (ml, acc at chunk blockIdx.x).
template <typename T, int R>
__global__ void __launch_bounds__(kThreads) step_latent_mma(Params p) {
  ATTNLAB_DYNAMIC_SHARED(float, msh);
  constexpr int LD = R + 8, NT = R / 8;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, group = lane / 4, t = lane % 4;
  const int b = blockIdx.y, h0 = blockIdx.z * kMmaHeads, H = p.hkv * p.g, rows = min(kMmaHeads, H - h0);
  T* qwh = reinterpret_cast<T*>(msh);
  T* qwl = qwh + kMmaHeads * LD;
  float* qrot = reinterpret_cast<float*>(qwl + kMmaHeads * LD);
  float* bkr = qrot + kMmaHeads * p.rot;
  float* beta = bkr + kMmaHeads * p.rot;
  float* work = beta + kMmaHeads;
  T* tile = reinterpret_cast<T*>(work) + warp * kMmaSlots * LD;
  float* wm = work + mma_work_bytes(R) / 4;
  float* wl = wm + kWarps * kMmaHeads;
  // The block's query side: qw as hi + lo, its rotated dims with their kv head's bias, β (zero rows
  // past H).
  const T* q = static_cast<const T*>(p.q);
  const T* bk = static_cast<const T*>(p.bk);
  for (int i = tid; i < kMmaHeads * R; i += kThreads) {
    const int h = i / R, j = i % R;
    const float x = h < rows ? p.qw[((int64_t)b * H + h0 + h) * p.r + j] : 0.f;
    const T hi = from_f<T>(x);
    qwh[h * LD + j] = hi;
    qwl[h * LD + j] = from_f<T>(x - to_f(hi));
  }
  for (int i = tid; i < kMmaHeads * p.rot; i += kThreads) {
    const int h = i / p.rot, d = i % p.rot;
    qrot[i] = h < rows ? to_f(q[b * p.q_sb + (int64_t)(h0 + h) * p.q_sh + d]) : 0.f;
    bkr[i] = h < rows && bk ? to_f(bk[(int64_t)((h0 + h) / p.g) * p.hd + d]) : 0.f;
  }
  if (tid < kMmaHeads) beta[tid] = tid < rows ? p.qbeta[(int64_t)b * H + h0 + tid] : 0.f;
  __syncthreads();
  // The chunk's visible slots: [lo, hi) (p − s ≥ w, s ≥ pad[b]).
  const int begin = blockIdx.x * p.chunk, end = min(p.S, begin + p.chunk);
  const int64_t newest = *p.pos, pad = p.pad ? p.pad[b] : 0;
  const int64_t lo = max((int64_t)begin, pad), hi = min((int64_t)end, newest - p.window + 1);
  float o[NT][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int d = 0; d < NT; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[d][e] = 0.f;
  for (int s0 = begin + warp * kMmaSlots; s0 < end; s0 += kWarps * kMmaSlots) {
    if (s0 + kMmaSlots <= lo || s0 >= hi) continue;  // nothing visible (the same for the whole warp)
    __syncwarp();  // every lane is done reading the previous tile
    load_latent_tile<T, R>(p, b, s0, lo, hi, newest, tile);
    __syncwarp();
    float s[2][4];
    latent_scores<T, R>(qwh, qwl, tile, s);
    finish_scores<T>(p, b, h0, rows, s0, lo, hi, qrot, bkr, beta, s);
    online_softmax<2, NT>(s, m, l, o);
    mma_p_x<T, kMmaSlots, R>(o, s, tile);  // O += P·C
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) l[r] = quad_sum(l[r]);
  __syncthreads();  // the tiles are read: their bytes take the warps' outputs
  float* mine = work + warp * kMmaHeads * R;
#pragma unroll
  for (int d = 0; d < NT; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) mine[(group + (e >= 2 ? 8 : 0)) * R + d * 8 + 2 * t + (e & 1)] = o[d][e];
  if (t == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      wm[warp * kMmaHeads + group + 8 * r] = m[r];
      wl[warp * kMmaHeads + group + 8 * r] = l[r];
    }
  }
  __syncthreads();
  // Merge the warps: each (head, column) by one thread, as step_partial does.
  for (int i = tid; i < rows * R; i += kThreads) {
    const int h = i / R, j = i % R;
    float M;
    const float sum = merge_warps(wm, kMmaHeads, h, work + h * R + j, kMmaHeads * R, M);
    p.acc[(((int64_t)b * H + h0 + h) * p.nchunks + blockIdx.x) * p.r + j] = sum;
  }
  if (tid < rows) {
    const int h = tid;
    float M;
    const float L = merge_warps(wm, kMmaHeads, h, wl + h, kMmaHeads, M);
    float* o2 = p.ml + (((int64_t)b * H + h0 + h) * (p.nchunks + p.nring) + blockIdx.x) * 2;
    o2[0] = M;
    o2[1] = L;
  }
}

// step_latent_mma for latents r wide, or null where it is not built (the caller falls back).
template <typename T>
inline void (*latent_mma_kernel(int r))(Params) {
  switch (r) {
    case 16: return step_latent_mma<T, 16>;
    case 32: return step_latent_mma<T, 32>;
    case 48: return step_latent_mma<T, 48>;
    case 64: return step_latent_mma<T, 64>;
    case 96: return step_latent_mma<T, 96>;
    case 128: return step_latent_mma<T, 128>;
    case 192: return step_latent_mma<T, 192>;
    case 256: return step_latent_mma<T, 256>;
    default: return nullptr;
  }
}

// What the combine kernel writes into the caches once every partial block has read them: the new
// token's key / value into the full-width slot that holds position *pos (k null: nothing), its
// latent into latent slot *pos (c null: nothing). Rows as in Params.
struct CacheWrite {
  void* k;
  void* v;
  int64_t k_sb, k_sh, k_ss, keep;
  const void* new_k;
  const void* new_v;
  int64_t nk_sb, nk_sh;
  void* c;
  int64_t c_sb, c_ss;
  const void* new_c;
  int64_t nc_sb;
  const int64_t* pos;
};

// Σ_c w[c]·x[c·stride + j] over c < count, for every j < width, by all the block's threads: where
// width < kThreads, kThreads / width stripes of chunks each, summed through `part` [kThreads]. The
// loads of a thread's chunks are independent (no branch: a chunk that saw no slot has weight 0 and
// its x, never written, is dropped by the select), so they overlap. emit(j, sum) runs once per j;
// a barrier ends it (width is the same in every thread: nothing at all for width ≤ 0).
template <typename F>
__device__ __forceinline__ void chunk_sum(const float* w, const float* x, int count, int width, int stride, float* part, F&& emit) {
  if (width <= 0) return;
  const int stripes = width < kThreads ? kThreads / width : 1;
  if (stripes == 1) {
    for (int j = threadIdx.x; j < width; j += kThreads) {
      float s = 0.f;
#pragma unroll 8
      for (int c = 0; c < count; ++c) s += w[c] == 0.f ? 0.f : w[c] * x[(int64_t)c * stride + j];
      emit(j, s);
    }
  } else {
    const int j = threadIdx.x % width, first = threadIdx.x / width;
    float s = 0.f;
    if (first < stripes) {
#pragma unroll 4
      for (int c = first; c < count; c += stripes) s += w[c] == 0.f ? 0.f : w[c] * x[(int64_t)c * stride + j];
    }
    part[threadIdx.x] = s;
    __syncthreads();
    if ((int)threadIdx.x < width) {
      float t = 0.f;
      for (int k = 0; k < stripes; ++k) t += part[k * width + threadIdx.x];
      emit(threadIdx.x, t);
    }
  }
  __syncthreads();
}

// Columns of pc / extra a combine block sums (blockIdx.y: which kCombineSlab of them), so that a
// thread's chunk loop is kThreads / kCombineSlab times shorter than with one block a head: each
// thread reduced every chunk of its column (r ≥ kThreads) in a chain of waits on memory (DAR at 4K,
// 128 chunks of r 128: 17.5 µs a layer on one H100, twice vanilla's). With Wv applied in the kernel
// a block needs all of pc: one block a head, every column.
constexpr int kCombineSlab = 32;
struct CombineGrid {
  int slabs, slab;
};
inline CombineGrid combine_grid(int r, int hd, bool wv_in_combine) {
  if (wv_in_combine) return {1, r > hd ? r : hd};
  const int widest = r > hd ? r : hd;
  return {(widest + kCombineSlab - 1) / kCombineSlab, kCombineSlab};
}

// The combine kernel's dynamic shared memory: the n chunks' weights, the reductions' kWarps and
// kThreads floats, and pc's r floats where it applies Wv itself.
inline size_t combine_smem_bytes(int64_t n, int64_t r, bool wv_in_combine) {
  return size_t(n + kWarps + kThreads + (wv_in_combine ? r : 0)) * sizeof(float);
}

// One block per (b, head) and slab of `slab` columns (combine_grid): the chunks merged. Either pc [Hkv, B, g, r] and extra [Hkv, B, g, hd]
// (the layout of the batched matmul by Wv per kv head that the launcher runs after), or, with `out`,
// the step's output [B, H, hd] itself: extra + pc · Wv[kv]ᵀ here, pc kept in fp32 in shared memory
// (wv [Hkv, hd, r] contiguous, null without latents). The chunks' maxima and sums are reduced by
// the whole block, their weights e^{m_c − M} kept in shared memory, and the weighted sums striped
// over the threads: a thread walking all n chunks three times serially cost 36 µs a layer at 4K
// (one H100, Pythia-70M shape: 43% of vanilla's step). Dynamic shared memory: combine_smem_bytes.
template <typename T>
__global__ void __launch_bounds__(kThreads) step_combine(const float* ml, const float* acc, const float* accv, const void* bv_,
                                                               int B, int H, int g, int r, int hd, int nchunks, int nring, int slab, T* pc,
                                                               T* extra, const void* wv_, T* out, CacheWrite cw) {
  ATTNLAB_DYNAMIC_SHARED(float, sh);
  const int head = blockIdx.x;  // b * H + h
  const int b = head / H, h = head % H, kvh = h / g, hg = h % g;
  const int n = nchunks + nring;
  const T* wv = static_cast<const T*>(wv_);
  float* w = sh;               // [n]
  float* red = w + n;          // [kWarps]
  float* part = red + kWarps;  // [kThreads]
  float* pcs = part + kThreads;  // [r] with wv
  const float* m = ml + (int64_t)head * n * 2;
  float mx = -INFINITY;
  for (int c = threadIdx.x; c < n; c += kThreads) mx = fmaxf(mx, m[2 * c]);
  const float M = block_reduce<kThreads, true>(mx, red);
  float l = 0.f, f = 0.f;
  for (int c = threadIdx.x; c < n; c += kThreads) {
    const float e = m[2 * c] == -INFINITY ? 0.f : __expf(m[2 * c] - M);
    w[c] = e;
    l += e * m[2 * c + 1];
    if (c < nchunks) f += e * m[2 * c + 1];
  }
  const float L = block_reduce<kThreads, false>(l, red);
  const float far = block_reduce<kThreads, false>(f, red);
  const float inv = L > 0.f ? 1.f / L : 0.f;
  const int64_t row = (((int64_t)kvh * B + b) * g + hg);
  // This block's columns: j0 .. j0 + slab of pc and of extra.
  const int j0 = blockIdx.y * slab;
  const auto width = [&](int all) { return min(slab, all - j0); };
  if (pc || wv) {
    chunk_sum(w, acc + (int64_t)head * nchunks * r + j0, nchunks, width(r), r, part, [&](int jj, float s) {
      const int j = j0 + jj;
      if (out) pcs[j] = s * inv;
      else pc[row * r + j] = from_f<T>(s * inv);
    });
  }
  const T* bv = static_cast<const T*>(bv_);
  chunk_sum(w + nchunks, accv + (int64_t)head * nring * hd + j0, nring, width(hd), hd, part, [&](int dd, float s) {
    const int d = j0 + dd;
    float e = s * inv;
    if (bv) e += far * inv * to_f(bv[(int64_t)kvh * hd + d]);
    if (!out) {
      extra[row * hd + d] = from_f<T>(e);
      return;
    }
    if (wv) {
      const T* wr = wv + ((int64_t)kvh * hd + d) * r;
      for (int j = 0; j < r; ++j) e += pcs[j] * to_f(wr[j]);
    }
    out[(int64_t)head * hd + d] = from_f<T>(e);
  });
  // The new token into the caches (by the first slab's blocks): its key / value by the first query
  // head of each kv head, its latent by head 0 of each row.
  if (blockIdx.y != 0) return;
  if (cw.k && hg == 0) {
    const int64_t newest = *cw.pos, slot = cw.keep > 0 ? newest % cw.keep : newest;
    const T* nk = static_cast<const T*>(cw.new_k) + b * cw.nk_sb + (int64_t)kvh * cw.nk_sh;
    const T* nv = static_cast<const T*>(cw.new_v) + b * cw.nk_sb + (int64_t)kvh * cw.nk_sh;
    const int64_t o = b * cw.k_sb + (int64_t)kvh * cw.k_sh + slot * cw.k_ss;
    for (int d = threadIdx.x; d < hd; d += kThreads) {
      static_cast<T*>(cw.k)[o + d] = nk[d];
      static_cast<T*>(cw.v)[o + d] = nv[d];
    }
  }
  if (cw.c && h == 0) {
    const T* nc = static_cast<const T*>(cw.new_c) + b * cw.nc_sb;
    T* c = static_cast<T*>(cw.c) + b * cw.c_sb + *cw.pos * cw.c_ss;
    for (int j = threadIdx.x; j < r; j += kThreads) c[j] = nc[j];
  }
}

}  // namespace
