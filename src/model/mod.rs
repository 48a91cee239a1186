//! Model architectures, one file each, parameter names as Hugging Face checkpoints: `neox` (GPT-NeoX
//! / Pythia) and `llama` (Llama and OLMo 2). They know architecture only: each layer's attention is a
//! `crate::attention::Layer` (vanilla, DAR, uniform, window; STILL and LoLCATs in a Llama made by
//! `attnlab linearize`). `Model` is what the trainer, evaluation and benches hold.
pub mod gguf;
pub mod hf;
pub mod llama;
pub mod loss;
pub mod neox;
pub mod rope;
pub mod stacked;
pub mod weights;

pub use llama::{Family, Llama, LlamaConfig};
pub use neox::{GptNeox, NeoxConfig};

use tch::Tensor;

/// A pretrained Llama-family model from wherever one is named: a `.gguf` file or `gguf:NAME`
/// ([`gguf`]), a Hugging Face folder, or `hf:owner/name` ([`hf`]).
pub fn load_pretrained(source: &str, device: tch::Device) -> crate::Result<(tch::nn::VarStore, Llama)> {
    if gguf::is_gguf(source) {
        return gguf::load_llama(source, device);
    }
    hf::load_llama(&hf::resolve(source)?, device)
}

pub enum Model {
    Neox(GptNeox),
    Llama(Llama),
}

impl Model {
    /// Width of one attention head.
    pub fn head_dim(&self) -> i64 {
        match self {
            Model::Neox(m) => m.cfg.head_dim() as i64,
            Model::Llama(m) => m.cfg.head_dim() as i64,
        }
    }

    /// Final hidden states `[B, T, d]`.
    pub fn hidden(&self, ids: &Tensor) -> Tensor {
        match self {
            Model::Neox(m) => m.hidden(ids),
            Model::Llama(m) => m.hidden(ids),
        }
    }

    /// Final hidden states `[B, T, d]` of packed rows with per-token document ids `[B, T]` (i64): no
    /// attention across documents, positions restarting at each (`Llama::hidden_docs`). GPT-NeoX
    /// supports only `None`.
    pub fn hidden_docs(&self, ids: &Tensor, doc_ids: Option<&Tensor>) -> Tensor {
        match self {
            Model::Llama(m) => m.hidden_docs(ids, doc_ids),
            _ => {
                assert!(doc_ids.is_none(), "document ids (packed rows) are supported by llama/olmo2 models only");
                self.hidden(ids)
            }
        }
    }

    /// The output projection `[V, d]`.
    pub fn head_weight(&self) -> &Tensor {
        match self {
            Model::Neox(m) => m.head_weight(),
            Model::Llama(m) => m.head_weight(),
        }
    }

    pub fn logits(&self, hidden: &Tensor) -> Tensor {
        hidden.matmul(&self.head_weight().tr())
    }

    pub fn forward(&self, ids: &Tensor) -> Tensor {
        self.logits(&self.hidden(ids))
    }

    /// Mean next-token cross-entropy, never materialising `[B·T, V]` logits (loss::chunked_cross_entropy).
    pub fn loss(&self, inputs: &Tensor, targets: &Tensor) -> Tensor {
        let h = self.hidden(inputs).flatten(0, 1);
        loss::chunked_cross_entropy(&h, self.head_weight(), &targets.reshape([-1]), loss::LOSS_CHUNK)
    }

    pub fn vocab(&self) -> usize {
        self.head_weight().size()[0] as usize
    }

    /// Training FLOPs per token for MFU (PaLM convention: 6·N_mm + 12·L·d·T).
    pub fn flops_per_token(&self, seq_len: usize) -> f64 {
        match self {
            Model::Neox(m) => m.cfg.flops_per_token(seq_len),
            // A linearized Llama's count leaves its feature maps and gate out.
            Model::Llama(Llama { cfg: c, .. }) => {
                let (d, l, hd) = (c.hidden_size as f64, c.num_hidden_layers as f64, c.head_dim() as f64);
                let attn = d * hd * (2.0 * c.num_attention_heads as f64 + 2.0 * c.num_key_value_heads as f64);
                let n_mm = l * (attn + 3.0 * d * c.intermediate_size as f64) + c.vocab_size as f64 * d;
                6.0 * n_mm + 12.0 * l * d * seq_len as f64
            }
        }
    }
}
