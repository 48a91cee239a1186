// SwiGLU's product y = silu(gate)·up for a half model's inference (Llama / OLMo 2 MLPs: decode,
// prefill, evaluation). aten takes two passes: `silu` reads gate, a strided half of the stacked
// gate / up projection, one element at a time, and writes a full intermediate that `mul` reads
// again with up (at 16K tokens the two took 1.1 of a STILL prefill's 9.9 ms on one H200). Here one
// pass reads gate and up once and writes y, eight values a thread, 16 bytes at a time where the
// rows allow (`swiglu_vec_fits`), else one at a time.
//
// Rounded as aten's two ops: s = T(silu(float(g))) with silu(x) = x / (1 + e^{−x}) in fp32, then
// y = T(float(s)·float(u)), so y is aten's bit for bit wherever the two exponentials agree.
//
// Device code only: csrc/cuda/emu runs it on the CPU in `make test`; csrc/cuda/swiglu.cu launches it.
#pragma once
#include "half.cuh"
#include <cmath>
#include <cstdint>

namespace {

constexpr int kSwigluThreads = 256;

// What the kernel reads and writes: gate and up `rows` × `cols` with row strides g_ld and u_ld (the
// halves of one stacked projection, or two tensors), y `rows` × `cols` contiguous.
struct SwigluParams {
  const void* g;
  const void* u;
  void* y;
  int64_t rows, cols, g_ld, u_ld;
};

template <typename T>
__device__ __forceinline__ float silu_mul_one(float g, float u) {
  const float s = to_f(from_f<T>(g / (1.f + expf(-g))));
  return s * u;
}

// Whether the 16-byte form takes these rows: eight columns a load, every row start 16-byte aligned.
inline bool swiglu_vec_fits(const SwigluParams& p) {
  const auto aligned = [](const void* x) { return reinterpret_cast<uintptr_t>(x) % 16 == 0; };
  return p.cols % 8 == 0 && p.g_ld % 8 == 0 && p.u_ld % 8 == 0 && aligned(p.g) && aligned(p.u) && aligned(p.y);
}

// VEC: eight columns a thread by 16-byte loads (swiglu_vec_fits), else one column a thread. A
// grid-stride loop over the rows × cols / (VEC ? 8 : 1) items.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kSwigluThreads) silu_mul(SwigluParams p) {
  constexpr int W = VEC ? 8 : 1;
  const int64_t per_row = p.cols / W, items = p.rows * per_row;
  const T* g = static_cast<const T*>(p.g);
  const T* u = static_cast<const T*>(p.u);
  T* y = static_cast<T*>(p.y);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < items; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / per_row, c = (i - r * per_row) * W;
    if constexpr (VEC) {
      const Pack8 gv = *reinterpret_cast<const Pack8*>(g + r * p.g_ld + c);
      const Pack8 uv = *reinterpret_cast<const Pack8*>(u + r * p.u_ld + c);
      Pack8 out;
#pragma unroll
      for (int e = 0; e < 8; ++e) pack_set<T>(out, e, silu_mul_one<T>(pack_at<T>(gv, e), pack_at<T>(uv, e)));
      *reinterpret_cast<Pack8*>(y + r * p.cols + c) = out;
    } else {
      y[r * p.cols + c] = from_f<T>(silu_mul_one<T>(to_f(g[r * p.g_ld + c]), to_f(u[r * p.u_ld + c])));
    }
  }
}

}  // namespace
