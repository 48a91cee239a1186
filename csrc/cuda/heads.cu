// The heads op's autograd function on CUDA with one kernel each way (csrc/cuda/heads.cuh says what
// they compute; csrc/heads.cpp is the aten form every other device takes). Taken by
// default (src/kernels/cuda.rs; ATTNLAB_HEADS_KERNEL=0 takes the aten form): 1.08-1.09x faster training.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/custom_function.h>
#include <cstring>
#include <vector>
#include "heads.cuh"

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

template <typename T>
void launch(HeadsParams p, const Tensor& x, const std::vector<Tensor>& pieces, float sign) {
  for (int i = 0; i < p.n; ++i) p.pieces[i] = pieces[i].defined() ? pieces[i].data_ptr() : nullptr;
  const bool wide = heads_rotate8_fits(p, x.data_ptr());
  const int64_t total = p.rows * p.n * (wide ? p.hd / 8 : p.hd - p.half);
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>((total + kHeadsThreads - 1) / kHeadsThreads, 65535 * 8);
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (wide) heads_rotate8<T><<<blocks, kHeadsThreads, 0, stream>>>(p, reinterpret_cast<T*>(x.data_ptr()), sign);
  else heads_rotate<T><<<blocks, kHeadsThreads, 0, stream>>>(p, reinterpret_cast<T*>(x.data_ptr()), sign);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename F>
void dispatch(at::ScalarType t, F f) {
  if (t == at::kBFloat16) f(__nv_bfloat16{});
  else if (t == at::kHalf) f(__half{});
  else TORCH_CHECK(false, "split_rotate (CUDA): x must be bf16 or fp16, not ", t);
}

struct SplitRotateCuda : public torch::autograd::Function<SplitRotateCuda> {
  static variable_list forward(AutogradContext* ctx, Tensor x, int64_t heads, int64_t n, int64_t rotated, Tensor cos, Tensor sin) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 3 && x.size(2) % (heads * n) == 0, "split_rotate (CUDA): x [B, T, H·n·hd] on CUDA, got ", x.sizes());
    TORCH_CHECK(n >= 1 && n <= kMaxPieces && rotated >= 0 && rotated <= n, "split_rotate (CUDA): 1 ≤ n ≤ 16, 0 ≤ rotated ≤ n");
    const int64_t B = x.size(0), T = x.size(1), hd = x.size(2) / (heads * n);
    TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.sizes() == sin.sizes() && 2 * cos.size(1) <= hd, "split_rotate (CUDA): cos / sin [T, r/2] with r ≤ hd");
    c10::cuda::CUDAGuard guard(x.device());
    // The tables are read in place where their columns are contiguous and both rows are equally
    // far apart (a narrowed view of Llama's [T, hd] tables), else copied.
    Tensor c = cos.to(x.device(), at::kFloat), s = sin.to(x.device(), at::kFloat);
    if (c.stride(1) != 1 || s.stride(1) != 1 || c.stride(0) != s.stride(0) || c.stride(0) < c.size(1)) {
      c = c.contiguous();
      s = s.contiguous();
    }
    Tensor xc = x.contiguous();
    HeadsParams p{B * T * heads, (int)T, (int)heads, (int)n, (int)rotated, (int)hd, (int)cos.size(1), c.stride(0), c.data_ptr<float>(), s.data_ptr<float>(), {}};
    std::vector<Tensor> outs;
    for (int64_t i = 0; i < n; ++i) outs.push_back(at::empty({B, T, heads, hd}, x.options()));
    dispatch(x.scalar_type(), [&](auto tag) { launch<decltype(tag)>(p, xc, outs, 1.f); });
    ctx->save_for_backward({c, s});
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["n"] = n;
    ctx->saved_data["rotated"] = rotated;
    ctx->saved_data["shape"] = x.sizes().vec();
    return outs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &c = saved[0], &s = saved[1];
    const int64_t heads = ctx->saved_data["heads"].toInt(), n = ctx->saved_data["n"].toInt(), rotated = ctx->saved_data["rotated"].toInt();
    const auto shape = ctx->saved_data["shape"].toIntVector();
    Tensor like;
    std::vector<Tensor> g;
    for (auto& t : grads) {
      g.push_back(t.defined() ? t.contiguous() : Tensor());
      if (t.defined()) like = t;
    }
    c10::cuda::CUDAGuard guard(like.device());
    const int64_t B = shape[0], T = shape[1], hd = shape[2] / (heads * n);
    HeadsParams p{B * T * heads, (int)T, (int)heads, (int)n, (int)rotated, (int)hd, (int)c.size(1), c.stride(0), c.data_ptr<float>(), s.data_ptr<float>(), {}};
    Tensor dx = at::empty(shape, like.options());
    dispatch(like.scalar_type(), [&](auto tag) { launch<decltype(tag)>(p, dx, g, -1.f); });
    return {dx, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

typedef at::Tensor* tensor;

// As attnlab_split_rotate (csrc/heads.cpp) for bf16 / fp16 x on CUDA: outs, n new tensors.
extern "C" char* attnlab_split_rotate_cuda(tensor x, int64_t heads, int64_t n, int64_t rotated, tensor cos, tensor sin, tensor* outs) {
  try {
    auto r = SplitRotateCuda::apply(*x, heads, n, rotated, *cos, *sin);
    for (int64_t i = 0; i < n; ++i) outs[i] = new at::Tensor(r[i]);
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
