// Launches of the one-token decode step's kernels (csrc/cuda/attend_step.cuh says what they compute).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include "attend_step.cuh"

namespace {

// Latent slots from which the tensor-core path reads DAR's and uniform's latents unless
// ATTNLAB_STEP_MMA says (the launcher's comment gives the timings): a decode span of 8,192, a 4K
// context's, is where the two paths tie.
constexpr int64_t kMmaFromSlots = 8192;

template <typename T, int G>
void launch_partial(const Params& p, int B, size_t smem, cudaStream_t stream) {
  auto kernel = step_partial<T, G>;
  if (smem > 48 * 1024) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dim3 grid(p.nchunks + p.nring - p.chunk0, B * p.hkv);
  kernel<<<grid, kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_partial_g(const Params& p, int B, size_t smem, cudaStream_t stream) {
  switch (p.g) {
    case 1: return launch_partial<T, 1>(p, B, smem, stream);
    case 2: return launch_partial<T, 2>(p, B, smem, stream);
    case 3: return launch_partial<T, 3>(p, B, smem, stream);
    case 4: return launch_partial<T, 4>(p, B, smem, stream);
    case 6: return launch_partial<T, 6>(p, B, smem, stream);
    case 8: return launch_partial<T, 8>(p, B, smem, stream);
    default: TORCH_CHECK(false, "attend_step: ", p.g, " query heads per kv head (1, 2, 3, 4, 6 or 8 are built)");
  }
}

// The distant part on the tensor cores: one block per (chunk, b, 16 query heads) (step_latent_mma).
template <typename T>
void launch_latent_mma(const Params& p, int B, cudaStream_t stream) {
  const int H = p.hkv * p.g;
  auto kernel = latent_mma_kernel<T>(p.r);
  const size_t smem = mma_smem_bytes(p.r, p.rot);
  if (smem > 48 * 1024) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dim3 grid(p.nchunks, B, (H + kMmaHeads - 1) / kMmaHeads);
  kernel<<<grid, kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The partial kernels: with latents qw and β once (step_qw), then the latents by step_latent_mma
// and the ring by step_partial (p.chunk0 = nchunks), or everything by step_partial.
template <typename T>
void launch_parts(const Params& p, int B, size_t smem, bool mma, cudaStream_t stream) {
  if (p.nchunks > 0) {
    step_qw<T><<<B * p.hkv * p.g, kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (mma && p.nchunks > 0) launch_latent_mma<T>(p, B, stream);
  if (p.nchunks + p.nring - p.chunk0 > 0) launch_partial_g<T>(p, B, smem, stream);
}

at::Tensor last_unit(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

}  // namespace

typedef at::Tensor* tensor;

// The step's output [B, H, 1, hd]. ts (null where absent): q [B, H, 1, hd]; pos [1] i64 (CUDA); pad
// [B] i64 or null; full-width k, v [B, Hkv, W, hd] or null; latents [B, S, r], wk, wv [Hkv, hd, r],
// bk, bv [Hkv, hd], cos, sin fp32 [S, rot/2] (any row stride), all null without a distant part.
// ts[12], ts[13], ts[14]: the new token's key, value [B, Hkv, 1, hd] and latent [B, 1, r], or null
// (then its slots must already hold them): read for their slots and written into the caches by the
// combine kernel. ts[15]: wk's rotated rows [Hkv·rot, r], contiguous (null without a distant part).
// keep: 0 when full-width slot j holds position j, else the ring's slot count; window:
// distant slots are those at distance ≥ window; chunk / ring_chunk: slots per block.
extern "C" char* attnlab_attend_step(tensor* ts, int64_t rotated, int64_t window, int64_t keep, int64_t chunk, int64_t ring_chunk, tensor* out_) {
  try {
    const at::Tensor q = last_unit(*ts[0]);
    const at::Tensor& pos = *ts[1];
    tensor pad = ts[2], rk = ts[3], rv = ts[4], cp = ts[5], wkp = ts[6], wvp = ts[7], bk = ts[8], bv = ts[9], cosp = ts[10], sinp = ts[11];
    tensor new_k = ts[12], new_v = ts[13], new_c = ts[14], wk_rot = ts[15];
    CacheWrite cw{};
    cw.pos = pos.data_ptr<int64_t>();
    TORCH_CHECK(q.is_cuda() && q.dim() == 4 && q.size(2) == 1, "attend_step: q must be CUDA [B, H, 1, hd]");
    TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_cuda(), "attend_step: pos must be a CUDA i64 tensor");
    TORCH_CHECK(rk || cp, "attend_step: neither full-width keys nor latents");
    const int64_t B = q.size(0), H = q.size(1), hd = q.size(3);
    const int64_t hkv = cp ? wkp->size(0) : rk->size(1);
    TORCH_CHECK(H % hkv == 0, "attend_step: ", H, " query heads over ", hkv, " kv heads");
    const int64_t g = H / hkv;
    c10::cuda::CUDAGuard guard(q.device());
    auto stream = c10::cuda::getCurrentCUDAStream();
    Params p{};
    // One slot per warp at a time everywhere (the first version of the kernels; timing and checks).
    const bool scalar_loops = std::getenv("ATTNLAB_STEP_SCALAR") != nullptr;
    // Latents four slots per warp at a time: right on the CPU (make cuda-emu-test), not yet run on a
    // GPU, so only when asked for (ATTNLAB_STEP_BATCHED=1) until bench --check and the decode
    // timings say it may be the default.
    // ATTNLAB_STEP_ROPE=absorbed (implies the batched loop): the latents' rotated dims scored through
    // per-pair query vectors (attend_step.cuh: rope_terms), no kr matmul; right on the CPU, not yet
    // on a GPU.
    const char* rope = std::getenv("ATTNLAB_STEP_ROPE");
    bool absorb_rope = !scalar_loops && rope && std::strcmp(rope, "absorbed") == 0;
    // The latents by step_latent_mma (all query heads of a row in one block, the scores and Σ p·c on
    // the tensor cores; attend_step.cuh) from kMmaFromSlots latent slots on, or always / never with
    // ATTNLAB_STEP_MMA=1 / 0. One H100, Pythia-70M shape, graphed decode, × the loops: 0.90 / 0.92 at
    // 1K (DAR / uniform, 2,048 slots), 1.00 / 1.03 at 4K (8,192), 1.06 / 1.10 at 16K, 2.17 / 2.29 at
    // 64K (BENCHMARKS.md, results/bench/2026-12-06d-h100/decode_fused*.jsonl); again with q·Wk once a step
    // (2026-12-06g-h100): 0.93 / 0.96 at 1K, 1.03 / 1.07 at 4K. It reads kr, so it
    // takes precedence over ATTNLAB_STEP_ROPE=absorbed; shapes it does not take (r not built:
    // latent_mma_kernel, unaligned latent rows) keep the loops above.
    const char* mma_env = std::getenv("ATTNLAB_STEP_MMA");
    bool use_mma = false;
    p.batched = !scalar_loops && (absorb_rope || std::getenv("ATTNLAB_STEP_BATCHED") != nullptr);
    p.q = q.data_ptr();
    p.q_sb = q.stride(0);
    p.q_sh = q.stride(1);
    p.pos = pos.data_ptr<int64_t>();
    at::Tensor padc;
    if (pad) {
      padc = pad->reshape({-1}).to(at::kLong).contiguous();
      TORCH_CHECK(padc.size(0) == B, "attend_step: pad must hold one entry per row");
      p.pad = padc.data_ptr<int64_t>();
    }
    at::Tensor rkc, rvc;
    if (rk) {
      rkc = last_unit(*rk);
      rvc = last_unit(*rv);
      TORCH_CHECK(rkc.strides() == rvc.strides() && rkc.size(0) == B && rkc.size(1) == hkv && rkc.size(3) == hd && rvc.sizes() == rkc.sizes(),
                  "attend_step: full-width k / v must be [B, Hkv, W, hd] alike");
      TORCH_CHECK(rkc.scalar_type() == q.scalar_type(), "attend_step: k / v must have q's dtype");
      p.rk = rkc.data_ptr();
      p.rv = rvc.data_ptr();
      p.r_sb = rkc.stride(0);
      p.r_sh = rkc.stride(1);
      p.r_ss = rkc.stride(2);
      p.W = rkc.size(2);
      const bool aligned = p.r_sb % 8 == 0 && p.r_sh % 8 == 0 && p.r_ss % 8 == 0 && reinterpret_cast<uintptr_t>(p.rk) % 16 == 0 &&
                           reinterpret_cast<uintptr_t>(p.rv) % 16 == 0;
      p.vec = aligned && (hd == 32 || hd == 64 || hd == 128 || hd == 256) && !scalar_loops;
      p.keep = keep;
      p.ring_chunk = ring_chunk;
      p.nring = (p.W + ring_chunk - 1) / ring_chunk;
      if (new_k) {
        const at::Tensor &nk = *new_k, &nv = *new_v;
        TORCH_CHECK(nk.dim() == 4 && nk.size(0) == B && nk.size(1) == hkv && nk.size(2) == 1 && nk.size(3) == hd && nv.sizes() == nk.sizes() &&
                        nk.strides() == nv.strides() && nk.scalar_type() == q.scalar_type() && nv.scalar_type() == q.scalar_type(),
                    "attend_step: the new key / value must be [B, Hkv, 1, hd] alike in q's dtype");
        const bool in_place = rk->stride(-1) == 1 && rv->stride(-1) == 1;  // else rkc / rvc are copies: write the cache itself
        const bool loadable = nk.stride(3) == 1 && (!p.vec || (reinterpret_cast<uintptr_t>(nk.data_ptr()) % 16 == 0 &&
                                                                reinterpret_cast<uintptr_t>(nv.data_ptr()) % 16 == 0 && nk.stride(0) % 8 == 0 && nk.stride(1) % 8 == 0));
        if (in_place && loadable) {
          p.new_k = nk.data_ptr();
          p.new_v = nv.data_ptr();
          p.nk_sb = nk.stride(0);
          p.nk_sh = nk.stride(1);
          cw.k = rkc.data_ptr();
          cw.v = rvc.data_ptr();
          cw.k_sb = p.r_sb, cw.k_sh = p.r_sh, cw.k_ss = p.r_ss, cw.keep = keep;
          cw.new_k = p.new_k, cw.new_v = p.new_v, cw.nk_sb = p.nk_sb, cw.nk_sh = p.nk_sh;
        } else {
          // Written here, before the kernels read the slot.
          at::Tensor slot = keep > 0 ? pos.remainder(keep) : pos;
          rk->index_copy_(2, slot, nk);
          rv->index_copy_(2, slot, nv);
          if (!in_place) {
            rkc = last_unit(*rk);
            rvc = last_unit(*rv);
            p.rk = rkc.data_ptr();
            p.rv = rvc.data_ptr();
          }
        }
      }
    }
    int64_t r = 1;
    at::Tensor kr, bkc, bvc;
    if (cp) {
      const at::Tensor& c = *cp;
      const at::Tensor& wk = *wkp;
      r = wk.size(2);
      TORCH_CHECK(c.dim() == 3 && c.size(0) == B && c.size(2) == r && c.stride(2) == 1, "attend_step: latents must be [B, S, r] with unit last stride");
      TORCH_CHECK(wk.is_contiguous() && wk.size(1) == hd && wvp->sizes() == wk.sizes(), "attend_step: wk / wv must be contiguous [Hkv, hd, r]");
      TORCH_CHECK(rotated % 2 == 0 && rotated <= hd, "attend_step: rotated dims");
      TORCH_CHECK(q.scalar_type() == c.scalar_type() && q.scalar_type() == wk.scalar_type() && wvp->scalar_type() == wk.scalar_type(), "attend_step: q, latents, wk and wv must share a dtype");
      const int64_t S = c.size(1);
      if (new_c) {
        const at::Tensor& nc = *new_c;
        TORCH_CHECK(nc.dim() == 3 && nc.size(0) == B && nc.size(1) == 1 && nc.size(2) == r && nc.stride(2) == 1 && nc.scalar_type() == c.scalar_type(),
                    "attend_step: the new latent must be [B, 1, r] in the latents' dtype with unit last stride");
        // Uniform (window 0) reads the new latent in this step, kr's matmul included: written first.
        if (window == 0) {
          at::Tensor(c).index_copy_(1, pos, nc);
        } else {
          p.new_c = nc.data_ptr();
          p.nc_sb = nc.stride(0);
          cw.c = c.data_ptr();
          cw.c_sb = c.stride(0);
          cw.c_ss = c.stride(1);
          cw.new_c = p.new_c;
          cw.nc_sb = p.nc_sb;
        }
      }
      p.c = c.data_ptr();
      p.c_sb = c.stride(0);
      p.c_ss = c.stride(1);
      // The tensor-core path loads latent rows 16 bytes at a time.
      const bool rows_aligned = p.c_sb % 8 == 0 && p.c_ss % 8 == 0 && reinterpret_cast<uintptr_t>(p.c) % 16 == 0 &&
                                (!p.new_c || (reinterpret_cast<uintptr_t>(p.new_c) % 16 == 0 && p.nc_sb % 8 == 0));
      const bool mma_built = q.scalar_type() == at::kBFloat16 ? latent_mma_kernel<__nv_bfloat16>(r) != nullptr : latent_mma_kernel<__half>(r) != nullptr;
      use_mma = (mma_env ? std::strcmp(mma_env, "1") == 0 : S >= kMmaFromSlots) && rows_aligned && mma_built && mma_smem_bytes(r, rotated) <= 200 * 1024;
      if (use_mma) absorb_rope = false;
      // The batched loop holds a slot's latent in its lanes' registers: r ≤ 256.
      if (r > 256) p.batched = 0;
      p.rope_absorbed = p.batched && absorb_rope && wvp->is_contiguous() && smem_floats(g, r, hd, rotated) * sizeof(float) <= 200 * 1024;
      if (rotated > 0) {
        const at::Tensor& cos = *cosp;
        TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.size(0) >= S && cos.size(1) == rotated / 2 && cos.stride(1) == 1 && cos.strides() == sinp->strides() &&
                        sinp->scalar_type() == at::kFloat, "attend_step: cos / sin must be fp32 [S, rot/2]");
        if (!p.rope_absorbed) {
          // kr [B, S, Hkv·rot] = c · Wk[:, :rot, :]ᵀ: one matmul on the tensor cores, its weight
          // made contiguous once by the caller (out of wk it is a copy each step where rot < hd).
          TORCH_CHECK(wk_rot && wk_rot->is_contiguous() && wk_rot->dim() == 2 && wk_rot->size(0) == hkv * rotated && wk_rot->size(1) == r &&
                          wk_rot->scalar_type() == wk.scalar_type(),
                      "attend_step: wk_rot must be wk's rotated rows [Hkv·rot, r], contiguous");
          kr = at::matmul(c, wk_rot->t());
          p.kr = kr.data_ptr();
          p.kr_sb = kr.stride(0);
          p.kr_ss = kr.stride(1);
        }
        p.cos = cos.data_ptr<float>();
        p.sin = sinp->data_ptr<float>();
        p.cs_s = cos.stride(0);
      }
      if (bk) bkc = bk->contiguous();
      if (bv) bvc = bv->contiguous();
      p.wk = wk.data_ptr();
      p.bk = bk ? bkc.data_ptr() : nullptr;
      p.window = window;
      p.S = S;
      p.chunk = chunk;
      if (use_mma) {
        // Blocks are (chunk, b, 16 heads), not (chunk, b, kv head): about two a SM of an H100 (132),
        // whole rounds of the four warps' 16-slot tiles (64), or 32 slots (two warps busy) where that
        // leaves SMs idle: B = 1, 4K, H ≤ 16 gives 128 blocks of 32, 64K 256 of 256.
        const int64_t per = (S * B * ((H + kMmaHeads - 1) / kMmaHeads) + 263) / 264;
        p.chunk = per <= 32 ? 32 : (per + 63) / 64 * 64;
      }
      p.nchunks = (S + p.chunk - 1) / p.chunk;
      p.chunk0 = use_mma ? p.nchunks : 0;
    }
    p.r = r;
    p.hd = hd;
    p.rot = rotated;
    p.g = g;
    p.hkv = hkv;
    p.scale = 1.f / std::sqrt((float)hd);
    auto f32 = q.options().dtype(at::kFloat);
    at::Tensor ml = at::empty({B, H, p.nchunks + p.nring, 2}, f32);
    at::Tensor acc = at::empty({B, H, std::max(p.nchunks, 1), r}, f32);
    at::Tensor accv = at::empty({B, H, std::max(p.nring, 1), hd}, f32);
    p.ml = ml.data_ptr<float>();
    p.acc = acc.data_ptr<float>();
    p.accv = accv.data_ptr<float>();
    at::Tensor qwbuf;
    if (cp) {
      qwbuf = at::empty({B * H * r + B * H}, f32);
      p.qw = qwbuf.data_ptr<float>();
      p.qbeta = p.qw + B * H * r;
    }
    const size_t smem = smem_floats(g, r, hd, p.rope_absorbed ? rotated : 0) * sizeof(float);
    TORCH_CHECK(smem <= 200 * 1024, "attend_step: ", smem, " bytes of shared memory (g, r or hd too large)");
    // With the RoPE-absorbed loop the combine kernel also applies Wv and writes [B, H, 1, hd] itself.
    const bool out_in_combine = p.rope_absorbed;
    at::Tensor pc = cp && !out_in_combine ? at::empty({hkv, B * g, r}, q.options()) : at::Tensor();
    at::Tensor extra = out_in_combine ? at::Tensor() : at::empty({hkv, B * g, hd}, q.options());
    at::Tensor o = out_in_combine ? at::empty({B, H, 1, hd}, q.options()) : at::Tensor();
    const CombineGrid cg = combine_grid(r, hd, out_in_combine);
    const dim3 grid(B * H, cg.slabs);
    const void* bvptr = bv && cp ? bvc.data_ptr() : nullptr;
    const void* wvptr = out_in_combine && cp ? wvp->data_ptr() : nullptr;
    const size_t combine_smem = combine_smem_bytes(p.nchunks + p.nring, r, out_in_combine);
    TORCH_CHECK(combine_smem <= 48 * 1024, "attend_step: ", p.nchunks + p.nring, " chunks to combine (more than its shared memory holds)");
    auto ptr_or_null = [](const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; };
    if (q.scalar_type() == at::kBFloat16) {
      using T = __nv_bfloat16;
      launch_parts<T>(p, B, smem, use_mma && cp, stream);
      step_combine<T><<<grid, kThreads, combine_smem, stream>>>(p.ml, p.acc, p.accv, bvptr, B, H, g, r, hd, p.nchunks, p.nring, cg.slab, static_cast<T*>(ptr_or_null(pc)),
                                                                static_cast<T*>(ptr_or_null(extra)), wvptr, static_cast<T*>(ptr_or_null(o)), cw);
    } else if (q.scalar_type() == at::kHalf) {
      using T = __half;
      launch_parts<T>(p, B, smem, use_mma && cp, stream);
      step_combine<T><<<grid, kThreads, combine_smem, stream>>>(p.ml, p.acc, p.accv, bvptr, B, H, g, r, hd, p.nchunks, p.nring, cg.slab, static_cast<T*>(ptr_or_null(pc)),
                                                                static_cast<T*>(ptr_or_null(extra)), wvptr, static_cast<T*>(ptr_or_null(o)), cw);
    } else {
      TORCH_CHECK(false, "attend_step: q must be bf16 or fp16, not ", q.scalar_type());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (!out_in_combine) {
      // [Hkv, B·g, hd] = extra (+ pc · Wvᵀ), then [B, H, 1, hd].
      o = cp ? at::baddbmm(extra, pc, wvp->transpose(1, 2)) : extra;
      o = o.view({hkv, B, g, hd}).permute({1, 0, 2, 3}).reshape({B, H, 1, hd});
    }
    *out_ = new at::Tensor(o);
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
