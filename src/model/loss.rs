//! The training loss shared by every architecture: next-token cross-entropy through the output
//! projection, computed in chunks with its exact gradients.
use tch::Tensor;

/// Rows of the output projection materialised at once by the loss.
pub const LOSS_CHUNK: i64 = 8192;

/// Mean cross-entropy of `logits = h·wᵀ` against `targets` without ever holding all `[N, V]` logits:
/// each chunk's loss and its exact gradients (dh = (softmax − onehot)·w / N, dw = (softmax − onehot)ᵀ·h / N)
/// are computed together without autograd, then attached through a surrogate whose gradient is
/// exactly those tensors. Per chunk: one fp32 softmax (fused max/exp/sum), the target probabilities
/// gathered from it for the loss, −1 scattered at the targets, one cast to the matmul dtype.
pub fn chunked_cross_entropy(h: &Tensor, w: &Tensor, targets: &Tensor, chunk: i64) -> Tensor {
    use tch::Kind;
    let n = h.size()[0];
    let (loss, dh, dw) = tch::no_grad(|| {
        let hd = h.detach();
        let mut nll = Tensor::zeros([], (Kind::Float, h.device()));
        let mut dh = Vec::new();
        let mut dw: Option<Tensor> = None;
        for start in (0..n).step_by(chunk as usize) {
            let len = chunk.min(n - start);
            let hc = hd.narrow(0, start, len);
            let tc = targets.narrow(0, start, len).unsqueeze(1);
            let logits = hc.matmul(&w.tr());
            let matmul_kind = logits.kind(); // bf16 under CUDA autocast
            let mut p = logits.softmax(1, Kind::Float);
            drop(logits);
            // −log p[target], floored at the smallest positive f32 so an underflow logs 103 nats, not inf.
            nll += p.gather(1, &tc, false).clamp_min(f32::from_bits(1) as f64).log().sum(Kind::Float).neg();
            let _ = p.scatter_add_(1, &tc, &Tensor::full([len, 1], -1.0, (Kind::Float, h.device())));
            let g = p.to_kind(matmul_kind);
            drop(p);
            dh.push(g.matmul(w).to_kind(Kind::Float));
            let dwc = g.tr().matmul(&hc).to_kind(Kind::Float);
            dw = Some(match dw {
                Some(acc) => acc + dwc,
                None => dwc,
            });
        }
        let inv = 1.0 / n as f64;
        (nll * inv, Tensor::cat(&dh, 0) * inv, dw.expect("at least one row") * inv)
    });
    // value = loss; gradient w.r.t. h and w = dh and dw.
    let surrogate = (h * dh.to_kind(h.kind())).sum(Kind::Float) + (w * dw.to_kind(w.kind())).sum(Kind::Float);
    &surrogate - surrogate.detach() + loss
}
