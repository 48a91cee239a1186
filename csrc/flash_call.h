// What csrc/flash.cpp and csrc/dar_attention.cpp share: the causal FlashAttention-2 forward call
// with a left window, and the rule that a backward reads dO in O's layout.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/_flash_attention_forward.h>
#include <ATen/ops/empty_like.h>

// An attention call's output, log-sum-exp and the two tensors its backward needs back (flash: rng
// state / unused; cuDNN: philox seed / offset).
struct AttnParts {
  at::Tensor out, lse, rng, unused;
};

// Causal flash attention over [B, T, H, D]; window_left < 0 is unbounded.
inline AttnParts flash_causal_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                  int64_t window_left) {
  auto r = at::_ops::_flash_attention_forward::call(
      q, k, v, std::nullopt, std::nullopt, q.sym_size(1), k.sym_size(1), 0.0, /*is_causal=*/true, false, scale,
      c10::SymInt(window_left), c10::SymInt(0), std::nullopt, std::nullopt);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r)};
}

// `grad` with `out`'s strides (a copy only where they differ): the backward kernels read dO and O
// with one layout. In a model the two agree and this is no copy.
inline at::Tensor in_layout_of(const at::Tensor& grad, const at::Tensor& out) {
  if (grad.strides() == out.strides()) return grad;
  at::Tensor g = at::empty_like(out);
  g.copy_(grad);
  return g;
}
