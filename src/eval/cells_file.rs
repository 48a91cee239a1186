//! A run's long-context results file (ruler.json, babilong.json): a list of cells, one per
//! (task, length). A new evaluation replaces the cells it measured and keeps the others.
use super::ruler::Cell;
use crate::{Error, Result};
use std::path::Path;

/// Merge `cells` into the file at `path` (created when missing; an unreadable file starts empty).
pub fn merge(path: &Path, cells: &[Cell]) -> Result<()> {
    let mut all: Vec<Cell> = std::fs::read_to_string(path).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default();
    all.retain(|c| !cells.iter().any(|n| n.task == c.task && n.length == c.length));
    all.extend(cells.iter().cloned());
    std::fs::write(path, serde_json::to_string_pretty(&all)?).map_err(|e| Error::io(path, e))
}
