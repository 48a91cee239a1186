// A one-token decode step as two kernels (issue 34 items 2-3): the new query attends full-width
// cached keys / values (vanilla's whole cache, or the window's / DAR's ring of recent ones) and, for
// DAR / uniform, the latents of every distant token, in one softmax, the latents read through the
// absorbed k / v map (dar.md §3; `dar::read_latents` and `cache::attend_newest` are the aten forms).
//
// Per query head h (of kv head k = h / g) at the step's position p:
//   distant slot s (visible iff p − s ≥ w and s ≥ pad[b]):
//     score = scale · (qw_h · c_s + β_h + q_rot,h · RoPE_s(kr_s + bk_rot)),
//     qw_h = q_h[rot:] · Wk[k][rot:, :] (the unrotated dims folded into latent space), β_h = q_h[rot:] · bk[rot:],
//     kr_s = Wk[k][:rot, :] · c_s (one cuBLAS matmul before the kernel: tensor cores, every slot);
//   full-width slot j: score = scale · q_h · k_j, visible iff the position it holds (j itself, or for
//   a ring of `keep` slots p − ((p − j) mod keep)) is in [pad[b], p].
// The partial kernel: one block per (row b, kv head, chunk of slots, distant or full-width); four
// warps each take every fourth slot with an online softmax, then merge. It writes (max, sum) and
// Σ p·c_s (distant, r wide) or Σ p·v_j (full width, hd wide), unnormalised.
// The combine kernel merges the chunks: pc_h = Σ p·c / L and extra_h = (Σ p_far / L)·bv + Σ p·v / L,
// and the output is pc · Wvᵀ + extra (one batched matmul; extra alone without latents). Nothing is
// read back to the host, and
// every shape depends on the span alone, so a CUDA graph captures it.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include "half.cuh"
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffff, x, off);
  return x;
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
  int batched;  // latents four slots per warp at a time (else one: ATTNLAB_STEP_SCALAR)
  int S, r, hd, rot, g, hkv, chunk, nchunks, ring_chunk, nring;
  float scale;
  float* ml;    // [B, H, nchunks + nring, 2]
  float* acc;   // [B, H, nchunks, r]
  float* accv;  // [B, H, nring, hd]
};

// Dynamic shared memory, in floats: qs [G][hd], qw [G][r], beta [G], wacc [kWarps][G][width],
// wm / wl [kWarps][G].
__host__ __device__ inline int64_t smem_floats(int g, int r, int hd) {
  const int width = r > hd ? r : hd;
  return (int64_t)g * hd + (int64_t)g * r + g + (int64_t)kWarps * g * width + 2 * kWarps * g;
}

// The position full-width slot s holds once position `newest` is written: s itself, or for a ring of
// `keep` slots the latest position ≤ newest congruent to s (cache::ring_positions on the host).
__device__ __forceinline__ int64_t slot_position(int64_t newest, int64_t s, int64_t keep) {
  return keep > 0 ? newest - (((newest - s) % keep) + keep) % keep : s;
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
  const T* rk = static_cast<const T*>(p.rk) + b * p.r_sb + (int64_t)kvh * p.r_sh + e0;
  const T* rv = static_cast<const T*>(p.rv) + b * p.r_sb + (int64_t)kvh * p.r_sh + e0;
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
        k[u] = *reinterpret_cast<const Pack8*>(rk + (int64_t)s * p.r_ss);
        v[u] = *reinterpret_cast<const Pack8*>(rv + (int64_t)s * p.r_ss);
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

// Distant slots [begin, end) of one warp's share: four slots per iteration, their latents' loads
// issued together (lanes over d_down), their scores reduced, then one online-softmax update per head
// for the four, which reads and writes the warp's Σ p·c (acc, in shared memory) once.
template <typename T, int G>
__device__ __forceinline__ void latent_slots(const Params& p, int b, int kvh, int begin, int end, int64_t newest, int64_t pad, const float* qs,
                                             const float* qw, const float* beta, float* m, float* l, float* acc, int width) {
  constexpr int U = 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, half = p.rot / 2;
  const T* c = static_cast<const T*>(p.c) + b * p.c_sb;
  const T* kr = static_cast<const T*>(p.kr) + b * p.kr_sb + (int64_t)kvh * p.rot;
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
    if (p.rot < p.hd) {
      for (int j = lane; j < p.r; j += 32) {
        float x[U];
#pragma unroll
        for (int u = 0; u < U; ++u) x[u] = vis[u] ? to_f(c[(int64_t)s[u] * p.c_ss + j]) : 0.f;
#pragma unroll
        for (int h = 0; h < G; ++h) {
          const float w = qw[h * p.r + j];
#pragma unroll
          for (int u = 0; u < U; ++u) part[u][h] += w * x[u];
        }
      }
    }
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
      for (int j = lane; j < p.r; j += 32) {
        float v = a[j] * f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (vis[u]) v += e[u] * to_f(c[(int64_t)s[u] * p.c_ss + j]);
        }
        a[j] = v;
      }
    }
  }
}

