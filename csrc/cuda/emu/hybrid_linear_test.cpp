// The STILL / LoLCATs prefill's linear branch (csrc/cuda/hybrid_linear.cuh) on the CPU against
// still.md §2–§3 in double: φ by the folded map (with and without the norm re-injection), the state of
// chunks ≤ c − 2 without the selected tokens, n_t = φ(q_t)·S_c and z_t = φ(q_t)·z_c on every row of the
// padded sequence, and the state after the sequence. Ragged T, a single chunk, F/2 ≠ D, D 64 and 128;
// the products by fp32 SIMT tiles and on the tensor cores (TF32).
#include "emu_test.h"
#include "../hybrid_linear.cuh"

namespace {

using Bf = __nv_bfloat16;
constexpr int C = kLinChunk;

struct Case {
  int B, H, T, D, Fh;
  bool reinject, keep;
};

struct Ref {
  std::vector<double> n_lin, z_lin, s_last, z_last;
};

// φ(x) of one row (zeros past T: aten pads the sequence with zeros), W [D, Fh].
std::vector<double> phi(const std::vector<double>& x, size_t at, bool present, int D, int Fh, const float* W, bool reinject) {
  std::vector<double> u(Fh, 0.0);
  double x2 = 0, u2 = 0;
  for (int d = 0; d < D; ++d) {
    const double xd = present ? x[at + d] : 0.0;
    x2 += xd * xd;
    for (int j = 0; j < Fh; ++j) u[j] += xd * W[size_t(d) * Fh + j];
  }
  for (double v : u) u2 += v * v;
  const double scale = reinject ? std::sqrt(x2) / std::max(std::sqrt(u2), 1e-12) : 1.0;
  std::vector<double> out(2 * Fh);
  for (int sign = 0; sign < 2; ++sign) {
    double m = -INFINITY, s = 0;
    for (double v : u) m = std::max(m, (sign ? -v : v) * scale);
    for (double v : u) s += std::exp((sign ? -v : v) * scale - m);
    for (int j = 0; j < Fh; ++j) out[sign * Fh + j] = std::max(std::exp((sign ? -u[j] : u[j]) * scale - m) / s, 1e-12);
  }
  return out;
}

// `lag` 2 is still.md's (chunks ≤ c − 2 in the state); a planted reference takes 1, or drops keep.
Ref reference(const Case& k, int n, const std::vector<double>& q, const std::vector<double>& kk, const std::vector<double>& v, const std::vector<float>& wq,
              const std::vector<float>& wk, const std::vector<float>& keep, int lag, bool use_keep) {
  const int D = k.D, Fh = k.Fh, F = 2 * Fh;
  Ref r;
  for (int b = 0; b < k.B; ++b)
    for (int h = 0; h < k.H; ++h) {
      const size_t bh = size_t(b) * k.H + h;
      auto at = [&](int t) { return (bh * k.T + t) * D; };
      const float* Wq = wq.data() + size_t(h) * D * Fh;
      const float* Wk = wk.data() + size_t(h) * D * Fh;
      // states[c]: Σ over tokens of chunks ≤ c − lag.
      std::vector<double> S(size_t(F) * D, 0.0), z(F, 0.0);
      std::vector<std::vector<double>> Sc(n), zc(n);
      for (int c = 0; c < n; ++c) {
        const int fold = c - lag;  // the chunk that joins the state here
        if (fold >= 0)
          for (int t = fold * C; t < std::min(k.T, (fold + 1) * C); ++t) {
            const double w = use_keep && !keep.empty() ? keep[bh * n * C + t] : 1.0;
            const std::vector<double> p = phi(kk, at(t), true, D, Fh, Wk, k.reinject);
            for (int f = 0; f < F; ++f) {
              z[f] += w * p[f];
              for (int d = 0; d < D; ++d) S[size_t(f) * D + d] += w * p[f] * v[at(t) + d];
            }
          }
        Sc[c] = S, zc[c] = z;
      }
      for (int t = 0; t < n * C; ++t) {
        const int c = t / C;
        const std::vector<double> p = phi(q, t < k.T ? at(t) : 0, t < k.T, D, Fh, Wq, k.reinject);
        double zt = 0;
        for (int f = 0; f < F; ++f) zt += p[f] * zc[c][f];
        r.z_lin.push_back(zt);
        for (int d = 0; d < D; ++d) {
          double s = 0;
          for (int f = 0; f < F; ++f) s += p[f] * Sc[c][size_t(f) * D + d];
          r.n_lin.push_back(s);
        }
      }
      r.s_last.insert(r.s_last.end(), Sc[n - 1].begin(), Sc[n - 1].end());
      r.z_last.insert(r.z_last.end(), zc[n - 1].begin(), zc[n - 1].end());
    }
  return r;
}

bool check(const Case& k, unsigned seed, bool tf32) {
  std::mt19937 rng(seed);
  const int n = (k.T + C - 1) / C, D = k.D, Fh = k.Fh, F = 2 * Fh;
  const size_t elems = size_t(k.B) * k.H * k.T * D;
  const auto q = emu_test::normal<Bf>(rng, elems, 1.5), kk = emu_test::normal<Bf>(rng, elems, 1.0), v = emu_test::normal<Bf>(rng, elems, 1.0);
  std::normal_distribution<float> w(0.f, 1.f / std::sqrt(float(D)));
  std::vector<float> wq(size_t(k.H) * D * Fh), wk(wq.size()), keep;
  for (float& x : wq) x = w(rng);
  for (float& x : wk) x = w(rng);
  std::bernoulli_distribution selected(0.25);
  if (k.keep)
    for (size_t i = 0; i < size_t(k.B) * k.H * n * C; ++i) keep.push_back(selected(rng) ? 0.f : 1.f);
  std::vector<float> state(size_t(k.B) * k.H * n * F * D, NAN), zstate(size_t(k.B) * k.H * n * F, NAN);
  std::vector<float> n_lin(size_t(k.B) * k.H * n * C * D, NAN), z_lin(size_t(k.B) * k.H * n * C, NAN);
  const int64_t sb = int64_t(k.H) * k.T * D, sh = int64_t(k.T) * D;
  LinearParams p{View{q.dev.data(), sb, D, sh}, View{kk.dev.data(), sb, D, sh}, View{v.dev.data(), sb, D, sh}, k.T, k.H, n, D, Fh,
                 wq.data(), wk.data(), k.reinject, k.reinject, k.keep ? keep.data() : nullptr, state.data(), zstate.data(), n_lin.data(), z_lin.data()};
  const dim3 grid(n, k.B * k.H);
  emu::launch(tf32 ? hybrid_linear_states<true> : hybrid_linear_states<false>, grid, dim3(kLinThreads), linear_smem_bytes(D, Fh), p);
  emu::launch(hybrid_linear_scan, dim3((F * D + F + kLinThreads - 1) / kLinThreads, k.B * k.H), dim3(kLinThreads), 0, p);
  emu::launch(tf32 ? hybrid_linear_query<true> : hybrid_linear_query<false>, grid, dim3(kLinThreads), linear_smem_bytes(D, Fh), p);

  const Ref want = reference(k, n, q.ref, kk.ref, v.ref, wq, wk, keep, 2, true);
  // Planted: the state one chunk late (chunk c − 1 in it); where the keep mask is tested, it ignored.
  const Ref planted = reference(k, n, q.ref, kk.ref, v.ref, wq, wk, keep, 1, true);
  const Ref unkept = k.keep ? reference(k, n, q.ref, kk.ref, v.ref, wq, wk, keep, 2, false) : planted;
  std::vector<double> s_last, z_last;
  for (int bh = 0; bh < k.B * k.H; ++bh) {
    const size_t s0 = (size_t(bh) * n + n - 1) * F;
    s_last.insert(s_last.end(), state.begin() + s0 * D, state.begin() + (s0 + F) * D);
    z_last.insert(z_last.end(), zstate.begin() + s0, zstate.begin() + s0 + F);
  }
  auto d = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
  using emu_test::rel_err;
  using emu_test::verdict;
  const std::string at = "T " + std::to_string(k.T) + ", D " + std::to_string(D) + ", F/2 " + std::to_string(Fh) + (k.reinject ? ", re-injected" : "") + (k.keep ? ", Sel dropped" : "") + (tf32 ? ", TF32" : "");
  // fp32 products: 1e-4. TF32 operands (unit round-off 2⁻¹¹ ≈ 4.9e-4, on both factors of every term):
  // four round-offs (measured 1.4e-5–5.8e-4). The planted references are 0.3–0.8 away.
  const double bound = tf32 ? 4 * std::ldexp(1.0, -11) : 1e-4;
  // The nearer of two planted references to the right one.
  auto worst = [&](const std::vector<double>& right, const std::vector<double>& p1, const std::vector<double>& p2) { return std::min(rel_err(p1, right), rel_err(p2, right)); };
  bool ok = true;
  if (n < 3) {
    // Two chunks or fewer: no query sees a state, so every output is zero (the buffers start as NaN).
    bool zero = true;
    for (const auto* x : {&n_lin, &z_lin}) for (float y : *x) zero &= y == 0.f;
    for (double y : s_last) zero &= y == 0.0;
    for (double y : z_last) zero &= y == 0.0;
    std::printf("  %-58s %s\n", ("every output zero, " + at).c_str(), zero ? "ok" : "FAILED");
    return zero;
  }
  ok &= verdict("n_lin, " + at, rel_err(d(n_lin), want.n_lin), worst(want.n_lin, planted.n_lin, unkept.n_lin), bound);
  ok &= verdict("z_lin, " + at, rel_err(d(z_lin), want.z_lin), worst(want.z_lin, planted.z_lin, unkept.z_lin), bound);
  ok &= verdict("S after the sequence, " + at, rel_err(s_last, want.s_last), worst(want.s_last, planted.s_last, unkept.s_last), bound);
  ok &= verdict("z after the sequence, " + at, rel_err(z_last, want.z_last), worst(want.z_last, planted.z_last, unkept.z_last), bound);
  return ok;
}

bool all_cases() {
  bool ok = true;
  unsigned seed = 91;
  // STILL's NP-Map (F/2 = D) with Sel dropped, ragged; LoLCATs' Hedgehog (F/2 ≠ D, no re-injection);
  // one chunk (no state anywhere); D 128.
  // Each with fp32 SIMT products and on the tensor cores (TF32).
  for (bool tf32 : {false, true}) {
    ok &= check({1, 2, 300, 64, 64, true, true}, seed++, tf32);
    ok &= check({2, 1, 200, 64, 32, false, false}, seed++, tf32);
    ok &= check({1, 1, 40, 64, 64, true, false}, seed++, tf32);
    ok &= check({1, 1, 260, 128, 16, true, true}, seed++, tf32);
    // A Llama-width NP-Map (F/2 = D = 128): the largest tiles, more tiles than threads in every product.
    ok &= check({1, 1, 200, 128, 128, true, true}, seed++, tf32);
  }
  // F/2 = 12: a multiple of 4, not of 8, which only the SIMT tiles take (hybrid_prefill.cu decides).
  ok &= check({1, 1, 200, 64, 12, true, true}, seed++, false);
  return ok;
}

emu_test::Register reg("hybrid_linear: STILL / LoLCATs prefill's linear branch (φ, chunk states, φ(q)·S) vs still.md", all_cases);

}  // namespace
