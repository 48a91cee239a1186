// The LayerNorm kernels (csrc/cuda/layer_norm.cuh) on the CPU against LayerNorm's formulas in
// double: y from the fp32 residual stream in the 16-bit type, dx in fp32, dγ and dβ summed over
// chunks of rows; rows of fewer and of more elements than a block has threads (1 to kMaxCols
// columns a thread), more rows than one chunk of the column sums. The same for their RMSNorm form
// (RMS = true: no mean, no β) against RMSNorm's formulas.
#include "emu_test.h"
#include "../layer_norm.cuh"

namespace {

struct Ref {
  std::vector<double> y, dx, dg, db;
};

// LayerNorm (rms: RMSNorm, x̂ = x·rstd, no β) of x [n, d] and its gradients for dy; the `planted`
// one drops β from y (RMSNorm: subtracts the mean, as LayerNorm does) and the x̂·mean(g·x̂) term
// from dx, and sums dy·x for dγ.
Ref reference(const std::vector<float>& x, const std::vector<float>& g, const std::vector<float>& b, const std::vector<double>& dy, int n, int d,
              double eps, bool rms, bool planted) {
  Ref r{std::vector<double>(size_t(n) * d), std::vector<double>(size_t(n) * d), std::vector<double>(d), std::vector<double>(d)};
  for (int i = 0; i < n; ++i) {
    const float* xr = &x[size_t(i) * d];
    double mu = 0, var = 0;
    for (int j = 0; j < d; ++j) mu += xr[j];
    mu = rms && !planted ? 0.0 : mu / d;
    for (int j = 0; j < d; ++j) var += (xr[j] - mu) * (xr[j] - mu);
    const double rs = 1.0 / std::sqrt(var / d + eps);
    const double beta_on = rms || planted ? 0.0 : 1.0;
    double mg = 0, mgx = 0;
    for (int j = 0; j < d; ++j) {
      const double xh = (xr[j] - mu) * rs, gr = dy[size_t(i) * d + j] * g[j];
      r.y[size_t(i) * d + j] = xh * g[j] + beta_on * b[j];
      mg += gr / d;
      mgx += gr * xh / d;
      r.dg[j] += dy[size_t(i) * d + j] * (planted ? xr[j] : xh);
      r.db[j] += dy[size_t(i) * d + j];
    }
    for (int j = 0; j < d; ++j) {
      const double xh = (xr[j] - mu) * rs;
      r.dx[size_t(i) * d + j] = rs * (dy[size_t(i) * d + j] * g[j] - (rms ? 0.0 : mg) - (planted ? 0.0 : xh * mgx));
    }
  }
  return r;
}

template <typename T, bool RMS = false>
bool check(int n, int d, const char* dtype, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> N(0.f, 1.f);
  std::vector<float> x(size_t(n) * d), g(d), b(d);
  for (auto& v : x) v = 3.f + 2.f * N(rng);  // an offset: the mean must come out
  for (auto& v : g) v = 1.f + 0.3f * N(rng);
  for (auto& v : b) v = 0.2f * N(rng);
  const auto dy = emu_test::normal<T>(rng, size_t(n) * d, 1.0);
  const double eps = 1e-5;
  const Ref want = reference(x, g, b, dy.ref, n, d, eps, RMS, false), bad = reference(x, g, b, dy.ref, n, d, eps, RMS, true);
  // RMSNorm's kernels take no β (null) and write no mean nor dβ partials (null too).
  const float* beta = RMS ? nullptr : b.data();

  std::vector<T> y(size_t(n) * d);
  std::vector<float> mean(n), rstd(n), dx(size_t(n) * d);
  const int chunks = (n + kRowsPerChunk - 1) / kRowsPerChunk;
  // With as few columns a thread as d needs, as csrc/cuda/layer_norm.cu's launches take them.
  with_cols(d, [&](auto cols) {
    emu::launch(ln_forward<T, decltype(cols)::value, RMS>, dim3(chunks), dim3(kThreads), 0, (const float*)x.data(), (const float*)g.data(), beta,
                (int64_t)n, (int64_t)d, (float)eps, y.data(), RMS ? nullptr : mean.data(), rstd.data());
  });
  std::vector<float> dgp(size_t(chunks) * d), dbp(size_t(chunks) * d);
  with_cols(d, [&](auto cols) {
    emu::launch(ln_backward<T, decltype(cols)::value, RMS>, dim3(chunks), dim3(kThreads), 0, (const T*)dy.dev.data(), (const float*)x.data(),
                (const float*)g.data(), RMS ? nullptr : (const float*)mean.data(), (const float*)rstd.data(), (int64_t)n, (int64_t)d, dx.data(), dgp.data(),
                RMS ? nullptr : dbp.data());
  });

  std::vector<double> gy, gdx(dx.begin(), dx.end()), gdg(d, 0.0), gdb(d, 0.0);
  for (auto v : y) gy.push_back(emu_test::from_half(v));
  for (int c = 0; c < chunks; ++c)
    for (int j = 0; j < d; ++j) {
      gdg[j] += dgp[size_t(c) * d + j];
      gdb[j] += dbp[size_t(c) * d + j];
    }
  const double half_bound = std::is_same_v<T, __half> ? 2e-3 : 1e-2;
  const std::string at = std::string(RMS ? "rms " : "") + dtype + " " + std::to_string(n) + "×" + std::to_string(d);
  using emu_test::rel_err;
  using emu_test::verdict;
  bool ok = verdict("y " + at, rel_err(gy, want.y), rel_err(bad.y, want.y), half_bound);
  ok &= verdict("dx " + at, rel_err(gdx, want.dx), rel_err(bad.dx, want.dx), 1e-4);
  ok &= verdict("dγ " + at, rel_err(gdg, want.dg), rel_err(bad.dg, want.dg), 1e-4);
  if (RMS) return ok;
  // dβ = Σ dy has no planted variant of its own: the same sums with a row left out must fail.
  std::vector<double> short_db = want.db;
  for (int j = 0; j < d; ++j) short_db[j] -= dy.ref[size_t(n - 1) * d + j];
  ok &= verdict("dβ " + at, rel_err(gdb, want.db), rel_err(short_db, want.db), 1e-4);
  return ok;
}

// The forward kernel for a half model's inference (X = T: x and γ in the 16-bit type, no
// statistics written), RMSNorm in either family's rounding (ROUND: x̂ rounded before γ, as HF's
// LlamaRMSNorm; else once after, as Olmo2RMSNorm): y against the formula in double (LayerNorm's
// mean subtracted as the planted one), and bit for bit against each rounding done on the host,
// where its own must match nearly everywhere and the other must not.
template <typename T, bool ROUND>
bool check_infer(int n, int d, const char* dtype, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> N(0.f, 1.f);
  std::vector<T> x(size_t(n) * d), g(d);
  std::vector<float> xf(x.size()), gf(d), zero(d, 0.f);
  for (size_t i = 0; i < x.size(); ++i) xf[i] = emu_test::from_half(x[i] = emu_test::to_half<T>(3.f + 2.f * N(rng)));
  for (int j = 0; j < d; ++j) gf[j] = emu_test::from_half(g[j] = emu_test::to_half<T>(1.f + 0.3f * N(rng)));
  const double eps = 1e-6;
  const std::vector<double> dy(x.size(), 0.0);
  const Ref want = reference(xf, gf, zero, dy, n, d, eps, true, false), bad = reference(xf, gf, zero, dy, n, d, eps, true, true);
  std::vector<T> y(x.size());
  with_cols(d, [&](auto cols) {
    emu::launch(ln_forward<T, decltype(cols)::value, true, T, ROUND>, dim3(infer_blocks(n)), dim3(kThreads), 0,
                (const T*)x.data(), (const T*)g.data(), (const T*)nullptr, (int64_t)n, (int64_t)d, (float)eps, y.data(), (float*)nullptr, (float*)nullptr);
  });
  std::vector<double> gy;
  size_t same_own = 0, same_other = 0;
  std::vector<double> rstd(n, 0.0);
  for (size_t i = 0; i < x.size(); ++i) rstd[i / d] += double(xf[i]) * xf[i] / d;
  for (auto& r : rstd) r = 1.0 / std::sqrt(r + eps);
  for (size_t i = 0; i < y.size(); ++i) {
    gy.push_back(emu_test::from_half(y[i]));
    const float xh = float(xf[i] * rstd[i / d]), gam = gf[i % d];
    const double round_first = emu_test::from_half(emu_test::to_half<T>(float(emu_test::from_half(emu_test::to_half<T>(xh))) * gam));
    const double round_once = emu_test::from_half(emu_test::to_half<T>(xh * gam));
    same_own += gy[i] == (ROUND ? round_first : round_once);
    same_other += gy[i] == (ROUND ? round_once : round_first);
  }
  const double half_bound = std::is_same_v<T, __half> ? 2e-3 : 1e-2;
  const std::string at = std::string("rms infer ") + (ROUND ? "llama " : "olmo2 ") + dtype + " " + std::to_string(n) + "×" + std::to_string(d);
  bool ok = emu_test::verdict("y " + at, emu_test::rel_err(gy, want.y), emu_test::rel_err(bad.y, want.y), half_bound);
  ok &= emu_test::verdict("y's bits unlike the rounding's " + at, 1.0 - double(same_own) / y.size(), 1.0 - double(same_other) / y.size(), 1e-2);
  return ok;
}

bool all_cases() {
  bool ok = check<__nv_bfloat16>(300, 200, "bf16", 11);  // 3 chunks of rows, 4 at a time, the last 44 rows
  ok &= check<__nv_bfloat16>(5, 1024, "bf16", 12);       // rows longer than a block: 4 columns a thread, 2 rows at a time
  ok &= check<__half>(130, 96, "fp16", 13);
  ok &= check<__nv_bfloat16>(7, 512, "bf16", 16);  // 2 columns a thread, 4 rows at a time, the last 3
  ok &= check<__nv_bfloat16>(3, 2500, "bf16", 14);  // 16 columns a thread, the last group ragged
  ok &= check<__nv_bfloat16>(1, 8192, "bf16", 15);  // the widest row (kMaxCols columns a thread), one row
  // RMSNorm: Llama widths (576 = SmolLM2-135M: 4 columns a thread, the last group ragged), an fp16
  // row shorter than a block, and more rows than a chunk.
  ok &= check<__nv_bfloat16, true>(300, 576, "bf16", 17);
  ok &= check<__half, true>(9, 96, "fp16", 18);
  ok &= check<__nv_bfloat16, true>(3, 2048, "bf16", 19);
  // A half model's RMSNorm (decode): one row, rows of a prefill, each family's rounding.
  ok &= check_infer<__nv_bfloat16, true>(1, 576, "bf16", 20);
  ok &= check_infer<__nv_bfloat16, false>(1, 576, "bf16", 21);
  ok &= check_infer<__nv_bfloat16, true>(200, 2048, "bf16", 22);
  ok &= check_infer<__half, false>(130, 96, "fp16", 23);
  ok &= check_infer<__half, true>(5, 960, "fp16", 24);
  return ok;
}

emu_test::Register reg("layer_norm: forward and backward vs the formulas", all_cases);

}  // namespace
