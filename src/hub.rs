//! Downloads from the Hugging Face hub (feature `hub`), cached in the standard HF cache.
use crate::{Error, Result};
use std::path::PathBuf;

/// Split `owner/name` (a bare `name` has no owner).
fn split(repo: &str) -> (String, String) {
    match repo.split_once('/') {
        Some((o, n)) => (o.to_string(), n.to_string()),
        None => (String::new(), repo.to_string()),
    }
}

#[cfg(feature = "hub")]
fn client() -> Result<hf_hub::HFClientSync> {
    hf_hub::HFClientSync::new().map_err(|e| Error::Data(format!("hub client: {e}")))
}

/// A file of a model repository (e.g. tokenizer.json of EleutherAI/pythia-70m).
#[cfg(feature = "hub")]
pub fn model_file(repo: &str, file: &str) -> Result<PathBuf> {
    let (owner, name) = split(repo);
    client()?
        .model(owner, name)
        .download_file()
        .filename(file)
        .send()
        .map_err(|e| Error::Data(format!("hub model {repo}, file {file}: {e} (offline? give a local path instead)")))
}

/// A file of a dataset repository at an optional revision.
#[cfg(feature = "hub")]
pub fn dataset_file(repo: &str, revision: Option<&str>, file: &str) -> Result<PathBuf> {
    let (owner, name) = split(repo);
    client()?
        .dataset(owner, name)
        .download_file()
        .filename(file)
        .maybe_revision(revision.map(str::to_string))
        .send()
        .map_err(|e| Error::Data(format!("hub dataset {repo}, file {file}: {e} (offline? give a local path instead)")))
}

#[cfg(not(feature = "hub"))]
pub fn model_file(repo: &str, file: &str) -> Result<PathBuf> {
    let _ = split(repo);
    Err(Error::Data(format!("{repo}/{file}: this build has no hub support (feature `hub`); give a local path")))
}

#[cfg(not(feature = "hub"))]
pub fn dataset_file(repo: &str, _revision: Option<&str>, file: &str) -> Result<PathBuf> {
    Err(Error::Data(format!("{repo}/{file}: this build has no hub support (feature `hub`); give a local path")))
}
