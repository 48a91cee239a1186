//! Spec inheritance: `base: other.yaml` at the top of a spec file (train, linearize or finetune)
//! starts from that file's tree, then the inheriting file's keys override it by deep merge:
//! mappings merge key by key, a `null` deletes the key (so the default, or nothing, applies), any
//! other value (scalar or list) replaces. A base may have its own base. The path is relative to
//! the inheriting file. Only a string ending in `.yaml` / `.yml` is a spec base: a finetune spec's
//! `base:` naming its base model (a folder or `hf:owner/name`) stays what it is.
//!
//! Sweeps read their `base:` spec through the same function, so a sweep's base may inherit too.
use super::lines::line_of;
use crate::{Error, Result};
use serde_yaml::{Mapping, Value};
use std::path::{Path, PathBuf};

/// One file of an inheritance chain.
#[derive(Debug, Clone)]
pub struct Layer {
    pub path: PathBuf,
    pub text: String,
    /// The file's own tree, `base:` removed.
    pub value: Value,
}

/// A spec file with its bases merged in.
#[derive(Debug, Clone)]
pub struct Tree {
    pub value: Value,
    /// The inheriting file first, then its base, the base's base, ...
    pub layers: Vec<Layer>,
}

/// The spec base a tree names, if any (see the module comment for what counts).
pub fn base_of(value: &Value) -> Option<&str> {
    let b = value.as_mapping()?.get("base")?.as_str()?;
    (b.ends_with(".yaml") || b.ends_with(".yml")).then_some(b)
}

/// Deep merge `over` into `base` (mappings key by key; `null` deletes; anything else replaces).
pub fn merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Mapping(b), Value::Mapping(o)) => {
            for (k, v) in o {
                if v.is_null() {
                    b.remove(&k);
                } else if let Some(slot) = b.get_mut(&k) {
                    merge(slot, v);
                } else {
                    b.insert(k, v);
                }
            }
        }
        (b, o) => *b = o,
    }
}

/// Read `path` and merge its chain of bases. Errors name the file that holds the bad `base:` and
/// the file it points to (missing, unreadable, or leading back into the chain).
pub fn read_tree(path: &Path) -> Result<Tree> {
    let mut layers: Vec<Layer> = Vec::new();
    let mut seen: Vec<PathBuf> = Vec::new();
    let mut next = path.to_path_buf();
    loop {
        let text = std::fs::read_to_string(&next).map_err(|e| match layers.last() {
            None => Error::io(&next, e),
            Some(child) => Error::Spec {
                file: child.path.display().to_string(),
                key: "base".into(),
                line: line_of(&child.text, "base"),
                msg: format!("cannot read its base {}: {e}", next.display()),
            },
        })?;
        let mut value: Value = serde_yaml::from_str(&text).map_err(|e| Error::Schema { file: next.display().to_string(), msg: e.to_string() })?;
        // Compare files, not spellings: `a/../b.yaml` and `b.yaml` are one file.
        seen.push(std::fs::canonicalize(&next).unwrap_or_else(|_| next.clone()));
        let base = base_of(&value).map(|b| next.parent().unwrap_or(Path::new("")).join(b));
        if base.is_some() {
            value.as_mapping_mut().expect("base_of saw a mapping").remove("base");
        }
        layers.push(Layer { path: next.clone(), text, value });
        let Some(base) = base else { break };
        let canonical = std::fs::canonicalize(&base).unwrap_or_else(|_| base.clone());
        if let Some(i) = seen.iter().position(|p| *p == canonical) {
            let child = layers.last().expect("pushed");
            let chain: Vec<String> = layers.iter().map(|l| l.path.display().to_string()).chain([layers[i].path.display().to_string()]).collect();
            return Err(Error::Spec {
                file: child.path.display().to_string(),
                key: "base".into(),
                line: line_of(&child.text, "base"),
                msg: format!("its base {} leads back to {}: a cycle ({})", base.display(), layers[i].path.display(), chain.join(" → ")),
            });
        }
        next = base;
    }
    // Oldest base first, each file overriding the ones it inherits from.
    let mut value = Value::Mapping(Mapping::new());
    for l in layers.iter().rev() {
        merge(&mut value, l.value.clone());
    }
    Ok(Tree { value, layers })
}

impl Tree {
    /// True when the file inherits nothing.
    pub fn is_single(&self) -> bool {
        self.layers.len() == 1
    }

    /// `child.yaml (base a.yaml ← b.yaml)`: how errors about the merged tree name it.
    pub fn origin(&self) -> String {
        let first = self.layers[0].path.display().to_string();
        if self.is_single() {
            return first;
        }
        let bases: Vec<String> = self.layers[1..].iter().map(|l| l.path.display().to_string()).collect();
        format!("{first} (base {})", bases.join(" ← "))
    }

    /// The file (and line) that sets dotted `key`: the first layer, child first, whose own tree has it.
    pub fn locate(&self, key: &str) -> Option<(&Path, Option<usize>)> {
        self.layers.iter().find(|l| has_path(&l.value, key)).map(|l| (l.path.as_path(), line_of(&l.text, key)))
    }

    /// An error from validating the merged tree, pointed at the file that set the key.
    pub fn relocate(&self, e: Error) -> Error {
        if self.is_single() {
            return e;
        }
        match e {
            Error::Spec { key, msg, .. } => match self.locate(&key) {
                Some((file, line)) => Error::Spec { file: file.display().to_string(), key, line, msg },
                None => Error::Spec { file: self.origin(), key, line: None, msg },
            },
            // serde's line and column count lines of the merged text, which no file has.
            Error::Schema { msg, .. } => Error::Schema { file: self.origin(), msg: msg.split(" at line ").next().unwrap_or(&msg).to_string() },
            e => e,
        }
    }
}

