// SwiGLU's product kernel (csrc/cuda/swiglu.cuh) on the CPU: y = silu(gate)·up against the definition in
// double, and bit for bit against aten's two roundings done on the host (silu rounded to the 16-bit
// type, then the product), on the halves of one stacked projection (the 16-byte form) and on rows
// it cannot load 16 bytes at a time (the one-value form); a few blocks, so the grid-stride loop runs.
#include "emu_test.h"
#include "../swiglu.cuh"

namespace {

template <typename T>
bool check(int rows, int cols, int ld, bool vec, int blocks, const char* dtype, unsigned seed) {
  std::mt19937 rng(seed);
  // gate and up as the two halves of one [rows, ld] buffer (the stacked projection): gate at column 0,
  // up at column ld / 2.
  auto buf = emu_test::normal<T>(rng, size_t(rows) * ld, 2.0);
  const int u0 = ld / 2;
  std::vector<T> y(size_t(rows) * cols);
  SwigluParams p{buf.dev.data(), buf.dev.data() + u0, y.data(), rows, cols, ld, ld};
  if (swiglu_vec_fits(p) != vec) {
    std::printf("  swiglu case %d×%d ld %d: the 16-byte form %s, not as the case says\n", rows, cols, ld, vec ? "does not fit" : "fits");
    return false;
  }
  if (vec) emu::launch(silu_mul<T, true>, dim3(blocks), dim3(kSwigluThreads), 0, p);
  else emu::launch(silu_mul<T, false>, dim3(blocks), dim3(kSwigluThreads), 0, p);
  std::vector<double> got, want, planted;
  size_t same_two = 0, same_one = 0;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const double g = buf.ref[size_t(r) * ld + c], u = buf.ref[size_t(r) * ld + u0 + c];
      got.push_back(emu_test::from_half(y[size_t(r) * cols + c]));
      want.push_back(g / (1.0 + std::exp(-g)) * u);
      planted.push_back(u / (1.0 + std::exp(-u)) * g);  // gate and up swapped
      const float gf = float(g), uf = float(u);
      const float s = float(emu_test::from_half(emu_test::to_half<T>(gf / (1.f + std::exp(-gf)))));
      same_two += got.back() == emu_test::from_half(emu_test::to_half<T>(s * uf));
      same_one += got.back() == emu_test::from_half(emu_test::to_half<T>(gf / (1.f + std::exp(-gf)) * uf));
    }
  const double bound = std::is_same_v<T, __half> ? 2e-3 : 1e-2;
  const std::string at = std::string(dtype) + " " + std::to_string(rows) + "×" + std::to_string(cols) + (vec ? " (16 bytes)" : " (one value)");
  const double n = double(got.size());
  bool ok = emu_test::verdict("silu(gate)·up " + at, emu_test::rel_err(got, want), emu_test::rel_err(planted, want), bound);
  ok &= emu_test::verdict("bits unlike aten's two roundings " + at, 1.0 - same_two / n, 1.0 - same_one / n, 1e-3);
  return ok;
}

bool swiglu() {
  bool ok = true;
  ok &= check<__nv_bfloat16>(37, 64, 128, true, 3, "bf16", 1);
  ok &= check<__half>(5, 96, 192, true, 1, "fp16", 2);
  ok &= check<__nv_bfloat16>(9, 12, 24, false, 2, "bf16", 3);  // 12 columns: not whole 16-byte loads
  ok &= check<__nv_bfloat16>(4, 40, 81, false, 1, "bf16", 4);  // odd row stride: rows off 16 bytes
  return ok;
}

emu_test::Register reg("swiglu: silu(gate)·up in one pass, against the definition and aten's roundings", swiglu);

}  // namespace
