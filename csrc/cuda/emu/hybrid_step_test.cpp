// The STILL / LoLCATs decode step's mixing kernel (csrc/cuda/hybrid_step.cuh) on the CPU against
// the hybrid operator's formula in double (still.md §3, `Hybrid::mix` over `Hybrid::step_at`'s
// blocks): the window ring's visible slots (chunks c − 1 and c; slots not yet written before the
// ring fills), the filled Sel slots, γ, the gate, the max-compensated and the softmax-only forms.
#include "emu_test.h"
#include "../hybrid_step.cuh"

namespace {

using Bf = __nv_bfloat16;

struct Case {
  const char* name;
  int B, H, C, cap, D, F;
  int64_t pos, n_sel;
  bool gamma, gate, linear, compensate;
  int score;  // kScore*: the routing score the kernel also writes
  int fmap;   // 0: φ(q) given; 1: computed from W' (u = q·W'); 2: with the norm re-injection
  bool fresh = false;  // the new token's key / value handed over, its ring slot stale until the kernel writes it
  bool gate_logits = false;  // the gate handed over before its sigmoid (the kernel takes σ)
};

// The routing score (still.md §4, routing.rs) of the token at `pos` of row bh in double, over positions
// max(0, pos − C + 1) .. pos of the ring. `plant`: a window one token too long, or, where the window
// starts at 0 (pos < C), b taken with the token itself; the own logit: the previous token's (pos ≥ 1).
double score_reference(int kind, const std::vector<double>& q, const std::vector<double>& wk, size_t bh, int C, int D, int64_t pos, bool plant) {
  const int W2 = 2 * C;
  const int64_t first = std::max<int64_t>(0, pos - C + 1 - (plant ? 1 : 0));
  const bool b_with_self = plant && pos < C;
  std::vector<double> s;
  for (int64_t t = first; t <= pos; ++t) {
    const double* kk = &wk[(bh * W2 + t % W2) * D];
    double x = 0;
    for (int d = 0; d < D; ++d) x += q[bh * D + d] * kk[d];
    s.push_back(x / std::sqrt(double(D)));
  }
  const double self_logit = s.back();
  auto softmax = [](std::vector<double> x) {
    double m = -INFINITY, z = 0;
    for (double v : x) m = std::max(m, v);
    for (double& v : x) z += (v = std::exp(v - m));
    for (double& v : x) v /= z;
    return x;
  };
  const auto a = softmax(s);
  if (kind == kScoreSelfLogit) return plant ? s[s.size() - 2] : self_logit;  // planted: the previous token's logit
  if (kind == kScoreDiagAttention) return a.back();
  std::vector<double> b(s.size(), 0.0);
  if (b_with_self) b = a;
  else if (s.size() > 1) {
    const auto others = softmax(std::vector<double>(s.begin(), s.end() - 1));
    std::copy(others.begin(), others.end(), b.begin());
  }
  double sc = 0;
  for (size_t j = 0; j < s.size(); ++j) sc += a[j] * std::log((a[j] + 1e-8) / (b[j] + 1e-8));
  return sc;
}

bool check(const Case& k, unsigned seed) {
  std::mt19937 rng(seed);
  const int W2 = 2 * k.C;
  auto q = emu_test::normal<Bf>(rng, size_t(k.B) * k.H * k.D, 1.5);
  auto wk = emu_test::normal<Bf>(rng, size_t(k.B) * k.H * W2 * k.D, 1.0), wv = emu_test::normal<Bf>(rng, size_t(k.B) * k.H * W2 * k.D, 1.0);
  auto sk = emu_test::normal<Bf>(rng, size_t(k.B) * k.H * std::max(k.cap, 1) * k.D, 1.0), sv = emu_test::normal<Bf>(rng, size_t(k.B) * k.H * std::max(k.cap, 1) * k.D, 1.0);
  auto g = emu_test::normal<Bf>(rng, size_t(k.B) * k.H * k.D, 1.0);
  std::uniform_real_distribution<float> U(0.f, 1.f);
  std::vector<float> phi(size_t(k.B) * k.H * k.F), S(size_t(k.B) * k.H * k.F * k.D), z(size_t(k.B) * k.H * k.F), gamma(k.H);
  for (auto& x : phi) x = U(rng);
  // With fmap, φ(q) = clamp_min([softmax(u) ⊕ softmax(−u)], 1e-12) of the rounded query (feature_maps.rs)
  // replaces the given φ in the reference; the kernel gets W' alone.
  std::vector<float> W(size_t(k.H) * k.D * (k.F / 2));
  for (auto& x : W) x = 0.4f * (U(rng) - 0.5f);
  std::vector<double> phi_ref(phi.begin(), phi.end());
  if (k.fmap) {
    const int Fh = k.F / 2;
    for (size_t bh = 0; bh < size_t(k.B) * k.H; ++bh) {
      const int h = int(bh % k.H);
      std::vector<double> u(Fh, 0.0);
      double f2 = 0, x2 = 0;
      for (int f = 0; f < Fh; ++f) {
        for (int d = 0; d < k.D; ++d) u[f] += q.ref[bh * k.D + d] * W[(size_t(h) * k.D + d) * Fh + f];
        f2 += u[f] * u[f];
      }
      for (int d = 0; d < k.D; ++d) x2 += q.ref[bh * k.D + d] * q.ref[bh * k.D + d];
      const double scale = k.fmap == 2 ? std::sqrt(x2) / std::max(std::sqrt(f2), 1e-12) : 1.0;
      for (int sign : {1, -1}) {
        double m = -INFINITY, z = 0;
        for (double x : u) m = std::max(m, sign * x * scale);
        for (double x : u) z += std::exp(sign * x * scale - m);
        for (int f = 0; f < Fh; ++f) phi_ref[bh * k.F + (sign == 1 ? 0 : Fh) + f] = std::max(std::exp(sign * u[f] * scale - m) / z, 1e-12);
      }
    }
  }
  for (auto& x : S) x = 3.f * (U(rng) - 0.5f);
  for (auto& x : z) x = 2.f * U(rng);
  for (auto& x : gamma) x = 0.5f + U(rng);
  // The formula; `shift` plants the window's start one chunk late (chunk c − 1 left out).
  auto reference = [&](int64_t shift) {
    std::vector<double> y;
    const int64_t from = std::max<int64_t>(0, (k.pos / k.C - 1) * k.C) + shift;
    for (int b = 0; b < k.B; ++b)
      for (int h = 0; h < k.H; ++h) {
        const size_t bh = size_t(b) * k.H + h;
        std::vector<double> s;
        std::vector<const double*> v;
        for (int i = 0; i < W2 + k.cap; ++i) {
          const double* kk;
          if (i < W2) {
            const int64_t held = k.pos - (((k.pos - i) % W2) + W2) % W2;
            if (held < from) continue;
            kk = &wk.ref[(bh * W2 + i) * k.D];
            v.push_back(&wv.ref[(bh * W2 + i) * k.D]);
          } else {
            if (i - W2 >= k.n_sel) continue;
            kk = &sk.ref[(bh * k.cap + (i - W2)) * k.D];
            v.push_back(&sv.ref[(bh * k.cap + (i - W2)) * k.D]);
          }
          double x = 0;
          for (int d = 0; d < k.D; ++d) x += q.ref[bh * k.D + d] * kk[d];
          s.push_back(x / std::sqrt(double(k.D)));
        }
        double m = -INFINITY;
        for (double x : s) m = std::max(m, x);
        const double gam = k.gamma ? gamma[h] : 1.0, lin_scale = k.linear ? (k.compensate ? std::exp(-m) : 1.0) : 0.0;
        double z_sm = 0, z_lin = 0;
        for (double x : s) z_sm += std::exp(x - m);
        for (int f = 0; f < k.F; ++f) z_lin += phi_ref[bh * k.F + f] * z[bh * k.F + f];
        for (int d = 0; d < k.D; ++d) {
          double num = 0, lin = 0;
          for (size_t i = 0; i < s.size(); ++i) num += std::exp(s[i] - m) * v[i][d];
          for (int f = 0; f < k.F; ++f) lin += phi_ref[bh * k.F + f] * S[(bh * k.F + f) * k.D + d];
          if (k.gate) lin *= k.gate_logits ? 1.0 / (1.0 + std::exp(-g.ref[bh * k.D + d])) : g.ref[bh * k.D + d];
          y.push_back((gam * num + lin * lin_scale) / (gam * z_sm + z_lin * lin_scale + 1e-6));
        }
      }
    return y;
  };
  MixParams p{};
  p.q = q.dev.data();
  p.q_sb = int64_t(k.H) * k.D;
  p.q_sh = k.D;
  p.phi = k.fmap ? nullptr : phi.data();
  p.fmap = k.fmap ? W.data() : nullptr;
  p.fmap_reinject = k.fmap == 2;
  p.phi_sb = int64_t(k.H) * k.F;
  p.phi_sh = k.F;
  p.wk = wk.dev.data();
  p.wv = wv.dev.data();
  p.w_ss = k.D;
  p.w_sh = int64_t(W2) * k.D;
  p.w_sb = int64_t(k.H) * p.w_sh;
  p.sk = sk.dev.data();
  p.sv = sv.dev.data();
  p.s_ss = k.D;
  p.s_sh = int64_t(k.cap) * k.D;
  p.s_sb = int64_t(k.H) * p.s_sh;
  p.n_sel = &k.n_sel;
  p.S = S.data();
  p.z = z.data();
  p.g = k.gate ? g.dev.data() : nullptr;
  p.gate_sigmoid = k.gate_logits;
  p.g_sb = int64_t(k.H) * k.D;
  p.g_sh = k.D;
  p.gamma = k.gamma ? gamma.data() : nullptr;
  p.pos = &k.pos;
  p.H = k.H;
  p.C = k.C;
  p.cap = k.cap;
  p.D = k.D;
  p.F = k.F;
  p.eps = 1e-6f;
  p.scale = 1.f / std::sqrt(float(k.D));
  p.linear = k.linear;
  p.compensate = k.compensate;
  std::vector<Bf> y(size_t(k.B) * k.H * k.D);
  p.y = y.data();
  // The ring of scores: the kernel writes the new token's slot and leaves the others as they were.
  const float kept = -7.f;
  std::vector<float> score(size_t(k.B) * k.H * W2, kept);
  p.score = k.score ? score.data() : nullptr;
  p.sc_sh = W2;
  p.sc_sb = int64_t(k.H) * W2;
  p.score_kind = k.score;
  // Both paths where the 16-byte one fits (it must, at D a multiple of 8: the buffers are packed),
  // the scalar one alone elsewhere.
  const bool fits = mix_vec_fits(p);
  if (fits != (k.D % 8 == 0)) {
    std::printf("  %s: mix_vec_fits says %d at D %d\n", k.name, int(fits), k.D);
    return false;
  }
  // Fresh: the new token's rows (what the reference's ring holds at its slot) come in apart, rows of
  // another layout (a head stride of 2·D); the ring's slot holds stale values until the kernel writes it.
  const int64_t slot = k.pos % W2;
  std::vector<Bf> nk(size_t(k.B) * k.H * 2 * k.D), nv(nk.size());
  auto stale_slot = [&] {
    for (size_t bh = 0; bh < size_t(k.B) * k.H; ++bh)
      for (int d = 0; d < k.D; ++d) {
        const size_t at = (bh * W2 + slot) * k.D + d;
        nk[bh * 2 * k.D + d] = wk.dev[at], nv[bh * 2 * k.D + k.D + d] = wv.dev[at];
        wk.dev[at] = emu_test::to_half<Bf>(9.f), wv.dev[at] = emu_test::to_half<Bf>(-9.f);
      }
  };
  if (k.fresh) {
    p.new_k = nk.data(), p.new_v = nv.data() + k.D;
    p.nk_sh = p.nv_sh = 2 * k.D;
    p.nk_sb = p.nv_sb = int64_t(k.H) * 2 * k.D;
  }
  const auto want = reference(0), planted = reference(k.C);
  const char* names[] = {"", "self-saliency", "a_tt", "own logit"};
  // The routing score the last launch wrote at the new token's slot (the others kept as they were),
  // then the slot set back, so that the next launch must write it again.
  auto score_ok = [&](const std::string& name) {
    if (!k.score) return true;
    std::vector<double> got_score, want_score, planted_score;
    bool others_kept = true;
    for (size_t bh = 0; bh < size_t(k.B) * k.H; ++bh)
      for (int i = 0; i < W2; ++i) {
        float& x = score[bh * W2 + i];
        if (i != k.pos % W2) {
          others_kept &= x == kept;
          continue;
        }
        got_score.push_back(x);
        x = kept;
        want_score.push_back(score_reference(k.score, q.ref, wk.ref, bh, k.C, k.D, k.pos, false));
        planted_score.push_back(score_reference(k.score, q.ref, wk.ref, bh, k.C, k.D, k.pos, true));
      }
    return emu_test::verdict(name + ": " + names[k.score] + " score", others_kept ? emu_test::rel_err(got_score, want_score) : INFINITY,
                             emu_test::rel_err(planted_score, want_score), 1e-3);
  };
  // hybrid_mix_split's workspace: slices of `per` slots (several a head at every case's shape), the
  // arrival counters zero, as the caller hands them.
  const int per = std::max(8, k.C);
  const bool whole = k.score != kScoreNone;
  const int slices = mix_slices(W2, W2 + k.cap, per, whole);
  std::vector<float> part(size_t(k.B) * k.H * slices * (k.D + 2), NAN), lin_out(size_t(k.B) * k.H * (k.D + 1), NAN);
  std::vector<int> arrived(size_t(k.B) * k.H, 0);
  bool ok = true;
  for (int split = 0; split <= 1; ++split)
    for (int vec = fits; vec >= 0; --vec) {
      p.vec = vec;
      if (k.fresh) stale_slot();
      std::string name = std::string(k.name) + (vec ? ", 16-byte loads" : "");
      if (split) {
        p.per = per, p.slices = slices, p.part = part.data(), p.lin_out = lin_out.data(), p.arrived = arrived.data();
        name += ", split over " + std::to_string(slices + k.linear) + " blocks a head";
        emu::launch(hybrid_mix_split<Bf>, dim3(slices + k.linear, k.B * k.H), dim3(kMixThreads), mix_split_smem_floats(k.D, k.F, k.C, per, whole, vec) * sizeof(float), p);
        // Every head's counter is back at zero for the next launch (planted: one arrival short of it).
        std::vector<double> counts(arrived.begin(), arrived.end()), zeros(counts.size(), 0.0), planted_counts(counts.size(), double(slices + k.linear - 1));
        ok &= emu_test::verdict(name + ": counters reset", emu_test::rel_err(counts, zeros), emu_test::rel_err(planted_counts, zeros), 0.0);
      } else {
        emu::launch(hybrid_mix<Bf>, dim3(k.B * k.H), dim3(kMixThreads), mix_smem_floats(k.D, k.F, k.C, k.cap, vec) * sizeof(float), p);
      }
      std::vector<double> got;
      for (auto v : y) got.push_back(emu_test::from_half(v));
      ok &= emu_test::verdict(name, emu_test::rel_err(got, want), emu_test::rel_err(planted, want), 1.6e-2);
      std::fill(y.begin(), y.end(), emu_test::to_half<Bf>(NAN));
      if (k.fresh) {
        // The ring's slot now holds the new token's rows, bit for bit.
        // (Planted: the stale slot, as a kernel that skips the write leaves it.)
        std::vector<double> slot_got, slot_want, slot_stale;
        for (size_t bh = 0; bh < size_t(k.B) * k.H; ++bh)
          for (int d = 0; d < k.D; ++d) {
            const size_t at = (bh * W2 + slot) * k.D + d;
            slot_got.insert(slot_got.end(), {emu_test::from_half(wk.dev[at]), emu_test::from_half(wv.dev[at])});
            slot_want.insert(slot_want.end(), {wk.ref[at], wv.ref[at]});
            slot_stale.insert(slot_stale.end(), {9.0, -9.0});
          }
        ok &= emu_test::verdict(name + ": new rows in the ring", emu_test::rel_err(slot_got, slot_want), emu_test::rel_err(slot_stale, slot_want), 0.0);
      }
      ok &= score_ok(name);
    }
  return ok;
}

bool all_cases() {
  const std::vector<Case> cases = {
      // LoLCATs: γ, no Sel, the linear branch plain; mid-chunk, the ring full.
      {"LoLCATs, mid-chunk", 2, 3, 16, 0, 64, 128, 77, 0, true, false, true, false, kScoreNone, 0},
      // STILL: Sel partly filled, the gate, max-compensated; at a chunk's first token.
      {"STILL, a chunk's first token", 1, 4, 16, 24, 64, 64, 96, 20, false, true, true, true, kScoreSelfSaliency, 0},
      // Early: the ring not yet full (slots holding no token yet), D 160: one group of slots.
      {"STILL, ring not full, D 160", 1, 2, 8, 4, 160, 32, 9, 3, false, true, true, false, kScoreSelfSaliency, 0},
      // D 96: two groups of 96 threads, the block's last 64 idle; Sel full.
      {"STILL, D 96, two slot groups", 1, 3, 16, 12, 96, 192, 150, 12, false, true, true, false, kScoreDiagAttention, 0},
      // D 320, wider than the block: one group, a thread taking two dims.
      {"LoLCATs, D 320", 1, 2, 8, 0, 320, 64, 21, 0, true, true, true, true, kScoreNone, 0},
      // The first two tokens: W is the token alone (b ≡ 0), then two tokens.
      {"STILL, position 0", 1, 2, 8, 4, 64, 32, 0, 0, false, true, true, false, kScoreSelfSaliency, 0},
      {"STILL, position 1", 1, 2, 8, 4, 64, 32, 1, 0, false, true, true, false, kScoreSelfSaliency, 0},
      // φ(q) in the kernel: STILL's NP-Map (re-injection; F = 2D), LoLCATs' Hedgehog (F/2 = 64 ≠ D), and
      // F/2 wider than the block.
      {"STILL, φ(q) by NP-Map", 1, 4, 16, 24, 64, 128, 96, 20, false, true, true, false, kScoreSelfSaliency, 2},
      {"LoLCATs, φ(q) by Hedgehog", 2, 3, 16, 0, 32, 128, 77, 0, true, false, true, false, kScoreNone, 1},
      {"φ(q) with F/2 = 320", 1, 2, 8, 4, 64, 640, 30, 4, false, false, true, true, kScoreNone, 2},
      // The softmax alone (no linear branch).
      {"softmax only", 1, 2, 8, 8, 32, 16, 40, 8, true, false, false, false, kScoreSelfLogit, 0},
      // D 20: no 16-byte rows, the scalar path alone.
      {"STILL, D 20", 1, 3, 8, 6, 20, 40, 37, 6, false, true, true, true, kScoreSelfSaliency, 0},
      // STILL's decode shape (C 64, 384 Sel slots, D 64, F 128): 32 groups of 8 slots' chunks.
      {"STILL, budget shape", 1, 2, 64, 384, 64, 128, 3000, 300, false, true, true, true, kScoreSelfSaliency, 2},
      // The new rows handed over (no index_copy before the step), scored by self-saliency from them.
      {"STILL, budget shape, fresh", 2, 2, 64, 384, 64, 128, 3000, 300, false, true, true, true, kScoreSelfSaliency, 2, true},
      {"LoLCATs, mid-chunk, fresh", 2, 3, 16, 0, 64, 128, 77, 0, true, false, true, false, kScoreNone, 0, true},
      {"STILL, D 20, fresh", 1, 3, 8, 6, 20, 40, 37, 6, false, true, true, true, kScoreSelfSaliency, 0, true},
      // The gate before its sigmoid (σ in the kernel), at the budget shape and with no score (the
      // window split over blocks too).
      {"STILL, budget shape, σ(g) here", 1, 2, 64, 384, 64, 128, 3000, 300, false, true, true, true, kScoreSelfSaliency, 2, true, true},
      {"STILL, random routing, σ(g) here", 2, 2, 16, 24, 64, 128, 200, 20, false, true, true, true, kScoreNone, 2, true, true},
  };
  bool ok = true;
  unsigned seed = 51;
  for (const auto& k : cases) ok &= check(k, seed++);
  return ok;
}

emu_test::Register reg("hybrid_step: the STILL / LoLCATs decode mix vs its formula", all_cases);

}  // namespace
