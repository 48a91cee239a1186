// The LayerNorm / RMSNorm kernels' autograd op and launches (csrc/cuda/layer_norm.cuh says what they
// compute). An undefined β is RMSNorm.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/custom_function.h>
#include <cstring>
#include "layer_norm.cuh"

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

typedef at::Tensor* tensor;

namespace {

template <typename T>
T* ptr(const Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

int64_t chunks_of(int64_t n) { return (n + kRowsPerChunk - 1) / kRowsPerChunk; }

// A float pointer, or null for an undefined tensor (RMSNorm's β, mean and dβ).
const float* fptr(const Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }
float* fptr_mut(Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// The kernels with the fewest registers that hold ⌈d / kThreads⌉ columns a thread; their RMSNorm
// form where β (forward) or the mean (backward) is undefined.
template <typename T>
void launch_forward(const Tensor& x, const Tensor& g, const Tensor& b, double eps, Tensor& y, Tensor& mean, Tensor& rstd, cudaStream_t stream) {
  const int64_t d = x.size(-1), n = x.numel() / d;
  const bool fits = with_cols(d, [&](auto cols) {
    constexpr int C = decltype(cols)::value;
    auto kernel = b.defined() ? ln_forward<T, C, false> : ln_forward<T, C, true>;
    kernel<<<chunks_of(n), kThreads, 0, stream>>>(x.data_ptr<float>(), g.data_ptr<float>(), fptr(b), n, d, (float)eps, ptr<T>(y), fptr_mut(mean),
                                                  rstd.data_ptr<float>());
  });
  TORCH_CHECK(fits, "layer_norm_half: rows of ", d, " are wider than the kernels take");
}

template <typename T>
void launch_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dg, Tensor& db,
                     cudaStream_t stream) {
  const int64_t d = x.size(-1), n = x.numel() / d;
  const bool fits = with_cols(d, [&](auto cols) {
    constexpr int C = decltype(cols)::value;
    auto kernel = mean.defined() ? ln_backward<T, C, false> : ln_backward<T, C, true>;
    kernel<<<dg.size(0), kThreads, 0, stream>>>(ptr<T>(dy), x.data_ptr<float>(), g.data_ptr<float>(), fptr(mean), rstd.data_ptr<float>(), n, d,
                                                dx.data_ptr<float>(), dg.data_ptr<float>(), fptr_mut(db));
  });
  TORCH_CHECK(fits, "layer_norm_half: rows of ", d, " are wider than the kernels take");
}

struct LayerNormHalf : public torch::autograd::Function<LayerNormHalf> {
  // No β: RMSNorm. An optional, not an undefined Tensor: autograd's apply reads every Tensor
  // argument's device, and an undefined one has none.
  static Tensor forward(AutogradContext* ctx, Tensor x, Tensor gamma, std::optional<Tensor> beta_opt, double eps, int64_t out_kind) {
    const Tensor beta = beta_opt.value_or(Tensor());
    const bool rms = !beta.defined();
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat, "layer_norm_half: x must be fp32 on CUDA");
    TORCH_CHECK(gamma.scalar_type() == at::kFloat && (rms || beta.scalar_type() == at::kFloat), "layer_norm_half: γ, β must be fp32");
    const int64_t d = x.size(-1);
    TORCH_CHECK(gamma.numel() == d && (rms || beta.numel() == d), "layer_norm_half: γ, β must have ", d, " entries");
    c10::cuda::CUDAGuard guard(x.device());
    Tensor xc = x.contiguous(), g = gamma.contiguous(), b = rms ? Tensor() : beta.contiguous();
    const int64_t n = xc.numel() / d;
    const auto kind = static_cast<at::ScalarType>(out_kind);
    Tensor y = at::empty(x.sizes(), x.options().dtype(kind));
    Tensor mean = rms ? Tensor() : at::empty({n}, x.options()), rstd = at::empty({n}, x.options());
    auto stream = c10::cuda::getCurrentCUDAStream();
    if (n > 0) {
      if (kind == at::kBFloat16) {
        launch_forward<__nv_bfloat16>(xc, g, b, eps, y, mean, rstd, stream);
      } else {
        TORCH_CHECK(kind == at::kHalf, "layer_norm_half: the output must be bf16 or fp16");
        launch_forward<__half>(xc, g, b, eps, y, mean, rstd, stream);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    ctx->save_for_backward({xc, g, rstd, mean});  // mean undefined for RMSNorm
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    Tensor x = saved[0], g = saved[1], rstd = saved[2], mean = saved[3];
    const bool rms = !mean.defined();
    const int64_t d = x.size(-1), n = x.numel() / d;
    Tensor dy = grads[0].contiguous();
    c10::cuda::CUDAGuard guard(x.device());
    auto stream = c10::cuda::getCurrentCUDAStream();
    Tensor dx = at::empty(x.sizes(), x.options());
    const int64_t chunks = chunks_of(n);
    // Every block writes its chunk's partial row; with no rows there is one row of zeros.
    Tensor dg = at::empty({std::max<int64_t>(chunks, 1), d}, x.options());
    Tensor db = rms ? Tensor() : at::empty({std::max<int64_t>(chunks, 1), d}, x.options());
    if (n > 0) {
      if (dy.scalar_type() == at::kBFloat16) {
        launch_backward<__nv_bfloat16>(dy, x, g, mean, rstd, dx, dg, db, stream);
      } else {
        TORCH_CHECK(dy.scalar_type() == at::kHalf, "layer_norm_half: dy must be bf16 or fp16");
        launch_backward<__half>(dy, x, g, mean, rstd, dx, dg, db, stream);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      dg.zero_();
      if (!rms) db.zero_();
    }
    return {dx, dg.sum(0), rms ? Tensor() : db.sum(0), Tensor(), Tensor()};
  }
};

// The op inside a CUDA autocast region for fp32 x and γ (and β): y in autocast's dtype. Otherwise
// (outside autocast, other dtypes, rows wider than the kernels take) *out stays null: the caller's
// aten form applies.
char* norm_half(tensor x, tensor gamma, const Tensor& beta, double eps, tensor* out) {
  try {
    *out = nullptr;
    if (!at::autocast::is_autocast_enabled(at::kCUDA) || !x->is_cuda() || x->scalar_type() != at::kFloat || gamma->scalar_type() != at::kFloat ||
        (beta.defined() && beta.scalar_type() != at::kFloat)) {
      return nullptr;
    }
    const at::ScalarType kind = at::autocast::get_autocast_dtype(at::kCUDA);
    if (kind != at::kBFloat16 && kind != at::kHalf) return nullptr;
    if (x->dim() == 0 || x->size(-1) == 0 || x->size(-1) > (int64_t)kMaxCols * kThreads) return nullptr;  // wider than the kernels take
    const std::optional<Tensor> beta_opt = beta.defined() ? std::optional<Tensor>(beta) : std::nullopt;
    *out = new at::Tensor(LayerNormHalf::apply(*x, *gamma, beta_opt, eps, static_cast<int64_t>(kind)));
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}

// RMSNorm of a half model's x by the forward kernel in x's own dtype (ROUND: Llama's rounding).
template <typename T, bool ROUND>
void launch_infer(const Tensor& x, const Tensor& g, double eps, Tensor& y, cudaStream_t stream) {
  const int64_t d = x.size(-1), n = x.numel() / d;
  const bool fits = with_cols(d, [&](auto cols) {
    constexpr int C = decltype(cols)::value;
    ln_forward<T, C, true, T, ROUND><<<infer_blocks(n), kThreads, 0, stream>>>(ptr<T>(x), ptr<T>(g), nullptr, n, d, (float)eps, ptr<T>(y), nullptr, nullptr);
  });
  TORCH_CHECK(fits, "rms_norm_infer: rows of ", d, " are wider than the kernels take");
}

}  // namespace

// y = LayerNorm(x)·γ + β over the last dim, x fp32 [.., d] on CUDA, γ / β fp32 [d], inside a CUDA
// autocast region: y in autocast's dtype (bf16 or fp16), differentiable in x, γ and β. Outside
// autocast (or for other dtypes) *out stays null: the caller's aten LayerNorm applies.
extern "C" char* attnlab_layer_norm_half(tensor x, tensor gamma, tensor beta, double eps, tensor* out) {
  return norm_half(x, gamma, *beta, eps, out);
}

// y = x·rsqrt(mean(x²) + eps)·γ (Llama's / OLMo 2's RMSNorm of an fp32 residual stream) on the same
// terms as attnlab_layer_norm_half.
extern "C" char* attnlab_rms_norm_half(tensor x, tensor gamma, double eps, tensor* out) {
  return norm_half(x, gamma, Tensor(), eps, out);
}

// y = x·rsqrt(mean(x²) + eps)·γ for a half model's inference: x bf16 / fp16 [.., d] on CUDA, γ of
// the same dtype [d], y in that dtype, statistics in fp32; `round_first`: x̂ rounded before γ
// (HF's LlamaRMSNorm), else one rounding at the end (Olmo2RMSNorm). Forward only: where autograd
// would need the graph (grad mode on and x or γ requiring grad), or for other dtypes and widths,
// *out stays null and the caller's aten form applies.
extern "C" char* attnlab_rms_norm_infer(tensor x, tensor gamma, double eps, int64_t round_first, tensor* out) {
  try {
    *out = nullptr;
    const at::ScalarType kind = x->scalar_type();
    if (!x->is_cuda() || (kind != at::kBFloat16 && kind != at::kHalf) || gamma->scalar_type() != kind || gamma->device() != x->device()) return nullptr;
    if (at::GradMode::is_enabled() && (x->requires_grad() || gamma->requires_grad())) return nullptr;
    if (x->dim() == 0 || x->size(-1) == 0 || x->size(-1) > (int64_t)kMaxCols * kThreads || gamma->numel() != x->size(-1)) return nullptr;
    c10::cuda::CUDAGuard guard(x->device());
    Tensor xc = x->contiguous(), g = gamma->contiguous();
    Tensor y = at::empty(x->sizes(), x->options());
    if (xc.numel() > 0) {
      auto stream = c10::cuda::getCurrentCUDAStream();
      if (kind == at::kBFloat16) {
        round_first ? launch_infer<__nv_bfloat16, true>(xc, g, eps, y, stream) : launch_infer<__nv_bfloat16, false>(xc, g, eps, y, stream);
      } else {
        round_first ? launch_infer<__half, true>(xc, g, eps, y, stream) : launch_infer<__half, false>(xc, g, eps, y, stream);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    *out = new at::Tensor(y);
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
