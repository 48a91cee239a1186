// Launch of DAR's band-and-merge kernel (csrc/cuda/dar_band.cuh says what it computes). Not yet
// called by the split-merge op (csrc/dar_attention.cpp): issue 35's next step wires it in as the
// local part's forward, checked by bench --check on a GPU first.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cstring>
#include "dar_band.cuh"

namespace {

template <int D>
void launch(const BandParams& p, int B, cudaStream_t stream) {
  const size_t smem = band_smem_bytes(D);
  if (smem > 48 * 1024) C10_CUDA_CHECK(cudaFuncSetAttribute(band_merge_fwd<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  band_merge_fwd<D><<<dim3((p.T + kBandRows - 1) / kBandRows, B * p.H), kBandThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

typedef at::Tensor* tensor;

// q, k, v [B, T, H, D] bf16 on CUDA (unit last stride), D 64 or 128; far [B, T − w, H, D] bf16 and
// far_lse [B, H, T − w] fp32 (the distant part: both null when w ≥ T). Writes *out [B, T, H, D] bf16
// and *lse [B, H, T] fp32, both new.
extern "C" char* attnlab_dar_band_merge(tensor q, tensor k, tensor v, tensor far, tensor far_lse, int64_t window, tensor* out, tensor* lse) {
  try {
    const at::Tensor &Q = *q, &K = *k, &V = *v;
    TORCH_CHECK(Q.is_cuda() && Q.dim() == 4 && Q.scalar_type() == at::kBFloat16, "dar_band_merge: q must be CUDA bf16 [B, T, H, D]");
    TORCH_CHECK(K.sizes() == Q.sizes() && V.sizes() == Q.sizes() && K.scalar_type() == Q.scalar_type() && V.scalar_type() == Q.scalar_type(),
                "dar_band_merge: k, v must be q's shape and dtype");
    TORCH_CHECK(Q.stride(3) == 1 && K.stride(3) == 1 && V.stride(3) == 1, "dar_band_merge: unit last strides");
    const int64_t B = Q.size(0), T = Q.size(1), H = Q.size(2), D = Q.size(3);
    TORCH_CHECK(window >= 1, "dar_band_merge: window ≥ 1");
    TORCH_CHECK(D == 64 || D == 128, "dar_band_merge: head dim 64 or 128, not ", D);
    c10::cuda::CUDAGuard guard(Q.device());
    BandParams p{};
    p.q = reinterpret_cast<const __nv_bfloat16*>(Q.data_ptr());
    p.k = reinterpret_cast<const __nv_bfloat16*>(K.data_ptr());
    p.v = reinterpret_cast<const __nv_bfloat16*>(V.data_ptr());
    p.q_sb = Q.stride(0), p.q_st = Q.stride(1), p.q_sh = Q.stride(2);
    p.k_sb = K.stride(0), p.k_st = K.stride(1), p.k_sh = K.stride(2);
    p.v_sb = V.stride(0), p.v_st = V.stride(1), p.v_sh = V.stride(2);
    const int64_t L = T - window;
    if (L > 0) {
      TORCH_CHECK(far && far_lse, "dar_band_merge: w < T needs the distant part");
      const at::Tensor &F = *far, &FL = *far_lse;
      TORCH_CHECK(F.scalar_type() == at::kBFloat16 && F.size(0) == B && F.size(1) == L && F.size(2) == H && F.size(3) == D && F.stride(3) == 1,
                  "dar_band_merge: far must be bf16 [B, T − w, H, D] with unit last stride");
      TORCH_CHECK(FL.scalar_type() == at::kFloat && FL.dim() == 3 && FL.size(0) == B && FL.size(1) == H && FL.size(2) >= L && FL.stride(2) == 1,
                  "dar_band_merge: far_lse must be fp32 [B, H, ≥ T − w] with unit last stride");
      p.far = reinterpret_cast<const __nv_bfloat16*>(F.data_ptr());
      p.f_sb = F.stride(0), p.f_st = F.stride(1), p.f_sh = F.stride(2);
      p.far_lse = FL.data_ptr<float>();
      p.fl_sb = FL.stride(0), p.fl_sh = FL.stride(1);
    }
    at::Tensor o = at::empty({B, T, H, D}, Q.options());
    at::Tensor l = at::empty({B, H, T}, Q.options().dtype(at::kFloat));
    p.out = reinterpret_cast<__nv_bfloat16*>(o.data_ptr());
    p.o_sb = o.stride(0), p.o_st = o.stride(1), p.o_sh = o.stride(2);
    p.lse = l.data_ptr<float>();
    p.T = T;
    p.H = H;
    p.w = window;
    p.scale = 1.f / std::sqrt((float)D);
    TORCH_CHECK(B * H <= 65535, "dar_band_merge: B·H ≤ 65535");
    auto stream = c10::cuda::getCurrentCUDAStream();
    if (T > 0) {
      if (D == 64) launch<64>(p, B, stream);
      else launch<128>(p, B, stream);
    }
    *out = new at::Tensor(o);
    *lse = new at::Tensor(l);
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
