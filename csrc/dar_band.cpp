// DAR attention on the CPU by split-merge (issue 35 item 5): the local band (keys at distance < w,
// full width) by blocks of C queries against the C + w − 1 keys their band touches (one batched
// matmul, a constant band mask), the distant part (keys at distance >= w, bottleneck) by libtorch's
// CPU flash attention, causal over the shifted sequences Q[w:] and K_g[:T-w] (it returns its
// log-sum-exp), merged by log-sum-exp. The backward gives each part the MERGED output and
// log-sum-exp (the ring-attention identity, as csrc/dar_attention.cpp): the local part by explicit
// matmuls over the same blocks, the distant part by the CPU flash backward. Layout [B, H, T, D]
// (heads as the model hands them), float or double, 0 < w < T. Exact against the explicit masked
// reference in fp64 (src/attention/dar.rs tests).
#include <ATen/TensorOperators.h>
#include <ATen/record_function.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/logaddexp.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/unfold_backward.h>
#include <torch/csrc/autograd/custom_function.h>
#include <cmath>
#include <cstdlib>
#include <cstring>

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// Queries per block of the local part: at least 16 (a batched matmul of tiny blocks is mostly
// overhead), at least w (each block then reads two key blocks' worth). ATTNLAB_BAND_BLOCK overrides
// (timing only).
int64_t block_size(int64_t w) {
  static const int64_t forced = [] {
    const char* s = std::getenv("ATTNLAB_BAND_BLOCK");
    return s ? std::atoll(s) : 0;
  }();
  if (forced > 0) return forced;
  return std::max<int64_t>(w, 16);
}

// The local part's geometry: nb blocks of C queries (T padded to Tp = nb·C), each reading a window
// of W = C + w − 1 keys of the keys padded by w − 1 in front (window index r of block b is key
// position b·C − (w − 1) + r).
struct Band {
  int64_t T, w, C, nb, Tp, W;
  Band(int64_t T_, int64_t w_) : T(T_), w(w_), C(block_size(w_)) {
    nb = (T + C - 1) / C;
    Tp = nb * C;
    W = C + w - 1;
  }
  // [B, H, T, D] → [B, H, nb, C, D] (zero rows past T).
  Tensor queries(const Tensor& x) const {
    return at::constant_pad_nd(x, {0, 0, 0, Tp - T}).view({x.size(0), x.size(1), nb, C, x.size(3)});
  }
  // [B, H, T, D] → the padded keys [B, H, Tp + w − 1, D].
  Tensor padded_keys(const Tensor& x) const { return at::constant_pad_nd(x, {0, 0, w - 1, Tp - T}); }
  // The padded keys → each block's window [B, H, nb, D, W] (a view).
  Tensor windows(const Tensor& kp) const { return kp.unfold(2, W, C); }
  // [nb, C, W]: query c of block b reads window index r iff c <= r < c + w and its key position
  // b·C − (w − 1) + r >= 0.
  Tensor mask(const at::TensorOptions& opt) const {
    auto lo = opt.dtype(at::kLong);
    Tensor c = at::arange(C, lo).view({1, C, 1});
    Tensor r = at::arange(W, lo).view({1, 1, W});
    Tensor pos = at::arange(nb, lo).view({nb, 1, 1}) * C - (w - 1) + r;
    return r.ge(c).logical_and(r.lt(c + w)).logical_and(pos.ge(0));
  }
  // Scores [B, H, nb, C, W] of the blocks, -inf outside the band.
  Tensor scores(const Tensor& qb, const Tensor& kw, double scale) const {
    Tensor s = at::matmul(qb, kw).mul_(scale);
    return s.masked_fill_(mask(qb.options()).logical_not(), -INFINITY);
  }
  // [B, H, nb, C, ...] → [B, H, T, ...].
  Tensor rows(const Tensor& x) const {
    auto sizes = x.sizes().vec();
    std::vector<int64_t> out{sizes[0], sizes[1], Tp};
    for (size_t i = 4; i < sizes.size(); ++i) out.push_back(sizes[i]);
    return x.reshape(out).narrow(2, 0, T);
  }
};

