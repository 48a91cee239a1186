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
    #[error("{file}: {msg}{forms}", forms = untagged_forms(msg))]
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
    #[error("{0}{forms}", forms = untagged_forms(.0))]
    Other(String),
    /// Another process holds the run directory's lock (train::lock): one writer at a time.
    #[error("run directory {dir} is in use by another attnlab process ({holder}); wait for it to end or stop it, then run again")]
    Busy { dir: PathBuf, holder: String },
}

/// serde's message for a value that fits none of an untagged enum's forms ("data did not match any
/// variant of untagged enum SourceSpec") says neither what the forms are nor which key it was at:
/// the forms, for the enums of the specs.
fn untagged_forms(msg: &str) -> String {
    const FORMS: [(&str, &str); 6] = [
        ("SourceSpec", "a text source is {path: FILE | DIR | GLOB}, {hf: {repo, files}}, {synthetic: {seed, docs}}, {needles: {...}}, {mix: [SOURCE, ...]} or {megatron: {...}}"),
        ("TrainData", "linearize's data.train is {alpaca: FILE | hf:OWNER/NAME}, a text source ({path: FILE}, {hf: {repo, files}}, {synthetic: {seed, docs}}, ...) or a list of these"),
        ("ChatSource", "conversations are {path: FILE | DIR, field: messages}, {hf: {repo, files}} or {alpaca: FILE}"),
        ("TokenizerSpec", "a tokenizer is `builtin`, a path to a tokenizer.json, or {hf: OWNER/NAME}"),
        ("RecallGap", "recall_gap is a number of tokens or a range [LO, HI]"),
        ("DeviceEntry", "a device is a GPU index or a name such as cuda:1 or cpu"),
    ];
    let named = |name: &str| msg.match_indices("untagged enum ").any(|(i, m)| msg[i + m.len()..].split(|c: char| !c.is_alphanumeric()).next() == Some(name));
    FORMS.iter().find(|(name, _)| named(name)).map_or_else(String::new, |(_, forms)| format!(" ({forms})"))
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

#[cfg(test)]
mod tests {
    /// A spec value that fits none of an untagged enum's forms is told the forms: a train spec's
    /// data source, linearize's training data, finetune's conversations.
    #[test]
    fn values_that_fit_no_form_are_told_the_forms() {
        let e = crate::spec::from_str("model: {flavor: tiny}\ndata:\n  train: {pth: x.jsonl}\ntrain: {steps: 1}\n", "t.yaml", &[]).unwrap_err().to_string();
        assert!(e.contains("SourceSpec") && e.contains("{path: FILE | DIR | GLOB}"), "{e}");
        let e = crate::linearize::LinearizeSpec::from_yaml("{teacher: t, attention: {kind: still}, data: {train: [{txt: a}]}, output: o}").unwrap_err().to_string();
        assert!(e.contains("{alpaca: FILE | hf:OWNER/NAME}"), "{e}");
        // Another message that mentions no such enum is left as it was.
        assert_eq!(super::untagged_forms("data did not match any variant of untagged enum SourceSpecs"), "");
        assert_eq!(super::untagged_forms("unknown field `pth`"), "");
    }
}
