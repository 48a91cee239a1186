// Launches of the STILL / LoLCATs prefill kernels (csrc/cuda/hybrid_prefill.cuh and hybrid_linear.cuh
// say what they compute). Taken by `Hybrid::prefill` unless ATTNLAB_HYBRID_PREFILL=0 (src/kernels/cuda.rs):
// the scores wherever they apply, the mix only where no gradient is recorded, and there the linear
// branch unless ATTNLAB_HYBRID_LINEAR=0.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cstring>
#include "hybrid_linear.cuh"
#include "hybrid_prefill.cuh"

typedef at::Tensor* tensor;

namespace {

// q, k, v [B, H, T, D] bf16 on one device with unit d stride and 16-byte rows, as [B, T, H, D] views.
void views(PrefillParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t chunk, const char* who) {
  TORCH_CHECK(chunk == kPrefillChunk, who, ": chunk ", chunk, " (the kernels take chunks of ", kPrefillChunk, ")");
  TORCH_CHECK(q.is_cuda() && q.dim() == 4 && q.scalar_type() == at::kBFloat16, who, ": q must be CUDA bf16 [B, H, T, D]");
  const int64_t D = q.size(3);
  TORCH_CHECK(D == 64 || D == 128, who, ": head dim ", D, " (64 or 128)");
  for (const at::Tensor* x : {&q, &k, &v}) {
    TORCH_CHECK(x->sizes() == q.sizes() && x->scalar_type() == at::kBFloat16 && x->device() == q.device(), who, ": q, k, v must share shape, dtype and device");
    TORCH_CHECK(x->stride(3) == 1 && x->stride(0) % 8 == 0 && x->stride(1) % 8 == 0 && x->stride(2) % 8 == 0 && reinterpret_cast<uintptr_t>(x->data_ptr()) % 16 == 0,
                who, ": q, k, v need a unit last stride and 16-byte aligned rows");
  }
  auto view = [](const at::Tensor& x) { return View{reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), x.stride(0), x.stride(2), x.stride(1)}; };
  p.q = view(q), p.k = view(k), p.v = view(v);
  p.T = (int)q.size(2), p.H = (int)q.size(1), p.n = (int)((q.size(2) + chunk - 1) / chunk);
  p.scale = 1.f / std::sqrt((float)D);
}

// A block per (chunk, b·H + h) of `threads` threads (PrefillParams, LinearParams).
template <typename Kernel, typename Params>
void launch(Kernel kernel, const Params& p, int64_t B, int threads, int64_t smem) {
  if (smem > 48 * 1024) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kernel<<<dim3(p.n, B * p.H), threads, smem, c10::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The linear branch's inputs beside q, k, v: a folded feature map `w` (fp32 contiguous [H, D, F/2]
// from a 16-byte boundary, F/2 a multiple of 4 up to 128) and `keep` (fp32 contiguous, `rows` per
// (b, h), or null), on `x`'s device.
void check_linear_inputs(const at::Tensor& x, const at::Tensor& w, const at::Tensor* keep, int64_t H, int64_t D, int64_t rows, const char* who) {
  const int64_t Fh = w.size(-1);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.device() == x.device() && w.sizes() == at::IntArrayRef({H, D, Fh}) &&
                  reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
              who, ": a folded map must be fp32 contiguous [H, D, F/2] from a 16-byte boundary");
  TORCH_CHECK(Fh % 4 == 0 && Fh <= 128, who, ": F/2 = ", Fh, " (a multiple of 4, at most 128)");
  if (keep)
    TORCH_CHECK(keep->scalar_type() == at::kFloat && keep->is_contiguous() && keep->numel() == x.size(0) * H * rows && keep->device() == x.device(),
                who, ": keep must be fp32 contiguous [B, H, ", rows, "]");
}

}  // namespace

