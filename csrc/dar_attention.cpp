// DAR attention on CUDA by split-merge (dar-kernels.md §3): a sliding-window flash call over the
// full-width keys (distance < w) and a square causal call of Q[w:] over the bottleneck keys
// K_g[:T-w] (distance >= w), merged by log-sum-exp in fp32. Backward feeds each part's stock
// backward kernel the MERGED output and log-sum-exp, which makes every partial gradient exact
// (the ring-attention identity); dQ sums the two parts. Layout [B, T, H, D], bf16/fp16, 0 < w < T.
// The global part runs on FlashAttention-2 (backend 0) or cuDNN (backend 1, faster on H100/H200).
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_flash_attention_backward.h>
#include <ATen/ops/_flash_attention_forward.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention_backward.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/logaddexp.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <cmath>
#include <cstdlib>
#include <cstring>

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

struct Part {
  Tensor out, lse, rng, unused;  // flash: rng/unused; cudnn: philox seed/offset
};

Part flash_fwd(const Tensor& q, const Tensor& k, const Tensor& v, double scale, int64_t wl) {
  auto r = at::_ops::_flash_attention_forward::call(
      q, k, v, std::nullopt, std::nullopt, q.sym_size(1), k.sym_size(1), 0.0, /*is_causal=*/true,
      false, scale, c10::SymInt(wl), c10::SymInt(0), std::nullopt, std::nullopt);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r)};
}

// cuDNN takes [B, H, L, D]-shaped tensors; we hand it transposed views of [B, L, H, D] storage and
// return its outputs in the [B, L, H, D] / [B, H, L] convention of the flash calls.
// Experiment switch (bench only): ATTNLAB_SM_CONTIG=1 hands cuDNN contiguous [B, H, L, D] copies.
static bool contiguous_cudnn() {
  static const bool on = std::getenv("ATTNLAB_SM_CONTIG") != nullptr;
  return on;
}

static Tensor bhld(const Tensor& x) {
  return contiguous_cudnn() ? x.transpose(1, 2).contiguous() : x.transpose(1, 2);
}

Part cudnn_fwd(const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  auto r = at::_scaled_dot_product_cudnn_attention(bhld(q), bhld(k), bhld(v), std::nullopt, true, 0.0,
                                                   /*is_causal=*/true, false, scale);
  auto lse = std::get<1>(r);
  return {std::get<0>(r).transpose(1, 2), lse.reshape({q.size(0), q.size(2), q.size(1)}),
          std::get<6>(r), std::get<7>(r)};
}

struct DarSplitMerge : public torch::autograd::Function<DarSplitMerge> {
  static Tensor forward(AutogradContext* ctx, Tensor q, Tensor kl, Tensor vl, Tensor kg, Tensor vg,
                        int64_t w, int64_t backend) {
    const int64_t T = q.size(1), L = T - w;
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    Part loc = flash_fwd(q, kl, vl, scale, w - 1);
    Tensor q2 = q.narrow(1, w, L), k2 = kg.narrow(1, 0, L), v2 = vg.narrow(1, 0, L);
    Part glo = backend == 1 ? cudnn_fwd(q2, k2, v2, scale)
                            : flash_fwd(q2.contiguous(), k2.contiguous(), v2.contiguous(), scale, -1);
    Tensor lse1 = loc.lse.narrow(2, 0, T);  // flash may pad lse; keep T entries
    Tensor lse2 = glo.lse.narrow(2, 0, L);
    Tensor tail = at::logaddexp(lse1.narrow(2, w, L), lse2);
    Tensor lse = at::cat({lse1.narrow(2, 0, w), tail}, 2).contiguous();  // [B, H, T] f32
    auto weight = [](const Tensor& part, const Tensor& full) {
      return at::exp(part - full).transpose(1, 2).unsqueeze(-1);  // [B, T, H, 1]
    };
    Tensor o = loc.out.to(at::kFloat) * weight(lse1, lse);
    o.narrow(1, w, L).add_(glo.out.to(at::kFloat) * weight(lse2, tail));
    Tensor out = o.to(q.scalar_type()).contiguous();
    ctx->save_for_backward({q, kl, vl, kg, vg, out, lse, loc.rng, loc.unused, glo.rng, glo.unused});
    ctx->saved_data["w"] = w;
    ctx->saved_data["backend"] = backend;
    ctx->saved_data["lse_pad"] = loc.lse.size(2);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    Tensor q = s[0], kl = s[1], vl = s[2], kg = s[3], vg = s[4], out = s[5], lse = s[6];
    const int64_t w = ctx->saved_data["w"].toInt(), backend = ctx->saved_data["backend"].toInt();
    const int64_t T = q.size(1), L = T - w;
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    Tensor dout = grads[0].contiguous();
    Tensor undef;
    auto loc = at::_flash_attention_backward(dout, q, kl, vl, out, lse, undef, undef, T, T, 0.0,
                                             true, s[7], s[8], scale, w - 1, 0);
    Tensor q2 = q.narrow(1, w, L), k2 = kg.narrow(1, 0, L), v2 = vg.narrow(1, 0, L);
    Tensor do2 = dout.narrow(1, w, L).contiguous(), o2 = out.narrow(1, w, L).contiguous();
    Tensor lse2 = lse.narrow(2, w, L).contiguous();
    Tensor dq2, dk2, dv2;
    if (backend == 1) {
      auto r = at::_scaled_dot_product_cudnn_attention_backward(
          bhld(do2), bhld(q2), bhld(k2), bhld(v2), bhld(o2), lse2.unsqueeze(-1), s[9], s[10], undef,
          undef, undef, L, L, 0.0, true, scale);
      dq2 = std::get<0>(r).transpose(1, 2);
      dk2 = std::get<1>(r).transpose(1, 2);
      dv2 = std::get<2>(r).transpose(1, 2);
    } else {
      auto r = at::_flash_attention_backward(do2, q2.contiguous(), k2.contiguous(),
                                             v2.contiguous(), o2, lse2, undef, undef, L, L, 0.0,
                                             true, s[9], s[10], scale, -1, 0);
      dq2 = std::get<0>(r);
      dk2 = std::get<1>(r);
      dv2 = std::get<2>(r);
    }
    Tensor dq = std::get<0>(loc);
    dq.narrow(1, w, L).add_(dq2);
    Tensor dkg = at::zeros_like(kg), dvg = at::zeros_like(vg);
    dkg.narrow(1, 0, L).copy_(dk2);
    dvg.narrow(1, 0, L).copy_(dv2);
    return {dq, std::get<1>(loc), std::get<2>(loc), dkg, dvg, Tensor(), Tensor()};
  }
};

}  // namespace

typedef at::Tensor* tensor;

extern "C" char* attnlab_dar_split_merge(tensor q, tensor kl, tensor vl, tensor kg, tensor vg,
                                         int64_t window, int64_t backend, tensor* out) {
  try {
    TORCH_CHECK(window > 0 && window < q->size(1), "split-merge needs 0 < window < T");
    *out = new at::Tensor(DarSplitMerge::apply(*q, *kl, *vl, *kg, *vg, window, backend));
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
