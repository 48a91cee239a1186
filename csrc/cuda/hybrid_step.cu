// Launch of the STILL / LoLCATs decode mix (csrc/cuda/hybrid_step.cuh says what it computes). Taken
// by `Hybrid::step_at` unless ATTNLAB_HYBRID_KERNEL=0 (src/kernels/cuda.rs).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cstdlib>
#include <cstring>
#include "hybrid_step.cuh"

typedef at::Tensor* tensor;

// ts (null where absent): q [B, H, 1, D] (bf16 / fp16 / fp32); phi [B, H, 1, F] fp32; the window
// ring k, v [B, H, 2C, D]; Sel k, v [B, H, cap, D] and n_sel [1] i64; S [B, H, F, D] and z [B, H, F]
// fp32; the gate [B, H, 1, D]; γ [H]; pos [1] i64; the ring of routing scores [B, H, 2C] fp32, which
// the kernel writes the new token's score into (score_kind, score_kinds.cuh's codes; 0: none); the
// query map's folded matrix W' [H, D, F/2] fp32, from which the kernel computes φ(q) itself (then phi may
// be null; fmap_kind 1: u = q·W', 2: with the norm re-injection; 0: φ given). k, v, Sel and the gate in
// q's dtype; the new token's key and value [B, H, 1, D] (ts[14], ts[15], q's dtype, unit last stride),
// which the kernel writes into the window ring at slot pos mod 2C first (null: the ring holds them);
// ts[16]: one int32 arrival counter a head [B·H], zero (and left zero): the mix split over blocks
// (hybrid_mix_split), else one block a head (hybrid_mix). gate_sigmoid: the gate came in before its
// sigmoid. *out: y [B, H, 1, D].
extern "C" char* attnlab_hybrid_mix(tensor* ts, int64_t chunk, double eps, int64_t linear, int64_t compensate, int64_t score_kind, int64_t fmap_kind,
                                    int64_t gate_sigmoid, tensor* out) {
  try {
    const at::Tensor &q = *ts[0], &wk = *ts[2], &wv = *ts[3];
    tensor phi = ts[1], sk = ts[4], sv = ts[5], n_sel = ts[6], gate = ts[9], gamma = ts[10], fmap = ts[13];
    const at::Tensor S = ts[7]->contiguous(), z = ts[8]->contiguous(), &pos = *ts[11];
    TORCH_CHECK(q.is_cuda() && q.dim() == 4 && q.size(2) == 1 && q.stride(3) == 1, "hybrid_mix: q must be CUDA [B, H, 1, D] with unit last stride");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(3);
    TORCH_CHECK(fmap_kind == 0 || ((fmap_kind == 1 || fmap_kind == 2) && fmap), "hybrid_mix: fmap_kind ", fmap_kind, " needs W'");
    TORCH_CHECK(fmap_kind != 0 || phi, "hybrid_mix: φ(q) or W' is needed");
    const int64_t F = fmap_kind ? 2 * fmap->size(2) : phi->size(3);
    if (fmap_kind) {
      TORCH_CHECK(fmap->scalar_type() == at::kFloat && fmap->is_contiguous() && fmap->dim() == 3 && fmap->size(0) == H && fmap->size(1) == D, "hybrid_mix: W' must be contiguous fp32 [H, D, F/2]");
    } else {
      TORCH_CHECK(phi->scalar_type() == at::kFloat && phi->dim() == 4 && phi->size(0) == B && phi->size(1) == H && phi->stride(3) == 1, "hybrid_mix: φ(q) must be fp32 [B, H, 1, F]");
    }
    TORCH_CHECK(wk.dim() == 4 && wk.size(2) == 2 * chunk && wk.size(3) == D && wk.strides() == wv.strides() && wk.stride(3) == 1 && wk.scalar_type() == q.scalar_type() &&
                    wv.scalar_type() == q.scalar_type(), "hybrid_mix: the window must be [B, H, 2C, D] in q's dtype");
    TORCH_CHECK(S.scalar_type() == at::kFloat && S.sizes() == at::IntArrayRef({B, H, F, D}) && z.scalar_type() == at::kFloat && z.sizes() == at::IntArrayRef({B, H, F}),
                "hybrid_mix: S [B, H, F, D] and z [B, H, F] in fp32");
    c10::cuda::CUDAGuard guard(q.device());
    MixParams p{};
    p.q = q.data_ptr();
    p.q_sb = q.stride(0), p.q_sh = q.stride(1);
    if (fmap_kind) {
      p.fmap = fmap->data_ptr<float>();
      p.fmap_reinject = fmap_kind == 2;
    } else {
      p.phi = phi->data_ptr<float>();
      p.phi_sb = phi->stride(0), p.phi_sh = phi->stride(1);
    }
    p.wk = wk.data_ptr(), p.wv = wv.data_ptr();
    p.w_sb = wk.stride(0), p.w_sh = wk.stride(1), p.w_ss = wk.stride(2);
    int64_t cap = 0;
    if (sk && sk->size(2) > 0) {
      TORCH_CHECK(n_sel && sk->strides() == sv->strides() && sk->stride(3) == 1 && sk->scalar_type() == q.scalar_type(), "hybrid_mix: Sel [B, H, cap, D] with n_sel");
      cap = sk->size(2);
      p.sk = sk->data_ptr(), p.sv = sv->data_ptr();
      p.s_sb = sk->stride(0), p.s_sh = sk->stride(1), p.s_ss = sk->stride(2);
      p.n_sel = n_sel->data_ptr<int64_t>();
    }
    p.S = S.data_ptr<float>();
    p.z = z.data_ptr<float>();
    at::Tensor g, gm;
    if (gate) {
      g = *gate;
      TORCH_CHECK(g.size(3) == D && g.stride(3) == 1 && g.scalar_type() == q.scalar_type(), "hybrid_mix: the gate must be [B, H, 1, D] in q's dtype");
      p.g = g.data_ptr();
      p.g_sb = g.stride(0), p.g_sh = g.stride(1);
      p.gate_sigmoid = gate_sigmoid != 0;
    }
    if (gamma) {
      gm = gamma->to(at::kFloat).contiguous();
      TORCH_CHECK(gm.numel() == H, "hybrid_mix: γ must hold one value per head");
      p.gamma = gm.data_ptr<float>();
    }
    p.pos = pos.data_ptr<int64_t>();
    if (score_kind != kScoreNone) {
      TORCH_CHECK(score_kind == kScoreSelfSaliency || score_kind == kScoreDiagAttention || score_kind == kScoreSelfLogit, "hybrid_mix: unknown score kind ", score_kind);
      TORCH_CHECK(ts[12], "hybrid_mix: a score kind needs the ring of scores");
      at::Tensor& sc = *ts[12];
      TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.dim() == 3 && sc.size(0) == B && sc.size(1) == H && sc.size(2) == 2 * chunk && sc.stride(2) == 1,
                  "hybrid_mix: the ring of scores must be fp32 [B, H, 2C] with unit last stride");
      p.score = sc.data_ptr<float>();
      p.sc_sb = sc.stride(0), p.sc_sh = sc.stride(1);
      p.score_kind = (int)score_kind;
    }
    if (ts[14] || ts[15]) {
      TORCH_CHECK(ts[14] && ts[15], "hybrid_mix: the new key and value come together");
      const at::Tensor &nk = *ts[14], &nv = *ts[15];
      for (const at::Tensor* t : {&nk, &nv})
        TORCH_CHECK(t->dim() == 4 && t->size(0) == B && t->size(1) == H && t->size(2) == 1 && t->size(3) == D && t->stride(3) == 1 && t->scalar_type() == q.scalar_type() && t->device() == q.device(),
                    "hybrid_mix: the new key / value must be [B, H, 1, D] in q's dtype with unit last stride, got ", t->sizes());
      p.new_k = nk.data_ptr(), p.new_v = nv.data_ptr();
      p.nk_sb = nk.stride(0), p.nk_sh = nk.stride(1), p.nv_sb = nv.stride(0), p.nv_sh = nv.stride(1);
    }
    p.H = H, p.C = chunk, p.cap = cap, p.D = D, p.F = F;
    p.eps = (float)eps;
    p.scale = 1.f / std::sqrt((float)D);
    p.linear = linear != 0, p.compensate = compensate != 0;
    at::Tensor y = at::empty({B, H, 1, D}, q.options());
    p.y = y.data_ptr();
    // The 16-byte loads wherever they fit unless ATTNLAB_HYBRID_VEC=0: they pass the gate and decode
    // STILL (budget) 1.22-1.44x and LoLCATs 1.00-1.15x faster than the scalar ones at 1K-16K on one
    // H100 (results/bench/2026-12-07-h100, `scripts/gpu_bench.sh hybridvec`).
    const char* vec_switch = std::getenv("ATTNLAB_HYBRID_VEC");
    p.vec = mix_vec_fits(p) && !(vec_switch && std::strcmp(vec_switch, "0") == 0);
    // Split over blocks where the caller hands the counters: softmax blocks of kSplitSlots slots
    // (with a routing score, the first takes the whole window ring), one for the linear branch.
    constexpr int kSplitSlots = 64;
    const bool split = ts[16] != nullptr;
    at::Tensor part, lin_out;
    if (split) {
      const at::Tensor& arrived = *ts[16];
      TORCH_CHECK(arrived.scalar_type() == at::kInt && arrived.is_contiguous() && arrived.numel() == B * H && arrived.device() == q.device(),
                  "hybrid_mix: the arrival counters must be int32 [B·H] on q's device");
      p.per = kSplitSlots;
      p.slices = mix_slices(2 * chunk, 2 * chunk + cap, kSplitSlots, score_kind != kScoreNone);
      part = at::empty({B * H, p.slices, D + 2}, q.options().dtype(at::kFloat));
      lin_out = at::empty({B * H, D + 1}, q.options().dtype(at::kFloat));
      p.part = part.data_ptr<float>(), p.lin_out = lin_out.data_ptr<float>(), p.arrived = arrived.data_ptr<int>();
    }
    const size_t smem = (split ? mix_split_smem_floats(D, F, chunk, kSplitSlots, score_kind != kScoreNone, p.vec) : mix_smem_floats(D, F, chunk, cap, p.vec)) * sizeof(float);
    TORCH_CHECK(smem <= 200 * 1024, "hybrid_mix: ", smem, " bytes of shared memory");
    auto stream = c10::cuda::getCurrentCUDAStream();
    auto launch = [&](auto kernel, dim3 grid) {
      if (smem > 48 * 1024) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
      kernel<<<grid, kMixThreads, smem, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    const dim3 split_grid(p.slices + p.linear, B * H);
    if (q.scalar_type() == at::kBFloat16) split ? launch(hybrid_mix_split<__nv_bfloat16>, split_grid) : launch(hybrid_mix<__nv_bfloat16>, dim3(B * H));
    else if (q.scalar_type() == at::kHalf) split ? launch(hybrid_mix_split<__half>, split_grid) : launch(hybrid_mix<__half>, dim3(B * H));
    else TORCH_CHECK(false, "hybrid_mix: q must be bf16 or fp16, not ", q.scalar_type());
    *out = new at::Tensor(y);
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
