// The heads of a fused projection, without copies in the backward (issue 33). GPT-NeoX projects
// q, k and v in one matmul, head-major: x [B, T, H·n·hd] holds, per head, n slices of hd. Taking
// them apart by select / narrow and RoPE's halves by narrow / cat makes autograd write, per piece,
// a zero-filled gradient the size of x and add them. Here the forward writes each piece once (the
// first `rotated` rotated by RoPE, half-split over the first r = 2·cos.size(-1) dims; cos / sin
// [T, r/2] cast to x's dtype) into a fresh [B, T, H, hd] tensor, and the backward writes the
// gradient of x once: one uninitialised [B, T, H, n, hd] buffer, each slice filled by the inverse
// rotation of its piece's gradient or a copy of it.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <torch/csrc/autograd/custom_function.h>
#include <cstring>

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// out ← x rotated by (cos, sin) (sign +1) or by its inverse (sign −1): for halves x1, x2,
// out1 = x1·c − sign·x2·s, out2 = x2·c + sign·x1·s; dims ≥ r copied. Broadcast c, s [1, T, 1, r/2].
void rotate(Tensor out, const Tensor& x, const Tensor& c, const Tensor& s, double sign) {
  const int64_t half = c.size(-1), r = 2 * half, hd = x.size(-1);
  if (half > 0) {
    Tensor o1 = out.narrow(-1, 0, half), o2 = out.narrow(-1, half, half);
    Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
    at::mul_out(o1, x1, c);
    o1.addcmul_(x2, s, -sign);
    at::mul_out(o2, x2, c);
    o2.addcmul_(x1, s, sign);
  }
  if (r < hd) out.narrow(-1, r, hd - r).copy_(x.narrow(-1, r, hd - r));
}

struct SplitRotate : public torch::autograd::Function<SplitRotate> {
  static variable_list forward(AutogradContext* ctx, Tensor x, int64_t heads, int64_t n, int64_t rotated,
                               Tensor cos, Tensor sin) {
    const int64_t B = x.size(0), T = x.size(1), hd = x.size(2) / (heads * n);
    TORCH_CHECK(x.dim() == 3 && heads * n * hd == x.size(2), "split_rotate: x [B, T, ", heads, "·", n, "·hd], got ", x.sizes());
    TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.sizes() == sin.sizes() && 2 * cos.size(1) <= hd,
                "split_rotate: cos / sin [T, r/2] with r ≤ hd, got ", cos.sizes(), " and ", sin.sizes());
    Tensor c = cos.to(x.scalar_type()).view({1, T, 1, cos.size(1)});
    Tensor s = sin.to(x.scalar_type()).view({1, T, 1, sin.size(1)});
    Tensor xv = x.view({B, T, heads, n, hd});
    variable_list outs;
    for (int64_t i = 0; i < n; ++i) {
      Tensor o = at::empty({B, T, heads, hd}, x.options());
      if (i < rotated) {
        rotate(o, xv.select(3, i), c, s, 1.0);
      } else {
        o.copy_(xv.select(3, i));
      }
      outs.push_back(o);
    }
    ctx->save_for_backward({c, s});
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["n"] = n;
    ctx->saved_data["rotated"] = rotated;
    return outs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &c = saved[0], &s = saved[1];
    const int64_t heads = ctx->saved_data["heads"].toInt(), n = ctx->saved_data["n"].toInt();
    const int64_t rotated = ctx->saved_data["rotated"].toInt();
    Tensor like;
    for (auto& g : grads) {
      if (g.defined()) like = g;
    }
    const int64_t B = like.size(0), T = like.size(1), hd = like.size(3);
    Tensor dx = at::empty({B, T, heads, n, hd}, like.options());
    for (int64_t i = 0; i < n; ++i) {
      Tensor slot = dx.select(3, i);
      if (!grads[i].defined()) {
        slot.zero_();
      } else if (i < rotated) {
        rotate(slot, grads[i], c, s, -1.0);
      } else {
        slot.copy_(grads[i]);
      }
    }
    return {dx.view({B, T, heads * n * hd}), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

typedef at::Tensor* tensor;

// outs: n new tensors [B, T, H, hd] (the caller owns them).
extern "C" char* attnlab_split_rotate(tensor x, int64_t heads, int64_t n, int64_t rotated, tensor cos, tensor sin,
                                      tensor* outs) {
  try {
    TORCH_CHECK(n >= 1 && rotated >= 0 && rotated <= n, "split_rotate: 0 ≤ rotated ≤ n, n ≥ 1");
    auto r = SplitRotate::apply(*x, heads, n, rotated, *cos, *sin);
    for (int64_t i = 0; i < n; ++i) outs[i] = new at::Tensor(r[i]);
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
