// One warp-wide tensor-core product, D = A·B + C with A 16×16 and B 16×8 in bf16, C and D 16×8 in
// fp32 (PTX mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32), with the PTX ISA's fragment
// layout: lane = 4·group + t (group = lane / 4, t = lane % 4);
//   a[0] = A[group][2t, 2t+1], a[1] = A[group+8][2t, 2t+1], a[2] = A[group][2t+8, 2t+9],
//   a[3] = A[group+8][2t+8, 2t+9]; b[0] = B[2t, 2t+1][group], b[1] = B[2t+8, 2t+9][group];
//   c[0..1] = C[group][2t, 2t+1], c[2..3] = C[group+8][2t, 2t+1];
// a 32-bit register holds two bf16, the lower index in its low half. The fp16 form
// (mma_f16_16816, ...f32.f16.f16.f32) has the same layout. Under ATTNLAB_CUDA_EMU the product is
// computed from every lane's fragments as laid out above (cuda_emu.h).
#pragma once
#include "half.cuh"
#include <cmath>
#include <type_traits>

// Two 16-bit values of type T (bf16 or fp16) in one 32-bit register, `lo` in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  return uint32_t(bits_of(from_f<T>(lo))) | (uint32_t(bits_of(from_f<T>(hi))) << 16);
}

// Two bf16 already in memory (adjacent, the first at the lower address, 4-byte aligned) as one
// register, by one 32-bit load.
__device__ __forceinline__ uint32_t load_pair(const __nv_bfloat16* p) {
#ifdef ATTNLAB_CUDA_EMU
  emu::check_aligned(p, 4, "a 32-bit load of a bf16 pair");
#endif
  return *reinterpret_cast<const uint32_t*>(p);
}

// Four 8×8 matrices of 16-bit values from shared memory, one warp-wide load (PTX
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16): lanes 8m .. 8m + 7 name the eight rows of matrix m
// (16 bytes each, 16-byte aligned), and r[m] of lane l = 4·group + t holds matrix m's row group,
// columns 2t, 2t + 1 (the A / B / C fragment layout above); with `_trans` its rows 2t, 2t + 1 of column
// group (a B fragment of a matrix stored row-major along k). Any 16-bit type (bf16, fp16).
#ifndef ATTNLAB_CUDA_EMU
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* row) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
#else
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row) { emu::ldmatrix_x4(r, row, false); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* row) { emu::ldmatrix_x4(r, row, true); }
#endif

// Asynchronous copies global → shared (PTX cp.async, sm_80+): `bytes` (4, 8 or 16) from src to dst,
// both aligned to it, or zeros where `valid` is false (source size 0: src is not read); they land
// once cp_async_wait<N>() has returned with at most N of this thread's committed groups pending, and
// other threads see them after a barrier that follows. Under the emulator a copy lands only then.
#ifndef ATTNLAB_CUDA_EMU
template <int Bytes>
__device__ __forceinline__ void cp_async(void* dst, const void* src, bool valid) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async copies 4, 8 or 16 bytes");
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  const int n = valid ? Bytes : 0;
  if constexpr (Bytes == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(n) : "memory");
  else asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(s), "l"(src), "n"(Bytes), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
