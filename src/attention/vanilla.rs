//! Vanilla attention: the causal softmax over every earlier key. Reference: the explicit masked
//! softmax (`super::masked_softmax_attention`); fast path: SDPA (flash / cuDNN on CUDA). Packed rows
//! get the block-diagonal causal mask. Decode keeps every token's keys and values (`cache::Recent`).
use super::{dar_masks, doc_dar_masks, masked, masked_softmax_attention};
use crate::spec::AttentionImpl;
use tch::Tensor;

/// Plain causal attention. `Reference` is the explicit masked softmax; everything else uses SDPA
/// (flash / cuDNN kernels on CUDA).
pub fn causal(q: &Tensor, k: &Tensor, v: &Tensor, imp: AttentionImpl) -> Tensor {
    match imp {
        AttentionImpl::Reference => {
            let t = q.size()[2];
            let (local, _) = dar_masks(t, t, q.device());
            masked_softmax_attention(q, &[(k, v, &local)])
        }
        _ => Tensor::scaled_dot_product_attention::<Tensor>(q, k, v, None, 0.0, true, None, false),
    }
}

/// Causal attention over heads `[B, H, T, hd]`; `seg`: the document segments of packed rows
/// (`super::doc_segments`), so that no key is read across a document boundary.
pub fn forward(q: &Tensor, k: &Tensor, v: &Tensor, seg: Option<&Tensor>, imp: AttentionImpl) -> Tensor {
    match seg {
        None => causal(q, k, v, imp),
        Some(seg) => {
            let (local, _) = doc_dar_masks(seg, q.size()[2]);
            masked(q, &[(k, v, &local)], imp)
        }
    }
}
