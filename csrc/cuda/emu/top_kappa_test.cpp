// The routing's top-κ kernel (csrc/cuda/top_kappa.cuh) on the CPU against the definition: a stable
// descending sort of each row (NaN first, ties by index), its first κ indices, ascending. Rows of
// normal scores, rows of heavy ties (four values), rows with NaNs, κ = C, a row stride past C (the
// decode's chunk inside its ring of 2C scores), C not a multiple of the block, and fewer blocks than
// rows (the grid-stride loop). Planted: ties broken by the higher index (as an unstable sort may), or
// the indices left in score order; each case must tell one of them from the definition.
#include "emu_test.h"
#include "../top_kappa.cuh"
#include <algorithm>
#include <numeric>

namespace {

// The κ indices of `row` a stable descending sort puts first (ties to the lower index, or with
// `high_first` to the higher one), ascending (or with `score_order` as the sort left them).
std::vector<int64_t> reference(const float* row, int C, int kappa, bool high_first, bool score_order = false) {
  std::vector<int> idx(C);
  std::iota(idx.begin(), idx.end(), 0);
  auto before = [&](int i, int j) {
    const float a = row[i], b = row[j];
    const bool na = std::isnan(a), nb = std::isnan(b);
    if (na || nb) return na && !nb;
    return a > b;
  };
  if (high_first) std::reverse(idx.begin(), idx.end());
  std::stable_sort(idx.begin(), idx.end(), before);
  std::vector<int64_t> top(idx.begin(), idx.begin() + kappa);
  if (!score_order) std::sort(top.begin(), top.end());
  return top;
}

bool check(const char* what, int64_t rows, int C, int ld, int kappa, int blocks, int ties, bool nans, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> level(0, std::max(ties, 1) - 1);
  std::uniform_real_distribution<float> u01;
  std::vector<float> scores(size_t(rows) * ld, -7.f);
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < C; ++c) {
      float x = ties > 0 ? float(level(rng)) : normal(rng);
      if (nans && u01(rng) < 0.05f) x = NAN;
      scores[size_t(r) * ld + c] = x;
    }
  std::vector<int64_t> out(size_t(rows) * kappa, -1);
  TopKappaParams p{scores.data(), rows, ld, C, kappa, out.data()};
  emu::launch(top_kappa_rank, dim3(blocks), dim3(kTopThreads), top_kappa_smem_bytes(C), p);
  double wrong = 0, ties_high = 0, unsorted = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<int64_t> got(out.begin() + r * kappa, out.begin() + (r + 1) * kappa);
    const float* row = &scores[size_t(r) * ld];
    wrong += got != reference(row, C, kappa, false);
    ties_high += got != reference(row, C, kappa, true);
    unsorted += got != reference(row, C, kappa, false, true);
  }
  const std::string at = std::string(what) + " " + std::to_string(rows) + "×" + std::to_string(C) + " κ " + std::to_string(kappa);
  return emu_test::verdict("rows unlike a stable sort's top-κ, " + at, wrong / rows, std::max(ties_high, unsorted) / rows, 0.0);
}

bool top_kappa() {
  bool ok = true;
  ok &= check("normal", 40, 64, 64, 4, 7, 0, false, 1);
  ok &= check("four values (ties)", 40, 64, 64, 4, 40, 4, false, 2);
  ok &= check("ties, NaNs", 30, 64, 64, 6, 9, 3, true, 3);
  ok &= check("ties, κ = C", 5, 64, 64, 64, 5, 2, false, 4);
  ok &= check("ties, in a ring of 2C", 16, 64, 128, 4, 16, 4, false, 5);
  ok &= check("ties, C 100", 12, 100, 100, 7, 3, 5, false, 6);
  ok &= check("ties, C 8", 9, 8, 8, 3, 2, 2, false, 7);
  return ok;
}

emu_test::Register reg("top_kappa: the routing's top-κ of each row, against a stable sort", top_kappa);

}  // namespace
