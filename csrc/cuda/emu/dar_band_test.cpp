// DAR's band kernels (csrc/cuda/dar_band.cuh: the forward with the merge, the backward) on the CPU
// against DAR attention's definition in double: query i attends full-width keys at distance < w and
// bottleneck keys at distance ≥ w in one softmax. The distant part is given as the split route gives it (its output in bf16 through a
// transposed layout, as cuDNN's comes back, and its lse in fp32). Windows 1, a few, a tile, more
// than a tile, ≥ T (no distant part); a ragged T; D 64 and 128.
#include "emu_test.h"
#include "../dar_band.cuh"

namespace {

using Bf = __nv_bfloat16;

struct Out {
  std::vector<double> o, lse;
};

struct Grads {
  std::vector<double> dq, dkl, dvl, dq_far;  // dq_far: the distant keys' share of dq
};

// DAR attention of [B, T, H, D] tensors in double, window w: full-width keys at distance < `band`
// (= w; a planted reference changes it) and bottleneck keys at distance ≥ w, one softmax; with
// `dout`, the gradients (dq of both parts, and the band's share alone, dk_l, dv_l).
struct Definition {
  int B, T, H, D, w, band;
  const std::vector<double>&q, &kl, &vl, &kg, &vg;
  size_t at(int b, int t, int h) const { return ((size_t(b) * T + t) * H + h) * D; }

  Out forward() const {
    Out r{std::vector<double>(size_t(B) * T * H * D, 0.0), std::vector<double>(size_t(B) * H * T, 0.0)};
    each_row([&](int b, int h, int i, const std::vector<double>& p, const std::vector<const double*>&, const std::vector<const double*>& v, const std::vector<int>&) {
      for (size_t n = 0; n < p.size(); ++n)
        for (int d = 0; d < D; ++d) r.o[at(b, i, h) + d] += p[n] * v[n][d];
    }, &r.lse);
    return r;
  }

  Grads backward(const std::vector<double>& dout, const Out& fwd) const {
    const double scale = 1.0 / std::sqrt(double(D));
    Grads g{std::vector<double>(q.size(), 0.0), std::vector<double>(q.size(), 0.0), std::vector<double>(q.size(), 0.0), std::vector<double>(q.size(), 0.0)};
    each_row([&](int b, int h, int i, const std::vector<double>& p, const std::vector<const double*>& k, const std::vector<const double*>& v,
                 const std::vector<int>& key) {
      double dd = 0;
      for (int d = 0; d < D; ++d) dd += dout[at(b, i, h) + d] * fwd.o[at(b, i, h) + d];
      for (size_t n = 0; n < p.size(); ++n) {
        double dp = 0;
        for (int d = 0; d < D; ++d) dp += dout[at(b, i, h) + d] * v[n][d];
        const double ds = p[n] * (dp - dd);
        const bool near = key[n] >= 0;  // band keys carry their position, distant ones −1 − position
        const int j = near ? key[n] : -1 - key[n];
        for (int d = 0; d < D; ++d) {
          g.dq[at(b, i, h) + d] += scale * ds * k[n][d];
          if (!near) g.dq_far[at(b, i, h) + d] += scale * ds * k[n][d];
          if (near) {
            g.dkl[at(b, j, h) + d] += scale * ds * q[at(b, i, h) + d];
            g.dvl[at(b, j, h) + d] += p[n] * dout[at(b, i, h) + d];
          }
        }
      }
    }, nullptr);
    return g;
  }

  // Per query row: the softmax weights over its keys, their keys and values, and which key each is.
  template <typename F>
  void each_row(F f, std::vector<double>* lse) const {
    const double scale = 1.0 / std::sqrt(double(D));
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < T; ++i) {
          std::vector<double> s;
          std::vector<const double*> ks, vs;
          std::vector<int> key;
          for (int j = 0; j <= i; ++j)
            for (int part = 0; part < 2; ++part) {
              if (part == 0 ? i - j >= band : i - j < w) continue;
              const double* k = (part == 0 ? kl : kg).data() + at(b, j, h);
              double x = 0;
              for (int d = 0; d < D; ++d) x += q[at(b, i, h) + d] * k[d];
              s.push_back(x * scale);
              ks.push_back(k);
              vs.push_back((part == 0 ? vl : vg).data() + at(b, j, h));
              key.push_back(part == 0 ? j : -1 - j);
            }
          double m = -INFINITY, z = 0;
          for (double x : s) m = std::max(m, x);
          for (double x : s) z += std::exp(x - m);
          for (double& x : s) x = std::exp(x - m) / z;
          if (lse) (*lse)[(size_t(b) * H + h) * T + i] = m + std::log(z);
          f(b, h, i, s, ks, vs, key);
        }
  }
};

View view_bthd(const Bf* p, int T, int H, int D) { return View{p, int64_t(T) * H * D, int64_t(H) * D, D}; }

std::vector<double> as_double(const std::vector<Bf>& x) {
  std::vector<double> r;
  for (auto v : x) r.push_back(emu_test::from_half(v));
  return r;
}

std::vector<Bf> as_bf16(const std::vector<double>& x) {
  std::vector<Bf> r;
  for (double v : x) r.push_back(__float2bfloat16(float(v)));
  return r;
}

