// Causal flash attention with a left window, forward and backward (FlashAttention-2 through aten),
// as one autograd function: the sliding-window kind's fast path (O(T·w), not a [T, T] mask), and
// causal attention at inference, where cuDNN would build an execution plan for every new shape
// (issue 34: a fixed ~0.06 s per prefill). Layout [B, T, H, D]; window_left < 0 is unbounded, else
// query i reads keys i − window_left ..= i. Keys / values may have fewer heads (GQA).
#include <ATen/core/Tensor.h>
#include <ATen/ops/_flash_attention_backward.h>
#include <torch/csrc/autograd/custom_function.h>
#include "flash_call.h"
#include <cmath>
#include <cstring>

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

struct FlashAttention : public torch::autograd::Function<FlashAttention> {
  static Tensor forward(AutogradContext* ctx, Tensor q, Tensor k, Tensor v, int64_t window_left) {
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    AttnParts r = flash_causal_fwd(q, k, v, scale, window_left);
    ctx->save_for_backward({q, k, v, r.out, r.lse, r.rng, r.unused});
    ctx->saved_data["window_left"] = window_left;
    return r.out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const Tensor &q = s[0], &k = s[1], &v = s[2], &out = s[3];
    const int64_t wl = ctx->saved_data["window_left"].toInt();
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    Tensor dout = in_layout_of(grads[0], out);
    Tensor undef;
    auto r = at::_flash_attention_backward(dout, q, k, v, out, s[4], undef, undef, q.size(1), k.size(1), 0.0, true,
                                           s[5], s[6], scale, wl, 0);
    return {std::get<0>(r), std::get<1>(r), std::get<2>(r), Tensor()};
  }
};

}  // namespace

typedef at::Tensor* tensor;

extern "C" char* attnlab_flash_attention(tensor q, tensor k, tensor v, int64_t window_left, tensor* out) {
  try {
    *out = new at::Tensor(FlashAttention::apply(*q, *k, *v, window_left));
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