struct DarBandSplit : public torch::autograd::Function<DarBandSplit> {
  static Tensor forward(AutogradContext* ctx, Tensor q, Tensor kl, Tensor vl, Tensor kg, Tensor vg, int64_t w) {
    const int64_t T = q.size(2), L = T - w;
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    const Band band(T, w);
    Tensor o1, lse1;
    {
      RECORD_USER_SCOPE("dar.local_fwd");
      Tensor s = band.scores(band.queries(q), band.windows(band.padded_keys(kl)), scale);
      Tensor lse = at::logsumexp(s, {-1}, true);  // [B, H, nb, C, 1]
      Tensor vw = band.windows(band.padded_keys(vl)).transpose(-2, -1);  // [B, H, nb, W, D]
      o1 = band.rows(at::matmul(s.sub_(lse).exp_(), vw));  // [B, H, T, D]
      lse1 = band.rows(lse.squeeze(-1));  // [B, H, T]
    }
    Tensor q2 = q.narrow(2, w, L), k2 = kg.narrow(2, 0, L), v2 = vg.narrow(2, 0, L);
    Tensor o2, lse2;
    {
      RECORD_USER_SCOPE("dar.distant_fwd");
      std::tie(o2, lse2) = at::_scaled_dot_product_flash_attention_for_cpu(q2, k2, v2, 0.0, true, std::nullopt, scale);
    }
    Tensor out, lse;
    {
      RECORD_USER_SCOPE("dar.merge");
      lse = lse1.clone(at::MemoryFormat::Contiguous);  // a copy even where lse1 is contiguous (T = Tp)
      Tensor tail = lse.narrow(2, w, L);
      Tensor l1t = tail.clone();
      tail.copy_(at::logaddexp(l1t, lse2));
      out = o1.mul(at::exp(lse1 - lse).unsqueeze(-1));
      out.narrow(2, w, L).add_(o2 * at::exp(lse2 - tail).unsqueeze(-1));
    }
    ctx->save_for_backward({q, kl, vl, kg, vg, out, lse});
    ctx->saved_data["w"] = w;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    Tensor q = s[0], kl = s[1], vl = s[2], kg = s[3], vg = s[4], out = s[5], lse = s[6];
    const int64_t w = ctx->saved_data["w"].toInt();
    const int64_t T = q.size(2), L = T - w;
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    const Band band(T, w);
    Tensor dout = grads[0].contiguous();
    Tensor dq, dkl, dvl;
    {
      RECORD_USER_SCOPE("dar.local_bwd");
      // Rows past T: dO = O = 0 and lse = 0, so their P·(dP − D) is 0.
      Tensor qb = band.queries(q), dob = band.queries(dout);
      Tensor kp = band.padded_keys(kl), vp = band.padded_keys(vl);
      Tensor kw = band.windows(kp), vw = band.windows(vp);  // [B, H, nb, D, W]
      Tensor lseb = at::constant_pad_nd(lse, {0, band.Tp - T}).view({q.size(0), q.size(1), band.nb, band.C, 1});
      Tensor p = band.scores(qb, kw, scale).sub_(lseb).exp_();  // [B, H, nb, C, W]
      Tensor dsum = band.queries((dout * out).sum({-1}, true));  // [B, H, nb, C, 1]
      Tensor ds = p * (at::matmul(dob, vw).sub_(dsum));
      dq = band.rows(at::matmul(ds, kw.transpose(-2, -1))).mul(scale);  // [B, H, T, D] (a copy: narrowed)
      Tensor dkw = at::matmul(ds.transpose(-2, -1), qb).mul_(scale);  // [B, H, nb, W, D]
      Tensor dvw = at::matmul(p.transpose(-2, -1), dob);
      auto fold = [&](const Tensor& dw, const Tensor& padded) {
        return at::unfold_backward(dw.transpose(-2, -1), padded.sizes(), 2, band.W, band.C).narrow(2, w - 1, T);
      };
      dkl = fold(dkw, kp);
      dvl = fold(dvw, vp);
    }
    Tensor q2 = q.narrow(2, w, L), k2 = kg.narrow(2, 0, L), v2 = vg.narrow(2, 0, L);
    Tensor dq2, dk2, dv2;
    {
      RECORD_USER_SCOPE("dar.distant_bwd");
      std::tie(dq2, dk2, dv2) = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          dout.narrow(2, w, L), q2, k2, v2, out.narrow(2, w, L), lse.narrow(2, w, L), 0.0, true, std::nullopt, scale);
    }
    Tensor dkg, dvg;
    {
      RECORD_USER_SCOPE("dar.bwd_scatter");
      dq = dq.contiguous();
      dq.narrow(2, w, L).add_(dq2);
      dkg = at::constant_pad_nd(dk2, {0, 0, 0, w});
      dvg = at::constant_pad_nd(dv2, {0, 0, 0, w});
    }
    return {dq, dkl, dvl, dkg, dvg, Tensor()};
  }
};

}  // namespace

typedef at::Tensor* tensor;

extern "C" char* attnlab_dar_band_split(tensor q, tensor kl, tensor vl, tensor kg, tensor vg, int64_t window,
                                        tensor* out) {
  try {
    TORCH_CHECK(q->dim() == 4, "band split takes heads [B, H, T, D]");
    TORCH_CHECK(window > 0 && window < q->size(2), "band split needs 0 < window < T");
    TORCH_CHECK(q->device().is_cpu(), "band split is the CPU path");
    TORCH_CHECK(q->scalar_type() == at::kFloat || q->scalar_type() == at::kDouble, "band split takes float or double");
    *out = new at::Tensor(DarBandSplit::apply(*q, *kl, *vl, *kg, *vg, window));
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
