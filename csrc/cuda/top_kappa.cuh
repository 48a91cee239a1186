// The routing's top-κ (src/attention/still/routing.rs `top_kappa`: the indices of a row's κ highest
// scores by aten's stable descending sort, then sorted ascending) of many rows of C scores in one
// kernel, where aten runs two sorts (and their copies) a layer, in STILL's prefill (every chunk) and
// in its decode's routing. A block per row at a time: the scores into shared memory, each index's
// rank counted against the others (a score before it: greater, or equal at a lower index; NaN before
// every number, as aten sorts it), the selected ones' flags, and each selected index written at the
// count of selected indices below it. C² comparisons a row: at C = 64 far below a sort's launches.
// Device code only: csrc/cuda/emu runs it on the CPU in `make test`; csrc/cuda/top_kappa.cu launches it.
#pragma once
#include "half.cuh"
#include <cmath>
#include <cstdint>

namespace {

constexpr int kTopThreads = 64;

struct TopKappaParams {
  const float* scores;  // row r's C scores at scores + r·ld, unit stride within a row
  int64_t rows, ld;
  int C, kappa;         // 0 < κ ≤ C
  int64_t* out;         // [rows, κ], ascending within a row
};

// Dynamic shared memory of top_kappa_rank, in bytes: a row's scores and its flags.
__host__ __device__ inline int64_t top_kappa_smem_bytes(int C) { return (int64_t)C * (sizeof(float) + sizeof(int)); }

// Whether score a (index i) comes before score b (index j) in aten's stable descending sort.
__device__ __forceinline__ bool sorts_before(float a, int i, float b, int j) {
  const bool na = a != a, nb = b != b;
  if (na || nb) return na && (!nb || i < j);
  return a > b || (a == b && i < j);
}

__global__ void __launch_bounds__(kTopThreads) top_kappa_rank(TopKappaParams p) {
  ATTNLAB_DYNAMIC_SHARED(float, smem);
  float* sc = smem;
  int* sel = reinterpret_cast<int*>(smem + p.C);
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const float* row = p.scores + r * p.ld;
    for (int i = threadIdx.x; i < p.C; i += kTopThreads) sc[i] = row[i];
    __syncthreads();
    for (int i = threadIdx.x; i < p.C; i += kTopThreads) {
      int rank = 0;
      for (int j = 0; j < p.C; ++j) rank += sorts_before(sc[j], j, sc[i], i);
      sel[i] = rank < p.kappa;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < p.C; i += kTopThreads) {
      if (!sel[i]) continue;
      int at = 0;
      for (int j = 0; j < i; ++j) at += sel[j];
      p.out[r * p.kappa + at] = i;
    }
    __syncthreads();  // every read of sc and sel done before the next row overwrites them
  }
}

}  // namespace
