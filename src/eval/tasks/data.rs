//! Task documents: JSON objects read from JSON Lines, JSON arrays or parquet files laid out as the
//! Hugging Face datasets are (one row per document, the dataset's own column names), from a local
//! path or from a hub dataset repository.
use super::{DatasetDef, SplitDef};
use crate::{Error, IoContext, Result};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

/// Every record of one file (.jsonl / .json, optionally .gz or .zst; .parquet).
pub fn read_records(path: &Path) -> Result<Vec<Value>> {
    let name = path.to_string_lossy().to_lowercase();
    if name.ends_with(".parquet") {
        return read_parquet(path);
    }
    let stem = name.trim_end_matches(".gz").trim_end_matches(".zst");
    if !(stem.ends_with(".jsonl") || stem.ends_with(".json")) {
        return Err(Error::Data(format!("{}: unknown task file type (want .jsonl, .json, .parquet)", path.display())));
    }
    let mut text = String::new();
    BufReader::new(crate::data::sources::open(path)?).read_to_string(&mut text).at(path)?;
    if text.trim_start().starts_with('[') {
        let v: Value = serde_json::from_str(&text).map_err(|e| Error::Data(format!("{}: {e}", path.display())))?;
        return Ok(v.as_array().cloned().unwrap_or_default());
    }
    let mut out = Vec::new();
    for (i, line) in text.as_bytes().lines().enumerate() {
        let line = line.at(path)?;
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(&line).map_err(|e| Error::Data(format!("{}:{}: {e}", path.display(), i + 1)))?;
        if !v.is_object() {
            return Err(Error::Data(format!("{}:{}: not a JSON object", path.display(), i + 1)));
        }
        out.push(v);
    }
    Ok(out)
}

#[cfg(feature = "analysis")]
fn read_parquet(path: &Path) -> Result<Vec<Value>> {
    use polars::prelude::*;
    let err = |e: PolarsError| Error::Data(format!("{}: {e}", path.display()));
    let file = std::fs::File::open(path).at(path)?;
    let mut df = ParquetReader::new(file).finish().map_err(err)?;
    // Rows as JSON lines: nested list / struct columns (MMLU choices, CSQA choices) keep their shape.
    let mut buf = Vec::new();
    JsonWriter::new(&mut buf).with_json_format(JsonFormat::JsonLines).finish(&mut df).map_err(err)?;
    buf.lines().map(|l| serde_json::from_str(&l.at(path)?).map_err(|e| Error::Data(format!("{}: {e}", path.display())))).collect()
}

#[cfg(not(feature = "analysis"))]
fn read_parquet(path: &Path) -> Result<Vec<Value>> {
    Err(Error::Data(format!("{}: parquet needs the `analysis` feature (polars); convert to JSON Lines", path.display())))
}

fn is_task_file(p: &Path) -> bool {
    let n = p.file_name().map(|n| n.to_string_lossy().to_lowercase()).unwrap_or_default();
    let stem = n.trim_end_matches(".gz").trim_end_matches(".zst");
    stem.ends_with(".jsonl") || stem.ends_with(".json") || n.ends_with(".parquet")
}

/// Files below `dir` (recursively) whose name starts with the split's name: `test.jsonl`,
/// `test-00000-of-00001.parquet`, `dev.json`.
fn split_files(dir: &Path, split: &str) -> Result<Vec<PathBuf>> {
    crate::data::sources::files_below(dir, |p| is_task_file(p) && p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(split)))
}

/// The documents of one split. `data`: None (the task's hub dataset), `hf:OWNER/NAME` (another hub
/// repository with the same files), a directory (files named after the split, searched
/// recursively), or a file (the evaluation split itself; other splits come from its directory).
pub fn load_split(def: &DatasetDef, split: &SplitDef, data: Option<&str>, is_eval: bool) -> Result<Vec<Value>> {
    let hub_repo = match data {
        None => Some(def.hf.clone().ok_or_else(|| Error::Data(format!("split `{}`: the task names no hub dataset; give --data PATH", split.name)))?),
        Some(d) => d.strip_prefix("hf:").map(str::to_string),
    };
    let files: Vec<PathBuf> = match hub_repo {
        Some(repo) => {
            if split.files.is_empty() {
                return Err(Error::Data(format!("split `{}`: the task lists no hub files; give --data PATH", split.name)));
            }
            split.files.iter().map(|f| crate::hub::dataset_file(&repo, def.revision.as_deref(), f)).collect::<Result<_>>()?
        }
        None => {
            let p = Path::new(data.expect("local"));
            if p.is_file() {
                if is_eval {
                    vec![p.to_path_buf()]
                } else {
                    split_files(p.parent().unwrap_or(Path::new(".")), &split.name)?
                }
            } else if p.is_dir() {
                split_files(p, &split.name)?
            } else {
                return Err(Error::Data(format!("--data {}: no such file or directory", p.display())));
            }
        }
    };
    if files.is_empty() {
        return Err(Error::Data(format!(
            "no files for split `{}` under {} (want names starting with `{}`: .jsonl, .json, .parquet)",
            split.name,
            data.unwrap_or("?"),
            split.name
        )));
    }
    let mut docs = Vec::new();
    for f in &files {
        docs.extend(read_records(f)?);
    }
    Ok(docs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Parquet rows come back as JSON objects with list columns intact (MMLU's `choices`).
    #[cfg(feature = "analysis")]
    #[test]
    fn parquet_rows_keep_nested_lists() {
        use polars::prelude::*;
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("test-00000-of-00001.parquet");
        let choices = Series::new("choices".into(), [Series::new("".into(), ["a", "b"]), Series::new("".into(), ["c", "d"])]);
        let mut df = DataFrame::new(2, vec![
            Column::new("question".into(), ["q1", "q2"]),
            Column::from(choices),
            Column::new("answer".into(), [1i64, 0]),
        ])
        .unwrap();
        ParquetWriter::new(std::fs::File::create(&path).unwrap()).finish(&mut df).unwrap();
        let rows = read_records(&path).unwrap();
        assert_eq!(rows, vec![json!({"question": "q1", "choices": ["a", "b"], "answer": 1}), json!({"question": "q2", "choices": ["c", "d"], "answer": 0})]);
        // Found by split name in a folder.
        let def = DatasetDef { hf: None, revision: None, eval: SplitDef { name: "test".into(), files: vec![] }, fewshot: None };
        assert_eq!(load_split(&def, &def.eval, Some(tmp.path().to_str().unwrap()), true).unwrap().len(), 2);
        let e = load_split(&def, &SplitDef { name: "dev".into(), files: vec![] }, Some(tmp.path().to_str().unwrap()), false).unwrap_err().to_string();
        assert!(e.contains("split `dev`"), "{e}");
    }
}
