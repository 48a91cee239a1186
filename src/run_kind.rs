//! Which command made a run directory: config.yaml's top-level `command: train | finetune |
//! linearize`, or — for run directories written before that key existed — which spec the config
//! has the keys of. Every command that opens a run directory asks `RunKind::of` instead of guessing.
//! It reads YAML only (no spec type), so that every layer may ask it (ARCHITECTURE.md, imports).
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The top-level key of config.yaml that names the command.
pub const KEY: &str = "command";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RunKind {
    Train,
    Finetune,
    Linearize,
}

impl RunKind {
    pub fn name(self) -> &'static str {
        match self {
            RunKind::Train => "train",
            RunKind::Finetune => "finetune",
            RunKind::Linearize => "linearize",
        }
    }

    /// The kind of the run directory `dir` (its config.yaml).
    pub fn of(dir: &Path) -> Result<RunKind> {
        let cfg = dir.join("config.yaml");
        let text = std::fs::read_to_string(&cfg).map_err(|e| Error::io(&cfg, e))?;
        RunKind::of_config(&text).map_err(|msg| Error::Run { dir: dir.into(), msg: format!("config.yaml: {msg}") })
    }

    /// The kind of a config or spec text: its `command:` when present (one naming no kind is an
    /// error); otherwise (older run directories, spec files) [`RunKind::of_keys`].
    pub fn of_config(text: &str) -> std::result::Result<RunKind, String> {
        let v: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| e.to_string())?;
        if let Some(c) = v.get(KEY) {
            return serde_yaml::from_value(c.clone()).map_err(|e| format!("`{KEY}`: {e} (train, finetune or linearize)"));
        }
        Ok(RunKind::of_keys(&v))
    }

    /// The kind of a config.yaml tree: its `command:` when it names a kind; otherwise (older run
    /// directories, spec files) [`RunKind::of_keys`].
    pub fn of_value(v: &serde_yaml::Value) -> RunKind {
        v.get(KEY).and_then(|c| c.as_str()).and_then(RunKind::named).unwrap_or_else(|| RunKind::of_keys(v))
    }

    /// The kind of a spec without `command:`, by the keys that only one spec has: a `teacher:` is
    /// linearize (as sweeps always decided); a `base:` model (required of a finetune spec, unknown to
    /// a train spec, whose own `base: other.yaml` is merged away before this is asked) is finetune;
    /// anything else train.
    pub fn of_keys(v: &serde_yaml::Value) -> RunKind {
        if v.get("teacher").is_some() {
            RunKind::Linearize
        } else if v.get("base").is_some() {
            RunKind::Finetune
        } else {
            RunKind::Train
        }
    }

    /// A spec's YAML as config.yaml records it: `command: <kind>` first.
    pub fn record(self, yaml: &str) -> String {
        format!("{KEY}: {}\n{yaml}", self.name())
    }

    /// `text` without its top-level `command: <this kind>` line (blanked, so that line numbers in
    /// errors still point into the file): what the spec parsers read. Another kind's line is kept,
    /// so that reading a finetune config as a train spec still fails.
    pub fn strip(self, text: &str) -> String {
        let own = format!("{KEY}: {}", self.name());
        blank_lines(text, |l| l == own)
    }

    /// The kind a command's name stands for (`train`, `finetune`, `linearize`).
    pub fn named(name: &str) -> Option<RunKind> {
        [RunKind::Train, RunKind::Finetune, RunKind::Linearize].into_iter().find(|k| k.name() == name)
    }
}

/// `text` with the lines (end-trimmed) that `hit` matches blanked; unchanged when none does.
fn blank_lines(text: &str, hit: impl Fn(&str) -> bool) -> String {
    if !text.lines().any(|l| hit(l.trim_end())) {
        return text.to_string();
    }
    text.lines().map(|l| if hit(l.trim_end()) { "" } else { l }).collect::<Vec<_>>().join("\n") + "\n"
}

#[cfg(test)]
mod tests;
