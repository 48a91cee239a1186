// The learned feature map's last step (src/attention/feature_maps.rs, still.md §2) for one row by one
// warp, shared by the decode step's mixing kernel (hybrid_step.cuh) and the prefill's linear branch
// (hybrid_linear.cuh). Device code only, all inline; csrc/cuda/emu runs it on the CPU.
#pragma once
#include "block.cuh"
#include <cmath>

namespace {

// φ of one row, every lane of a warp calling it: u [Fh] holds x·W'_h in shared memory, `scale` is
// ‖x‖ / max(‖u‖, 1e-12) with the norm re-injection (else 1); φ = clamp_min([softmax(u·scale) ⊕
// softmax(−u·scale)], 1e-12) replaces it in u [0, 2·Fh), each softmax max-subtracted as aten's. Each
// lane rewrites only the features it read.
__device__ __forceinline__ void feature_softmax_warp(float* u, int Fh, float scale) {
  const int lane = threadIdx.x % 32;
  float mp = -INFINITY, mn = -INFINITY;
  for (int j = lane; j < Fh; j += 32) mp = fmaxf(mp, u[j] * scale), mn = fmaxf(mn, -u[j] * scale);
  mp = warp_max(mp);
  mn = warp_max(mn);
  float sp = 0.f, sn = 0.f;
  for (int j = lane; j < Fh; j += 32) sp += expf(u[j] * scale - mp), sn += expf(-u[j] * scale - mn);
  sp = warp_sum(sp);
  sn = warp_sum(sn);
  for (int j = lane; j < Fh; j += 32) {
    const float x = u[j] * scale;
    u[j] = fmaxf(expf(x - mp) / sp, 1e-12f);
    u[Fh + j] = fmaxf(expf(-x - mn) / sn, 1e-12f);
  }
}

}  // namespace
