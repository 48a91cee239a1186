// LayerNorm from the fp32 residual stream straight to bf16 / fp16 (issue 33; the 410M profile's
// LayerNorms and their casts: ≈ 65 of 430 ms). Under autocast aten runs LayerNorm in fp32 and the
// next matmul casts its output down, so each LayerNorm reads and writes fp32 and a cast reads it
// again. Here one kernel per row reads x (fp32) once for its statistics (two passes over registers'
// worth of the row, in fp32) and writes y = (x − mean)·rstd·γ + β in the half dtype; the backward
// reads dy (half) and x, writes dx in fp32 (the residual stream's dtype), and sums dγ, dβ by column
// over chunks of rows (fp32 partials, then one aten sum).
//
// Not yet run on a GPU: only taken with ATTNLAB_LN_KERNEL=1 (src/kernels/cuda.rs), and held by
// `bench --check` (the layer-norm rows) against aten's fp32 LayerNorm.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include "half.cuh"
#include <torch/csrc/autograd/custom_function.h>
#include <cstring>

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerChunk = 128;

// The block's sum of x (every thread gets it).
__device__ float block_sum(float x, float* shared) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffff, x, off);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // `shared` may still be read from the previous call
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  float s = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) s += shared[w];
  return s;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) ln_forward(const float* x, const float* gamma, const float* beta, int64_t d, float eps, T* y,
                                                       float* mean_out, float* rstd_out) {
  __shared__ float shared[kThreads / 32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * d;
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < d; i += kThreads) s += xr[i];
  const float mean = block_sum(s, shared) / d;
  float v = 0.f;
  for (int64_t i = threadIdx.x; i < d; i += kThreads) {
    const float c = xr[i] - mean;
    v += c * c;
  }
  const float rstd = rsqrtf(block_sum(v, shared) / d + eps);
  T* yr = y + row * d;
  for (int64_t i = threadIdx.x; i < d; i += kThreads) yr[i] = from_f<T>((xr[i] - mean) * rstd * gamma[i] + beta[i]);
  if (threadIdx.x == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// dx = rstd·(g − mean(g) − x̂·mean(g·x̂)), g = dy·γ, x̂ = (x − mean)·rstd.
template <typename T>
__global__ void __launch_bounds__(kThreads) ln_backward_dx(const T* dy, const float* x, const float* gamma, const float* mean,
                                                           const float* rstd, int64_t d, float* dx) {
  __shared__ float shared[kThreads / 32];
  const int64_t row = blockIdx.x;
  const T* dyr = dy + row * d;
  const float* xr = x + row * d;
  const float mu = mean[row], rs = rstd[row];
  float a = 0.f, b = 0.f;
  for (int64_t i = threadIdx.x; i < d; i += kThreads) {
    const float g = to_f(dyr[i]) * gamma[i];
    a += g;
    b += g * (xr[i] - mu) * rs;
  }
  a = block_sum(a, shared) / d;
  b = block_sum(b, shared) / d;
  float* dxr = dx + row * d;
  for (int64_t i = threadIdx.x; i < d; i += kThreads) {
    const float xhat = (xr[i] - mu) * rs;
    dxr[i] = rs * (to_f(dyr[i]) * gamma[i] - a - xhat * b);
  }
}

// Partial column sums over a chunk of rows: dγ += dy·x̂, dβ += dy; one thread per column.
template <typename T>
__global__ void __launch_bounds__(kThreads) ln_backward_params(const T* dy, const float* x, const float* mean, const float* rstd, int64_t n,
                                                               int64_t d, float* dgamma_part, float* dbeta_part) {
  const int64_t col = blockIdx.x * (int64_t)kThreads + threadIdx.x;
  if (col >= d) return;
  const int64_t r0 = blockIdx.y * (int64_t)kRowsPerChunk, r1 = min(n, r0 + kRowsPerChunk);
  float g = 0.f, bsum = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    const float dyv = to_f(dy[r * d + col]);
    g += dyv * (x[r * d + col] - mean[r]) * rstd[r];
    bsum += dyv;
  }
  dgamma_part[blockIdx.y * d + col] = g;
  dbeta_part[blockIdx.y * d + col] = bsum;
}

template <typename T>
T* ptr(const Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

struct LayerNormHalf : public torch::autograd::Function<LayerNormHalf> {
  static Tensor forward(AutogradContext* ctx, Tensor x, Tensor gamma, Tensor beta, double eps, int64_t out_kind) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat, "layer_norm_half: x must be fp32 on CUDA");
    TORCH_CHECK(gamma.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat, "layer_norm_half: γ, β must be fp32");
    const int64_t d = x.size(-1);
    TORCH_CHECK(gamma.numel() == d && beta.numel() == d, "layer_norm_half: γ, β must have ", d, " entries");
    c10::cuda::CUDAGuard guard(x.device());
    Tensor xc = x.contiguous(), g = gamma.contiguous(), b = beta.contiguous();
    const int64_t n = xc.numel() / d;
    const auto kind = static_cast<at::ScalarType>(out_kind);
    Tensor y = at::empty(x.sizes(), x.options().dtype(kind));
    Tensor mean = at::empty({n}, x.options()), rstd = at::empty({n}, x.options());
    auto stream = c10::cuda::getCurrentCUDAStream();
    if (n > 0) {
      if (kind == at::kBFloat16) {
        ln_forward<__nv_bfloat16><<<n, kThreads, 0, stream>>>(xc.data_ptr<float>(), g.data_ptr<float>(), b.data_ptr<float>(), d, (float)eps,
                                                              ptr<__nv_bfloat16>(y), mean.data_ptr<float>(), rstd.data_ptr<float>());
      } else {
        TORCH_CHECK(kind == at::kHalf, "layer_norm_half: the output must be bf16 or fp16");
        ln_forward<__half><<<n, kThreads, 0, stream>>>(xc.data_ptr<float>(), g.data_ptr<float>(), b.data_ptr<float>(), d, (float)eps,
                                                       ptr<__half>(y), mean.data_ptr<float>(), rstd.data_ptr<float>());
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    ctx->save_for_backward({xc, g, mean, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    Tensor x = saved[0], g = saved[1], mean = saved[2], rstd = saved[3];
    const int64_t d = x.size(-1), n = x.numel() / d;
    Tensor dy = grads[0].contiguous();
    c10::cuda::CUDAGuard guard(x.device());
    auto stream = c10::cuda::getCurrentCUDAStream();
    Tensor dx = at::empty(x.sizes(), x.options());
    const int64_t chunks = (n + kRowsPerChunk - 1) / kRowsPerChunk;
    TORCH_CHECK(chunks <= 65535, "layer_norm_half: ", n, " rows are more than one launch of the column sums takes");
    Tensor dg = at::empty({std::max<int64_t>(chunks, 1), d}, x.options()), db = at::empty({std::max<int64_t>(chunks, 1), d}, x.options());
    if (n > 0) {
      const dim3 pgrid((d + kThreads - 1) / kThreads, chunks);
      if (dy.scalar_type() == at::kBFloat16) {
        ln_backward_dx<__nv_bfloat16><<<n, kThreads, 0, stream>>>(ptr<__nv_bfloat16>(dy), x.data_ptr<float>(), g.data_ptr<float>(), mean.data_ptr<float>(),
                                                                  rstd.data_ptr<float>(), d, dx.data_ptr<float>());
        ln_backward_params<__nv_bfloat16><<<pgrid, kThreads, 0, stream>>>(ptr<__nv_bfloat16>(dy), x.data_ptr<float>(), mean.data_ptr<float>(),
                                                                          rstd.data_ptr<float>(), n, d, dg.data_ptr<float>(), db.data_ptr<float>());
      } else {
        TORCH_CHECK(dy.scalar_type() == at::kHalf, "layer_norm_half: dy must be bf16 or fp16");
        ln_backward_dx<__half><<<n, kThreads, 0, stream>>>(ptr<__half>(dy), x.data_ptr<float>(), g.data_ptr<float>(), mean.data_ptr<float>(),
                                                           rstd.data_ptr<float>(), d, dx.data_ptr<float>());
        ln_backward_params<__half><<<pgrid, kThreads, 0, stream>>>(ptr<__half>(dy), x.data_ptr<float>(), mean.data_ptr<float>(), rstd.data_ptr<float>(), n,
                                                                   d, dg.data_ptr<float>(), db.data_ptr<float>());
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      dg.zero_();
      db.zero_();
    }
    return {dx, dg.sum(0), db.sum(0), Tensor(), Tensor()};
  }
};

}  // namespace

typedef at::Tensor* tensor;

// y = LayerNorm(x)·γ + β over the last dim, x fp32 [.., d] on CUDA, γ / β fp32 [d], inside a CUDA
// autocast region: y in autocast's dtype (bf16 or fp16), differentiable in x, γ and β. Outside
// autocast (or for other dtypes) *out stays null: the caller's aten LayerNorm applies.
extern "C" char* attnlab_layer_norm_half(tensor x, tensor gamma, tensor beta, double eps, tensor* out) {
  try {
    *out = nullptr;
    if (!at::autocast::is_autocast_enabled(at::kCUDA) || !x->is_cuda() || x->scalar_type() != at::kFloat || gamma->scalar_type() != at::kFloat ||
        beta->scalar_type() != at::kFloat) {
      return nullptr;
    }
    const at::ScalarType kind = at::autocast::get_autocast_dtype(at::kCUDA);
    if (kind != at::kBFloat16 && kind != at::kHalf) return nullptr;
    *out = new at::Tensor(LayerNormHalf::apply(*x, *gamma, *beta, eps, static_cast<int64_t>(kind)));
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
