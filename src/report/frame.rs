//! All runs as one polars DataFrame: one row per (run, logged step), the run's config as columns
//! beside every metric column, written as runs.parquet for notebooks. A run that logged nothing
//! still gets one row (step null) so that it is visible. `recipe` excludes the seed (groups.rs), so
//! grouping by (recipe, kind, d_down, window, init) pools a configuration's seeds.
use super::groups;
use super::load::Run;
use crate::{Error, Result};
use polars::prelude::*;
use std::collections::BTreeSet;
use std::path::Path;

fn polars_err(e: PolarsError) -> Error {
    Error::Data(format!("polars: {e}"))
}

/// Build the DataFrame (metric columns sorted by name after the metadata columns).
pub fn build(runs: &[Run]) -> Result<DataFrame> {
    // (run index, step) of every output row.
    let mut keys: Vec<(usize, Option<u64>)> = Vec::new();
    for (i, r) in runs.iter().enumerate() {
        if r.rows.is_empty() {
            keys.push((i, None));
        }
        keys.extend(r.rows.keys().map(|&s| (i, Some(s))));
    }
    let metrics: BTreeSet<&String> = runs.iter().flat_map(|r| r.rows.values().flat_map(|row| row.keys())).collect();

    let text = |f: &dyn Fn(&Run) -> Option<String>| -> Vec<Option<String>> { keys.iter().map(|&(i, _)| f(&runs[i])).collect() };
    let int = |f: &dyn Fn(&Run) -> Option<i64>| -> Vec<Option<i64>> { keys.iter().map(|&(i, _)| f(&runs[i])).collect() };
    let config = |r: &Run| r.spec.attention.comparable();
    let mut cols = vec![
        Column::new("run".into(), text(&|r| Some(r.rel.clone()))),
        Column::new("name".into(), text(&|r| Some(r.name()))),
        Column::new("kind".into(), text(&|r| Some(r.spec.attention.kind().name().to_string()))),
        Column::new("d_down".into(), int(&|r| config(r).d_down_width().map(|d| d as i64))),
        Column::new("window".into(), int(&|r| config(r).window_len().map(|w| w as i64))),
        Column::new("init".into(), text(&|r| r.spec.attention.init().map(|i| i.name().to_string()))),
        Column::new("seed".into(), int(&|r| Some(r.spec.seed() as i64))),
        Column::new("dar_act".into(), text(&|r| serde_json::to_value(r.spec.attention.dar_act()).ok().and_then(|v| v.as_str().map(String::from)))),
        Column::new("flavor".into(), text(&|r| r.spec.model.flavor.map(groups::flavor_name))),
        Column::new("d_model".into(), int(&|r| Some(r.spec.shape().d_model as i64))),
        Column::new("layers".into(), int(&|r| Some(r.spec.shape().layers as i64))),
        Column::new("heads".into(), int(&|r| Some(r.spec.shape().heads as i64))),
        Column::new("seq_len".into(), int(&|r| Some(r.spec.seq_len() as i64))),
        Column::new("train_steps".into(), int(&|r| Some(r.steps() as i64))),
        Column::new("done".into(), keys.iter().map(|&(i, _)| runs[i].done).collect::<Vec<bool>>()),
        Column::new("scale".into(), text(&|r| Some(groups::scale(&r.spec)))),
        Column::new("recipe".into(), text(&|r| Some(groups::key_id(&groups::recipe_key(&r.spec))))),
        Column::new("step".into(), keys.iter().map(|&(_, s)| s.map(|s| s as i64)).collect::<Vec<Option<i64>>>()),
    ];
    for m in metrics {
        // Absent and NaN both read as null: "not logged / not a number at this step".
        let values: Vec<Option<f64>> = keys.iter().map(|&(i, s)| s.and_then(|s| runs[i].rows[&s].get(m.as_str())).copied().filter(|v| v.is_finite())).collect();
        cols.push(Column::new(m.as_str().into(), values));
    }
    DataFrame::new(keys.len(), cols).map_err(polars_err)
}

pub fn write_parquet(df: &mut DataFrame, path: &Path) -> Result<()> {
    let f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    ParquetWriter::new(f).finish(df).map_err(polars_err)?;
    Ok(())
}
