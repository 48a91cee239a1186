// DAR attention by split-merge (dar-kernels.md §3): a sliding-window flash call over the
// full-width keys (distance < w) and a square causal call of Q[w:] over the bottleneck keys
// K_g[:T-w] (distance >= w), merged by log-sum-exp. Backward feeds each part's stock backward kernel
// the MERGED output and log-sum-exp, which makes every partial gradient exact (the ring-attention
// identity); dQ sums the two parts. Layout [B, T, H, D], 0 < w < T.
// K_g / V_g may hold only positions 0 .. T − w − 1 (all the distant part reads; their gradients are
// then the distant part's own, with no padded copy).
// Backends: 0 = FlashAttention-2 for the global part, 1 = cuDNN (faster on H100/H200), both CUDA
// bf16/fp16; 2 = "math": both parts by explicit matmuls in the inputs' dtype on any device, with the
// kernels' conventions, so that the glue (merge, seeds, scatter) is tested exactly in fp64 on CPU.
// `fused` (experimental, off by default; issue 28): the merge in one pass in place into the local
// part's output (no fp32 copies) and dK_g / dV_g by one padded write in the backward.
// Backend 3 (issue 35): cuDNN for the distant part, and the local band with the merge in its
// epilogue, forward and backward, by our kernels (csrc/cuda/dar_band.cu, in the CUDA kernel library:
// src/kernels/cuda.rs hands their entry points over by attnlab_set_band_kernels when it loads it);
// dQ's scatter-add is in the band's dQ kernel, dK_g / dV_g one padded write. Off CUDA its distant
// part is the math (backend 2's), so that its glue is tested on CPU with stand-in band kernels.
#include <ATen/TensorOperators.h>
#include <ATen/record_function.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_flash_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention_backward.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/logaddexp.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include "flash_call.h"
#include <cmath>
#include <cstdlib>
#include <cstring>

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

typedef at::Tensor* tensor;

