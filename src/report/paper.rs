//! The DAR paper's published numbers, read from data/papers/dar.csv (the only place they live; see
//! data/papers/README.md for their source). Compiled in so that the binary works from any directory.
use crate::spec::AttentionKind;
use crate::{Error, Result};
use std::collections::BTreeMap;

pub const DAR_CSV: &str = include_str!("../../data/papers/dar.csv");

/// Columns that describe a row; every other column is a corpus.
const META: [&str; 8] = ["table", "scale", "d_model", "model", "d_down", "window", "rel", "note"];

#[derive(Debug, Clone, PartialEq)]
pub struct PaperRow {
    pub table: u8,
    pub scale: String,
    pub d_model: usize,
    pub kind: AttentionKind,
    pub d_down: Option<usize>,
    pub window: Option<usize>,
    /// Paper corpus column → PPL.
    pub ppl: BTreeMap<String, f64>,
    /// Rel.(%) as reported (not recomputed).
    pub rel: f64,
    pub note: String,
}

/// Parse a paper CSV: a header line, then comma-separated rows (no quoting; notes hold no commas).
pub fn parse(text: &str) -> Result<Vec<PaperRow>> {
    let bad = |line: usize, msg: String| Error::Data(format!("data/papers/dar.csv line {line}: {msg}"));
    let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
    let (_, header) = lines.next().ok_or_else(|| bad(1, "empty file".into()))?;
    let cols: Vec<&str> = header.split(',').map(str::trim).collect();
    let mut rows = Vec::new();
    for (i, line) in lines {
        let cells: Vec<&str> = line.split(',').map(str::trim).collect();
        if cells.len() != cols.len() {
            return Err(bad(i + 1, format!("{} cells, header has {}", cells.len(), cols.len())));
        }
        let get = |name: &str| cols.iter().position(|c| *c == name).map(|p| cells[p]).unwrap_or("");
        let num = |name: &str| -> Result<Option<f64>> {
            let s = get(name);
            if s.is_empty() {
                return Ok(None);
            }
            s.parse::<f64>().map(Some).map_err(|_| bad(i + 1, format!("`{name}` = `{s}` is not a number")))
        };
        let need = |name: &str| num(name)?.ok_or_else(|| bad(i + 1, format!("`{name}` is empty")));
        let kind: AttentionKind =
            serde_yaml::from_str(get("model")).map_err(|_| bad(i + 1, format!("model `{}` is not vanilla, dar or uniform", get("model"))))?;
        let mut ppl = BTreeMap::new();
        for c in cols.iter().filter(|c| !META.contains(c)) {
            if let Some(v) = num(c)? {
                ppl.insert(c.to_string(), v);
            }
        }
        rows.push(PaperRow {
            table: need("table")? as u8,
            scale: get("scale").to_string(),
            d_model: need("d_model")? as usize,
            kind,
            d_down: num("d_down")?.map(|v| v as usize),
            window: num("window")?.map(|v| v as usize),
            ppl,
            rel: need("rel")?,
            note: get("note").to_string(),
        });
    }
    Ok(rows)
}

/// The DAR paper's rows.
pub fn dar() -> Result<Vec<PaperRow>> {
    parse(DAR_CSV)
}

/// Corpus names compare case-, '-' and '_'-insensitively. Any `wikitext*` corpus is the paper's
/// WikiText-103 column: WikiText-2 and WikiText-103 share their test set.
fn canonical(name: &str) -> String {
    let n: String = name.chars().filter(|c| c.is_ascii_alphanumeric()).map(|c| c.to_ascii_lowercase()).collect();
    if n.starts_with("wikitext") {
        "wikitext".into()
    } else {
        n
    }
}

/// The paper column our corpus `ours` corresponds to, if any.
pub fn paper_column<'a>(ours: &str, paper_columns: impl IntoIterator<Item = &'a String>) -> Option<String> {
    paper_columns.into_iter().find(|p| canonical(p) == canonical(ours)).cloned()
}

/// Display name of a paper column.
pub fn column_title(col: &str) -> &str {
    match col {
        "fineweb_edu" => "FineWeb-Edu",
        "c4" => "C4",
        "wikitext103" => "WikiText-103",
        other => other,
    }
}

pub const STILL_CSV: &str = include_str!("../../data/papers/still.csv");

/// A row of STILL's routing or component ablation (data/papers/still.csv).
#[derive(Debug, Clone, PartialEq)]
pub struct StillRow {
    /// `routing` or `component`.
    pub table: String,
    /// The paper's row name.
    pub variant: String,
    /// Our config keys (`attention.routing`, `.gate`, `.feature_map`) for that row.
    pub routing: String,
    pub gate: bool,
    pub feature_map: String,
    pub value: f64,
    pub metric: String,
    pub note: String,
}

/// Parse still.csv: a header, then rows of its 8 columns (no quoting; notes hold no commas).
pub fn parse_still(text: &str) -> Result<Vec<StillRow>> {
    const COLS: [&str; 8] = ["table", "variant", "routing", "gate", "feature_map", "value", "metric", "note"];
    let bad = |line: usize, msg: String| Error::Data(format!("data/papers/still.csv line {line}: {msg}"));
    let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
    let (_, header) = lines.next().ok_or_else(|| bad(1, "empty file".into()))?;
    if header.split(',').map(str::trim).collect::<Vec<_>>() != COLS {
        return Err(bad(1, format!("header must be {}", COLS.join(","))));
    }
    lines
        .map(|(i, line)| {
            let c: Vec<&str> = line.split(',').map(str::trim).collect();
            if c.len() != COLS.len() {
                return Err(bad(i + 1, format!("{} cells, header has {}", c.len(), COLS.len())));
            }
            let gate = c[3].parse::<bool>().map_err(|_| bad(i + 1, format!("gate `{}` is not true or false", c[3])))?;
            let value = c[5].parse::<f64>().map_err(|_| bad(i + 1, format!("value `{}` is not a number", c[5])))?;
            Ok(StillRow { table: c[0].into(), variant: c[1].into(), routing: c[2].into(), gate, feature_map: c[4].into(), value, metric: c[6].into(), note: c[7].into() })
        })
        .collect()
}

/// STILL's published ablation rows.
pub fn still() -> Result<Vec<StillRow>> {
    parse_still(STILL_CSV)
}
