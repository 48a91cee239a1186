//! Reading documents from a source: local files or directories (.txt, .jsonl[.zst|.gz], .json.gz,
//! .parquet), Hugging Face dataset files, or the synthetic corpus. One document = one file (.txt),
//! one JSON line / parquet row (field `field`), or one WikiText article (`format: wikitext`).
use super::wikitext;
use crate::spec::{LocalSource, SourceSpec, TextFormat};
use crate::{Error, IoContext, Result};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

/// A document plus the counts that word- and byte-level perplexity divide by (evaluation.md §2.1).
#[derive(Debug, Clone)]
pub struct Doc {
    pub text: String,
    pub words: usize,
    pub bytes: usize,
}

impl Doc {
    fn plain(text: String) -> Doc {
        Doc { words: wikitext::count_words(&text), bytes: text.len(), text }
    }
}

/// All documents of a source, in a deterministic order.
pub fn read_documents(src: &SourceSpec) -> Result<Vec<Doc>> {
    match src {
        SourceSpec::Synthetic { synthetic } => {
            let docs = match super::synthetic::Recall::of(synthetic) {
                Some(recall) => recall.documents(synthetic.seed, synthetic.docs),
                None => super::synthetic::documents(synthetic.seed, synthetic.docs),
            };
            Ok(docs.into_iter().map(Doc::plain).collect())
        }
        SourceSpec::Local(l) => read_local(l),
        SourceSpec::Needles { needles } => Ok(super::needles::documents(needles)?.into_iter().map(Doc::plain).collect()),
        SourceSpec::Mix { mix } => Ok(mix.iter().map(read_documents).collect::<Result<Vec<_>>>()?.concat()),
        SourceSpec::Megatron { megatron } => Err(Error::Data(format!("megatron source {}: token ids, not text documents; use it as data.train", megatron.bin.join(" + ")))),
        SourceSpec::Hub { hf } => {
            let mut docs = Vec::new();
            for f in &hf.files {
                let path = crate::hub::dataset_file(&hf.repo, hf.revision.as_deref(), f)?;
                docs.extend(read_file(&path, &hf.field, TextFormat::Text)?);
            }
            Ok(docs)
        }
    }
}

fn read_local(l: &LocalSource) -> Result<Vec<Doc>> {
    let mut docs = Vec::new();
    for f in list_files(&l.path)? {
        docs.extend(read_file(&f, &l.field, l.format)?);
    }
    if docs.is_empty() {
        return Err(Error::Data(format!("{}: no documents found", l.path.display())));
    }
    Ok(docs)
}

/// A file itself, every readable file below a directory, or the files of one directory whose names
/// match a `*` wildcard (`dir/train-*.jsonl.zst`); sorted by path.
pub fn list_files(path: &Path) -> Result<Vec<PathBuf>> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if name.contains('*') {
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
            .at(dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && wildcard(&name, &p.file_name().unwrap_or_default().to_string_lossy()))
            .collect();
        out.sort();
        if out.is_empty() {
            return Err(Error::Data(format!("{}: no file matches", path.display())));
        }
        return Ok(out);
    }
    let meta = std::fs::metadata(path).at(path)?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    files_below(path, |p| kind_of(p).is_some())
}