template <typename T, int G>
__global__ void __launch_bounds__(kThreads) step_partial(Params p) {
  extern __shared__ float sh[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int kvh = blockIdx.y % p.hkv, b = blockIdx.y / p.hkv;
  const bool ring = (int)blockIdx.x >= p.nchunks;
  const int H = p.hkv * G, width = p.r > p.hd ? p.r : p.hd;
  float* qs = sh;
  float* qw = qs + G * p.hd;
  float* beta = qw + G * p.r;
  float* wacc = beta + G;
  float* wm = wacc + kWarps * G * width;
  float* wl = wm + kWarps * G;
  const T* q = static_cast<const T*>(p.q);
  for (int i = tid; i < G * p.hd; i += kThreads) {
    const int h = i / p.hd, d = i % p.hd;
    qs[i] = to_f(q[b * p.q_sb + (int64_t)(kvh * G + h) * p.q_sh + d]);
  }
  for (int i = tid; i < kWarps * G * width; i += kThreads) wacc[i] = 0.f;
  __syncthreads();
  const int n_acc = ring ? p.hd : p.r;  // the width of what the block accumulates
  if (!ring) {
    // qw_h = q_h[rot:] · Wk[kvh][rot:, :], β_h = q_h[rot:] · bk[kvh][rot:].
    const T* wk = static_cast<const T*>(p.wk) + (int64_t)kvh * p.hd * p.r;
    for (int i = tid; i < G * p.r; i += kThreads) {
      const int h = i / p.r, j = i % p.r;
      float s = 0.f;
      for (int d = p.rot; d < p.hd; ++d) s += qs[h * p.hd + d] * to_f(wk[(int64_t)d * p.r + j]);
      qw[i] = s;
    }
    if (tid < G) {
      float s = 0.f;
      if (p.bk) {
        const T* bk = static_cast<const T*>(p.bk) + (int64_t)kvh * p.hd;
        for (int d = p.rot; d < p.hd; ++d) s += qs[tid * p.hd + d] * to_f(bk[d]);
      }
      beta[tid] = s;
    }
    __syncthreads();
  }
  float m[G], l[G];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
  }
  float* my_acc = wacc + warp * G * width;
  const int begin = ring ? (blockIdx.x - p.nchunks) * p.ring_chunk : blockIdx.x * p.chunk;
  const int end = ring ? min(p.W, begin + p.ring_chunk) : min(p.S, begin + p.chunk);
  const int64_t newest = *p.pos;
  const int64_t pad = p.pad ? p.pad[b] : 0;
  const int half = p.rot / 2;
  const T* bk = p.bk ? static_cast<const T*>(p.bk) + (int64_t)kvh * p.hd : nullptr;
  const bool scalar = ring ? !p.vec : !p.batched;
  if (ring && p.vec) full_width_slots<T, G>(p, b, kvh, begin, end, newest, pad, qs, m, l, my_acc, width);
  if (!ring && p.batched) latent_slots<T, G>(p, b, kvh, begin, end, newest, pad, qs, qw, beta, m, l, my_acc, width);
  for (int s = begin + warp; s < end && scalar; s += kWarps) {
    float part[G];
#pragma unroll
    for (int h = 0; h < G; ++h) part[h] = 0.f;
    const T* sv;  // what the scores read (key or latent), and what the block accumulates (value or latent)
    const T* av;
    if (ring) {
      const int64_t at = slot_position(newest, s, p.keep);
      if (at < pad || at > newest) continue;
      const int64_t o = b * p.r_sb + (int64_t)kvh * p.r_sh + (int64_t)s * p.r_ss;
      sv = static_cast<const T*>(p.rk) + o;
      av = static_cast<const T*>(p.rv) + o;
      for (int d = lane; d < p.hd; d += 32) {
        const float k = to_f(sv[d]);
#pragma unroll
        for (int h = 0; h < G; ++h) part[h] += qs[h * p.hd + d] * k;
      }
    } else {
      if (newest - s < p.window || s < pad) continue;
      sv = static_cast<const T*>(p.c) + b * p.c_sb + (int64_t)s * p.c_ss;
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
    float M = -INFINITY;
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, wm[w * G + h]);
    float sum = 0.f;
    if (M != -INFINITY) {
      for (int w = 0; w < kWarps; ++w) {
        const float mw = wm[w * G + h];
        if (mw != -INFINITY) sum += __expf(mw - M) * wacc[(w * G + h) * width + j];
      }
    }
    const int64_t head = (int64_t)b * H + kvh * G + h;
    if (ring) {
      p.accv[(head * p.nring + blockIdx.x - p.nchunks) * p.hd + j] = sum;
    } else {
      p.acc[(head * p.nchunks + blockIdx.x) * p.r + j] = sum;
    }
  }
  if (tid < G) {
    const int h = tid;
    float M = -INFINITY, L = 0.f;
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, wm[w * G + h]);
    if (M != -INFINITY) {
      for (int w = 0; w < kWarps; ++w) {
        const float mw = wm[w * G + h];
        if (mw != -INFINITY) L += __expf(mw - M) * wl[w * G + h];
      }
    }
    const int64_t head = (int64_t)b * H + kvh * G + h;
    float* o = p.ml + (head * (p.nchunks + p.nring) + blockIdx.x) * 2;
    o[0] = M;
    o[1] = L;
  }
}

