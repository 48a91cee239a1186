//! Test helpers: the shared data folder's files, from `$ATTNLAB_SHARED`, `../shared` beside the
//! crate, or the gzip'd copies vendored in `tests/fixtures/shared` (so a clean clone tests alone).
use std::io::Read;
use std::path::PathBuf;

/// Text of `rel` (e.g. `data/tokenizers/gpt-neox-20b.json`) from the first root that has it, plain or
/// as `rel.gz`; panics naming every place searched when none has it.
pub fn shared_text(rel: &str) -> String {
    let mut roots: Vec<PathBuf> = std::env::var_os("ATTNLAB_SHARED").map(PathBuf::from).into_iter().collect();
    roots.push(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared")));
    roots.push(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/shared")));
    let mut tried = Vec::new();
    for root in roots {
        let plain = root.join(rel);
        if let Ok(s) = std::fs::read_to_string(&plain) {
            return s;
        }
        let gz = root.join(format!("{rel}.gz"));
        if let Ok(f) = std::fs::File::open(&gz) {
            let mut s = String::new();
            flate2::read::GzDecoder::new(f).read_to_string(&mut s).unwrap_or_else(|e| panic!("{}: {e}", gz.display()));
            return s;
        }
        tried.push(plain.display().to_string());
    }
    panic!("test data `{rel}` not found; tried {tried:?} (and .gz); set ATTNLAB_SHARED to the shared folder");
}
