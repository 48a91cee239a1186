//! Initialising the DAR bottleneck of a pretrained Llama / OLMo 2 model (dar.md §4.2): `small_init`
//! (random, N(0, 2/(5d)) as GPT-NeoX) or `pca`: W_down = Uᵀ, W_up = U with U the top-d_down principal
//! directions of the layer's own K/V input over a calibration batch, so that `h' = h·W_down·W_up` is the
//! orthogonal projection of h onto that subspace and fine-tuning starts near the original model.
//! The bottleneck has no bias, so the directions are those of the uncentred second moment
//! `C = hᵀh / N`: the projection minimising the mean squared reconstruction error, which then equals
//! the sum of the discarded eigenvalues of C.
use crate::attention::dar::{AttentionInit, Bottleneck, DarAct, DarLayer};
use crate::attention::{Attention, AttentionSpec, Layer};
use crate::model::Llama;
use rand::{Rng, SeedableRng};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::{nn, Kind, Tensor};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum BottleneckInit {
    /// Random N(0, 2/(5d)) (dar.md §2).
    #[default]
    SmallInit,
    /// Principal directions of each layer's K/V input over a calibration batch.
    Pca,
}

/// Principal directions of the rows of `a` `[N, d]`: (U `[d, k]` (columns = top-k eigenvectors of
/// `aᵀa/N`), all d eigenvalues, descending), fp64.
pub fn pca_basis(a: &Tensor, k: usize) -> (Tensor, Tensor) {
    let a = a.to_kind(Kind::Double);
    top_eigen(&(a.tr().matmul(&a) / a.size()[0] as f64), k)
}

/// (top-k eigenvectors `[d, k]`, all eigenvalues descending) of a symmetric matrix.
fn top_eigen(c: &Tensor, k: usize) -> (Tensor, Tensor) {
    let (vals, vecs) = c.linalg_eigh("L"); // ascending
    (vecs.flip([-1]).narrow(1, 0, k as i64), vals.flip([0]))
}

/// Set every layer's bottleneck (the model must have DAR with `dar_act: linear`) to the PCA projection
/// of its own K/V input over `calib_ids` `[B, T]` (packed rows: with their `doc_ids`, as
/// `Llama::hidden_docs`). Layers are calibrated in order: layer i sees the inputs produced by
/// layers < i with their new bottlenecks. Returns per layer the fraction of the second moment the
/// subspace discards (Σ discarded eigenvalues / Σ all; 0 when d_down = d).
pub fn calibrate_pca(model: &Llama, calib_ids: &Tensor, doc_ids: Option<&Tensor>) -> Result<Vec<f64>> {
    let cfg = &model.cfg;
    if !cfg.attention.has_bottleneck() {
        return Err(Error::Other("calibrate_pca: the model has no DAR bottleneck (add_dar first)".into()));
    }
    let a = cfg.attention.softmax().expect("a bottleneck is a softmax kind's");
    if a.dar_act() != DarAct::Linear {
        return Err(Error::Other("calibrate_pca: PCA initialisation needs dar_act: linear (a sigmoid latent is not a projection)".into()));
    }
    let (d, k) = (cfg.hidden_size as i64, a.d_down_width().unwrap_or(0));
    let tokens = calib_ids.numel() as f64;
    tch::no_grad(|| {
        let (seg, cos, sin) = model.doc_tables(calib_ids, doc_ids);
        let mut x = model.embed(calib_ids);
        let mut discarded = Vec::new();
        for i in 0..cfg.num_hidden_layers {
            let (down, up) = model.bottleneck(i).expect("DAR layers have bottlenecks");
            // Second moment accumulated row by row in fp64 (never the whole batch in fp64 at once).
            let a = model.kv_input(i, &x);
            let mut c = Tensor::zeros([d, d], (Kind::Double, a.device()));
            for r in 0..a.size()[0] {
                let ar = a.get(r).to_kind(Kind::Double);
                c += ar.tr().matmul(&ar);
            }
            let (u, vals) = top_eigen(&(c / tokens), k);
            down.shallow_clone().copy_(&u.tr());
            up.shallow_clone().copy_(&u);
            let total = vals.sum(Kind::Double).double_value(&[]);
            let tail = vals.narrow(0, k as i64, d - k as i64).sum(Kind::Double).double_value(&[]);
            discarded.push(if total > 0.0 { tail / total } else { 0.0 });
            x = model.layer_forward_docs(i, &x, &cos, &sin, seg.as_ref());
        }
        Ok(discarded)
    })
}

