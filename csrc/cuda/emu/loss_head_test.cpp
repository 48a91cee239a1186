// The loss head's kernel (csrc/cuda/loss_head.cuh) on the CPU against cross-entropy in double:
// each row's nll, and the row overwritten with scale·(softmax − one-hot); rows read as 16-byte packs
// and one value at a time, or held in registers (`ce_grad_in_place_held`, rows of up to 8·kThreads·
// kPacks values, packs past the row's end in some threads), a row stride wider than the row, a target
// outside the vocabulary (nll NaN, no one-hot term).
#include "emu_test.h"
#include "../loss_head.cuh"

namespace {

enum class Kernel { OneByOne, Packs, Held };

template <typename T>
void launch_held(int n, T* x, int64_t ld, const int64_t* t, int64_t V, float scale, float* nll) {
  const bool fits = with_packs(V, [&](auto packs) {
    emu::launch(ce_grad_in_place_held<T, decltype(packs)::value>, dim3(n), dim3(kThreads), 0, x, ld, t, V, scale, nll);
  });
  if (!fits) {
    std::printf("  FAILED: V %lld is too wide for the held kernel\n", (long long)V);
    std::exit(1);
  }
}

template <typename T, Kernel kKernel>
bool check(int n, int V, int ld, const char* what, unsigned seed) {
  std::mt19937 rng(seed);
  auto x = emu_test::normal<T>(rng, size_t(n) * ld, 3.0);
  std::vector<int64_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (i * 7919) % V;
  t[n - 1] = -1;  // outside the vocabulary
  const double scale = 1.0 / n;
  std::vector<double> want_g, bad_g, want_nll, bad_nll;
  for (int i = 0; i < n; ++i) {
    const double* r = &x.ref[size_t(i) * ld];
    double m = -INFINITY, z = 0;
    for (int j = 0; j < V; ++j) m = std::max(m, r[j]);
    for (int j = 0; j < V; ++j) z += std::exp(r[j] - m);
    const double lse = m + std::log(z);
    want_nll.push_back(t[i] >= 0 ? lse - r[t[i]] : NAN);
    bad_nll.push_back(t[i] >= 0 ? lse - r[(t[i] + 1) % V] : NAN);
    for (int j = 0; j < V; ++j) {
      const double p = std::exp(r[j] - lse) * scale;
      want_g.push_back(p - (j == t[i] ? scale : 0.0));
      bad_g.push_back(p - (j == (t[i] + 1) % V ? scale : 0.0));  // planted: the target one off
    }
  }
  std::vector<float> nll(n);
  if (kKernel == Kernel::Held) {
    launch_held<T>(n, x.dev.data(), ld, t.data(), V, (float)scale, nll.data());
  } else {
    emu::launch(ce_grad_in_place<T, kKernel == Kernel::Packs>, dim3(n), dim3(kThreads), 0, x.dev.data(), (int64_t)ld, (const int64_t*)t.data(),
                (int64_t)V, (float)scale, nll.data());
  }
  std::vector<double> got_g, got_nll, want_nll_in, bad_nll_in, got_padding;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < V; ++j) got_g.push_back(emu_test::from_half(x.dev[size_t(i) * ld + j]));
    // The stride's padding is not the row's: left as it was.
    for (int j = V; j < ld; ++j) got_padding.push_back(emu_test::from_half(x.dev[size_t(i) * ld + j]) - x.ref[size_t(i) * ld + j]);
    if (i < n - 1) {
      got_nll.push_back(nll[i]);
      want_nll_in.push_back(want_nll[i]);
      bad_nll_in.push_back(bad_nll[i]);
    }
  }
  const bool nan_row = std::isnan(nll[n - 1]);
  bool ok = emu_test::verdict(std::string("gradient rows, ") + what, emu_test::rel_err(got_g, want_g), emu_test::rel_err(bad_g, want_g),
                              std::is_same_v<T, __half> ? 2e-3 : 1e-2);
  ok &= emu_test::verdict(std::string("nll, ") + what, emu_test::rel_err(got_nll, want_nll_in), emu_test::rel_err(bad_nll_in, want_nll_in), 1e-5);
  for (double e : got_padding) {
    if (e != 0.0) {
      std::printf("  FAILED: the row stride's padding was written\n");
      ok = false;
      break;
    }
  }
  if (!nan_row) std::printf("  FAILED: a target outside the vocabulary gave nll %g, not NaN\n", nll[n - 1]);
  return ok && nan_row;
}

bool all_cases() {
  bool ok = check<__nv_bfloat16, Kernel::Packs>(7, 1000, 1008, "bf16 packs, stride 1008", 21);
  ok &= check<__nv_bfloat16, Kernel::OneByOne>(5, 997, 997, "bf16 one by one", 22);
  ok &= check<__half, Kernel::Packs>(4, 2048, 2048, "fp16 packs", 23);
  // Held in registers: 2 packs a thread (some threads with one or none), 4, and 12 (a ragged last
  // slot: Pythia's padded vocabulary, 50,304 values); fp16; a stride wider than the row.
  ok &= check<__nv_bfloat16, Kernel::Held>(5, 5000, 5008, "bf16 held, 2 packs a thread, stride 5008", 24);
  ok &= check<__nv_bfloat16, Kernel::Held>(3, 16384, 16384, "bf16 held, 4 packs a thread", 25);
  ok &= check<__nv_bfloat16, Kernel::Held>(2, 50304, 50304, "bf16 held, 13 of 16 packs a thread", 26);
  ok &= check<__half, Kernel::Held>(3, 3000, 3000, "fp16 held", 27);
  return ok;
}

emu_test::Register reg("loss_head: in-place cross-entropy gradient vs its formula", all_cases);

}  // namespace
