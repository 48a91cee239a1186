//! The `megatron:` training source: token ids already tokenized by Megatron / GPT-NeoX tooling
//! (`.bin` + optional `.idx`), read in place by `crate::data::megatron`.
use serde::{Deserialize, Serialize};

/// ```yaml
/// train:
///   megatron:
///     hf: EleutherAI/pile-standard-pythia-preshuffled   # omit for local files
///     bin: [document-00000-of-00020.bin]                # consecutive pieces of one .bin
///     idx: document.idx                                 # optional: MMapIndexedDataset index
///     start_sample: 0                                   # skip this many (seq_len + 1)-token samples
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MegatronSource {
    /// Hugging Face dataset repository the `bin` / `idx` names are files of (else they are local paths).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hf: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// The `.bin` data: one file, or consecutive pieces of one file (Pythia's 20 shards), in order.
    #[serde(deserialize_with = "one_or_many")]
    pub bin: Vec<String>,
    /// The `.idx` index: the token dtype comes from its header, and the `.bin` must hold every
    /// sequence it lists. Without it the `.bin` is a flat stream of `dtype` tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idx: Option<String>,
    /// Token type of a `.bin` without index: u16 (Pythia), i32, u8, i8, i16, i64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// Training sample g (= step · batch_size + i) is stream tokens [(start_sample + g)·(T+1),
    /// (start_sample + g + 1)·(T+1)): Pythia's batch order with T = 2048. No shuffling.
    #[serde(default)]
    pub start_sample: u64,
}

fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    })
}

impl MegatronSource {
    /// Problems found before any file is opened: (key suffix, message).
    pub fn check(&self) -> Result<(), (String, String)> {
        if self.bin.is_empty() {
            return Err((".megatron.bin".into(), "lists no .bin file".into()));
        }
        if let Some(d) = &self.dtype {
            if DType::from_name(d).is_none() {
                return Err((".megatron.dtype".into(), format!("`{d}` is not one of u8, i8, i16, u16, i32, i64")));
            }
        }
        Ok(())
    }
}

/// Token types of the format (the float codes 6 and 7 exist in the format but hold no token ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    U8,
    I8,
    I16,
    I32,
    I64,
    U16,
}

impl DType {
    pub fn from_code(code: u8) -> std::result::Result<DType, String> {
        Ok(match code {
            1 => DType::U8,
            2 => DType::I8,
            3 => DType::I16,
            4 => DType::I32,
            5 => DType::I64,
            8 => DType::U16,
            6 | 7 => return Err(format!("dtype code {code} ({}) holds no token ids", if code == 6 { "float64" } else { "float32" })),
            c => return Err(format!("unknown dtype code {c} (megatron-core knows 1–8)")),
        })
    }

    pub fn code(self) -> u8 {
        match self {
            DType::U8 => 1,
            DType::I8 => 2,
            DType::I16 => 3,
            DType::I32 => 4,
            DType::I64 => 5,
            DType::U16 => 8,
        }
    }

    pub fn from_name(name: &str) -> Option<DType> {
        Some(match name {
            "u8" | "uint8" => DType::U8,
            "i8" | "int8" => DType::I8,
            "i16" | "int16" => DType::I16,
            "u16" | "uint16" => DType::U16,
            "i32" | "int32" => DType::I32,
            "i64" | "int64" => DType::I64,
            _ => return None,
        })
    }

    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::I16 | DType::U16 => 2,
            DType::I32 => 4,
            DType::I64 => 8,
        }
    }
}
