//! Named weights: safetensors files read with every check, and copied into a `VarStore` by name.
//!
//! The `safetensors` crate validates a header (its size bound, UTF-8 JSON, known dtypes, every
//! tensor's bytes contiguous from 0 with no overlap or gap, and the file covered exactly); this
//! adds the file's name to each error, refuses a directory, a key given twice and dtypes torch
//! cannot hold, and [`copy_into`] refuses missing, unexpected, mis-shaped or non-finite weights.
use crate::{Error, IoContext, Result};
use std::collections::HashMap;
use std::path::Path;
use tch::{nn::VarStore, Kind, Tensor};

/// The header's keys in file order (values skipped), to find one given twice: a JSON object read
/// into a map keeps only the last.
struct Keys(Vec<String>);

impl<'de> serde::Deserialize<'de> for Keys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Keys;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> std::result::Result<Keys, A::Error> {
                let mut keys = Vec::new();
                while let Some((k, _)) = m.next_entry::<String, serde::de::IgnoredAny>()? {
                    keys.push(k);
                }
                Ok(Keys(keys))
            }
        }
        d.deserialize_map(V)
    }
}

fn kind_of(dtype: ::safetensors::Dtype) -> Option<Kind> {
    use ::safetensors::Dtype as D;
    Some(match dtype {
        D::BOOL => Kind::Bool,
        D::U8 => Kind::Uint8,
        D::I8 => Kind::Int8,
        D::I16 => Kind::Int16,
        D::I32 => Kind::Int,
        D::I64 => Kind::Int64,
        D::F16 => Kind::Half,
        D::BF16 => Kind::BFloat16,
        D::F32 => Kind::Float,
        D::F64 => Kind::Double,
        _ => return None,
    })
}

/// Every tensor of safetensors file `path`, by name, after the checks above.
pub fn read_safetensors(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let bad = |msg: String| Error::Data(format!("{}: {msg}", path.display()));
    if path.is_dir() {
        return Err(bad("is a directory, not a safetensors file".into()));
    }
    let file = std::fs::File::open(path).at(path)?;
    // SAFETY: read-only map of a file we do not write; a concurrent writer is the caller's problem.
    let map = unsafe { memmap2::Mmap::map(&file) }.at(path)?;
    let st = ::safetensors::SafeTensors::deserialize(&map).map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    // Whole and valid JSON, as deserialize just checked.
    let n = u64::from_le_bytes(map[..8].try_into().expect("8 bytes")) as usize;
    let Keys(keys) = serde_json::from_slice(&map[8..8 + n]).map_err(|e| bad(format!("header: {e}")))?;
    let mut seen = std::collections::HashSet::new();
    if let Some(k) = keys.iter().find(|k| !seen.insert(k.as_str())) {
        return Err(bad(format!("header: tensor `{k}` appears twice")));
    }
    let mut out = Vec::with_capacity(st.len());
    for (name, view) in st.iter() {
        let kind = kind_of(view.dtype()).ok_or_else(|| bad(format!("tensor `{name}` has dtype {}, which torch does not hold (F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)", view.dtype())))?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let t = Tensor::f_from_data_size(view.data(), &shape, kind).map_err(|e| bad(format!("tensor `{name}`: {e}")))?;
        out.push((name.to_string(), t));
    }
    Ok(out)
}

/// Copy named tensors into `vs`: every variable must be present with its shape and finite; a tied
/// `lm_head` may be absent or present (then equal to the embedding); other extras are errors.
pub fn copy_into(vs: &VarStore, mut tensors: HashMap<String, Tensor>, origin: &Path) -> Result<()> {
    let vars = vs.variables();
    if !vars.contains_key("lm_head.weight") {
        tensors.remove("lm_head.weight");
    }
    tensors.retain(|n, _| !n.ends_with("rotary_emb.inv_freq"));
    let mut missing: Vec<&String> = vars.keys().filter(|k| !tensors.contains_key(*k)).collect();
    let mut extra: Vec<&String> = tensors.keys().filter(|k| !vars.contains_key(*k)).collect();
    missing.sort();
    extra.sort();
    if !missing.is_empty() || !extra.is_empty() {
        return Err(Error::Data(format!("{}: missing {missing:?}, unexpected {extra:?}", origin.display())));
    }
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort();
    tch::no_grad(|| {
        for name in names {
            let (src, var) = (&tensors[name], &vars[name]);
            if src.size() != var.size() {
                return Err(Error::Data(format!("{}: {name} has shape {:?}, model wants {:?}", origin.display(), src.size(), var.size())));
            }
            if src.is_floating_point() && src.isfinite().all().int64_value(&[]) == 0 {
                return Err(Error::Data(format!("{}: {name} holds non-finite values (NaN or ±inf)", origin.display())));
            }
            var.shallow_clone().f_copy_(src)?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests;
