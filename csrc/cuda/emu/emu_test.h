// What the kernel tests under csrc/cuda/emu share: a registry (each *_test.cpp adds its tests),
// seeded inputs rounded to the kernels' 16-bit types, and the error measure with its verdict.
#pragma once
#include "cuda_emu.h"
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace emu_test {

struct Test {
  const char* name;
  std::function<bool()> run;  // true: passed (it prints what failed)
};

std::vector<Test>& registry();

struct Register {
  Register(const char* name, std::function<bool()> run) { registry().push_back({name, std::move(run)}); }
};

// Values of a 16-bit type T for the kernels and the same values as doubles for the references.
template <typename T>
struct Half {
  std::vector<T> dev;
  std::vector<double> ref;
};

template <typename T>
inline T to_half(float x);
template <>
inline __nv_bfloat16 to_half<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}
template <>
inline __half to_half<__half>(float x) {
  return __float2half(x);
}
inline double from_half(__nv_bfloat16 x) { return __bfloat162float(x); }
inline double from_half(__half x) { return __half2float(x); }

template <typename T>
Half<T> normal(std::mt19937& rng, size_t n, double sd) {
  std::normal_distribution<float> d(0.f, float(sd));
  Half<T> h;
  for (size_t i = 0; i < n; ++i) {
    const T x = to_half<T>(d(rng));
    h.dev.push_back(x);
    h.ref.push_back(from_half(x));
  }
  return h;
}

// max |got − want| / max |want|: the kernel's error relative to the output's scale.
inline double rel_err(const std::vector<double>& got, const std::vector<double>& want) {
  double e = 0, s = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    // std::max drops a NaN (every comparison with it is false): a NaN output is an infinite error.
    if (i < got.size() && std::isnan(got[i]) != std::isnan(want[i])) return INFINITY;
    e = std::max(e, std::abs(got[i] - want[i]));
    s = std::max(s, std::abs(want[i]));
  }
  return (std::isfinite(e) && got.size() == want.size()) ? e / std::max(s, 1e-30) : INFINITY;
}

// The kernel's error within `bound`, and a planted wrong reference (e.g. a window one slot off)
// beyond it: the comparison can tell a wrong kernel from a right one.
inline bool verdict(const std::string& what, double err, double planted, double bound) {
  const bool ok = err <= bound && planted > bound;
  std::printf("  %-58s err %.2e  planted %.2e  bound %.1e  %s\n", what.c_str(), err, planted, bound, ok ? "ok" : "FAILED");
  return ok;
}

}  // namespace emu_test