// One block per (b, head): the chunks merged. pc [Hkv, B, g, r] and extra [Hkv, B, g, hd] (the
// layout of the batched matmul by Wv per kv head that follows).
template <typename T>
__global__ void __launch_bounds__(kThreads) step_combine(const float* ml, const float* acc, const float* accv, const void* bv_,
                                                               int B, int H, int g, int r, int hd, int nchunks, int nring, T* pc, T* extra) {
  const int head = blockIdx.x;  // b * H + h
  const int b = head / H, h = head % H, kvh = h / g, hg = h % g;
  const int n = nchunks + nring;
  const float* m = ml + (int64_t)head * n * 2;
  float M = -INFINITY;
  for (int c = 0; c < n; ++c) M = fmaxf(M, m[2 * c]);
  float L = 0.f, far = 0.f;
  for (int c = 0; c < n; ++c) {
    const float f = m[2 * c] == -INFINITY ? 0.f : __expf(m[2 * c] - M) * m[2 * c + 1];
    L += f;
    if (c < nchunks) far += f;
  }
  const float inv = L > 0.f ? 1.f / L : 0.f;
  const int64_t out = (((int64_t)kvh * B + b) * g + hg);
  if (pc) {
    for (int j = threadIdx.x; j < r; j += kThreads) {
      float s = 0.f;
      for (int c = 0; c < nchunks; ++c) {
        const float mc = m[2 * c];
        if (mc != -INFINITY) s += __expf(mc - M) * acc[((int64_t)head * nchunks + c) * r + j];
      }
      pc[out * r + j] = from_f<T>(s * inv);
    }
  }
  const T* bv = static_cast<const T*>(bv_);
  for (int d = threadIdx.x; d < hd; d += kThreads) {
    float e = 0.f;
    for (int c = 0; c < nring; ++c) {
      const float mc = m[2 * (nchunks + c)];
      if (mc != -INFINITY) e += __expf(mc - M) * accv[((int64_t)head * nring + c) * hd + d];
    }
    e *= inv;
    if (bv) e += far * inv * to_f(bv[(int64_t)kvh * hd + d]);
    extra[out * hd + d] = from_f<T>(e);
  }
}

