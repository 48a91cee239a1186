// Warp- and block-wide reductions and ring-slot positions for the decode and prefill kernels
// (csrc/cuda/attend_step.cuh, hybrid_step.cuh, hybrid_linear.cuh): device code only, all inline; csrc/cuda/emu runs it on the CPU.
#pragma once
#include <cmath>
#include <cstdint>

namespace {

// One warp's max / sum of x over its lanes (every lane gets it).
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, off));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffff, x, off);
  return x;
}

// The block's max (kMax) or sum of x over its kThreadsN threads (a multiple of 32); every thread
// gets it. `red` holds kThreadsN / 32 floats of shared memory. Its barriers also publish the shared
// writes made before it.
template <int kThreadsN, bool kMax>
__device__ __forceinline__ float block_reduce(float x, float* red) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float y = __shfl_xor_sync(0xffffffff, x, off);
    x = kMax ? fmaxf(x, y) : x + y;
  }
  __syncthreads();  // red may still be read from the previous call
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < kThreadsN / 32; ++w) r = kMax ? fmaxf(r, red[w]) : r + red[w];
  return r;
}

// The position slot s holds once position `newest` is written: s itself, or for a ring of `keep`
// slots the latest position ≤ newest congruent to s (cache::ring_positions on the host).
__device__ __forceinline__ int64_t slot_position(int64_t newest, int64_t s, int64_t keep) {
  return keep > 0 ? newest - (((newest - s) % keep) + keep) % keep : s;
}

}  // namespace
