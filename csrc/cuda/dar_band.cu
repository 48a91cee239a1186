// Launches of DAR's band kernels (csrc/cuda/dar_band.cuh says what they compute): the split-merge
// op's local part when its backend is 3 (csrc/dar_attention.cpp; src/kernels/cuda.rs hands it these
// two entry points when it loads the library).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cstring>
#include "dar_band.cuh"

namespace {

template <typename K, typename P>
void launch(K kernel, const P& p, int64_t blocks, int64_t B, size_t smem, cudaStream_t stream) {
  if (smem > 48 * 1024) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kernel<<<dim3(blocks, B * p.H), kBandThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Rows that start on 16 bytes: strides of b, t, h multiples of 8 elements and an aligned start.
void check_aligned(const char* what, const at::Tensor& t) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0, what,
              ": rows must start on 16 bytes (strides ", t.strides(), ")");
}

View view(const at::Tensor& x) {
  return View{reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), x.stride(0), x.stride(1), x.stride(2)};
}

// q, k, v (and others of their shape): CUDA bf16 [B, T, H, D], D 64 or 128, unit last stride, rows
// 16-byte aligned (the kernels load them 16 bytes at a time; src/kernels/cuda.rs::band_available
// sends other layouts elsewhere).
void check_inputs(const char* what, std::initializer_list<const at::Tensor*> ts) {
  const at::Tensor& q = **ts.begin();
  TORCH_CHECK(q.is_cuda() && q.dim() == 4 && q.scalar_type() == at::kBFloat16, what, ": q must be CUDA bf16 [B, T, H, D]");
  TORCH_CHECK(q.size(3) == 64 || q.size(3) == 128, what, ": head dim 64 or 128, not ", q.size(3));
  TORCH_CHECK(q.size(0) * q.size(2) <= 65535, what, ": B·H ≤ 65535");
  for (const at::Tensor* t : ts) {
    TORCH_CHECK(t->sizes() == q.sizes() && t->scalar_type() == q.scalar_type() && t->stride(3) == 1, what, ": every [B, T, H, D] input must be q's shape and dtype, unit last stride");
    check_aligned(what, *t);
  }
}

}  // namespace

typedef at::Tensor* tensor;