fn has_path(v: &Value, key: &str) -> bool {
    let mut node = v;
    for part in key.split('.') {
        match node.as_mapping().and_then(|m| m.get(part)) {
            Some(n) => node = n,
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yaml(s: &str) -> Value {
        serde_yaml::from_str(s).unwrap()
    }

    #[test]
    fn merge_is_deep_for_mappings_and_replaces_the_rest() {
        let mut v = yaml("a: {x: 1, y: {p: 1, q: 2}}\nl: [1, 2]\ns: old\nk: keep\n");
        merge(&mut v, yaml("a: {y: {q: 3, r: 4}, z: 5}\nl: [9]\ns: new\n"));
        assert_eq!(v, yaml("a: {x: 1, y: {p: 1, q: 3, r: 4}, z: 5}\nl: [9]\ns: new\nk: keep\n"));
        // null deletes; a mapping replaces a scalar and the other way round.
        merge(&mut v, yaml("a: {x: null}\nk: {now: map}\nl: null\n"));
        assert_eq!(v, yaml("a: {y: {p: 1, q: 3, r: 4}, z: 5}\ns: new\nk: {now: map}\n"));
    }

    #[test]
    fn nested_bases_merge_in_order_relative_to_each_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("common")).unwrap();
        std::fs::write(dir.path().join("common/root.yaml"), "model: {flavor: tiny}\nattention: {kind: dar, d_down: 16, window: 8}\ntrain: {steps: 5, lr: 0.001}\n").unwrap();
        std::fs::write(dir.path().join("common/mid.yaml"), "base: root.yaml\ntrain: {steps: 7}\n").unwrap();
        std::fs::write(dir.path().join("leaf.yaml"), "base: common/mid.yaml\nattention: {window: null}\ntrain: {seed: 3}\n").unwrap();
        let t = read_tree(&dir.path().join("leaf.yaml")).unwrap();
        assert_eq!(t.value, yaml("model: {flavor: tiny}\nattention: {kind: dar, d_down: 16}\ntrain: {steps: 7, lr: 0.001, seed: 3}\n"));
        assert_eq!(t.layers.len(), 3);
        assert!(t.origin().contains("leaf.yaml (base ") && t.origin().contains("mid.yaml ← "), "{}", t.origin());
        // train.lr comes from root.yaml, on its line 3.
        let (file, line) = t.locate("train.lr").unwrap();
        assert!(file.ends_with("common/root.yaml") && line == Some(3), "{file:?} {line:?}");
        assert!(t.locate("train.steps").unwrap().0.ends_with("mid.yaml"));
        // Not a spec base: a finetune spec's base model stays a key.
        assert_eq!(base_of(&yaml("base: results/teacher")), None);
        assert_eq!(base_of(&yaml("base: hf:owner/name")), None);
    }

    #[test]
    fn errors_in_an_inherited_spec_name_the_file_and_line_that_set_the_key() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("root.yaml"), "data: {train: {synthetic: {docs: 10}}}\ntrain: {steps: 5}\nattention:\n  kind: dar\n  d_down: 0\n").unwrap();
        std::fs::write(dir.path().join("leaf.yaml"), "base: root.yaml\ntrain: {steps: 2}\n").unwrap();
        let e = crate::spec::load(&dir.path().join("leaf.yaml"), &[]).unwrap_err().to_string();
        assert!(e.contains("root.yaml: `attention.d_down` (line 5)"), "{e}");
        // Fixed in the inheriting file: the merged spec resolves, and records no `base`.
        std::fs::write(dir.path().join("leaf.yaml"), "base: root.yaml\ntrain: {steps: 2}\nattention: {d_down: 8}\n").unwrap();
        let s = crate::spec::load(&dir.path().join("leaf.yaml"), &["train.seed=7".into()]).unwrap();
        assert_eq!((s.steps(), s.d_down(), s.seed()), (2, 8, 7));
        // An unknown key anywhere in the chain is a schema error naming the chain.
        std::fs::write(dir.path().join("leaf.yaml"), "base: root.yaml\nmodel: {colour: red}\n").unwrap();
        let e = crate::spec::load(&dir.path().join("leaf.yaml"), &[]).unwrap_err().to_string();
        assert!(e.contains("leaf.yaml (base ") && e.contains("colour"), "{e}");
    }

    #[test]
    fn cycles_and_missing_bases_name_both_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.yaml"), "base: b.yaml\ntrain: {steps: 1}\n").unwrap();
        std::fs::write(dir.path().join("b.yaml"), "model: {flavor: tiny}\nbase: ./a.yaml\n").unwrap();
        let e = read_tree(&dir.path().join("a.yaml")).unwrap_err().to_string();
        assert!(e.contains("b.yaml: `base` (line 2)") && e.contains("leads back to") && e.contains("a.yaml: a cycle"), "{e}");
        std::fs::write(dir.path().join("self.yaml"), "base: self.yaml\n").unwrap();
        let e = read_tree(&dir.path().join("self.yaml")).unwrap_err().to_string();
        assert!(e.contains("cycle"), "{e}");
        std::fs::write(dir.path().join("c.yaml"), "# comment\nbase: nowhere/gone.yaml\n").unwrap();
        let e = read_tree(&dir.path().join("c.yaml")).unwrap_err().to_string();
        assert!(e.contains("c.yaml: `base` (line 2)") && e.contains("cannot read its base") && e.contains("nowhere/gone.yaml"), "{e}");
    }
}
