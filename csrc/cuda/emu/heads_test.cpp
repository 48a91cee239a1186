// GPT-NeoX's heads op kernel (csrc/cuda/heads.cuh) on the CPU against RoPE's definition in double:
// the pieces of a fused projection, the first `rotated` turned over their first 2·half dims, and
// the backward's dx (the inverse turn of each gradient, a copy, zeros for a piece without one);
// Pythia's quarter of the dims rotated with q, k rotated and v not, and every dim rotated.
#include "emu_test.h"
#include "../heads.cuh"

namespace {

using Bf = __nv_bfloat16;

// `wide`: through heads_rotate8 (16-byte chunks; the case must fit it), else heads_rotate. The
// angle tables' rows lie `stride` floats apart (0: half, packed); columns past half hold values
// that no rotation may read (as Llama's [T, hd] tables, whose first half columns are used).
bool check(int B, int T, int H, int n, int rotated, int hd, int half, unsigned seed, bool wide, int stride = 0) {
  std::mt19937 rng(seed);
  const int64_t rows = int64_t(B) * T * H;
  const int ts = stride > 0 ? stride : half;
  auto x = emu_test::normal<Bf>(rng, size_t(rows) * n * hd, 1.0);
  std::vector<float> cos(size_t(T) * ts, 5.f), sin(size_t(T) * ts, 5.f);
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < half; ++i) {
      const double a = (t + 3) * std::pow(10000.0, -2.0 * i / (2 * half));
      cos[size_t(t) * ts + i] = float(std::cos(a));
      sin[size_t(t) * ts + i] = float(std::sin(a));
    }
  // piece i of row r: turn (sign +1) or its inverse (−1) of v (hd values).
  auto turn = [&](const double* v, int64_t row, bool rot, double sign, double* out) {
    const int t = int((row / H) % T);
    for (int d = 0; d < hd; ++d) out[d] = v[d];
    if (!rot) return;
    for (int d = 0; d < half; ++d) {
      const double c = cos[size_t(t) * ts + d], s = sign * sin[size_t(t) * ts + d];
      out[d] = v[d] * c - v[d + half] * s;
      out[d + half] = v[d + half] * c + v[d] * s;
    }
  };
  std::vector<double> want(size_t(rows) * n * hd), planted(want.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) {
      const size_t o = ((size_t(i) * rows) + r) * hd;  // pieces one after another
      turn(&x.ref[(r * n + i) * hd], r, i < rotated, 1.0, &want[o]);
      // Planted: the inverse turn; with nothing rotated, piece 0 turned.
      turn(&x.ref[(r * n + i) * hd], r, rotated > 0 ? i < rotated : i == 0, rotated > 0 ? -1.0 : 1.0, &planted[o]);
    }
  std::vector<std::vector<Bf>> pieces(n, std::vector<Bf>(size_t(rows) * hd));
  HeadsParams p{rows, T, H, n, rotated, hd, half, ts, cos.data(), sin.data(), {}};
  for (int i = 0; i < n; ++i) p.pieces[i] = pieces[i].data();
  auto launch = [&](int blocks, Bf* whole, float sign) {
    if (wide) {
      if (!heads_rotate8_fits(p, whole)) {
        std::printf("  heads_rotate8 does not fit the case\n");
        std::exit(1);
      }
      emu::launch(heads_rotate8<Bf>, dim3(blocks), dim3(kHeadsThreads), 0, p, whole, sign);
    } else {
      emu::launch(heads_rotate<Bf>, dim3(blocks), dim3(kHeadsThreads), 0, p, whole, sign);
    }
  };
  launch(3, x.dev.data(), 1.f);  // 3 blocks: the grid-stride loop too
  std::vector<double> got;
  for (auto& pc : pieces)
    for (auto v : pc) got.push_back(emu_test::from_half(v));
  const std::string at = std::string(wide ? "8-wide, " : "") + std::to_string(n) + " pieces, " + std::to_string(rotated) + " rotated, hd " + std::to_string(hd) + ", half " + std::to_string(half) +
                         (stride > 0 ? ", tables " + std::to_string(stride) + " apart" : "");
  bool ok = emu_test::verdict("pieces, " + at, emu_test::rel_err(got, want), emu_test::rel_err(planted, want), 8e-3);

  // Backward: gradients of the pieces but the last (null: zeros in dx); of a lone piece, its own.
  const int with_grad = std::max(n - 1, 1);
  std::vector<emu_test::Half<Bf>> g;
  for (int i = 0; i < n; ++i) g.push_back(emu_test::normal<Bf>(rng, size_t(rows) * hd, 1.0));
  std::vector<double> want_dx(size_t(rows) * n * hd, 0.0), bad_dx(want_dx.size(), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < with_grad; ++i) {
      turn(&g[i].ref[r * hd], r, i < rotated, -1.0, &want_dx[(r * n + i) * hd]);
      turn(&g[i].ref[r * hd], r, rotated > 0 ? i < rotated : i == 0, 1.0, &bad_dx[(r * n + i) * hd]);
    }
  std::vector<Bf> dx(size_t(rows) * n * hd, __float2bfloat16(7.f));  // stale values: every entry must be written
  for (int i = 0; i < n; ++i) p.pieces[i] = i < with_grad ? g[i].dev.data() : nullptr;
  launch(2, dx.data(), -1.f);
  std::vector<double> got_dx;
  for (auto v : dx) got_dx.push_back(emu_test::from_half(v));
  ok &= emu_test::verdict("dx, " + at, emu_test::rel_err(got_dx, want_dx), emu_test::rel_err(bad_dx, want_dx), 8e-3);
  return ok;
}

bool all_cases() {
  bool ok = true;
  for (bool wide : {false, true}) {
    ok &= check(2, 5, 3, 3, 2, 64, 8, 41, wide);   // Pythia: q, k rotated over a quarter of the dims, v not
    ok &= check(1, 4, 2, 3, 3, 32, 16, 42, wide);  // every dim of every piece rotated
    ok &= check(1, 3, 1, 2, 0, 16, 8, 43, wide);   // nothing rotated: copies
    ok &= check(2, 3, 2, 3, 1, 48, 16, 44, wide);  // two chunks a half, one piece rotated
    ok &= check(2, 4, 3, 1, 1, 64, 32, 46, wide, 64);  // Llama's q (or k): one piece, every dim, its [T, hd] tables read in place
  }
  ok &= check(1, 3, 1, 2, 1, 20, 4, 45, false);    // a half of 4: the scalar kernel's alone
  return ok;
}

emu_test::Register reg("heads: the fused projection's pieces and RoPE, forward and backward, vs the definition", all_cases);

}  // namespace
