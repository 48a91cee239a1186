// The CUDA subset our kernels use (csrc/cuda/*.cuh), emulated on the CPU so that `make test` runs
// the kernels' own code against references on a machine without a GPU (csrc/cuda/emu/*_test.cpp).
//
// Every CUDA thread of a block is an OS thread; blocks run one after another. That gives the
// semantics the kernels rely on, and catches what breaks them:
// - __syncthreads() is a barrier of the block's threads (a thread that returns drops out of it, as on
//   the GPU); shared memory is a function's `static` (one block at a time) or, dynamic, a per-block
//   buffer filled with NaNs, so a read before any write shows;
// - __shfl_*_sync are barriers of the warp's 32 lanes: a shuffle that not every lane of the warp
//   reaches deadlocks here (the runner's alarm ends it), the divergence bug it is on a GPU;
// - 16-bit floats round to nearest even, as the device's conversions do.
// - with `emu::jitter` set (the runner's second pass), warps are held back at random at their
//   start and after every barrier, so the others run ahead into the next phase; with
//   `emu::run_ahead` (the third), one warp of each of a launch's first 8 blocks and its last always
//   finishes a phase and starts the next before the others leave the barrier between them: a
//   missing barrier (a tile read before it is written, or overwritten while another warp still
//   reads it) then changes the results, and the test's reference check fails;
// - a launch the GPU would refuse (over 1024 threads a block, over 227 KB of shared memory), a
//   write into the 16 bytes past a block's dynamic shared memory, or a misaligned vector load or
//   store (half.cuh's Pack8, mma.cuh's load_pair and ldmatrix rows) aborts the run.
// Not emulated: timing, memory coherence beyond the barriers, warp-synchronous code without a
// shuffle or __syncwarp (none of ours), and anything not declared below (it fails to compile).
#pragma once
#define ATTNLAB_CUDA_EMU 1

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// One block runs at a time, so a function's static is its block's shared memory.
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

// 16-bit floats: the bits, converted as the device converts (round to nearest even).
struct __nv_bfloat16 {
  uint16_t bits;
};
struct __half {
  uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t u = uint32_t(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40)};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return {uint16_t(u >> 16)};
}
// fp16 by bits (no _Float16: g++ before 12 lacks it on x86).
inline float __half2float(__half h) {
  const uint32_t sign = uint32_t(h.bits & 0x8000u) << 16, e = (h.bits >> 10) & 0x1fu, m = h.bits & 0x3ffu;
  uint32_t u;
  if (e == 0) {
    const float f = std::ldexp(float(m), -24);  // zero or subnormal, exact
    return sign ? -f : f;
  }
  u = e == 31 ? sign | 0x7f800000u | (m << 13) : sign | ((e + 112) << 23) | (m << 13);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __half __float2half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return {uint16_t(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u))};
  if (ax >= 0x477ff000u) return {uint16_t(sign | 0x7c00u)};  // from 65520 on: inf
  if (ax < 0x38800000u) {                                    // below 2^-14: a subnormal half, or zero
    if (ax < 0x33000000u) return {sign};                     // at most 2^-25: zero (the tie rounds to even)
    const uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u, shift = 126 - e;
    uint32_t h = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
    return {uint16_t(sign | h)};
  }
  uint32_t h = (ax >> 13) - (112u << 10);
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return {uint16_t(sign | h)};
}

inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
template <typename A, typename B>
inline std::common_type_t<A, B> min(A a, B b) {
  return a < b ? a : b;
}
template <typename A, typename B>
inline std::common_type_t<A, B> max(A a, B b) {
  return a < b ? b : a;
}

