// The STILL / LoLCATs prefill kernels (csrc/cuda/hybrid_prefill.cuh) on the CPU against still.md's
// definitions in double: the routing scores over each token's 64 most recent keys, and the output
// of softmax over Win ∪ Sel merged with given linear terms. Ragged T, the first chunks (no previous
// chunk, no Sel), a Sel cap (max_chunks), the phantom chunk-0 keys, γ, compensation, no linear
// branch, the gate on the linear numerator (read in [B, T, H, D] order, as the model's projection
// gives it), D 64 and 128.
#include "emu_test.h"
#include "../hybrid_prefill.cuh"

namespace {

using Bf = __nv_bfloat16;
constexpr int C = kPrefillChunk;

struct Case {
  int B, H, T, D;
  int kappa, max_chunks;  // Sel: κ slots of each chunk ≤ c − 2, at most max_chunks chunks
  bool linear, compensate, phantom, gamma;
  bool gate = false;  // g ⊙ n_lin, g [B, T, H, D] in (0, 1)
};

struct Inputs {
  int B, H, T, D, n;
  emu_test::Half<Bf> q, k, v;
  size_t at(int b, int h, int t) const { return ((size_t(b) * H + h) * T + t) * D; }
  // Row t of x, zero past T (aten pads the sequence with zeros to whole chunks).
  double dot(const std::vector<double>& x, const std::vector<double>& y, int b, int h, int i, int j) const {
    if (i >= T || j >= T) return 0.0;
    double s = 0;
    for (int d = 0; d < D; ++d) s += x[at(b, h, i) + d] * y[at(b, h, j) + d];
    return s;
  }
};

// still.md §4 over the `width` most recent keys (64; a planted reference changes it), the token's own
// key `own` places back (0; a planted reference takes the previous token's).
std::vector<double> scores_ref(const Inputs& x, int kind, int width, int own = 0) {
  const double scale = 1.0 / std::sqrt(double(x.D)), eps = kScoreEps;
  std::vector<double> out;
  for (int b = 0; b < x.B; ++b)
    for (int h = 0; h < x.H; ++h)
      for (int j = 0; j < x.n * C; ++j) {
        std::vector<double> s;
        for (int p = std::max(0, j - width + 1); p <= j; ++p) s.push_back(x.dot(x.q.ref, x.k.ref, b, h, j, p) * scale);
        const size_t self = s.size() - 1 - std::min<size_t>(own, s.size() - 1);
        double ma = -INFINITY, mb = -INFINITY, sa = 0, sb = 0;
        for (size_t i = 0; i < s.size(); ++i) {
          ma = std::max(ma, s[i]);
          if (i != self) mb = std::max(mb, s[i]);
        }
        for (size_t i = 0; i < s.size(); ++i) {
          sa += std::exp(s[i] - ma);
          if (i != self) sb += std::exp(s[i] - mb);
        }
        double r = kind == kScoreSelfLogit ? s[self] : std::exp(s[self] - ma) / sa;
        if (kind == kScoreSelfSaliency) {
          r = 0;
          for (size_t i = 0; i < s.size(); ++i) {
            const double a = std::exp(s[i] - ma) / sa, bb = i != self && sb > 0 ? std::exp(s[i] - mb) / sb : 0.0;
            r += a * std::log((a + eps) / (bb + eps));
          }
        }
        out.push_back(r);
      }
  return out;
}

// The hybrid output in double. Sel of query chunk c: the first seen[c] slots of sel (κ tokens of
// each routed chunk in chunk order); `early` (planted) lets chunk c see chunk c − 1's slots too.
std::vector<double> mix_ref(const Inputs& x, const Case& k, const std::vector<int64_t>& sel, int nsel, const std::vector<int>& seen, const std::vector<double>& n_lin,
                            const std::vector<double>& z_lin, const std::vector<double>& gamma, const std::vector<double>& gate, bool early) {
  const double scale = 1.0 / std::sqrt(double(x.D)), eps = 1e-6;
  std::vector<double> y(size_t(x.B) * x.H * x.T * x.D);
  for (int b = 0; b < x.B; ++b)
    for (int h = 0; h < x.H; ++h)
      for (int i = 0; i < x.T; ++i) {
        const int c = i / C;
        std::vector<int64_t> keys;
        for (int j = std::max(0, (c - 1) * C); j <= i; ++j) keys.push_back(j);
        const int visible = early ? std::min(nsel, seen[c] + k.kappa) : seen[c];
        for (int s = 0; s < visible; ++s) keys.push_back(sel[(size_t(b) * x.H + h) * nsel + s]);
        std::vector<double> s;
        for (int64_t j : keys) s.push_back(x.dot(x.q.ref, x.k.ref, b, h, i, int(j)) * scale);
        const bool phantom = k.phantom && c == 0;
        double m = phantom ? 0.0 : -INFINITY;  // the phantom keys' logits are 0
        for (double v : s) m = std::max(m, v);
        double z = phantom ? C * std::exp(-m) : 0.0;
        std::vector<double> num(x.D, 0.0);
        for (size_t n = 0; n < keys.size(); ++n) {
          const double e = std::exp(s[n] - m);
          z += e;
          for (int d = 0; d < x.D; ++d) num[d] += e * x.v.ref[x.at(b, h, int(keys[n])) + d];
        }
        const double g = gamma.empty() ? 1.0 : gamma[h];
        const size_t row = (size_t(b) * x.H + h) * x.n * C + i;
        const double lf = k.compensate ? std::exp(-m) : 1.0, zl = k.linear ? z_lin[row] * lf : 0.0;
        for (int d = 0; d < x.D; ++d) {
          const double gd = gate.empty() ? 1.0 : gate[((size_t(b) * x.T + i) * x.H + h) * x.D + d];
          const double nl = k.linear ? n_lin[row * x.D + d] * gd * lf : 0.0;
          y[x.at(b, h, i) + d] = (g * num[d] + nl) / (g * z + zl + eps);
        }
      }
  return y;
}

template <int D>
bool check(const Case& k, unsigned seed) {
  std::mt19937 rng(seed);
  Inputs x{k.B, k.H, k.T, D, (k.T + C - 1) / C, {}, {}, {}};
  const size_t n = size_t(k.B) * k.H * k.T * D;
  x.q = emu_test::normal<Bf>(rng, n, 1.5), x.k = emu_test::normal<Bf>(rng, n, 1.0), x.v = emu_test::normal<Bf>(rng, n, 1.0);
  PrefillParams p{};
  const int64_t sb = int64_t(k.H) * k.T * D, sh = int64_t(k.T) * D;
  p.q = View{x.q.dev.data(), sb, D, sh}, p.k = View{x.k.dev.data(), sb, D, sh}, p.v = View{x.v.dev.data(), sb, D, sh};
  p.T = k.T, p.H = k.H, p.n = x.n, p.scale = 1.f / std::sqrt(float(D));
  const dim3 grid(x.n, k.B * k.H);
  const std::string at = "T " + std::to_string(k.T) + ", D " + std::to_string(D);
  using emu_test::rel_err;
  using emu_test::verdict;
  bool ok = true;

  // The routing scores, each kind; planted: a window of 65 keys.
  std::vector<float> score(size_t(k.B) * k.H * x.n * C, NAN);
  p.score = score.data();
  const char* names[] = {"", "self-saliency", "a_tt", "own logit"};
  for (int kind = kScoreSelfSaliency; kind <= kScoreSelfLogit; ++kind) {
    p.score_kind = kind;
    emu::launch(hybrid_prefill_scores<D>, grid, dim3(kBandThreads), prefill_scores_smem_bytes(D), p);
    // Planted: a window of 65 keys; for the own logit (no window), the previous token's.
    const std::vector<double> want = scores_ref(x, kind, C), planted = kind == kScoreSelfLogit ? scores_ref(x, kind, C, 1) : scores_ref(x, kind, C + 1);
    ok &= verdict(std::string("scores, ") + names[kind] + ", " + at, rel_err(std::vector<double>(score.begin(), score.end()), want), rel_err(planted, want), 1e-4);
  }

  // Sel: κ random tokens of each chunk ≤ min(n − 3, max_chunks − 1), in chunk order.
  const int routed = std::max(0, std::min(x.n - 2, k.max_chunks)), nsel = routed * k.kappa;
  std::vector<int64_t> sel(size_t(k.B) * k.H * std::max(nsel, 1), -1);
  for (int bh = 0; bh < k.B * k.H; ++bh)
    for (int c = 0; c < routed; ++c) {
      std::vector<int> pick(C);
      for (int i = 0; i < C; ++i) pick[i] = i;
      std::shuffle(pick.begin(), pick.end(), rng);
      for (int s = 0; s < k.kappa; ++s) sel[size_t(bh) * nsel + c * k.kappa + s] = int64_t(c) * C + pick[s];
    }
  std::vector<int> seen(x.n);
  for (int c = 0; c < x.n; ++c) seen[c] = std::min(nsel, k.kappa * std::max(0, c - 1));
  std::uniform_real_distribution<double> u(0.2, 2.0);
  std::vector<double> n_lin, z_lin, gamma;
  std::vector<float> n_lin_f, z_lin_f, gamma_f;
  if (k.linear)
    for (size_t r = 0; r < size_t(k.B) * k.H * x.n * C; ++r) {
      // z_lin as φ(q)·z is positive; n_lin of the values' scale times it.
      z_lin.push_back(std::ldexp(u(rng), 3)), z_lin_f.push_back(float(z_lin.back()));
      for (int d = 0; d < D; ++d) n_lin.push_back(z_lin.back() * (u(rng) - 1.1)), n_lin_f.push_back(float(n_lin.back()));
    }
  if (k.gamma)
    for (int h = 0; h < k.H; ++h) gamma.push_back(u(rng)), gamma_f.push_back(float(gamma.back()));
  emu_test::Half<Bf> gate;
  if (k.gate) {
    std::uniform_real_distribution<float> unit(0.05f, 0.95f);
    for (size_t i = 0; i < n; ++i) gate.dev.push_back(emu_test::to_half<Bf>(unit(rng))), gate.ref.push_back(emu_test::from_half(gate.dev.back()));
    p.gate = View{gate.dev.data(), int64_t(k.T) * k.H * D, int64_t(k.H) * D, D};
  }
  if (nsel > 0) p.sel = sel.data(), p.sel_sb = int64_t(k.H) * nsel, p.sel_sh = nsel, p.seen = seen.data();
  if (k.linear) p.n_lin = n_lin_f.data(), p.z_lin = z_lin_f.data();
  if (k.gamma) p.gamma = gamma_f.data();
  p.eps = 1e-6f, p.compensate = k.compensate, p.phantom = k.phantom;
  std::vector<Bf> y(n);
  p.y = y.data();
  emu::launch(hybrid_prefill_mix<D>, grid, dim3(kBandThreads), prefill_mix_smem_bytes(D), p);
  const std::vector<double> want = mix_ref(x, k, sel, nsel, seen, n_lin, z_lin, gamma, gate.ref, false);
  // Planted: with a gate, the gate left out; else Sel one chunk early where there is a Sel; else the
  // phantom keys' rule flipped.
  Case flipped = k;
  flipped.phantom = !k.phantom;
  const std::vector<double> planted = k.gate    ? mix_ref(x, k, sel, nsel, seen, n_lin, z_lin, gamma, {}, false)
                                      : nsel > 0 ? mix_ref(x, k, sel, nsel, seen, n_lin, z_lin, gamma, {}, true)
                                                 : mix_ref(x, flipped, sel, nsel, seen, n_lin, z_lin, gamma, {}, false);
  std::vector<double> got;
  for (Bf v : y) got.push_back(emu_test::from_half(v));
  const std::string what = "output, " + at + ", κ " + std::to_string(k.kappa) + (k.linear ? ", linear" : "") + (k.compensate ? ", compensated" : "") +
                           (k.phantom ? ", phantom" : "") + (k.gamma ? ", γ" : "") + (k.gate ? ", gate" : "");
  ok &= verdict(what, rel_err(got, want), rel_err(planted, want), 1.6e-2);
  return ok;
}

bool all_cases() {
  bool ok = true;
  unsigned seed = 71;
  // STILL: several routed chunks, a ragged end; the budget's cap; LoLCATs: no Sel, γ, compensated.
  // (κ 32 at D 128: 96 slots, two tiles of Sel, for the last chunk.)
  ok &= check<64>({1, 2, 200, 64, 4, 1000, true, false, false, false}, seed++);
  ok &= check<64>({2, 3, 230, 64, 4, 1000, true, false, false, false, true}, seed++);  // the gate (STILL's)
  ok &= check<64>({2, 1, 300, 64, 8, 2, true, true, false, false}, seed++);
  ok &= check<64>({1, 1, 150, 64, 0, 0, true, true, false, true}, seed++);
  ok &= check<64>({1, 1, 100, 64, 4, 1000, false, false, true, false}, seed++);
  ok &= check<128>({1, 1, 260, 128, 32, 1000, true, false, false, false}, seed++);
  return ok;
}

emu_test::Register reg("hybrid_prefill: STILL / LoLCATs routing scores and Win ∪ Sel mix vs still.md's definitions", all_cases);

}  // namespace
