//! `--set a.b.c=value`: set a key path in the YAML tree. The value is parsed as YAML, so numbers,
//! booleans, lists (`[1, 2]`) and maps (`{hf: x}`) work; missing parent maps are created.
use serde_yaml::{Mapping, Value};

pub fn apply_override(root: &mut Value, assignment: &str) -> Result<(), String> {
    let (path, raw) = assignment.split_once('=').ok_or_else(|| format!("`{assignment}` is not of the form key.path=value"))?;
    let path = path.trim();
    if path.is_empty() || path.split('.').any(str::is_empty) {
        return Err(format!("`{path}` is not a valid key path"));
    }
    let value: Value = serde_yaml::from_str(raw).map_err(|e| format!("value `{raw}`: {e}"))?;
    set_path(root, path, value)
}

/// Set `path` (dotted) in `root` to `value`, creating intermediate maps.
pub fn set_path(root: &mut Value, path: &str, value: Value) -> Result<(), String> {
    let mut node = root;
    let parts: Vec<&str> = path.split('.').collect();
    for (i, part) in parts.iter().enumerate() {
        if node.is_null() {
            *node = Value::Mapping(Mapping::new());
        }
        let map = node
            .as_mapping_mut()
            .ok_or_else(|| format!("`{}` is not a mapping", parts[..i].join(".")))?;
        let key = Value::String(part.to_string());
        if i + 1 == parts.len() {
            map.insert(key, value);
            return Ok(());
        }
        node = map.entry(key).or_insert(Value::Null);
    }
    unreachable!("path has at least one part")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_nested_and_parses_yaml_values() {
        let mut v: Value = serde_yaml::from_str("attention: {kind: dar}\n").unwrap();
        apply_override(&mut v, "attention.window=64").unwrap();
        apply_override(&mut v, "train.betas=[0.9, 0.99]").unwrap();
        apply_override(&mut v, "data.tokenizer={hf: EleutherAI/pythia-70m}").unwrap();
        assert_eq!(v["attention"]["window"].as_u64(), Some(64));
        assert_eq!(v["attention"]["kind"].as_str(), Some("dar"));
        assert_eq!(v["train"]["betas"][1].as_f64(), Some(0.99));
        assert_eq!(v["data"]["tokenizer"]["hf"].as_str(), Some("EleutherAI/pythia-70m"));
        assert!(apply_override(&mut v, "attention.kind.x=1").is_err());
        assert!(apply_override(&mut v, "novalue").is_err());
    }
}
