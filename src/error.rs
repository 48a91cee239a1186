//! The library's error type. Every variant says what went wrong and where (file, key path, line).
use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A validation failure: (dotted key path, message); the spec turns it into [`Error::Spec`] with the
/// file and line.
pub type Invalid = (String, String);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A spec value that parses but is not allowed (bad range, unknown name, inconsistent keys).
    #[error("{file}: `{key}`{line}: {msg}", line = line.map(|l| format!(" (line {l})")).unwrap_or_default())]
    Spec { file: String, key: String, line: Option<usize>, msg: String },
    /// YAML that does not fit the schema (unknown key, wrong type), with serde's location.
    #[error("{file}: {msg}")]
    Schema { file: String, msg: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("data: {0}")]
    Data(String),
    #[error("run directory {dir}: {msg}")]
    Run { dir: PathBuf, msg: String },
    #[error("training stopped at step {step}: {msg}")]
    Diverged { step: u64, msg: String },
    #[error("kernel: {0}")]
    Kernel(String),
    #[error("{0}")]
    Other(String),
    /// Another process holds the run directory's lock (train::lock): one writer at a time.
    #[error("run directory {dir} is in use by another attnlab process ({holder}); wait for it to end or stop it, then run again")]
    Busy { dir: PathBuf, holder: String },
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}

/// `.at(path)` on io results: attach the path the operation touched.
pub trait IoContext<T> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T> {
        self.map_err(|e| Error::io(path, e))
    }
}

impl From<serde_json::Error> for Error {
    fn from(e: serde_json::Error) -> Self {
        Error::Other(format!("json: {e}"))
    }
}
