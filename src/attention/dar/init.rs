//! The starts of a DAR bottleneck. Pretraining (dar.md §7.4): `small_init` or `orthogonal`, from the
//! bottleneck's own seeded stream ([`pretraining_start`]). A pretrained model (dar.md §4.2,
//! `crate::finetune::dar_start`): `pca`, W_down = Uᵀ, W_up = U with U the top-d_down principal
//! directions of the layer's own K/V input ([`pca_basis`]), so that `h' = h·W_down·W_up` is the
//! orthogonal projection of h onto that subspace and fine-tuning starts near the original model.
//! The bottleneck has no bias, so the directions are those of the uncentred second moment
//! `C = hᵀh / N`: the projection minimising the mean squared reconstruction error, which then equals
//! the sum of the discarded eigenvalues of C.
use crate::attention::dar::AttentionInit;
use rand::{Rng, SeedableRng};
use tch::{Kind, Tensor};

/// Principal directions of the rows of `a` `[N, d]`: (U `[d, k]` (columns = top-k eigenvectors of
/// `aᵀa/N`), all d eigenvalues, descending), fp64.
pub fn pca_basis(a: &Tensor, k: usize) -> (Tensor, Tensor) {
    let a = a.to_kind(Kind::Double);
    top_eigen(&(a.tr().matmul(&a) / a.size()[0] as f64), k)
}

/// (top-k eigenvectors `[d, k]`, all eigenvalues descending) of a symmetric matrix.
pub(crate) fn top_eigen(c: &Tensor, k: usize) -> (Tensor, Tensor) {
    let (vals, vecs) = c.linalg_eigh("L"); // ascending
    (vecs.flip([-1]).narrow(1, 0, k as i64), vals.flip([0]))
}

/// The bottleneck of layer `layer` at the start of pretraining, `(W_down [d_down, d], W_up [d, d_down])`
/// (fp32, CPU). Drawn from its own stream, seeded from (`seed`, `layer`) and nothing else, never from
/// libtorch's global generator: the model's other weights therefore consume exactly the draws they
/// consume in a vanilla model, so a DAR or uniform run starts bit-identical to the vanilla run of the
/// same seed everywhere but in its bottleneck (a paired comparison).
pub fn pretraining_start(init: AttentionInit, seed: u64, layer: usize, d: usize, d_down: usize) -> (Tensor, Tensor) {
    // SplitMix64-style mixing so that neighbouring seeds and layers give unrelated streams.
    let mut z = seed ^ 0xDA2_B077_1E5E_ED00 ^ (layer as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(z ^ (z >> 31));
    // Standard normals by Box–Muller (u1 in (0, 1] keeps the log finite).
    let mut normals = |n: usize| -> Vec<f64> {
        let mut out = Vec::with_capacity(n + 1);
        while out.len() < n {
            let (u1, u2) = (1.0 - rng.random::<f64>(), rng.random::<f64>());
            let r = (-2.0 * u1.ln()).sqrt();
            let t = std::f64::consts::TAU * u2;
            out.extend([r * t.cos(), r * t.sin()]);
        }
        out.truncate(n);
        out
    };
    let (d64, k64) = (d as i64, d_down as i64);
    match init {
        AttentionInit::SmallInit => {
            let std = (2.0 / (5.0 * d as f64)).sqrt();
            let down = Tensor::from_slice(&normals(d_down * d)).reshape([k64, d64]) * std;
            let up = Tensor::from_slice(&normals(d * d_down)).reshape([d64, k64]) * std;
            (down.to_kind(Kind::Float), up.to_kind(Kind::Float))
        }
        AttentionInit::Orthogonal => {
            // Q of a Gaussian [d, d_down] with the signs of R's diagonal folded in: a uniformly random
            // orthonormal basis of a d_down-dimensional subspace (columns of `up`, rows of `down`).
            let g = Tensor::from_slice(&normals(d * d_down)).reshape([d64, k64]);
            let (q, r) = Tensor::linalg_qr(&g, "reduced");
            let sign = r.diagonal(0, 0, 1).sign();
            let q = q * sign.unsqueeze(0);
            (q.tr().contiguous().to_kind(Kind::Float), q.contiguous().to_kind(Kind::Float))
        }
        // Spec::resolve refuses pca in a pretraining spec; fine-tuning calibrates (add_dar_to_pretrained).
        AttentionInit::Pca => unreachable!("attention.init: pca is a fine-tuning start, refused in pretraining specs"),
    }
}

#[cfg(test)]
mod tests;
