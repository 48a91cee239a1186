// The routing scores our kernels compute (routing.rs, `Scorer::scores`, still.md §4) over a token's C
// most recent keys W (positions max(0, j − C + 1) .. j), a the softmax of its logits over W and b the
// softmax over W without the token (b ≡ 0 when W holds only it): the codes the launchers take
// (src/kernels/cuda.rs's `KernelScore`), shared by the decode step (hybrid_step.cuh) and the prefill
// (hybrid_prefill.cuh).
#pragma once

namespace {

constexpr int kScoreNone = 0;
constexpr int kScoreSelfSaliency = 1;  // Σ_W a·ln((a + ε) / (b + ε)), ε = 1e-8 (the paper's form)
constexpr int kScoreDiagAttention = 2; // a at the token itself
constexpr int kScoreSelfLogit = 3;     // the token's own logit q·k / √D
constexpr float kScoreEps = 1e-8f;

}  // namespace