template <int D>
bool check(int B, int T, int H, int w, unsigned seed) {
  std::mt19937 rng(seed);
  const size_t n = size_t(B) * T * H * D;
  auto q = emu_test::normal<Bf>(rng, n, 1.5), kl = emu_test::normal<Bf>(rng, n, 1.0), vl = emu_test::normal<Bf>(rng, n, 1.0);
  auto kg = emu_test::normal<Bf>(rng, n, 1.0), vg = emu_test::normal<Bf>(rng, n, 1.0), dout = emu_test::normal<Bf>(rng, n, 1.0);
  const Definition def{B, T, H, D, w, w, q.ref, kl.ref, vl.ref, kg.ref, vg.ref};
  // Planted: a band one key wider; with no distant part (w ≥ T), a band of half the width.
  const Definition bad{B, T, H, D, w, w < T ? w + 1 : w / 2, q.ref, kl.ref, vl.ref, kg.ref, vg.ref};
  const Out want = def.forward(), planted = bad.forward();
  // The distant part alone (queries i ≥ w over keys j ≤ i − w), as the split route's cuDNN call
  // returns it: output [B, H, L, D] in bf16 (read through a [B, L, H, D] view), lse [B, H, L].
  const int L = std::max(T - w, 0);
  std::vector<Bf> far(size_t(B) * H * std::max(L, 1) * D);
  std::vector<float> far_lse(size_t(B) * H * std::max(L, 1));
  if (L > 0) {
    const Out only_far = Definition{B, T, H, D, w, 0, q.ref, kl.ref, vl.ref, kg.ref, vg.ref}.forward();
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int i = w; i < T; ++i) {
          for (int d = 0; d < D; ++d) far[((size_t(b) * H + h) * L + (i - w)) * D + d] = __float2bfloat16(float(only_far.o[def.at(b, i, h) + d]));
          far_lse[(size_t(b) * H + h) * L + (i - w)] = float(only_far.lse[(size_t(b) * H + h) * T + i]);
        }
  }
  BandParams p{};
  p.q = view_bthd(q.dev.data(), T, H, D);
  p.k = view_bthd(kl.dev.data(), T, H, D);
  p.v = view_bthd(vl.dev.data(), T, H, D);
  if (L > 0) {
    p.far = View{far.data(), int64_t(H) * L * D, D, int64_t(L) * D};
    p.far_lse = far_lse.data();
    p.fl_sb = int64_t(H) * L;
    p.fl_sh = L;
  }
  std::vector<Bf> out(n);
  std::vector<float> lse(size_t(B) * H * T);
  p.out = out.data();
  p.lse = lse.data();
  p.T = T;
  p.H = H;
  p.w = w;
  p.scale = 1.f / std::sqrt(float(D));
  emu::launch(band_merge_fwd<D>, dim3((T + kBandRows - 1) / kBandRows, B * H), dim3(kBandThreads), band_smem_bytes(D), p);
  const std::string at = "T " + std::to_string(T) + ", D " + std::to_string(D) + ", w " + std::to_string(w);
  using emu_test::rel_err;
  using emu_test::verdict;
  bool ok = verdict("out, " + at, rel_err(as_double(out), want.o), rel_err(planted.o, want.o), 1.6e-2);
  ok &= verdict("lse, " + at, rel_err(std::vector<double>(lse.begin(), lse.end()), want.lse), rel_err(planted.lse, want.lse), 2e-3);

  // Backward, from the merged output and lse as the forward gives them (bf16 out, fp32 lse), the
  // distant part's dq as cuDNN gives it (bf16, rows i ≥ w as i − w).
  const Grads gw = def.backward(dout.ref, want), gp = bad.backward(dout.ref, planted);
  const std::vector<Bf> far_dq = as_bf16(gw.dq_far);
  BandBwdParams g{};
  g.q = p.q;
  g.k = p.k;
  g.v = p.v;
  g.out = view_bthd(out.data(), T, H, D);
  g.dout = view_bthd(dout.dev.data(), T, H, D);
  g.lse = lse.data();
  // far_dq holds every row; the kernel reads row i − w for i ≥ w, so the view starts at row w.
  if (L > 0) g.far_dq = View{far_dq.data() + size_t(w) * H * D, int64_t(T) * H * D, int64_t(H) * D, D};
  std::vector<Bf> dq(n), dk(n), dv(n);
  g.dq = dq.data();
  g.dk = dk.data();
  g.dv = dv.data();
  g.T = T;
  g.H = H;
  g.w = w;
  g.scale = p.scale;
  std::vector<float> dd(size_t(B) * H * T, NAN);  // a row dQ's kernel leaves unwritten shows in dK / dV
  g.dd = dd.data();
  const dim3 grid((T + kBandKeys - 1) / kBandKeys, B * H);
  emu::launch(band_bwd_dq<D>, grid, dim3(kBandThreads), band_smem_bytes(D), g);
  emu::launch(band_bwd_dkdv<D>, grid, dim3(kBandThreads), band_bwd_smem_bytes(D), g);
  ok &= verdict("dq (band + distant), " + at, rel_err(as_double(dq), gw.dq), rel_err(gp.dq, gw.dq), 2.5e-2);
  ok &= verdict("dk_l, " + at, rel_err(as_double(dk), gw.dkl), rel_err(gp.dkl, gw.dkl), 2.5e-2);
  ok &= verdict("dv_l, " + at, rel_err(as_double(dv), gw.dvl), rel_err(gp.dvl, gw.dvl), 2.5e-2);
  return ok;
}

bool all_cases() {
  bool ok = true;
  unsigned seed = 31;
  for (int w : {1, 5, 64, 100, 150}) ok &= check<64>(2, 150, 2, w, seed++);
  ok &= check<128>(1, 97, 1, 40, seed++);
  return ok;
}

emu_test::Register reg("dar_band: band attention merged with the distant part, and its backward, vs DAR's definition", all_cases);

}  // namespace
