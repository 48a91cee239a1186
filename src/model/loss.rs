//! The training loss shared by every architecture: next-token cross-entropy through the output
//! projection, computed in chunks with its exact gradients, the logits never in fp32 on the GPU.
use crate::kernels;
use tch::{Kind, Tensor};

/// Rows of the output projection materialised at once by the loss.
pub const LOSS_CHUNK: i64 = 8192;

/// Mean cross-entropy of `logits = h·wᵀ` against `targets` without ever holding all `[N, V]` logits.
/// Per chunk of rows: one matmul to the logits (bf16 under CUDA autocast), then
/// [`cross_entropy_grad_in_place`] turns them into the loss's gradient `G = (softmax − onehot) / N`
/// in place, and the backward is two matmuls, `dh = G·w` and `dw += Gᵀ·h`. Computed without autograd
/// and attached through a surrogate whose gradient is exactly (dh, dw).
pub fn chunked_cross_entropy(h: &Tensor, w: &Tensor, targets: &Tensor, chunk: i64) -> Tensor {
    let n = h.size()[0];
    let inv = 1.0 / n as f64;
    let (loss, dh, dw) = tch::no_grad(|| {
        let hd = h.detach();
        let acc = if h.kind() == Kind::Double { Kind::Double } else { Kind::Float };
        let mut nll = Tensor::zeros([], (acc, h.device()));
        let mut dh = Vec::new();
        let mut dw: Option<Tensor> = None;
        for start in (0..n).step_by(chunk as usize) {
            let len = chunk.min(n - start);
            let hc = hd.narrow(0, start, len);
            let mut g = hc.matmul(&w.tr());
            nll += cross_entropy_grad_in_place(&mut g, &targets.narrow(0, start, len), inv).sum(acc);
            dh.push(g.matmul(w));
            let dwc = g.tr().matmul(&hc);
            dw = Some(match dw {
                Some(mut acc) => {
                    let _ = acc.g_add_(&dwc);
                    acc
                }
                None => dwc.to_kind(acc),
            });
        }
        (nll * inv, Tensor::cat(&dh, 0), dw.expect("at least one row"))
    });
    // value = loss; gradient w.r.t. h and w = dh and dw.
    let surrogate = (h * dh.to_kind(h.kind())).sum(Kind::Float) + (w * dw.to_kind(w.kind())).sum(Kind::Float);
    &surrogate - surrogate.detach() + loss
}

/// Per-row cross-entropy of `logits` `[N, V]` against `targets` `[N]` (`[N]`, fp32, fp64 for fp64
/// logits: log-sum-exp minus the target's logit), overwriting `logits` with `scale·(softmax − onehot)` in their own dtype.
/// On CUDA in bf16 / fp16 one kernel reads each row and writes its gradient (csrc/cuda/loss_head.cu);
/// elsewhere (and without the kernel library) aten computes the same in fp32.
pub fn cross_entropy_grad_in_place(logits: &mut Tensor, targets: &Tensor, scale: f64) -> Tensor {
    if logits.device().is_cuda() && matches!(logits.kind(), Kind::BFloat16 | Kind::Half) && logits.stride()[1] == 1 {
        if let Some(r) = kernels::cuda::ce_grad_in_place(logits, targets, scale) {
            return r.unwrap_or_else(|e| panic!("loss head kernel failed: {e}"));
        }
    }
    cross_entropy_grad_in_place_aten(logits, targets, scale)
}

/// [`cross_entropy_grad_in_place`] through aten ops in fp32 (fp64 logits stay fp64): the CPU path,
/// and the function the kernel is checked against.
pub fn cross_entropy_grad_in_place_aten(logits: &mut Tensor, targets: &Tensor, scale: f64) -> Tensor {
    let acc = if logits.kind() == Kind::Double { Kind::Double } else { Kind::Float };
    let t = targets.to_device(logits.device()).to_kind(Kind::Int64).unsqueeze(1);
    let x = logits.to_kind(acc);
    let lse = x.logsumexp([1i64].as_slice(), true);
    let nll = (&lse - x.gather(1, &t, false)).squeeze_dim(1);
    let mut g = (x - lse).exp_() * scale;
    let _ = g.scatter_add_(1, &t, &Tensor::full([t.size()[0], 1], -scale, (acc, g.device())));
    logits.copy_(&g);
    nll
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// Loss and both gradients of the chunked head equal autograd through full fp64 logits, with a ragged last chunk; a wrong target fails the same check.
    #[test]
    fn chunked_loss_and_gradients_equal_full_logits_autograd() {
        let _rng = crate::testutil::seeded(7);
        let (n, d, v) = (13i64, 6i64, 29i64);
        let opt = (Kind::Double, Device::Cpu);
        let h = Tensor::randn([n, d], opt).set_requires_grad(true);
        let w = Tensor::randn([v, d], opt).set_requires_grad(true);
        let targets = Tensor::randint(v, [n], (Kind::Int64, Device::Cpu));
        let grads = |loss: Tensor| {
            let g = Tensor::run_backward(&[loss.shallow_clone()], &[&h, &w], false, false);
            (loss.double_value(&[]), g[0].shallow_clone(), g[1].shallow_clone())
        };
        // (tch's cross_entropy_for_logits computes in fp32.)
        let full = |t: &Tensor| grads(h.matmul(&w.tr()).log_softmax(1, Kind::Double).gather(1, &t.unsqueeze(1), false).mean(Kind::Double).neg());
        let (l0, dh0, dw0) = full(&targets);
        let close = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]) < 1e-12;
        for chunk in [4, n, 100] {
            let (l, dh, dw) = grads(chunked_cross_entropy(&h, &w, &targets, chunk));
            assert!((l - l0).abs() < 1e-12, "chunk {chunk}: loss {l} vs {l0}");
            assert!(close(&dh, &dh0) && close(&dw, &dw0), "chunk {chunk}: gradients differ");
        }
        let shifted = (&targets + 1).remainder(v);
        let (l, dh, _) = grads(chunked_cross_entropy(&h, &w, &shifted, 4));
        assert!((l - l0).abs() > 1e-3 || !close(&dh, &dh0));
        let _ = full(&shifted);
    }

    /// The in-place step in bf16 on CPU: per-row losses within bf16 rounding of the fp64 values, and
    /// the rows overwritten with scale·(softmax − onehot), each row's gradient summing to ~0.
    #[test]
    fn in_place_gradient_is_softmax_minus_onehot_in_the_logits_dtype() {
        let _rng = crate::testutil::seeded(3);
        let (n, v, scale) = (5i64, 40i64, 0.25);
        let x = Tensor::randn([n, v], (Kind::Double, Device::Cpu)) * 4.0;
        let t = Tensor::from_slice(&[0i64, 39, 7, 7, 20]);
        let mut g = x.to_kind(Kind::BFloat16);
        let nll = cross_entropy_grad_in_place(&mut g, &t, scale);
        assert_eq!(g.kind(), Kind::BFloat16);
        let xb = x.to_kind(Kind::BFloat16).to_kind(Kind::Double);
        let want_nll = xb.logsumexp([1i64].as_slice(), false) - xb.gather(1, &t.unsqueeze(1), false).squeeze_dim(1);
        assert!((nll.to_kind(Kind::Double) - &want_nll).abs().max().double_value(&[]) < 1e-5);
        let want_g = (xb.softmax(1, Kind::Double) - t.one_hot(v).to_kind(Kind::Double)) * scale;
        let err = (g.to_kind(Kind::Double) - &want_g).abs().max().double_value(&[]);
        assert!(err < 2e-3 * scale, "gradient off by {err}");
    }
}
