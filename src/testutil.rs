//! Test helpers: locating the shared data folder (../shared, or $ATTNLAB_SHARED).
use std::path::PathBuf;

/// Path of `rel` inside the shared folder; panics with the places searched when it is missing.
pub fn shared(rel: &str) -> PathBuf {
    let mut tried = Vec::new();
    let mut roots: Vec<PathBuf> = std::env::var_os("ATTNLAB_SHARED").map(PathBuf::from).into_iter().collect();
    roots.push(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared")));
    for root in roots {
        let p = root.join(rel);
        if p.exists() {
            return p;
        }
        tried.push(p.display().to_string());
    }
    panic!("test data `{rel}` not found; tried {tried:?} (set ATTNLAB_SHARED to the shared folder)");
}