namespace emu {

struct Warp {
  std::unique_ptr<std::barrier<>> bar;
  uint64_t slot[32];
};

struct Block {
  std::unique_ptr<std::barrier<>> all;
  std::vector<Warp> warps;
  std::vector<unsigned char> shared;
  // Run-ahead (below): the leading warp, its lanes and their arrivals at block barriers (a lane
  // that returns counts as arriving at every later one).
  bool ahead = false;  // run-ahead applies to this block
  int leader = 0, leader_lanes = 32;
  std::atomic<int> leader_arrivals{0};
};

inline Block* block = nullptr;  // the running block (one at a time)
inline thread_local int tid = 0;  // this thread's linear index in its block

// Schedule jitter: 0 is off; otherwise the seed of which warps wait, and how long.
inline uint64_t jitter = 0;
inline thread_local uint64_t jitter_block = 0, jitter_calls = 0;
// The runner's third pass: one warp of a block runs a whole phase ahead of all the others.
inline bool run_ahead = false;
// How many block barriers this thread has passed.
inline thread_local int phase = 0;

inline bool is_leader() { return tid / 32 == block->leader; }

// Under run-ahead, a thread other than the leader's, having passed its k-th block barrier (k = 0 at
// its start), waits (asleep, not polling: it must leave the cores to the leader) until the leader's
// lanes have arrived at barrier k + 1 or returned:
// the leader always finishes a phase and starts the next before anyone else reads, so a missing
// barrier before shared memory is overwritten changes the results. Random holds (the second pass)
// rarely give a warp that much of a lead: the others' shuffles take longer than the holds.
inline void wait_for_leader() {
  if (!block->ahead || is_leader()) return;
  const int want = block->leader_lanes * (phase + 1);
  for (int seen = block->leader_arrivals.load(); seen < want; seen = block->leader_arrivals.load()) block->leader_arrivals.wait(seen);
}

// Called where a thread starts and where it leaves a barrier. Under jitter, a warp (every lane the
// same: on a GPU a warp's lanes move together) sleeps 20–200 µs one time in three, so the other
// warps run ahead; otherwise its lanes may yield their cores.
inline void maybe_hold_back() {
  if (run_ahead) return wait_for_leader();  // (and no random holds)
  if (!jitter) return;
  uint64_t x = jitter ^ (jitter_block * 0x9E3779B97F4A7C15ull) ^ ((uint64_t(tid / 32) + 1) << 32) ^ (++jitter_calls * 0xD1B54A32D192ED03ull);
  x ^= x >> 31, x *= 0x7FB5D329728EA185ull, x ^= x >> 27, x *= 0x81DADEF4BC2DD44Dull, x ^= x >> 33;  // a 64-bit mix
  if (x % 3 == 0) std::this_thread::sleep_for(std::chrono::microseconds(20 + (x >> 8) % 180));
  else if ((x >> 4) & 1) std::this_thread::yield();
}

inline Warp& warp() { return block->warps[tid / 32]; }

// A vector load or store at an address the GPU would refuse (misaligned for its width) aborts.
inline void check_aligned(const void* p, size_t bytes, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % bytes != 0) {
    std::fprintf(stderr, "cuda-emu: %s at %p, which is not %zu-byte aligned (thread %d)\n", what, p, bytes, tid);
    std::abort();
  }
}

template <typename T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(block->shared.data());
}

// Threads of a 1-D, 2-D or 3-D block in order x, y, z; blocks likewise, one after another.
template <typename... P, typename... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 threads, size_t shared_bytes, A... args) {
  gridDim = grid;
  blockDim = threads;
  const int n = int(threads.x * threads.y * threads.z);
  // What an H100 / H200 refuses to launch (227 KB: the most dynamic shared memory a block may opt into).
  if (n > 1024 || grid.y > 65535 || grid.z > 65535 || shared_bytes > 227 * 1024) {
    std::fprintf(stderr, "cuda-emu: a launch the GPU refuses: %d threads a block, grid y %u z %u, %zu bytes of shared memory\n", n, grid.y, grid.z, shared_bytes);
    std::abort();
  }
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block b;
        b.all = std::make_unique<std::barrier<>>(n);
        b.warps.resize((n + 31) / 32);
        for (int w = 0; w < (n + 31) / 32; ++w) b.warps[w].bar = std::make_unique<std::barrier<>>(std::min(32, n - 32 * w));
        b.shared.assign(shared_bytes + 16, 0xff);  // NaN in every float: a read before a write shows
        // Under run_ahead, the first 8 blocks and the last (a ragged edge) run with one warp ahead,
        // which one varying from block to block; the others as scheduled (every wake-up is a
        // futex call: all blocks of a large grid took minutes).
        const uint64_t linear = (uint64_t(bz) * grid.y + by) * grid.x + bx, blocks = uint64_t(grid.x) * grid.y * grid.z;
        b.ahead = run_ahead && (linear < 8 || linear + 1 == blocks);
        b.leader = int(linear % b.warps.size());
        b.leader_lanes = std::min(32, n - 32 * b.leader);
        block = &b;
        std::vector<std::thread> ts;
        ts.reserve(n);
        for (int t = 0; t < n; ++t) {
          ts.emplace_back([&, t] {
            tid = t;
            threadIdx = dim3(t % threads.x, (t / threads.x) % threads.y, t / (threads.x * threads.y));
            blockIdx = dim3(bx, by, bz);
            jitter_block = linear + 1, jitter_calls = 0;
            phase = 0;
            maybe_hold_back();
            kernel(args...);
            if (block->ahead && is_leader()) {
              block->leader_arrivals.fetch_add(1 << 24);
              block->leader_arrivals.notify_all();
            }
            // A returned thread no longer holds the others at a barrier (as on the GPU).
            warp().bar->arrive_and_drop();
            block->all->arrive_and_drop();
          });
        }
        for (auto& t : ts) t.join();
        // The 16 bytes past the dynamic shared memory are still as filled: nothing wrote beyond it.
        if (std::any_of(b.shared.end() - 16, b.shared.end(), [](unsigned char c) { return c != 0xff; })) {
          std::fprintf(stderr, "cuda-emu: block (%u, %u, %u) wrote past its %zu bytes of dynamic shared memory\n", bx, by, bz, shared_bytes);
          std::abort();
        }
        block = nullptr;
      }
}