template <typename T, int G>
void launch_partial(const Params& p, int B, size_t smem, cudaStream_t stream) {
  auto kernel = step_partial<T, G>;
  if (smem > 48 * 1024) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dim3 grid(p.nchunks + p.nring, B * p.hkv);
  kernel<<<grid, kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_partial_g(const Params& p, int B, size_t smem, cudaStream_t stream) {
  switch (p.g) {
    case 1: return launch_partial<T, 1>(p, B, smem, stream);
    case 2: return launch_partial<T, 2>(p, B, smem, stream);
    case 3: return launch_partial<T, 3>(p, B, smem, stream);
    case 4: return launch_partial<T, 4>(p, B, smem, stream);
    case 6: return launch_partial<T, 6>(p, B, smem, stream);
    case 8: return launch_partial<T, 8>(p, B, smem, stream);
    default: TORCH_CHECK(false, "attend_step: ", p.g, " query heads per kv head (1, 2, 3, 4, 6 or 8 are built)");
  }
}

at::Tensor last_unit(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

}  // namespace

typedef at::Tensor* tensor;

// The step's output [B, H, 1, hd]. ts (null where absent): q [B, H, 1, hd]; pos [1] i64 (CUDA); pad
// [B] i64 or null; full-width k, v [B, Hkv, W, hd] or null; latents [B, S, r], wk, wv [Hkv, hd, r],
// bk, bv [Hkv, hd], cos, sin fp32 [S, rot/2] (any row stride), all null without a distant part.
// keep: 0 when full-width slot j holds position j, else the ring's slot count; window: distant slots
// are those at distance ≥ window; chunk / ring_chunk: slots per block.
extern "C" char* attnlab_attend_step(tensor* ts, int64_t rotated, int64_t window, int64_t keep, int64_t chunk, int64_t ring_chunk, tensor* out_) {
  try {
    const at::Tensor q = last_unit(*ts[0]);
    const at::Tensor& pos = *ts[1];
    tensor pad = ts[2], rk = ts[3], rv = ts[4], cp = ts[5], wkp = ts[6], wvp = ts[7], bk = ts[8], bv = ts[9], cosp = ts[10], sinp = ts[11];
    TORCH_CHECK(q.is_cuda() && q.dim() == 4 && q.size(2) == 1, "attend_step: q must be CUDA [B, H, 1, hd]");
    TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_cuda(), "attend_step: pos must be a CUDA i64 tensor");
    TORCH_CHECK(rk || cp, "attend_step: neither full-width keys nor latents");
    const int64_t B = q.size(0), H = q.size(1), hd = q.size(3);
    const int64_t hkv = cp ? wkp->size(0) : rk->size(1);
    TORCH_CHECK(H % hkv == 0, "attend_step: ", H, " query heads over ", hkv, " kv heads");
    const int64_t g = H / hkv;
    c10::cuda::CUDAGuard guard(q.device());
    auto stream = c10::cuda::getCurrentCUDAStream();
    Params p{};
    // One slot per warp at a time everywhere (the first version of the kernels; timing and checks).
    const bool scalar_loops = std::getenv("ATTNLAB_STEP_SCALAR") != nullptr;
    // Latents four slots per warp at a time: not yet run on a GPU, so only when asked for
    // (ATTNLAB_STEP_BATCHED=1) until bench --check and the decode timings say it may be the default.
    p.batched = !scalar_loops && std::getenv("ATTNLAB_STEP_BATCHED") != nullptr;
    p.q = q.data_ptr();
    p.q_sb = q.stride(0);
    p.q_sh = q.stride(1);
    p.pos = pos.data_ptr<int64_t>();
    at::Tensor padc;
    if (pad) {
      padc = pad->reshape({-1}).to(at::kLong).contiguous();
      TORCH_CHECK(padc.size(0) == B, "attend_step: pad must hold one entry per row");
      p.pad = padc.data_ptr<int64_t>();
    }
    at::Tensor rkc, rvc;
    if (rk) {
      rkc = last_unit(*rk);
      rvc = last_unit(*rv);
      TORCH_CHECK(rkc.strides() == rvc.strides() && rkc.size(0) == B && rkc.size(1) == hkv && rkc.size(3) == hd && rvc.sizes() == rkc.sizes(),
                  "attend_step: full-width k / v must be [B, Hkv, W, hd] alike");
      TORCH_CHECK(rkc.scalar_type() == q.scalar_type(), "attend_step: k / v must have q's dtype");
      p.rk = rkc.data_ptr();
      p.rv = rvc.data_ptr();
      p.r_sb = rkc.stride(0);
      p.r_sh = rkc.stride(1);
      p.r_ss = rkc.stride(2);
      p.W = rkc.size(2);
      const bool aligned = p.r_sb % 8 == 0 && p.r_sh % 8 == 0 && p.r_ss % 8 == 0 && reinterpret_cast<uintptr_t>(p.rk) % 16 == 0 &&
                           reinterpret_cast<uintptr_t>(p.rv) % 16 == 0;
      p.vec = aligned && (hd == 32 || hd == 64 || hd == 128 || hd == 256) && !scalar_loops;
      p.keep = keep;
      p.ring_chunk = ring_chunk;
      p.nring = (p.W + ring_chunk - 1) / ring_chunk;
    }
    int64_t r = 1;
    at::Tensor kr, bkc, bvc;
    if (cp) {
      const at::Tensor& c = *cp;
      const at::Tensor& wk = *wkp;
      r = wk.size(2);
      TORCH_CHECK(c.dim() == 3 && c.size(0) == B && c.size(2) == r && c.stride(2) == 1, "attend_step: latents must be [B, S, r] with unit last stride");
      TORCH_CHECK(wk.is_contiguous() && wk.size(1) == hd && wvp->sizes() == wk.sizes(), "attend_step: wk / wv must be contiguous [Hkv, hd, r]");
      TORCH_CHECK(rotated % 2 == 0 && rotated <= hd, "attend_step: rotated dims");
      TORCH_CHECK(q.scalar_type() == c.scalar_type() && q.scalar_type() == wk.scalar_type() && wvp->scalar_type() == wk.scalar_type(), "attend_step: q, latents, wk and wv must share a dtype");
      const int64_t S = c.size(1);
      p.c = c.data_ptr();
      p.c_sb = c.stride(0);
      p.c_ss = c.stride(1);
      if (rotated > 0) {
        const at::Tensor& cos = *cosp;
        TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.size(0) >= S && cos.size(1) == rotated / 2 && cos.stride(1) == 1 && cos.strides() == sinp->strides() &&
                        sinp->scalar_type() == at::kFloat, "attend_step: cos / sin must be fp32 [S, rot/2]");
        // kr [B, S, Hkv·rot] = c · Wk[:, :rot, :]ᵀ: one matmul on the tensor cores.
        kr = at::matmul(c, wk.narrow(1, 0, rotated).reshape({hkv * rotated, r}).t());
        p.kr = kr.data_ptr();
        p.kr_sb = kr.stride(0);
        p.kr_ss = kr.stride(1);
        p.cos = cos.data_ptr<float>();
        p.sin = sinp->data_ptr<float>();
        p.cs_s = cos.stride(0);
      }
      if (bk) bkc = bk->contiguous();
      if (bv) bvc = bv->contiguous();
      p.wk = wk.data_ptr();
      p.bk = bk ? bkc.data_ptr() : nullptr;
      p.window = window;
      p.S = S;
      p.chunk = chunk;
      p.nchunks = (S + chunk - 1) / chunk;
    }
    p.r = r;
    p.hd = hd;
    p.rot = rotated;
    p.g = g;
    p.hkv = hkv;
    p.scale = 1.f / std::sqrt((float)hd);
    auto f32 = q.options().dtype(at::kFloat);
    at::Tensor ml = at::empty({B, H, p.nchunks + p.nring, 2}, f32);
    at::Tensor acc = at::empty({B, H, std::max(p.nchunks, 1), r}, f32);
    at::Tensor accv = at::empty({B, H, std::max(p.nring, 1), hd}, f32);
    p.ml = ml.data_ptr<float>();
    p.acc = acc.data_ptr<float>();
    p.accv = accv.data_ptr<float>();
    const size_t smem = smem_floats(g, r, hd) * sizeof(float);
    TORCH_CHECK(smem <= 200 * 1024, "attend_step: ", smem, " bytes of shared memory (g, r or hd too large)");
    at::Tensor pc = cp ? at::empty({hkv, B * g, r}, q.options()) : at::Tensor();
    at::Tensor extra = at::empty({hkv, B * g, hd}, q.options());
    const int grid = B * H;
    const void* bvptr = bv && cp ? bvc.data_ptr() : nullptr;
    if (q.scalar_type() == at::kBFloat16) {
      using T = __nv_bfloat16;
      if (p.nchunks + p.nring > 0) launch_partial_g<T>(p, B, smem, stream);
      step_combine<T><<<grid, kThreads, 0, stream>>>(p.ml, p.acc, p.accv, bvptr, B, H, g, r, hd, p.nchunks, p.nring,
                                                           cp ? reinterpret_cast<T*>(pc.data_ptr()) : nullptr, reinterpret_cast<T*>(extra.data_ptr()));
    } else if (q.scalar_type() == at::kHalf) {
      using T = __half;
      if (p.nchunks + p.nring > 0) launch_partial_g<T>(p, B, smem, stream);
      step_combine<T><<<grid, kThreads, 0, stream>>>(p.ml, p.acc, p.accv, bvptr, B, H, g, r, hd, p.nchunks, p.nring,
                                                           cp ? reinterpret_cast<T*>(pc.data_ptr()) : nullptr, reinterpret_cast<T*>(extra.data_ptr()));
    } else {
      TORCH_CHECK(false, "attend_step: q must be bf16 or fp16, not ", q.scalar_type());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    // [Hkv, B·g, hd] = extra (+ pc · Wvᵀ), then [B, H, 1, hd].
    at::Tensor o = cp ? at::baddbmm(extra, pc, wvp->transpose(1, 2)) : extra;
    o = o.view({hkv, B, g, hd}).permute({1, 0, 2, 3}).reshape({B, H, 1, hd});
    *out_ = new at::Tensor(o);
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