// ts: q, k [B, H, T, D]; score_kind: score_kinds.cuh's codes. *out: the routing
// scores [B, H, n·C] fp32 of every row of the sequence padded to whole chunks.
extern "C" char* attnlab_hybrid_prefill_scores(tensor* ts, int64_t chunk, int64_t score_kind, tensor* out) {
  try {
    const at::Tensor &q = *ts[0], &k = *ts[1];
    TORCH_CHECK(score_kind >= kScoreSelfSaliency && score_kind <= kScoreSelfLogit, "hybrid_prefill_scores: unknown score kind ", score_kind);
    PrefillParams p{};
    views(p, q, k, k, chunk, "hybrid_prefill_scores");
    c10::cuda::CUDAGuard guard(q.device());
    at::Tensor score = at::empty({q.size(0), q.size(1), (int64_t)p.n * chunk}, q.options().dtype(at::kFloat));
    p.score = score.data_ptr<float>();
    p.score_kind = (int)score_kind;
    if (q.size(3) == 64) launch(hybrid_prefill_scores<64>, p, q.size(0), kBandThreads, prefill_scores_smem_bytes(64));
    else launch(hybrid_prefill_scores<128>, p, q.size(0), kBandThreads, prefill_scores_smem_bytes(128));
    *out = new at::Tensor(score);
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}

// ts (null where absent): q, k, v [B, H, T, D]; the selected positions [B, H, cap] i64 on q's device
// and seen [n] int32 on the host (Sel slots each query chunk sees; checked against cap here); n_lin [B, H, n·C, D] and z_lin [B, H, n·C]
// fp32 contiguous (absent: no linear branch); γ [H]; the gate g [B, H, T, D] bf16 with unit last stride
// (any other strides), multiplying n_lin (absent: none, or already applied). *out: y [B, H, T, D] bf16.
extern "C" char* attnlab_hybrid_prefill_mix(tensor* ts, int64_t chunk, double eps, int64_t compensate, int64_t phantom, tensor* out) {
  try {
    const at::Tensor &q = *ts[0], &k = *ts[1], &v = *ts[2];
    tensor sel = ts[3], seen = ts[4], n_lin = ts[5], z_lin = ts[6], gamma = ts[7], gate = ts[8];
    PrefillParams p{};
    views(p, q, k, v, chunk, "hybrid_prefill_mix");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(3), rows = (int64_t)p.n * chunk;
    c10::cuda::CUDAGuard guard(q.device());
    at::Tensor seen_dev;
    if (sel) {
      TORCH_CHECK(seen && seen->scalar_type() == at::kInt && seen->is_contiguous() && seen->numel() == p.n && seen->device().is_cpu(),
                  "hybrid_prefill_mix: seen must be int32 [n] on the host");
      TORCH_CHECK(sel->scalar_type() == at::kLong && sel->dim() == 3 && sel->size(0) == B && sel->size(1) == H && sel->stride(2) == 1 && sel->device() == q.device(),
                  "hybrid_prefill_mix: the selected positions must be i64 [B, H, cap] with unit last stride on q's device");
      const int* counts = seen->data_ptr<int>();
      for (int c = 0; c < p.n; ++c) TORCH_CHECK(counts[c] >= 0 && counts[c] <= sel->size(2), "hybrid_prefill_mix: chunk ", c, " sees ", counts[c], " slots of ", sel->size(2));
      // Through pinned memory, asynchronously: a copy from pageable memory (or a blocking one) waits
      // for the stream to drain, a host sync in every STILL layer's prefill.
      seen_dev = seen->pin_memory().to(q.device(), /*non_blocking=*/true);
      p.sel = sel->data_ptr<int64_t>(), p.sel_sb = sel->stride(0), p.sel_sh = sel->stride(1);
      p.seen = seen_dev.data_ptr<int>();
    }
    if (n_lin) {
      TORCH_CHECK(z_lin && n_lin->scalar_type() == at::kFloat && n_lin->is_contiguous() && n_lin->sizes() == at::IntArrayRef({B, H, rows, D}) &&
                      z_lin->scalar_type() == at::kFloat && z_lin->is_contiguous() && z_lin->numel() == B * H * rows,
                  "hybrid_prefill_mix: n_lin [B, H, n·C, D] and z_lin [B, H, n·C], fp32 contiguous");
      p.n_lin = n_lin->data_ptr<float>(), p.z_lin = z_lin->data_ptr<float>();
      if (gate) {
        TORCH_CHECK(gate->scalar_type() == at::kBFloat16 && gate->sizes() == q.sizes() && gate->stride(3) == 1 && gate->device() == q.device(),
                    "hybrid_prefill_mix: the gate must be bf16 [B, H, T, D] with unit last stride on q's device");
        p.gate = View{reinterpret_cast<const __nv_bfloat16*>(gate->data_ptr()), gate->stride(0), gate->stride(2), gate->stride(1)};
      }
    }
    at::Tensor gm;
    if (gamma) {
      gm = gamma->to(at::kFloat).contiguous();
      TORCH_CHECK(gm.numel() == H, "hybrid_prefill_mix: γ must hold one value per head");
      p.gamma = gm.data_ptr<float>();
    }
    p.eps = (float)eps, p.compensate = compensate != 0, p.phantom = phantom != 0;
    at::Tensor y = at::empty({B, H, q.size(2), D}, q.options());
    p.y = reinterpret_cast<__nv_bfloat16*>(y.data_ptr());
    if (D == 64) launch(hybrid_prefill_mix<64>, p, B, kBandThreads, prefill_mix_smem_bytes(64));
    else launch(hybrid_prefill_mix<128>, p, B, kBandThreads, prefill_mix_smem_bytes(128));
    *out = new at::Tensor(y);
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}

// ts (null where absent): q, k, v [B, H, T, D]; q's and k's folded maps [H, D, F/2] fp32 (FeatureMap::
// folded_linear); keep [B, H, n·C] fp32 (0 for a selected token). out[0..4]: n_lin [B, H, n·C, D] and
// z_lin [B, H, n·C] (φ(q)·S, φ(q)·z of each row's chunk state), S [B, H, F, D] and z [B, H, F] after
// the sequence (the state of chunks ≤ n − 3, the decode cache's), all fp32. tf32: the products on the
// tensor cores (where D and F/2 are multiples of 8; fp32 SIMT otherwise).
extern "C" char* attnlab_hybrid_prefill_linear(tensor* ts, int64_t chunk, int64_t reinject_q, int64_t reinject_k, int64_t tf32, tensor* out) {
  try {
    const at::Tensor &q = *ts[0], &k = *ts[1], &v = *ts[2], &wq = *ts[3], &wk = *ts[4];
    tensor keep = ts[5];
    PrefillParams pv{};
    views(pv, q, k, v, chunk, "hybrid_prefill_linear");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Fh = wq.size(-1), F = 2 * Fh, n = pv.n;
    const int64_t rows = n * chunk;
    // Both maps (and keep), then the maps of one F.
    for (const at::Tensor* w : {&wq, &wk}) check_linear_inputs(q, *w, keep, H, D, rows, "hybrid_prefill_linear");
    TORCH_CHECK(wk.size(-1) == Fh, "hybrid_prefill_linear: the folded maps must be of one F");
    c10::cuda::CUDAGuard guard(q.device());
    const auto f32 = q.options().dtype(at::kFloat);
    at::Tensor state = at::empty({B, H, n, F, D}, f32), zstate = at::empty({B, H, n, F}, f32);
    at::Tensor n_lin = at::empty({B, H, rows, D}, f32), z_lin = at::empty({B, H, rows}, f32);
    LinearParams p{pv.q, pv.k, pv.v, pv.T, (int)H, (int)n, (int)D, (int)Fh, wq.data_ptr<float>(), wk.data_ptr<float>(), reinject_q != 0, reinject_k != 0,
                   keep ? keep->data_ptr<float>() : nullptr, state.data_ptr<float>(), zstate.data_ptr<float>(), n_lin.data_ptr<float>(), z_lin.data_ptr<float>()};
    const int64_t smem = linear_smem_bytes((int)D, (int)Fh);
    const bool mma = tf32 != 0 && D % 8 == 0 && Fh % 8 == 0;
    launch(mma ? hybrid_linear_states<true> : hybrid_linear_states<false>, p, B, kLinThreads, smem);
    hybrid_linear_scan<<<dim3((F * D + F + kLinThreads - 1) / kLinThreads, B * H), kLinThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    launch(mma ? hybrid_linear_query<true> : hybrid_linear_query<false>, p, B, kLinThreads, smem);
    // The last chunk's S, z copied out: a view would keep every chunk's state alive in the cache.
    out[0] = new at::Tensor(n_lin);
    out[1] = new at::Tensor(z_lin);
    out[2] = new at::Tensor(state.select(2, n - 1).clone());
    out[3] = new at::Tensor(zstate.select(2, n - 1).clone());
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}

// One chunk routed in decode folded into the cache's state (`Hybrid::prepare_at`'s aten form: about
// fifteen kernels a layer from the host, in a decode's first step before anything is captured):
// ts: k, v [B, H, C, D] bf16 (the ring's slots of the chunk, C = kPrefillChunk), wk [H, D, F/2] fp32
// (the key map folded), keep [B, H, C] fp32 contiguous or null (0 where the token went to Sel instead),
// S [B, H, F, D] and z [B, H, F] fp32 contiguous, added to in place:
//   S += Σ_t keep_t·φ(k_t)ᵀ v_t,  z += Σ_t keep_t·φ(k_t)
// by hybrid_linear_states over the one chunk (the prefill's own products: the TF32 form with tf32).
extern "C" char* attnlab_hybrid_fold_chunk(tensor* ts, int64_t reinject_k, int64_t tf32) {
  try {
    const at::Tensor &k = *ts[0], &v = *ts[1], &wk = *ts[2];
    tensor keep = ts[3];
    at::Tensor &S = *ts[4], &z = *ts[5];
    PrefillParams pv{};
    views(pv, k, k, v, k.size(2), "hybrid_fold_chunk");
    const int64_t B = k.size(0), H = k.size(1), C = k.size(2), D = k.size(3), Fh = wk.size(-1), F = 2 * Fh;
    check_linear_inputs(k, wk, keep, H, D, C, "hybrid_fold_chunk");
    TORCH_CHECK(S.scalar_type() == at::kFloat && S.is_contiguous() && S.sizes() == at::IntArrayRef({B, H, F, D}) && S.device() == k.device(),
                "hybrid_fold_chunk: S must be fp32 contiguous [B, H, F, D]");
    TORCH_CHECK(z.scalar_type() == at::kFloat && z.is_contiguous() && z.sizes() == at::IntArrayRef({B, H, F}) && z.device() == k.device(),
                "hybrid_fold_chunk: z must be fp32 contiguous [B, H, F]");
    c10::cuda::CUDAGuard guard(k.device());
    const auto f32 = k.options().dtype(at::kFloat);
    at::Tensor state = at::empty({B, H, 1, F, D}, f32), zstate = at::empty({B, H, 1, F}, f32);
    // The query's fields are the keys' (hybrid_linear_states reads k, v, wk and keep alone).
    LinearParams p{pv.q, pv.k, pv.v, pv.T, (int)H, 1, (int)D, (int)Fh, wk.data_ptr<float>(), wk.data_ptr<float>(), reinject_k != 0, reinject_k != 0,
                   keep ? keep->data_ptr<float>() : nullptr, state.data_ptr<float>(), zstate.data_ptr<float>(), nullptr, nullptr};
    const bool mma = tf32 != 0 && D % 8 == 0 && Fh % 8 == 0;
    launch(mma ? hybrid_linear_states<true> : hybrid_linear_states<false>, p, B, kLinThreads, linear_smem_bytes((int)D, (int)Fh));
    S.add_(state.view({B, H, F, D}));
    z.add_(zstate.view({B, H, F}));
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