namespace {

using Part = AttnParts;

// Backend 3's kernels (csrc/cuda/dar_band.cu), null until the kernel library is loaded.
using BandMergeFn = char* (*)(tensor q, tensor k, tensor v, tensor far, tensor far_lse, int64_t window, tensor* out, tensor* lse);
using BandBwdFn = char* (*)(tensor q, tensor k, tensor v, tensor out, tensor dout, tensor lse, tensor far_dq, int64_t window, tensor* dq, tensor* dk,
                            tensor* dv);
BandMergeFn band_merge_fn = nullptr;
BandBwdFn band_bwd_fn = nullptr;

// A kernel library call's error as an exception, its new tensors taken over.
void library_call(char* err) {
  if (err) {
    std::string e(err);
    free(err);
    TORCH_CHECK(false, e);
  }
}
Tensor take(tensor t) {
  Tensor x = *t;
  delete t;
  return x;
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

// Backend 2: one part with the flash conventions (causal, left window wl, < 0 unbounded; lse per
// row) by explicit scores, in the inputs' dtype.
Tensor visible(int64_t n, int64_t wl, const at::TensorOptions& opt) {
  Tensor i = at::arange(n, opt.dtype(at::kLong)).unsqueeze(1);
  Tensor d = i - at::arange(n, opt.dtype(at::kLong)).unsqueeze(0);
  return wl < 0 ? d.ge(0) : d.ge(0).logical_and(d.le(wl));
}

Tensor math_scores(const Tensor& qh, const Tensor& kh, double scale, int64_t wl) {
  Tensor s = at::matmul(qh, kh.transpose(-2, -1)).mul(scale);
  return s.masked_fill(visible(qh.size(2), wl, qh.options()).logical_not(), -INFINITY);
}

Part math_fwd(const Tensor& q, const Tensor& k, const Tensor& v, double scale, int64_t wl) {
  Tensor s = math_scores(q.transpose(1, 2), k.transpose(1, 2), scale, wl);  // [B, H, L, L]
  Tensor lse = at::logsumexp(s, {-1});
  Tensor o = at::matmul(at::exp(s - lse.unsqueeze(-1)), v.transpose(1, 2));
  return {o.transpose(1, 2).contiguous(), lse, Tensor(), Tensor()};
}

// The flash backward's math given the merged O and lse: P = exp(S − lse), D = rowsum(dO ∘ O).
std::tuple<Tensor, Tensor, Tensor> math_bwd(const Tensor& dout, const Tensor& q, const Tensor& k,
                                            const Tensor& v, const Tensor& out, const Tensor& lse,
                                            double scale, int64_t wl) {
  // The contract the CUDA backward kernels are known right under (issue 33's GPU gate): dO and O
  // contiguous. Held on CPU too, so that a glue breaking it fails its tests there.
  TORCH_CHECK(dout.is_contiguous() && out.is_contiguous(), "split-merge backward: dO (strides ", dout.strides(),
              ") and O (strides ", out.strides(), ") must be contiguous");
  auto bh = [](const Tensor& x) { return x.transpose(1, 2); };
  Tensor qh = bh(q), kh = bh(k), doh = bh(dout);
  Tensor p = at::exp(math_scores(qh, kh, scale, wl) - lse.unsqueeze(-1));
  Tensor seed = (doh * bh(out)).sum(at::IntArrayRef{-1}, true);
  Tensor ds = p * (at::matmul(doh, bh(v).transpose(-2, -1)) - seed);
  return {bh(at::matmul(ds, kh).mul(scale)), bh(at::matmul(ds.transpose(-2, -1), qh).mul(scale)),
          bh(at::matmul(p.transpose(-2, -1), doh))};
}

struct DarSplitMerge : public torch::autograd::Function<DarSplitMerge> {
  static Tensor forward(AutogradContext* ctx, Tensor q, Tensor kl, Tensor vl, Tensor kg, Tensor vg,
                        int64_t w, int64_t backend, bool fused) {
    const int64_t T = q.size(1), L = T - w;
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    // Each piece in a named scope: `attnlab bench --profile` attributes its kernels by these names.
    Part loc, glo;
    Tensor lse, out;
    Tensor q2 = q.narrow(1, w, L), k2 = kg.narrow(1, 0, L), v2 = vg.narrow(1, 0, L);
    if (backend == 3) {
      TORCH_CHECK(band_merge_fn, "split-merge backend 3: the CUDA kernel library (dar_band) is not loaded");
      {
        RECORD_USER_SCOPE("dar.distant_fwd");
        // Off CUDA (tests of this glue, with stand-in band kernels) the distant part is the math.
        glo = q.is_cuda() ? cudnn_fwd(q2, k2, v2, scale) : math_fwd(q2, k2, v2, scale, -1);
      }
      RECORD_USER_SCOPE("dar.band_merge_fwd");
      Tensor lse2 = glo.lse.narrow(2, 0, L);
      tensor o = nullptr, l = nullptr;
      library_call(band_merge_fn(&q, &kl, &vl, &glo.out, &lse2, w, &o, &l));
      out = take(o);
      lse = take(l);
    } else {
      {
        RECORD_USER_SCOPE("dar.local_fwd");
        loc = backend == 2 ? math_fwd(q, kl, vl, scale, w - 1) : flash_causal_fwd(q, kl, vl, scale, w - 1);
      }
      {
        RECORD_USER_SCOPE("dar.distant_fwd");
        glo = backend == 2   ? math_fwd(q2, k2, v2, scale, -1)
              : backend == 1 ? cudnn_fwd(q2, k2, v2, scale)
                             : flash_causal_fwd(q2.contiguous(), k2.contiguous(), v2.contiguous(), scale, -1);
      }
      {
        RECORD_USER_SCOPE("dar.merge");
        Tensor lse1 = loc.lse.narrow(2, 0, T);  // flash may pad lse; keep T entries
        Tensor lse2 = glo.lse.narrow(2, 0, L), lse1t = lse1.narrow(2, w, L);
        Tensor tail = at::logaddexp(lse1t, lse2);
        lse = at::cat({lse1.narrow(2, 0, w), tail}, 2).contiguous();  // [B, H, T] f32 (f64 in fp64)
        if (fused) {
          // O[w:] = O_1[w:] + a·(O_2 − O_1[w:]), a = e^{lse_2 − lse} = σ(lse_2 − lse_1), in one pass in
          // place into the local part's output; lerp takes a weight of the output's dtype (computes in
          // fp32), so a carries one bf16 rounding, the size of the output's own.
          Tensor a = at::sigmoid(lse2 - lse1t).transpose(1, 2).unsqueeze(-1).to(q.scalar_type());
          out = loc.out;
          out.narrow(1, w, L).lerp_(glo.out, a);
        } else {
          const auto acc = at::promote_types(q.scalar_type(), at::kFloat);
          auto weight = [](const Tensor& part, const Tensor& full) {
            return at::exp(part - full).transpose(1, 2).unsqueeze(-1);  // [B, T, H, 1]
          };
          Tensor o = loc.out.to(acc) * weight(lse1, lse);
          o.narrow(1, w, L).add_(glo.out.to(acc) * weight(lse2, tail));
          out = o.to(q.scalar_type()).contiguous();
        }
      }
    }
    ctx->save_for_backward({q, kl, vl, kg, vg, out, lse, loc.rng, loc.unused, glo.rng, glo.unused});
    ctx->saved_data["w"] = w;
    ctx->saved_data["backend"] = backend;
    ctx->saved_data["fused"] = fused;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    Tensor q = s[0], kl = s[1], vl = s[2], kg = s[3], vg = s[4], out = s[5], lse = s[6];
    const int64_t w = ctx->saved_data["w"].toInt(), backend = ctx->saved_data["backend"].toInt();
    const bool fused = ctx->saved_data["fused"].toBool();
    const int64_t T = q.size(1), L = T - w;
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    Tensor dout;
    {
      RECORD_USER_SCOPE("dar.bwd_copies");
      // The fused path once passed the gradient of a transposed view through as it came, and dq /
      // dk_g came out wrong on the GPU (issue 33).
      dout = in_layout_of(grads[0], out);
    }
    Tensor undef;
    std::tuple<Tensor, Tensor, Tensor> loc;
    if (backend != 3) {
      RECORD_USER_SCOPE("dar.local_bwd");
      loc = backend == 2 ? math_bwd(dout, q, kl, vl, out, lse, scale, w - 1)
                         : at::_flash_attention_backward(dout, q, kl, vl, out, lse, undef, undef, T, T,
                                                         0.0, true, s[7], s[8], scale, w - 1, 0);
    }
    Tensor q2 = q.narrow(1, w, L), k2 = kg.narrow(1, 0, L), v2 = vg.narrow(1, 0, L);
    Tensor do2 = dout.narrow(1, w, L), o2 = out.narrow(1, w, L), lse2 = lse.narrow(2, w, L);
    {
      RECORD_USER_SCOPE("dar.bwd_copies");
      // The distant part's dO / O as contiguous copies, fused or not: cuDNN handed narrowed views
      // (a layout other than Q's) computed dq / dk_g / dv_g wrong at every window (issue 33's GPU
      // gate), and flash needs them contiguous anyway.
      do2 = do2.contiguous();
      o2 = o2.contiguous();
      lse2 = lse2.contiguous();
    }
    Tensor dq2, dk2, dv2;
    {
      RECORD_USER_SCOPE("dar.distant_bwd");
      if (backend == 2 || (backend == 3 && !q.is_cuda())) {
        std::tie(dq2, dk2, dv2) = math_bwd(do2, q2, k2, v2, o2, lse2, scale, -1);
      } else if (backend == 1 || backend == 3) {
        auto r = at::_scaled_dot_product_cudnn_attention_backward(
            bhld(do2), bhld(q2), bhld(k2), bhld(v2), bhld(o2), lse2.unsqueeze(-1), s[9], s[10],
            undef, undef, undef, L, L, 0.0, true, scale);
        dq2 = std::get<0>(r).transpose(1, 2);
        dk2 = std::get<1>(r).transpose(1, 2);
        dv2 = std::get<2>(r).transpose(1, 2);
      } else {
        std::tie(dq2, dk2, dv2) = at::_flash_attention_backward(
            do2, q2.contiguous(), k2.contiguous(), v2.contiguous(), o2, lse2, undef, undef, L, L,
            0.0, true, s[9], s[10], scale, -1, 0);
      }
    }
    if (backend == 3) {
      // The band's gradients, dQ with the distant part's added in the same kernel.
      RECORD_USER_SCOPE("dar.band_bwd");
      TORCH_CHECK(band_bwd_fn, "split-merge backend 3: the CUDA kernel library (dar_band) is not loaded");
      tensor gq = nullptr, gk = nullptr, gv = nullptr;
      library_call(band_bwd_fn(&q, &kl, &vl, &out, &dout, &lse, &dq2, w, &gq, &gk, &gv));
      loc = {take(gq), take(gk), take(gv)};
    }
    Tensor dq = std::get<0>(loc), dkg, dvg;
    {
      RECORD_USER_SCOPE("dar.bwd_scatter");
      if (backend != 3) dq.narrow(1, w, L).add_(dq2);
      if (kg.size(1) == L) {
        // K_g / V_g of the T − w positions the distant part reads (the model builds no more): their
        // gradients are the distant part's own.
        dkg = dk2;
        dvg = dv2;
      } else if (fused || backend == 3) {
        // dK_g = [dK_g'; 0_w]: one padded write instead of zeros and a copy.
        dkg = at::constant_pad_nd(dk2, {0, 0, 0, 0, 0, kg.size(1) - L});
        dvg = at::constant_pad_nd(dv2, {0, 0, 0, 0, 0, vg.size(1) - L});
      } else {
        dkg = at::zeros_like(kg);
        dvg = at::zeros_like(vg);
        dkg.narrow(1, 0, L).copy_(dk2);
        dvg.narrow(1, 0, L).copy_(dv2);
      }
    }
    return {dq, std::get<1>(loc), std::get<2>(loc), dkg, dvg, Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

// Backend 3's kernels, from the CUDA kernel library (src/kernels/cuda.rs, when it loads it).
extern "C" void attnlab_set_band_kernels(void* merge, void* bwd) {
  band_merge_fn = reinterpret_cast<BandMergeFn>(merge);
  band_bwd_fn = reinterpret_cast<BandBwdFn>(bwd);
}

extern "C" char* attnlab_dar_split_merge(tensor q, tensor kl, tensor vl, tensor kg, tensor vg,
                                         int64_t window, int64_t backend, int fused, tensor* out) {
  try {
    TORCH_CHECK(window > 0 && window < q->size(1), "split-merge needs 0 < window < T");
    // The distant part reads K_g / V_g at positions 0 .. T − w − 1 only: they may stop there.
    const int64_t far = q->size(1) - window;
    TORCH_CHECK(kg->size(1) >= far && vg->size(1) == kg->size(1) && kg->size(1) <= q->size(1), "split-merge: K_g / V_g of ", kg->size(1), " / ",
                vg->size(1), " positions, not T − w = ", far, " to T = ", q->size(1));
    TORCH_CHECK(backend >= 0 && backend <= 3, "split-merge backend ", backend, " is not 0, 1, 2 or 3");
    *out = new at::Tensor(DarSplitMerge::apply(*q, *kl, *vl, *kg, *vg, window, backend, fused != 0));
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
