// The STILL / LoLCATs prefill on the tensor cores (issue 34: STILL / LoLCATs prefill ≤ vanilla's at
// 16K; `Hybrid::prefill` in src/attention/still/chunked.rs is the aten form, still.md §3–§4). Two
// kernels, a block per (chunk of 64 queries, b, h), four warps of 16 queries, as dar_band.cuh's band:
//
// hybrid_prefill_scores: each token j's routing score over its C = 64 most recent keys W_j =
//   positions max(0, j − 63) .. j (keys of chunks c − 1 and c in shared memory, S = Q·Kᵀ by mma, every
//   row's logits spread over a quad's four lanes): self-saliency Σ_W a·ln((a + ε) / (b + ε)), a the
//   softmax of the logits over W_j and b the softmax over W_j without j (b ≡ 0 when W_j = {j}); or a at
//   j; or j's own logit (score_kinds.cuh's codes). Written for every row of the padded
//   sequence (rows past T as aten's zero padding gives them), where aten took the [T, 2C] window
//   logits in fp32 and ≈ 15 kernels over them.
//
// hybrid_prefill_mix: each query i of chunk c over its softmax keys Win ∪ Sel, one online softmax
//   (flash attention's), in key tiles of 64, two stages of cp.async:
//     Win: chunk c − 1 (every key) and chunk c up to i; chunk 0 has no previous chunk (with the
//       reference code's phantom keys: C more of logit 0 and value 0, still.md's C6);
//     Sel: selected slots 0 .. seen[c] − 1 of the head's positions `sel` (slots in chunk order, so a
//       query chunk sees a prefix: those of chunks ≤ c − 2), each gathered from its row of K and V;
//   then with m the max of its logits, n_sm = γ_h·Σ e^{logit − m}·v, z_sm = γ_h·Σ e^{logit − m}, and
//   the linear terms n_lin, z_lin given (φ(q)·S of the chunk states: aten, or hybrid_linear.cuh), n_lin
//   times the gate g_i where one is given (read here: aten's product was a full fp32 pass and a copy of
//   the transposed gate), both times e^{−m} when compensated: y_i = (n_sm + g_i ⊙ n_lin) / (z_sm + z_lin
//   + eps), in bf16.
//   Where aten ran ≈ 30 kernels a group of query chunks (masks, logit blocks, maxima, sums, pads).
//
// bf16 only (the band's mma helpers); C = 64 (a tile of keys is a chunk); D ∈ {64, 128}.
// Device code only: csrc/cuda/emu runs it on the CPU in `make test`; csrc/cuda/hybrid_prefill.cu launches it.
#pragma once
#include "dar_band.cuh"
#include "score_kinds.cuh"
#include <cmath>
#include <cstdint>