// q, k, v [B, T, H, D] bf16 on CUDA (unit last stride), D 64 or 128; far [B, T − w, H, D] bf16 and
// far_lse [B, H, T − w] fp32 (the distant part: both null when w ≥ T). Writes *out [B, T, H, D] bf16
// and *lse [B, H, T] fp32, both new.
extern "C" char* attnlab_dar_band_merge(tensor q, tensor k, tensor v, tensor far, tensor far_lse, int64_t window, tensor* out, tensor* lse) {
  try {
    const at::Tensor &Q = *q, &K = *k, &V = *v;
    check_inputs("dar_band_merge", {&Q, &K, &V});
    const int64_t B = Q.size(0), T = Q.size(1), H = Q.size(2), D = Q.size(3);
    TORCH_CHECK(window >= 1, "dar_band_merge: window ≥ 1");
    c10::cuda::CUDAGuard guard(Q.device());
    BandParams p{};
    p.q = view(Q);
    p.k = view(K);
    p.v = view(V);
    const int64_t L = T - window;
    if (L > 0) {
      TORCH_CHECK(far && far_lse, "dar_band_merge: w < T needs the distant part");
      const at::Tensor &F = *far, &FL = *far_lse;
      TORCH_CHECK(F.scalar_type() == at::kBFloat16 && F.size(0) == B && F.size(1) == L && F.size(2) == H && F.size(3) == D && F.stride(3) == 1,
                  "dar_band_merge: far must be bf16 [B, T − w, H, D] with unit last stride");
      check_aligned("dar_band_merge: far", F);
      TORCH_CHECK(FL.scalar_type() == at::kFloat && FL.dim() == 3 && FL.size(0) == B && FL.size(1) == H && FL.size(2) >= L && FL.stride(2) == 1,
                  "dar_band_merge: far_lse must be fp32 [B, H, ≥ T − w] with unit last stride");
      p.far = view(F);
      p.far_lse = FL.data_ptr<float>();
      p.fl_sb = FL.stride(0), p.fl_sh = FL.stride(1);
    }
    at::Tensor o = at::empty({B, T, H, D}, Q.options());
    at::Tensor l = at::empty({B, H, T}, Q.options().dtype(at::kFloat));
    p.out = reinterpret_cast<__nv_bfloat16*>(o.data_ptr());
    p.lse = l.data_ptr<float>();
    p.T = T;
    p.H = H;
    p.w = window;
    p.scale = 1.f / std::sqrt((float)D);
    auto stream = c10::cuda::getCurrentCUDAStream();
    const int64_t blocks = (T + kBandRows - 1) / kBandRows;
    if (T > 0) {
      if (D == 64) launch(band_merge_fwd<64>, p, blocks, B, band_smem_bytes(64), stream);
      else launch(band_merge_fwd<128>, p, blocks, B, band_smem_bytes(128), stream);
    }
    *out = new at::Tensor(o);
    *lse = new at::Tensor(l);
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}

// The band's gradients given the merged output and lse: q, k, v, out, dout [B, T, H, D] bf16 (as
// above), lse [B, H, T] fp32 contiguous; far_dq [B, T − w, H, D] bf16 (the distant part's dQ, added
// to rows ≥ w) or null. Writes *dq, *dk, *dv [B, T, H, D] bf16, new and contiguous.
extern "C" char* attnlab_dar_band_bwd(tensor q, tensor k, tensor v, tensor out, tensor dout, tensor lse, tensor far_dq, int64_t window, tensor* dq,
                                      tensor* dk, tensor* dv) {
  try {
    const at::Tensor &Q = *q, &L = *lse;
    check_inputs("dar_band_bwd", {q, k, v, out, dout});
    const int64_t B = Q.size(0), T = Q.size(1), H = Q.size(2), D = Q.size(3);
    TORCH_CHECK(window >= 1, "dar_band_bwd: window ≥ 1");
    TORCH_CHECK(L.scalar_type() == at::kFloat && L.is_contiguous() && L.dim() == 3 && L.size(0) == B && L.size(1) == H && L.size(2) == T,
                "dar_band_bwd: lse must be contiguous fp32 [B, H, T]");
    c10::cuda::CUDAGuard guard(Q.device());
    BandBwdParams p{};
    p.q = view(Q);
    p.k = view(*k);
    p.v = view(*v);
    p.out = view(*out);
    p.dout = view(*dout);
    p.lse = L.data_ptr<float>();
    if (far_dq) {
      const at::Tensor& F = *far_dq;
      TORCH_CHECK(F.scalar_type() == at::kBFloat16 && F.dim() == 4 && F.size(0) == B && F.size(1) == T - window && F.size(2) == H && F.size(3) == D &&
                      F.stride(3) == 1, "dar_band_bwd: far_dq must be bf16 [B, T − w, H, D] with unit last stride");
      check_aligned("dar_band_bwd: far_dq", F);
      p.far_dq = view(F);
    }
    at::Tensor gq = at::empty({B, T, H, D}, Q.options()), gk = at::empty({B, T, H, D}, Q.options()), gv = at::empty({B, T, H, D}, Q.options());
    at::Tensor dd = at::empty({B, H, T}, L.options());
    p.dd = dd.data_ptr<float>();
    p.dq = reinterpret_cast<__nv_bfloat16*>(gq.data_ptr());
    p.dk = reinterpret_cast<__nv_bfloat16*>(gk.data_ptr());
    p.dv = reinterpret_cast<__nv_bfloat16*>(gv.data_ptr());
    p.T = T;
    p.H = H;
    p.w = window;
    p.scale = 1.f / std::sqrt((float)D);
    auto stream = c10::cuda::getCurrentCUDAStream();
    const int64_t blocks = (T + kBandKeys - 1) / kBandKeys;
    if (T > 0) {
      if (D == 64) {
        // dQ first: it writes each row's D, which the dK / dV kernel reads.
        launch(band_bwd_dq<64>, p, blocks, B, band_smem_bytes(64), stream);
        launch(band_bwd_dkdv<64>, p, blocks, B, band_bwd_smem_bytes(64), stream);
      } else {
        launch(band_bwd_dq<128>, p, blocks, B, band_smem_bytes(128), stream);
        launch(band_bwd_dkdv<128>, p, blocks, B, band_bwd_smem_bytes(128), stream);
      }
    }
    *dq = new at::Tensor(gq);
    *dk = new at::Tensor(gk);
    *dv = new at::Tensor(gv);
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
