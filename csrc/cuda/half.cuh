// 16-bit floats in the kernels (csrc/cuda/*.cu): conversions to and from fp32 for bf16 and fp16,
// and eight of them as one 16-byte load. One copy for every kernel file (all inline). Under
// ATTNLAB_CUDA_EMU (csrc/cuda/emu/cuda_emu.h, included first) the CPU emulation supplies the types.
#pragma once
#ifndef ATTNLAB_CUDA_EMU
#include <cuda_bf16.h>
#include <cuda_fp16.h>
// A kernel's dynamically sized shared memory (the launch's third argument), as an array `name`.
#define ATTNLAB_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif
#include <cstdint>

__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }

// Eight 16-bit values as one 16-byte load, held as four 32-bit words (value 2i in the low half of
// word i, value 2i + 1 in the high half, as in memory): entries are taken apart by shifts, so an
// array of packs indexed by unrolled constants stays in four registers a pack.
#ifndef ATTNLAB_CUDA_EMU
struct alignas(16) Pack8 {
  uint32_t w[4];
};
#else
// Emulated: every copy checks that both ends are 16-byte aligned, as the GPU's vector load and
// store require (a misaligned one is an error there, and nothing at all on a CPU).
struct alignas(16) Pack8 {
  uint32_t w[4];
  Pack8() = default;
  Pack8(const Pack8& o) {
    emu::check_aligned(&o, 16, "a 16-byte load (Pack8)");
    std::memcpy(w, o.w, 16);
  }
  Pack8& operator=(const Pack8& o) {
    emu::check_aligned(&o, 16, "a 16-byte load (Pack8)");
    emu::check_aligned(this, 16, "a 16-byte store (Pack8)");
    std::memcpy(w, o.w, 16);
    return *this;
  }
};
#endif

// A 16-bit value from its bits and back.
#ifndef ATTNLAB_CUDA_EMU
__device__ __forceinline__ void from_bits(uint16_t b, __nv_bfloat16& h) { h = __ushort_as_bfloat16(b); }
__device__ __forceinline__ void from_bits(uint16_t b, __half& h) { h = __ushort_as_half(b); }
__device__ __forceinline__ uint16_t bits_of(__nv_bfloat16 h) { return __bfloat16_as_ushort(h); }
__device__ __forceinline__ uint16_t bits_of(__half h) { return __half_as_ushort(h); }
#else
template <typename T>
inline void from_bits(uint16_t b, T& h) { h.bits = b; }
template <typename T>
inline uint16_t bits_of(T h) { return h.bits; }
#endif

// Entry e of a pack, as fp32 (T: the values' 16-bit type).
template <typename T>
__device__ __forceinline__ float pack_at(const Pack8& x, int e) {
  T h;
  from_bits(uint16_t(x.w[e >> 1] >> (16 * (e & 1))), h);
  return to_f(h);
}

// Entry e of a pack set to fp32 `v` rounded to T.
template <typename T>
__device__ __forceinline__ void pack_set(Pack8& x, int e, float v) {
  const uint32_t b = bits_of(from_f<T>(v)), shift = 16 * (e & 1);
  x.w[e >> 1] = (x.w[e >> 1] & ~(0xffffu << shift)) | (b << shift);
}