/// Give a pretrained vanilla model (loaded under `root`, e.g. by `hf::load_llama`) DAR with
/// `attention`, bottlenecks initialised by `init` (`pca` needs `calib_ids` `[B, T]`, optionally with
/// `doc_ids` for packed rows). Returns the per-layer discarded fraction for `pca` (empty for small_init).
pub fn add_dar_to_pretrained(model: &mut Llama, root: &nn::Path, attention: AttentionSpec, init: BottleneckInit, calib_ids: Option<&Tensor>, doc_ids: Option<&Tensor>) -> Result<Vec<f64>> {
    model.add_dar(root, attention)?;
    match (init, calib_ids) {
        (BottleneckInit::SmallInit, _) => Ok(Vec::new()),
        (BottleneckInit::Pca, Some(ids)) => calibrate_pca(model, ids, doc_ids),
        (BottleneckInit::Pca, None) => Err(Error::Other("add_dar_to_pretrained: pca initialisation needs calibration ids".into())),
    }
}

/// DAR on a Llama-family model: the surgery that gives a pretrained model bottlenecks, and their
/// accessor for calibration.
impl Llama {
    /// Turn a vanilla model (e.g. a pretrained checkpoint just loaded under `root`) into a DAR / uniform
    /// one: adds `self_attn.bottleneck_{down,up}.weight` to every layer, small_init N(0, 2/(5d)) from
    /// the global generator (calibrate them afterwards with `attention::dar::init::calibrate_pca` for
    /// the PCA start).
    pub fn add_dar(&mut self, root: &nn::Path, attention: AttentionSpec) -> Result<()> {
        let d = self.cfg.hidden_size;
        if !attention.has_bottleneck() {
            return Err(Error::Other(format!("add_dar: attention kind {} has no bottleneck", attention.kind().name())));
        }
        if !self.cfg.attention.is_vanilla() {
            return Err(Error::Other(format!("add_dar: the model's attention is already {}", self.cfg.attention.label())));
        }
        let s = attention.settings();
        let d_down = s.d_down.unwrap_or(0);
        if d_down == 0 || d_down > d {
            return Err(Error::Other(format!("add_dar: d_down {d_down} is not in 1..={d}")));
        }
        let window = s.window.unwrap_or(0);
        if attention.kind() == crate::attention::AttentionKind::Uniform && window != 0 {
            return Err(Error::Other(format!("add_dar: uniform is DAR with window 0, got window {window}")));
        }
        let m = root / "model";
        let small = nn::Init::Randn { mean: 0.0, stdev: (2.0 / (5.0 * d as f64)).sqrt() };
        for (i, b) in self.layers.iter_mut().enumerate() {
            let bottleneck = Bottleneck::new(&(&m / "layers" / i / "self_attn"), d as i64, d_down as i64, s.dar_act, small);
            b.attn = Layer::from_op(Box::new(DarLayer::new(bottleneck, window as i64, s.implementation)));
        }
        self.cfg.attention = Attention::Softmax(attention);
        Ok(())
    }

    /// Layer `i`'s DAR bottleneck `(down [d_down, d], up [d, d_down])`, if any.
    pub(crate) fn bottleneck(&self, i: usize) -> Option<(&Tensor, &Tensor)> {
        self.layers[i].attn.bottleneck().map(|b| (&b.down, &b.up))
    }

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
