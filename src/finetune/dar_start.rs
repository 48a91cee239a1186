//! A pretrained Llama / OLMo 2 model given DAR (dar.md §4.2): the surgery that adds a bottleneck
//! to every layer (`Llama::add_dar`) and its start, `small_init` or `pca` (W_down = Uᵀ, W_up = U with
//! U the top-d_down principal directions of each layer's own K/V input over calibration rows; the
//! math is `attention::dar::init`). Here, above the model, so that neither the model nor the
//! attention variant knows the other's insides.
use crate::attention::dar::init::top_eigen;
use crate::attention::dar::{Bottleneck, DarAct, DarLayer};
use crate::attention::{Attention, AttentionSpec, Layer};
use crate::model::Llama;
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
