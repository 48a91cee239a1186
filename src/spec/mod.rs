//! The experiment spec: a YAML file with sections `model`, `attention`, `data`, `train`, `eval`,
//! `checkpoint`, `output`. Loading = parse (unknown keys rejected with serde's line/column) →
//! `--set` overrides → resolve defaults (pythia.md) → validate (errors name the key path and the
//! line in the file where it is known). The resolved spec is what a run directory records.
//! A spec file may inherit another with `base: other.yaml` (`base`; merged before the overrides).
mod attention;
pub mod base;
mod lines;
mod megatron;
mod overrides;
pub mod ruler_tasks;
mod schema;

pub use crate::attention::LineStyle;
pub use attention::finetune_form as finetune_attention;
pub use megatron::{DType as MegatronDType, MegatronSource};
pub use overrides::apply_override;
pub use schema::*;

use crate::{Error, Result};
use std::path::Path;

/// A YAML file (with its `base:` chain merged) deserialized as `T` after `--set key=value` overrides
/// (values are YAML): the loader of the specs that have no resolve/validate step of their own
/// (`linearize`, `finetune`).
pub fn read_with_overrides<T: serde::de::DeserializeOwned>(path: &Path, sets: &[String]) -> Result<T> {
    let tree = base::read_tree(path)?;
    let file = tree.origin();
    let mut value = tree.value.clone();
    // A run's config.yaml starts with `command: <kind>` (crate::run_kind): not a spec key.
    if let Some(m) = value.as_mapping_mut() {
        if m.get("command").and_then(|c| c.as_str()).is_some_and(|c| crate::run_kind::RunKind::named(c).is_some()) {
            m.remove("command");
        }
    }
    for s in sets {
        apply_override(&mut value, s).map_err(|msg| Error::Spec { file: file.clone(), key: s.split('=').next().unwrap_or("").to_string(), line: None, msg })?;
    }
    let text = if tree.is_single() { tree.layers[0].text.as_str() } else { "" };
    serde_yaml::from_value(value).map_err(|e| tree.relocate(schema_error(text, &file, &e)))
}

/// A schema error that names its key (`` `attention.d_down`: invalid type … ``, as the attention
/// kinds' options say it) as a spec error at that key's line in `text`; any other as serde gives it.
fn schema_error(text: &str, origin: &str, e: &serde_yaml::Error) -> Error {
    let msg = e.to_string();
    // serde_yaml may put the path it was at first (`attention: `…) and its position last: where the
    // mapping ended, not the key's.
    static KEYED: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let keyed = KEYED.get_or_init(|| regex::Regex::new(r"(?s)^(?:[^\s`]+: )?`([^`\s]+)`: (.*?)(?: at line \d+ column \d+)?$").expect("regex"));
    if let Some(c) = keyed.captures(&msg) {
        let key = &c[1];
        return Error::Spec { file: origin.to_string(), key: key.to_string(), line: lines::line_of(text, key), msg: c[2].to_string() };
    }
    Error::Schema { file: origin.to_string(), msg }
}

/// Load (merging `base:` files), override, resolve and validate a spec file.
pub fn load(path: &Path, sets: &[String]) -> Result<Spec> {
    let tree = base::read_tree(path)?;
    if tree.is_single() {
        // No inheritance: parse the file's own text, so that errors carry its lines and columns.
        return from_str(&tree.layers[0].text, &path.display().to_string(), sets);
    }
    let text = serde_yaml::to_string(&tree.value).map_err(|e| Error::Schema { file: tree.origin(), msg: e.to_string() })?;
    from_str(&text, &tree.origin(), sets).map_err(|e| tree.relocate(e))
}

/// The built-in default experiment: a tiny model on the synthetic corpus (what the Quick start runs).
pub const BUILTIN_TINY: &str = include_str!("../../experiments/tiny-synthetic.yaml");

/// Parse `text` (named `origin` in errors), apply `--set key=value` overrides, resolve and validate.
pub fn from_str(text: &str, origin: &str, sets: &[String]) -> Result<Spec> {
    // A run directory's config.yaml records `command: train` (crate::run_kind); the spec has no such key.
    let text = &crate::run_kind::RunKind::Train.strip(text);
    let schema_err = |e: serde_yaml::Error| schema_error(text, origin, &e);
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
    let spec: Spec = serde_yaml::from_value(value).map_err(|e| schema_error(text, &format!("{origin} (after --set overrides)"), &e))?;
    spec.resolve().map_err(|(key, msg)| Error::Spec {
        file: origin.to_string(),
        line: lines::line_of(text, &key),
        key,
        msg,
    })
}

/// Where a command's train spec comes from: a file (or the built-in tiny spec when `path` is
/// `None`), `--set` overrides, and `--out` (replaces `output:` and names the run after that folder
/// when the spec gives no name). What `train`, `compare`, `bench`, `bench-decode` and `config` take.
#[derive(Debug, Clone, Default)]
pub struct SpecSource {
    pub path: Option<std::path::PathBuf>,
    pub sets: Vec<String>,
    pub out: Option<std::path::PathBuf>,
}

impl SpecSource {
    /// Load, override, resolve and validate.
    pub fn load(&self) -> Result<Spec> {
        let mut spec = match &self.path {
            Some(p) => load(p, &self.sets)?,
            None => from_str(BUILTIN_TINY, "<builtin tiny-synthetic>", &self.sets)?,
        };
        if let Some(out) = &self.out {
            spec.output = Some(out.clone());
            spec.name.get_or_insert_with(|| out.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default());
        }
        Ok(spec)
    }
}

#[cfg(test)]
mod source_tests {
    use super::SpecSource;

    #[test]
    fn out_sets_the_output_and_names_only_an_unnamed_run() {
        let src = SpecSource { path: None, sets: vec!["train.steps=3".into()], out: Some("results/my-run".into()) };
        let s = src.load().unwrap();
        let resolved_name = SpecSource { out: None, ..src.clone() }.load().unwrap().name;
        assert_eq!((s.output.as_deref(), s.train.steps), (Some(std::path::Path::new("results/my-run")), Some(3)));
        assert_eq!(s.name, resolved_name.or(Some("my-run".into())));
        let named = SpecSource { sets: vec!["name=kept".into()], ..src }.load().unwrap();
        assert_eq!(named.name.as_deref(), Some("kept"));
    }
}