#else
template <int Bytes>
__device__ __forceinline__ void cp_async(void* dst, const void* src, bool valid) { emu::cp_async(dst, src, Bytes, valid); }
__device__ __forceinline__ void cp_async_commit() { emu::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { emu::cp_async_wait(N); }
#endif

#ifndef ATTNLAB_CUDA_EMU
__device__ __forceinline__ void mma_bf16_16816(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_f16_16816(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#else
__device__ __forceinline__ void mma_bf16_16816(float c[4], const uint32_t a[4], const uint32_t b[2]) { emu::mma_16816(c, a, b, false); }
__device__ __forceinline__ void mma_f16_16816(float c[4], const uint32_t a[4], const uint32_t b[2]) { emu::mma_16816(c, a, b, true); }
#endif

// The TF32 form, D = A·B + C with A 16×8 and B 8×8 (PTX mma.sync.aligned.m16n8k8.row.col.f32.tf32.
// tf32.f32): a[0] = A[group][t], a[1] = A[group+8][t], a[2] = A[group][t+4], a[3] = A[group+8][t+4];
// b[0] = B[t][group], b[1] = B[t+4][group]; c as above. Operands are fp32 rounded by to_tf32 (10 stored
// mantissa bits, relative rounding ≤ 2⁻¹¹); the products are exact and accumulate in fp32.
#ifndef ATTNLAB_CUDA_EMU
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void mma_tf32_1688(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#else
__device__ __forceinline__ uint32_t to_tf32(float x) { return emu::to_tf32(x); }
__device__ __forceinline__ void mma_tf32_1688(float c[4], const uint32_t a[4], const uint32_t b[2]) { emu::mma_1688_tf32(c, a, b); }
#endif

// The product for operands of type T: bf16 or fp16.
template <typename T>
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  if constexpr (std::is_same_v<T, __half>) mma_f16_16816(c, a, b);
  else mma_bf16_16816(c, a, b);
}

// A quad's max and sum: the four lanes 4·group .. 4·group + 3 that hold one row of a C fragment.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// One tile of scores into a running softmax over rows of C fragments (a row's scores spread over the
// four lanes of a quad; e < 2 of a fragment: the lane's first row, else its row + 8): s (NS fragments
// of 8 columns, masked ones −inf) becomes P = e^{s − m}, the rows' max m and lane-partial sum l are
// updated, and the output o (NO fragments) is rescaled to the new max.
template <int NS, int NO>
__device__ __forceinline__ void online_softmax(float s[NS][4], float m[2], float l[2], float o[NO][4]) {
  float mx[2] = {m[0], m[1]}, f[2];
#pragma unroll
  for (int nt = 0; nt < NS; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) mx[e / 2] = fmaxf(mx[e / 2], s[nt][e]);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = quad_max(mx[r]);
    f[r] = mx[r] == -INFINITY ? 1.f : __expf(m[r] - mx[r]);  // m = −inf: nothing yet (f·0)
    m[r] = mx[r];
    l[r] *= f[r];
  }
#pragma unroll
  for (int d = 0; d < NO; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[d][e] *= f[e / 2];
#pragma unroll
  for (int nt = 0; nt < NS; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float pe = s[nt][e] == -INFINITY ? 0.f : __expf(s[nt][e] - m[e / 2]);
      s[nt][e] = pe;
      l[e / 2] += pe;
    }
}

// acc (16 × D) += P (16 × K: K / 8 C fragments of scores, packed to T here as the A operand) · X
// (K × D, rows of a shared tile D + 8 values apart). X's B fragments of columns d and d + 1 by one
// transposing ldmatrix (matrices 0 / 1: rows kc·16 + 0–7 / 8–15 of column block d; 2 / 3: of d + 1).
template <typename T, int K, int D>
__device__ __forceinline__ void mma_p_x(float acc[D / 8][4], const float p[K / 8][4], const T* xs) {
  constexpr int LD = D + 8;
  const int lane = threadIdx.x % 32, row = lane % 8 + 8 * ((lane / 8) % 2), col = 8 * (lane / 16);
  for (int kc = 0; kc < K / 16; ++kc) {
    const uint32_t pa[4] = {pack_pair<T>(p[2 * kc][0], p[2 * kc][1]), pack_pair<T>(p[2 * kc][2], p[2 * kc][3]),
                            pack_pair<T>(p[2 * kc + 1][0], p[2 * kc + 1][1]), pack_pair<T>(p[2 * kc + 1][2], p[2 * kc + 1][3])};
    for (int d = 0; d < D / 8; d += 2) {
      uint32_t xb[4];
      ldmatrix_x4_trans(xb, xs + (kc * 16 + row) * LD + d * 8 + col);
      mma_16816<T>(acc[d], pa, xb);
      mma_16816<T>(acc[d + 1], pa, xb + 2);
    }
  }
}