namespace {

constexpr int kPrefillChunk = kBandKeys;  // a chunk is one tile of keys, and one block of queries

struct PrefillParams {
  View q, k, v;  // [B, T, H, D] views (of [B, H, T, D] tensors: any strides with 16-byte rows, unit d)
  int T, H, n;   // n chunks: the padded length n·C ≥ T
  float scale;   // 1 / √D
  // hybrid_prefill_scores: out [B, H, n·C] fp32 contiguous.
  float* score;
  int score_kind;
  // hybrid_prefill_mix:
  const int64_t* sel;  // the selected positions [B, H, ≥ max seen] (strides sel_sb, sel_sh, unit slot), or null
  int64_t sel_sb, sel_sh;
  const int* seen;     // [n]: Sel slots query chunk c sees
  const float* n_lin;  // [B, H, n·C, D] fp32 contiguous, or null: no linear branch
  const float* z_lin;  // [B, H, n·C] fp32 contiguous
  View gate;           // g [B, T, H, D] (unit d) multiplying n_lin; gate.p null: none (or applied to n_lin)
  const float* gamma;  // [H] or null
  float eps;
  int compensate, phantom;
  __nv_bfloat16* y;  // [B, H, T, D] contiguous
};

// Shared memory: the scores' two K tiles; the mix's two stages of a K and a V tile.
__host__ __device__ inline int64_t prefill_scores_smem_bytes(int D) { return 2 * band_tile_bytes(D); }
__host__ __device__ inline int64_t prefill_mix_smem_bytes(int D) { return band_smem_bytes(D); }

template <int D>
__global__ void __launch_bounds__(kBandThreads) hybrid_prefill_scores(PrefillParams p) {
  ATTNLAB_DYNAMIC_SHARED(__nv_bfloat16, smem);
  constexpr int LD = D + 8, NT = kBandKeys / 8, TILE = kBandKeys * LD, C = kPrefillChunk;
  const auto [warp, group, t, b, h] = place(p.H);
  const int c = blockIdx.x, local0 = warp * 16 + group, row0 = c * C + local0;
  // K of chunks c − 1 (zeros before chunk 0) and c.
  for (int i = threadIdx.x; i < 2 * C * D / 8; i += kBandThreads) {
    const int tile = i / (C * D / 8), r = i % (C * D / 8) / (D / 8), col = 8 * (i % (D / 8));
    const int j = (c - 1 + tile) * C + r;
    const bool ok = j >= 0 && j < p.T;
    cp_async<16>(smem + tile * TILE + r * LD + col, ok ? p.k.at(b, j, h) + col : p.k.p, ok);
  }
  cp_async_commit();
  uint32_t qa[D / 16][4];
  load_a_rows<D>(p.q, b, h, row0, p.T, qa);
  cp_async_wait<0>();
  __syncthreads();
  float s[2][NT][4];
  mma_a_xt<D>(s[0], qa, smem);
  mma_a_xt<D>(s[1], qa, smem + TILE);
#pragma unroll
  for (int tile = 0; tile < 2; ++tile)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[tile][nt][e] *= p.scale;
  // f(r, self, logit) for every logit of this lane's rows' windows: row il = local0 + 8r of the chunk
  // (e < 2 of a fragment: r = 0) sees the previous tile's columns > il (c ≥ 1) and this tile's ≤ il,
  // its own key this tile's column il.
  const int quad_col = t;  // (a lambda may not capture structured bindings before C++20)
  auto over_window = [&](auto f) {
#pragma unroll
    for (int tile = 0; tile < 2; ++tile)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e / 2, il = local0 + 8 * r, col = nt * 8 + 2 * quad_col + (e & 1);
          if (tile == 0 ? c > 0 && col > il : col <= il) f(r, tile == 1 && col == il, s[tile][nt][e]);
        }
  };
  float ma[2] = {-INFINITY, -INFINITY}, mb[2] = {-INFINITY, -INFINITY}, own[2] = {0.f, 0.f};
  over_window([&](int r, bool self, float x) {
    ma[r] = fmaxf(ma[r], x);
    if (self) own[r] = x;
    else mb[r] = fmaxf(mb[r], x);
  });
  float sa[2] = {0.f, 0.f}, sb[2] = {0.f, 0.f};
  for (int r = 0; r < 2; ++r) {
    ma[r] = quad_max(ma[r]);
    mb[r] = quad_max(mb[r]);
    own[r] = quad_sum(own[r]);  // one lane of the quad holds it, the others 0
  }
  over_window([&](int r, bool self, float x) {
    sa[r] += __expf(x - ma[r]);
    if (!self) sb[r] += __expf(x - mb[r]);
  });
  float sc[2];
  for (int r = 0; r < 2; ++r) {
    sa[r] = quad_sum(sa[r]);
    sb[r] = quad_sum(sb[r]);
    sc[r] = p.score_kind == kScoreSelfLogit ? own[r] : __expf(own[r] - ma[r]) / sa[r];
  }
  if (p.score_kind == kScoreSelfSaliency) {
    float kl[2] = {0.f, 0.f};
    over_window([&](int r, bool self, float x) {
      const float a = __expf(x - ma[r]) / sa[r], bq = !self && sb[r] > 0.f ? __expf(x - mb[r]) / sb[r] : 0.f;
      kl[r] += a * logf((a + kScoreEps) / (bq + kScoreEps));
    });
    for (int r = 0; r < 2; ++r) sc[r] = quad_sum(kl[r]);
  }
  if (t == 0)
    for (int r = 0; r < 2; ++r) p.score[((int64_t)b * p.H + h) * p.n * C + row0 + 8 * r] = sc[r];
}