template <typename T>
T exchange(T v, int src) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  Warp& w = warp();
  const int lane = tid % 32;
  std::memcpy(&w.slot[lane], &v, sizeof(T));
  w.bar->arrive_and_wait();
  T r;
  std::memcpy(&r, &w.slot[src], sizeof(T));
  w.bar->arrive_and_wait();
  return r;
}

// A warp's mma.sync, D = A·B + C with C and D 16 × 8 in fp32, from the 32 lanes' fragments: each lane
// publishes its registers, then computes its own outputs (c[e]: row group, + 8 for e ≥ 2, column
// 2t + e % 2) in double, A(a, row, k) and B(b, k, n) reading an operand out of the lanes' registers
// (a[lane][4], b[lane][2]) as the PTX ISA lays it out (csrc/cuda/mma.cuh).
template <int K, typename AOf, typename BOf>
inline void warp_mma(float c[4], const uint32_t a[4], const uint32_t b[2], AOf A, BOf B) {
  struct Fragments {
    uint32_t a[32][4], b[32][2];
  };
  static Fragments frag[64];  // one per warp of the running block
  Fragments& f = frag[tid / 32];
  const int lane = tid % 32, group = lane / 4, t = lane % 4;
  std::memcpy(f.a[lane], a, sizeof(f.a[lane]));
  std::memcpy(f.b[lane], b, sizeof(f.b[lane]));
  warp().bar->arrive_and_wait();
  for (int e = 0; e < 4; ++e) {
    const int row = group + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
    double acc = c[e];
    for (int k = 0; k < K; ++k) acc += double(A(f.a, row, k)) * B(f.b, k, col);
    c[e] = float(acc);
  }
  warp().bar->arrive_and_wait();
}

