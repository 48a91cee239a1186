//! The experiment spec: a YAML file with sections `model`, `attention`, `data`, `train`, `eval`,
//! `checkpoint`, `output`. Loading = parse (unknown keys rejected with serde's line/column) →
//! `--set` overrides → resolve defaults (pythia.md) → validate (errors name the key path and the
//! line in the file where it is known). The resolved spec is what a run directory records.
mod lines;
mod overrides;
mod schema;

pub use overrides::apply_override;
pub use schema::*;

use crate::{Error, Result};
use std::path::Path;

/// A YAML file deserialized as `T` after `--set key=value` overrides (values are YAML): the loader of
/// the specs that have no resolve/validate step of their own (`linearize`, `finetune`).
pub fn read_with_overrides<T: serde::de::DeserializeOwned>(path: &Path, sets: &[String]) -> Result<T> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut value: serde_yaml::Value = serde_yaml::from_str(&text).map_err(|e| Error::Schema { file: file.clone(), msg: e.to_string() })?;
    for s in sets {
        apply_override(&mut value, s).map_err(|msg| Error::Spec { file: file.clone(), key: s.split('=').next().unwrap_or("").to_string(), line: None, msg })?;
    }
    serde_yaml::from_value(value).map_err(|e| Error::Schema { file, msg: e.to_string() })
}

/// Load, override, resolve and validate a spec file.
pub fn load(path: &Path, sets: &[String]) -> Result<Spec> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    from_str(&text, &path.display().to_string(), sets)
}

/// The built-in default experiment: a tiny model on the synthetic corpus (what the Quick start runs).
pub const BUILTIN_TINY: &str = include_str!("../../experiments/tiny-synthetic.yaml");

/// Parse `text` (named `origin` in errors), apply `--set key=value` overrides, resolve and validate.
pub fn from_str(text: &str, origin: &str, sets: &[String]) -> Result<Spec> {
    // A run directory's config.yaml records `command: train` (crate::run_kind); the spec has no such key.
    let text = &crate::run_kind::RunKind::Train.strip(text);
    let schema_err = |e: serde_yaml::Error| Error::Schema { file: origin.to_string(), msg: e.to_string() };
    // Parse once straight from the text so that schema errors carry serde's line and column.
    let _: Spec = serde_yaml::from_str(text).map_err(schema_err)?;
    let mut value: serde_yaml::Value = serde_yaml::from_str(text).map_err(schema_err)?;
    for s in sets {
        apply_override(&mut value, s).map_err(|msg| Error::Spec {
            file: origin.to_string(),
            key: s.split('=').next().unwrap_or("").to_string(),
            line: None,
            msg,
        })?;
    }
    let spec: Spec = serde_yaml::from_value(value)
        .map_err(|e| Error::Schema { file: format!("{origin} (after --set overrides)"), msg: e.to_string() })?;
    spec.resolve().map_err(|(key, msg)| Error::Spec {
        file: origin.to_string(),
        line: lines::line_of(text, &key),
        key,
        msg,
    })
}
