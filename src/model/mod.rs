//! Model architectures. `neox` is GPT-NeoX / Pythia (pythia.md) with the attention variants of
//! `crate::attention`; parameter names are Hugging Face's.
pub mod neox;
pub mod rope;

pub use neox::{GptNeox, NeoxConfig};