/// Every file below `dir` (recursively) that `keep` accepts, sorted by path.
pub fn files_below(dir: &Path, keep: impl Fn(&Path) -> bool) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).at(&dir)? {
            let p = entry.at(&dir)?.path();
            if p.is_dir() {
                stack.push(p);
            } else if keep(&p) {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// `*` matches any run of characters; everything else literally.
fn wildcard(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || !name[first.len()..].ends_with(last) || name.len() < first.len() + last.len() {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

#[derive(Debug, PartialEq)]
enum FileKind {
    Text,
    JsonLines,
    Parquet,
}

fn kind_of(p: &Path) -> Option<FileKind> {
    let name = p.file_name()?.to_string_lossy().to_lowercase();
    let stem = name.trim_end_matches(".zst").trim_end_matches(".gz");
    if stem.ends_with(".jsonl") || stem.ends_with(".json") {
        Some(FileKind::JsonLines)
    } else if stem.ends_with(".txt") || stem.ends_with(".raw") || stem.ends_with(".tokens") {
        Some(FileKind::Text)
    } else if name.ends_with(".parquet") {
        Some(FileKind::Parquet)
    } else {
        None
    }
}

/// A reader that undoes .zst / .gz compression by file name.
pub fn open(path: &Path) -> Result<Box<dyn Read>> {
    let f = std::fs::File::open(path).at(path)?;
    let name = path.to_string_lossy();
    Ok(if name.ends_with(".zst") {
        Box::new(zstd::stream::read::Decoder::new(f).at(path)?)
    } else if name.ends_with(".gz") {
        Box::new(flate2::read::MultiGzDecoder::new(f))
    } else {
        Box::new(f)
    })
}

fn read_file(path: &Path, field: &str, format: TextFormat) -> Result<Vec<Doc>> {
    let kind = kind_of(path).ok_or_else(|| Error::Data(format!("{}: unknown file type (want .txt, .jsonl[.zst|.gz], .json.gz, .parquet)", path.display())))?;
    let texts: Vec<String> = match kind {
        FileKind::Text => {
            let mut s = String::new();
            open(path)?.read_to_string(&mut s).at(path)?;
            vec![s]
        }
        FileKind::JsonLines => read_jsonl(path, field)?,
        FileKind::Parquet => read_parquet(path, field)?,
    };
    Ok(match format {
        TextFormat::Text => texts.into_iter().map(Doc::plain).collect(),
        TextFormat::Wikitext => texts
            .iter()
            .flat_map(|t| wikitext::wikitext_docs(t))
            .map(|d| Doc { text: d.text, words: d.words, bytes: d.bytes })
            .collect(),
    })
}

fn read_jsonl(path: &Path, field: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for (i, line) in BufReader::new(open(path)?).lines().enumerate() {
        let line = line.at(path)?;
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| Error::Data(format!("{}:{}: {e}", path.display(), i + 1)))?;
        let text = v.get(field).and_then(|t| t.as_str()).ok_or_else(|| Error::Data(format!("{}:{}: no string field `{field}`", path.display(), i + 1)))?;
        out.push(text.to_string());
    }
    Ok(out)
}

#[cfg(feature = "analysis")]
fn read_parquet(path: &Path, field: &str) -> Result<Vec<String>> {
    use polars::prelude::*;
    let err = |e: PolarsError| Error::Data(format!("{}: {e}", path.display()));
    let file = std::fs::File::open(path).at(path)?;
    let df = ParquetReader::new(file).with_columns(Some(vec![field.to_string()])).finish().map_err(err)?;
    let col = df.column(field).map_err(err)?.str().map_err(err)?.clone();
    Ok(col.iter().map(|s| s.unwrap_or("").to_string()).collect())
}

#[cfg(not(feature = "analysis"))]
fn read_parquet(path: &Path, _field: &str) -> Result<Vec<String>> {
    Err(Error::Data(format!("{}: parquet needs the `analysis` feature (polars); this is a lean build", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn wildcards_match_like_a_shell() {
        assert!(wildcard("train-*.jsonl.zst", "train-03.jsonl.zst"));
        assert!(!wildcard("train-*.jsonl.zst", "valid.jsonl.zst"));
        assert!(wildcard("*", "x") && wildcard("a*b*c", "aXbYc") && !wildcard("a*b*c", "aXcYb"));
        assert!(!wildcard("ab*ba", "aba"));
    }

    #[test]
    fn reads_jsonl_compressed_and_text_files() {
        let dir = tempfile::tempdir().unwrap();
        let jl = dir.path().join("a.jsonl.gz");
        let mut gz = flate2::write::GzEncoder::new(std::fs::File::create(&jl).unwrap(), flate2::Compression::fast());
        writeln!(gz, "{{\"text\": \"one two\"}}\n{{\"text\": \"three\"}}").unwrap();
        gz.finish().unwrap();
        std::fs::write(dir.path().join("b.txt"), " x  y ").unwrap();
        std::fs::write(dir.path().join("ignored.bin"), "zz").unwrap();
        let docs = read_documents(&SourceSpec::Local(LocalSource { path: dir.path().into(), field: "text".into(), format: TextFormat::Text })).unwrap();
        let texts: Vec<&str> = docs.iter().map(|d| d.text.as_str()).collect();
        assert_eq!(texts, ["one two", "three", " x  y "]);
        // Python's len(re.split(r"\s+", " x  y ")) = 4 (empty strings at both ends).
        assert_eq!((docs[2].words, docs[2].bytes), (4, 6));
        let bad = dir.path().join("c.jsonl");
        std::fs::write(&bad, "{\"body\": 1}\n").unwrap();
        let e = read_file(&bad, "text", TextFormat::Text).unwrap_err().to_string();
        assert!(e.contains("c.jsonl:1") && e.contains("`text`"), "{e}");
    }
}