template <int D>
__global__ void __launch_bounds__(kBandThreads) hybrid_prefill_mix(PrefillParams p) {
  ATTNLAB_DYNAMIC_SHARED(__nv_bfloat16, smem);
  constexpr int LD = D + 8, NT = kBandKeys / 8, TILE = kBandKeys * LD, C = kPrefillChunk;
  const auto [warp, group, t, b, h] = place(p.H);
  const int c = blockIdx.x, row0 = c * C + warp * 16 + group;  // this lane's rows: row0 and row0 + 8
  // Tiles: the window's (chunk c − 1 where there is one, then chunk c), then Sel's, 64 slots each.
  const int nwin = c > 0 ? 2 : 1, win0 = (c + 1 - nwin) * C, seen = p.sel ? p.seen[c] : 0;
  const int tiles = nwin + (seen + kBandKeys - 1) / kBandKeys;
  const int64_t* sel = p.sel ? p.sel + b * p.sel_sb + h * p.sel_sh : nullptr;
  const int row_b = b, head = h;  // (a lambda may not capture structured bindings before C++20)
  auto load = [&](int it) {
    __nv_bfloat16* ks = smem + (it & 1) * 2 * TILE;
    for (int i = threadIdx.x; i < kBandKeys * D / 8; i += kBandThreads) {
      const int r = i / (D / 8), col = 8 * (i % (D / 8));
      int64_t j = win0 + it * kBandKeys + r;
      bool ok = j < p.T;
      if (it >= nwin) {
        const int slot = (it - nwin) * kBandKeys + r;
        ok = slot < seen;
        j = ok ? sel[slot] : 0;
      }
      cp_async<16>(ks + r * LD + col, ok ? p.k.at(row_b, j, head) + col : p.k.p, ok);
      cp_async<16>(ks + TILE + r * LD + col, ok ? p.v.at(row_b, j, head) + col : p.v.p, ok);
    }
    cp_async_commit();
  };
  load(0);
  uint32_t qa[D / 16][4];
  load_a_rows<D>(p.q, b, h, row0, p.T, qa);
  float o[D / 8][4], m[2], l[2];
  start_rows<D>(o, m, l);
  for (int it = 0; it < tiles; ++it) {
    if (it + 1 < tiles) load(it + 1);
    wait_for_tile(it, tiles);
    const __nv_bfloat16* ks = smem + (it & 1) * 2 * TILE;
    float s[NT][4];
    mma_a_xt<D>(s, qa, ks);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = row0 + (e >= 2 ? 8 : 0), col = nt * 8 + 2 * t + (e & 1);
        const bool visible = it < nwin ? win0 + it * kBandKeys + col <= i : (it - nwin) * kBandKeys + col < seen;
        s[nt][e] = visible ? s[nt][e] * p.scale : -INFINITY;
      }
    online_softmax<NT, D / 8>(s, m, l, o);
    mma_p_x<__nv_bfloat16, kBandKeys, D>(o, s, ks + TILE);  // O += P·V
    __syncthreads();  // this stage is read: the tile after next may be copied into it
  }
  for (int r = 0; r < 2; ++r) l[r] = quad_sum(l[r]);
  for (int r = 0; r < 2; ++r) {
    const int i = row0 + 8 * r;
    if (i >= p.T) continue;
    float mr = m[r], fo = 1.f, z = l[r];
    if (p.phantom && c == 0) {  // C more keys of logit 0 and value 0
      const float top = fmaxf(mr, 0.f);
      fo = __expf(mr - top);
      z = z * fo + C * __expf(-top);
      mr = top;
    }
    const float g = p.gamma ? p.gamma[h] : 1.f;
    fo *= g;
    z *= g;
    const int64_t lin_row = ((int64_t)b * p.H + h) * p.n * C + i;
    const float* nl = p.n_lin ? p.n_lin + lin_row * D : nullptr;
    const __nv_bfloat16* gr = nl && p.gate.p ? p.gate.at(b, i, h) : nullptr;
    const float lf = nl && p.compensate ? __expf(-mr) : 1.f;
    const float inv = 1.f / (z + (nl ? p.z_lin[lin_row] * lf : 0.f) + p.eps);
    __nv_bfloat16* out = p.y + (((int64_t)b * p.H + h) * p.T + i) * D;
    for (int d = 0; d < D / 8; ++d) {
      const int col = d * 8 + 2 * t;
      // (n_lin · g) · e^{−m}: the order of aten's gated product, then the compensation.
      const float n0 = nl ? nl[col] * (gr ? to_f(gr[col]) : 1.f) : 0.f, n1 = nl ? nl[col + 1] * (gr ? to_f(gr[col + 1]) : 1.f) : 0.f;
      const float x0 = o[d][2 * r] * fo + n0 * lf, x1 = o[d][2 * r + 1] * fo + n1 * lf;
      store_pair(out + col, x0 * inv, x1 * inv);
    }
  }
}

}  // namespace
