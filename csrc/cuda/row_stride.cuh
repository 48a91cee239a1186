// Host code shared by the launches (csrc/cuda/*.cu) that take a tensor as rows of its last dim (no
// device code: the emulator never includes it).
#pragma once
#include <ATen/ATen.h>

// The stride between rows of x [.., cols] seen as one matrix, or -1 where its leading dims do not
// collapse into rows at one stride (the last dim must be unit-stride).
inline int64_t row_stride(const at::Tensor& x) {
  const int64_t n = x.dim();
  if (n == 0 || x.stride(n - 1) != 1) return -1;
  if (n == 1) return x.size(0);
  for (int64_t i = 0; i + 2 < n; ++i) {
    if (x.size(i) > 1 && x.stride(i) != x.size(i + 1) * x.stride(i + 1)) return -1;
  }
  return x.stride(n - 2);
}
