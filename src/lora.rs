//! LoRA (Hu et al. 2021, peft defaults): y = x Wᵀ + (α/r) · B(A(dropout(x))), A `[r, in]` kaiming-uniform
//! (a = √5, as peft / nn.Linear), B `[out, r]` zeros, so an adapter at init changes nothing. The
//! adapters live next to the weight they adapt: `<module>.lora_A`, `<module>.lora_B`
//! (e.g. `model.layers.0.self_attn.q_proj.lora_A`).
use serde::{Deserialize, Serialize};
use tch::{nn, Tensor};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    /// r (8).
    #[serde(default = "default_rank")]
    pub rank: i64,
    /// α (8 = peft's default, STILL; LoLCATs uses 16).
    #[serde(default = "default_alpha")]
    pub alpha: f64,
    #[serde(default)]
    pub dropout: f64,
    /// Projection names inside `self_attn` (q_proj, k_proj, v_proj, o_proj, g_proj).
    #[serde(default = "default_targets")]
    pub targets: Vec<String>,
}

fn default_rank() -> i64 {
    8
}
fn default_alpha() -> f64 {
    8.0
}
fn default_targets() -> Vec<String> {
    ["q_proj", "k_proj", "v_proj", "o_proj"].iter().map(|s| s.to_string()).collect()
}

impl Default for LoraConfig {
    fn default() -> Self {
        serde_yaml::from_str("{}").expect("defaults")
    }
}

/// One adapter for a weight `[out, in]`.
#[derive(Debug)]
pub struct Lora {
    pub a: Tensor,
    pub b: Tensor,
    pub scale: f64,
    pub dropout: f64,
}

impl Lora {
    pub fn new(p: &nn::Path, input: i64, output: i64, cfg: &LoraConfig) -> Lora {
        let bound = 1.0 / (input as f64).sqrt(); // kaiming_uniform(a=√5): U(±1/√fan_in)
        let a = p.var("lora_A", &[cfg.rank, input], nn::Init::Uniform { lo: -bound, up: bound });
        let b = p.var("lora_B", &[output, cfg.rank], nn::Init::Const(0.0));
        Lora { a, b, scale: cfg.alpha / cfg.rank as f64, dropout: cfg.dropout }
    }

    /// x Wᵀ + scale · (dropout(x) Aᵀ) Bᵀ.
    pub fn forward(&self, w: &Tensor, x: &Tensor, train: bool) -> Tensor {
        let xd = if train && self.dropout > 0.0 { x.dropout(self.dropout, true) } else { x.shallow_clone() };
        x.matmul(&w.tr()) + xd.matmul(&self.a.tr()).matmul(&self.b.tr()) * self.scale
    }

    /// W + scale · B A.
    pub fn merged(&self, w: &Tensor) -> Tensor {
        w + self.b.matmul(&self.a) * self.scale
    }
}

/// A bias-free linear layer `weight` `[out, in]` that can carry a LoRA adapter: the Llama family's
/// attention projections (`q_proj`, `k_proj`, `v_proj`, `o_proj`).
#[derive(Debug)]
pub struct Linear {
    pub weight: Tensor,
    pub lora: Option<Lora>,
}

impl Linear {
    /// `weight` under `p` (e.g. `model.layers.0.self_attn.q_proj.weight`), drawn by `init`.
    pub fn new(p: &nn::Path, input: i64, output: i64, init: nn::Init) -> Linear {
        Linear { weight: p.var("weight", &[output, input], init), lora: None }
    }

    /// x Wᵀ, plus the adapter's update when there is one (`train`: its dropout).
    pub fn forward(&self, x: &Tensor, train: bool) -> Tensor {
        match &self.lora {
            Some(l) => l.forward(&self.weight, x, train),
            None => x.linear::<Tensor>(&self.weight, None),
        }
    }

    /// Give the layer an adapter under its path `p` (`<module>.lora_A`, `.lora_B`).
    pub fn add_lora(&mut self, p: &nn::Path, cfg: &LoraConfig) {
        let (o, i) = (self.weight.size()[0], self.weight.size()[1]);
        self.lora = Some(Lora::new(p, i, o, cfg));
    }

    /// The weight with the adapter merged in (W + scale·B·A), detached.
    pub fn merged(&self) -> Tensor {
        tch::no_grad(|| match &self.lora {
            Some(l) => l.merged(&self.weight),
            None => self.weight.detach().copy(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn zero_b_is_identity_and_merge_matches() {
        let _rng = crate::testutil::seeded(0);
        let vs = nn::VarStore::new(Device::Cpu);
        let cfg = LoraConfig { rank: 4, alpha: 8.0, dropout: 0.0, targets: vec![] };
        let l = Lora::new(&(vs.root() / "q_proj"), 16, 12, &cfg);
        assert!(vs.variables().contains_key("q_proj.lora_A") && vs.variables().contains_key("q_proj.lora_B"));
        let w = Tensor::randn([12, 16], (Kind::Float, Device::Cpu));
        let x = Tensor::randn([2, 5, 16], (Kind::Float, Device::Cpu));
        let base = x.matmul(&w.tr());
        assert!(l.forward(&w, &x, true).allclose(&base, 0.0, 0.0, false), "B = 0 must leave the output unchanged");
        tch::no_grad(|| {
            l.b.shallow_clone().copy_(&Tensor::randn([12, 4], (Kind::Float, Device::Cpu)));
        });
        let y = l.forward(&w, &x, false);
        assert!((&y - &base).abs().max().double_value(&[]) > 1e-3, "B ≠ 0 must change the output");
        let merged = x.matmul(&l.merged(&w).tr());
        assert!(y.allclose(&merged, 1e-5, 1e-5, false));
    }
}
