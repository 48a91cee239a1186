// DAR's band-and-merge kernel (csrc/cuda/dar_band.cuh) on the CPU against DAR attention's definition
// in double: query i attends full-width keys at distance < w and bottleneck keys at distance ≥ w in
// one softmax. The distant part is given as the split route gives it (its output in bf16 through a
// transposed layout, as cuDNN's comes back, and its lse in fp32). Windows 1, a few, a tile, more
// than a tile, ≥ T (no distant part); a ragged T; D 64 and 128.
#include "emu_test.h"
#include "../dar_band.cuh"

namespace {

using Bf = __nv_bfloat16;

struct Out {
  std::vector<double> o, lse;
};

// [B, T, H, D] tensors as doubles; DAR attention with window w: full-width keys at distance < `band`
// (= w; the planted reference changes it) and bottleneck keys at distance ≥ w.
Out definition(const std::vector<double>& q, const std::vector<double>& kl, const std::vector<double>& vl, const std::vector<double>& kg,
               const std::vector<double>& vg, int B, int T, int H, int D, int w, int band) {
  Out r;
  const double scale = 1.0 / std::sqrt(double(D));
  auto at = [&](int b, int t, int h) { return ((size_t(b) * T + t) * H + h) * D; };
  r.o.assign(size_t(B) * T * H * D, 0.0);
  r.lse.assign(size_t(B) * H * T, 0.0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < T; ++i) {
        std::vector<double> s;
        std::vector<const double*> v;
        for (int j = 0; j <= i; ++j) {
          const bool near = i - j < band, far = i - j >= w;
          for (int part = 0; part < 2; ++part) {
            if (part == 0 ? !near : !far) continue;
            const double* k = (part == 0 ? kl : kg).data() + at(b, j, h);
            double x = 0;
            for (int d = 0; d < D; ++d) x += q[at(b, i, h) + d] * k[d];
            s.push_back(x * scale);
            v.push_back((part == 0 ? vl : vg).data() + at(b, j, h));
          }
        }
        double m = -INFINITY, z = 0;
        for (double x : s) m = std::max(m, x);
        for (size_t n = 0; n < s.size(); ++n) {
          const double e = std::exp(s[n] - m);
          z += e;
          for (int d = 0; d < D; ++d) r.o[at(b, i, h) + d] += e * v[n][d];
        }
        for (int d = 0; d < D; ++d) r.o[at(b, i, h) + d] /= z;
        r.lse[(size_t(b) * H + h) * T + i] = m + std::log(z);
      }
  return r;
}

template <int D>
bool check(int B, int T, int H, int w, unsigned seed) {
  std::mt19937 rng(seed);
  const size_t n = size_t(B) * T * H * D;
  auto q = emu_test::normal<Bf>(rng, n, 1.5), kl = emu_test::normal<Bf>(rng, n, 1.0), vl = emu_test::normal<Bf>(rng, n, 1.0);
  auto kg = emu_test::normal<Bf>(rng, n, 1.0), vg = emu_test::normal<Bf>(rng, n, 1.0);
  const Out want = definition(q.ref, kl.ref, vl.ref, kg.ref, vg.ref, B, T, H, D, w, w);
  // Planted: a band one key wider; with no distant part (w ≥ T), a band of half the width.
  const Out planted = definition(q.ref, kl.ref, vl.ref, kg.ref, vg.ref, B, T, H, D, w, w < T ? w + 1 : w / 2);
  // The distant part alone (queries i ≥ w over keys j ≤ i − w), as the split route's cuDNN call
  // returns it: output [B, H, L, D] in bf16 (read through a [B, L, H, D] view), lse [B, H, L].
  const int L = std::max(T - w, 0);
  std::vector<Bf> far(size_t(B) * H * std::max(L, 1) * D);
  std::vector<float> far_lse(size_t(B) * H * std::max(L, 1));
  const std::vector<double> nothing(n, 0.0);
  if (L > 0) {
    // Band width 0: only the distant keys.
    const Out only_far = definition(q.ref, nothing, nothing, kg.ref, vg.ref, B, T, H, D, w, 0);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int i = w; i < T; ++i) {
          for (int d = 0; d < D; ++d) far[((size_t(b) * H + h) * L + (i - w)) * D + d] = __float2bfloat16(float(only_far.o[((size_t(b) * T + i) * H + h) * D + d]));
          far_lse[(size_t(b) * H + h) * L + (i - w)] = float(only_far.lse[(size_t(b) * H + h) * T + i]);
        }
  }
  BandParams p{};
  p.q = q.dev.data();
  p.k = kl.dev.data();
  p.v = vl.dev.data();
  p.q_st = p.k_st = p.v_st = int64_t(H) * D;
  p.q_sh = p.k_sh = p.v_sh = D;
  p.q_sb = p.k_sb = p.v_sb = int64_t(T) * H * D;
  if (L > 0) {
    p.far = far.data();
    p.f_sb = int64_t(H) * L * D;
    p.f_sh = int64_t(L) * D;
    p.f_st = D;
    p.far_lse = far_lse.data();
    p.fl_sb = int64_t(H) * L;
    p.fl_sh = L;
  }
  std::vector<Bf> out(n);
  std::vector<float> lse(size_t(B) * H * T);
  p.out = out.data();
  p.o_st = int64_t(H) * D;
  p.o_sh = D;
  p.o_sb = int64_t(T) * H * D;
  p.lse = lse.data();
  p.T = T;
  p.H = H;
  p.w = w;
  p.scale = 1.f / std::sqrt(float(D));
  emu::launch(band_merge_fwd<D>, dim3((T + kBandRows - 1) / kBandRows, B * H), dim3(kBandThreads), band_smem_bytes(D), p);
  std::vector<double> got, got_lse(lse.begin(), lse.end());
  for (auto x : out) got.push_back(emu_test::from_half(x));
  const std::string at = "T " + std::to_string(T) + ", D " + std::to_string(D) + ", w " + std::to_string(w);
  bool ok = emu_test::verdict("out, " + at, emu_test::rel_err(got, want.o), emu_test::rel_err(planted.o, want.o), 1.6e-2);
  ok &= emu_test::verdict("lse, " + at, emu_test::rel_err(got_lse, want.lse), emu_test::rel_err(planted.lse, want.lse), 2e-3);
  return ok;
}

bool all_cases() {
  bool ok = true;
  unsigned seed = 31;
  for (int w : {1, 5, 64, 100, 150}) ok &= check<64>(2, 150, 2, w, seed++);
  ok &= check<128>(1, 97, 1, 40, seed++);
  return ok;
}

emu_test::Register reg("dar_band: band attention merged with the distant part vs DAR's definition", all_cases);

}  // namespace