// m16n8k16, bf16 or (`f16`) fp16 in: two 16-bit values a register, the lower k in its low half.
inline float bf16_half_of(uint32_t reg, int k) {
  const uint32_t u = (k & 1 ? reg >> 16 : reg & 0xffffu) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float f16_half_of(uint32_t reg, int k) { return __half2float(__half{uint16_t(k & 1 ? reg >> 16 : reg & 0xffffu)}); }
inline void mma_16816(float c[4], const uint32_t a[4], const uint32_t b[2], bool f16) {
  auto half_of = [f16](uint32_t reg, int k) { return f16 ? f16_half_of(reg, k) : bf16_half_of(reg, k); };
  auto A = [&](const uint32_t (*a)[4], int row, int k) { return half_of(a[(row % 8) * 4 + (k % 8) / 2][(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k); };
  auto B = [&](const uint32_t (*b)[2], int k, int n) { return half_of(b[n * 4 + (k % 8) / 2][k >= 8 ? 1 : 0], k); };
  warp_mma<16>(c, a, b, A, B);
}

// cvt.rna.tf32.f32: x rounded to TF32's 10 stored mantissa bits, to nearest, ties away from zero
// (the bits below them zero); NaN and infinity unchanged.
inline uint32_t to_tf32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return u;
  return (u + 0x1000u) & 0xffffe000u;
}

// m16n8k8 with TF32 operands: A(row, k) in lane (row % 8)·4 + k % 4, register (row ≥ 8) + 2·(k ≥ 4);
// B(k, n) in lane 4·n + k % 4, register (k ≥ 4).
inline void mma_1688_tf32(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  auto value = [](uint32_t reg) {
    // The hardware ignores the bits below TF32's mantissa (it truncates); the kernels round by
    // to_tf32 first, and an operand that did not is an error here.
    if (reg & 0x1fffu) {
      std::fprintf(stderr, "cuda-emu: a TF32 mma operand with bits below TF32's mantissa (not from to_tf32)\n");
      std::abort();
    }
    float x;
    std::memcpy(&x, &reg, 4);
    return x;
  };
  auto A = [&](const uint32_t (*a)[4], int row, int k) { return value(a[(row % 8) * 4 + k % 4][(row >= 8 ? 1 : 0) + (k >= 4 ? 2 : 0)]); };
  auto B = [&](const uint32_t (*b)[2], int k, int n) { return value(b[n * 4 + k % 4][k >= 4 ? 1 : 0]); };
  warp_mma<8>(c, a, b, A, B);
}

// cp.async (csrc/cuda/mma.cuh), at either end of the window in which the GPU may complete a copy:
// normally a thread's copies land only when its cp.async.wait_group lets them (the latest moment),
// so a tile read before its wait (and the barrier after it) shows the old bytes, or the NaNs dynamic
// shared memory starts with; under run-ahead they land at once (the earliest), so a leader that
// starts copying into a stage the others still read (a missing barrier after a tile's use) changes
// what they read. `bytes` 4, 8 or 16, both ends aligned to it; `valid` false: zeros (the PTX source
// size 0), the source not read.
struct AsyncCopy {
  void* dst;
  const void* src;
  int bytes;
  bool valid;
};
inline thread_local std::vector<AsyncCopy> async_open;  // issued, not yet committed
inline thread_local std::vector<std::vector<AsyncCopy>> async_groups;  // committed, oldest first
inline void land(const AsyncCopy& c) {
  if (c.valid) std::memcpy(c.dst, c.src, c.bytes);
  else std::memset(c.dst, 0, c.bytes);
}
inline void cp_async(void* dst, const void* src, int bytes, bool valid) {
  check_aligned(dst, bytes, "a cp.async destination");
  if (valid) check_aligned(src, bytes, "a cp.async source");
  async_open.push_back({dst, src, bytes, valid});
  if (run_ahead) land(async_open.back()), async_open.pop_back();
}
inline void cp_async_commit() {
  async_groups.push_back(std::move(async_open));
  async_open.clear();
}
inline void cp_async_wait(int pending) {
  while ((int)async_groups.size() > pending) {
    for (const AsyncCopy& c : async_groups.front()) land(c);
    async_groups.erase(async_groups.begin());
  }
}

// ldmatrix.x4 (csrc/cuda/mma.cuh): each lane publishes the row it names, then gathers its pairs.
inline void ldmatrix_x4(uint32_t r[4], const void* row, bool trans) {
  static const unsigned char* rows[64][32];  // per warp of the running block, per lane
  const int lane = tid % 32, w = tid / 32, group = lane / 4, t = lane % 4;
  check_aligned(row, 16, "an ldmatrix row");
  rows[w][lane] = static_cast<const unsigned char*>(row);
  warp().bar->arrive_and_wait();
  auto at = [&](int m, int i, int j) {  // matrix m, row i, column j
    uint16_t x;
    std::memcpy(&x, rows[w][8 * m + i] + 2 * j, 2);
    return uint32_t(x);
  };
  for (int m = 0; m < 4; ++m)
    r[m] = trans ? at(m, 2 * t, group) | at(m, 2 * t + 1, group) << 16 : at(m, group, 2 * t) | at(m, group, 2 * t + 1) << 16;
  warp().bar->arrive_and_wait();
}

}  // namespace emu

inline void __syncthreads() {
  if (emu::block->ahead && emu::is_leader()) {
    // The followers wait for whole phases: wake them once, when the leader's last lane arrives.
    if ((emu::block->leader_arrivals.fetch_add(1) + 1) % emu::block->leader_lanes == 0) emu::block->leader_arrivals.notify_all();
  }
  emu::block->all->arrive_and_wait();
  ++emu::phase;
  emu::maybe_hold_back();
}
inline void __syncwarp(unsigned = 0xffffffffu) {
  emu::warp().bar->arrive_and_wait();
  emu::maybe_hold_back();
}

// Device-wide memory order and atomics: blocks run one after another here, so a fence has nothing
// left to order and an atomic only needs to be one among the block's threads.
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline int atomicAdd(int* address, int value) { return std::atomic_ref<int>(*address).fetch_add(value); }
// A load that bypasses L1 on the GPU (another block's writes of this launch): a plain load here.
template <typename T>
T __ldcg(const T* p) {
  return *p;
}

// Only full-warp masks are used (and emulated): every lane takes part.
template <typename T>
T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
  const int lane = emu::tid % 32;
  const int src = (lane ^ lane_mask) < ((lane / width) + 1) * width ? lane ^ lane_mask : lane;
  return emu::exchange(v, src);
}
template <typename T>
T __shfl_sync(unsigned, T v, int src_lane, int width = 32) {
  const int lane = emu::tid % 32;
  return emu::exchange(v, (lane / width) * width + src_lane % width);
}
template <typename T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
  const int lane = emu::tid % 32;
  const int src = lane % width + int(delta) < width ? lane + int(delta) : lane;
  return emu::exchange(v, src);
}

#define ATTNLAB_DYNAMIC_SHARED(T, name) T* name = emu::dynamic_shared<T>()
