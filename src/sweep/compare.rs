//! `attnlab compare`: one spec trained once per attention kind (into ROOT/<kind>), in this process;
//! a sweep over `attention.kind` whose final perplexities are shown side by side.
use crate::eval::CorpusResult;
use crate::spec::{AttentionKind, SpecSource};
use crate::train::{self, TrainOptions};
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The folder the kinds' run directories go below: `--out` itself; else the folder that holds the
/// spec's `output:` (so the kinds sit beside it); else `results/compare`.
pub fn root(out: Option<&Path>, output: Option<&Path>) -> PathBuf {
    match (out, output) {
        (Some(o), _) => o.to_path_buf(),
        (None, Some(o)) => o.parent().map(Path::to_path_buf).unwrap_or_else(|| o.to_path_buf()),
        (None, None) => PathBuf::from("results/compare"),
    }
}

/// Train `src` once per kind (a name `AttentionKind` parses, e.g. `vanilla`) into ROOT/<kind>,
/// resuming or skipping finished runs as `train` does. Returns (kind, final evaluation) per kind.
pub fn compare(src: &SpecSource, kinds: &[String], quiet: bool) -> Result<Vec<(String, BTreeMap<String, CorpusResult>)>> {
    let base = src.load()?;
    let root = root(src.out.as_deref(), base.output.as_deref());
    let mut rows = Vec::new();
    for k in kinds {
        let kind: AttentionKind = serde_yaml::from_str(k).map_err(|e| Error::Other(format!("unknown attention kind `{k}`: {e}")))?;
        let mut s = base.with_attention(kind).map_err(|(key, msg)| Error::Other(format!("{key}: {msg}")))?;
        s.output = Some(root.join(k));
        s.name = Some(k.clone());
        if !quiet {
            eprintln!("== {k}: {}", s.attention.note().unwrap_or("full-width keys everywhere"));
        }
        let o = train::train(s, &TrainOptions { quiet, ..Default::default() })?;
        rows.push((k.clone(), o.eval));
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_go_below_out_else_beside_the_specs_output() {
        let p = |s: &str| Some(PathBuf::from(s));
        assert_eq!(root(p("x/cmp").as_deref(), p("results/run").as_deref()), PathBuf::from("x/cmp"));
        assert_eq!(root(None, p("results/run").as_deref()), PathBuf::from("results"));
        assert_eq!(root(None, p("run").as_deref()), PathBuf::from(""));
        assert_eq!(root(None, None), PathBuf::from("results/compare"));
    }

    #[test]
    fn an_unknown_kind_is_an_error_before_training() {
        let e = compare(&SpecSource::default(), &["vanila".into()], true).unwrap_err().to_string();
        assert!(e.contains("unknown attention kind `vanila`"), "{e}");
    }
}
