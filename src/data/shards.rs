//! Tokenized corpora on disk: `tokens-NNNNN.bin` (little-endian u16 ids, every document followed by
//! EOD) plus `index.json`. Training reads them through a memory map as one token stream.
use super::sources::Doc;
use super::{Tok, EOD};
use crate::{Error, IoContext, Result};
use memmap2::Mmap;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Tokens per shard file (128 Mi tokens = 256 MiB).
const SHARD_TOKENS: usize = 1 << 27;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Index {
    pub format: String,
    pub dtype: String,
    pub eod: u32,
    pub tokenizer: String,
    pub tokenizer_fingerprint: String,
    pub vocab_size: usize,
    pub source: String,
    pub n_docs: usize,
    pub n_tokens: usize,
    pub shards: Vec<ShardInfo>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShardInfo {
    pub file: String,
    pub tokens: usize,
}

/// Summary of a `prepare` call.
pub struct Prepared {
    pub dir: PathBuf,
    pub index: Index,
    pub seconds: f64,
}

/// Tokenize `docs` in parallel (rayon) with a progress bar and write shards + index.json into `out`
/// (written under a temporary name, then renamed, so a crash never leaves a half-written corpus).
pub fn prepare(docs: &[Doc], tok: &Tok, source: &str, out: &Path, quiet: bool) -> Result<Prepared> {
    if tok.vocab_size() > u16::MAX as usize + 1 {
        return Err(Error::Data(format!("tokenizer {} has {} ids; u16 shards hold at most 65536", tok.origin, tok.vocab_size())));
    }
    let start = std::time::Instant::now();
    let bar = crate::progress::bar(docs.len() as u64, "tokenizing", quiet);
    let encoded: Vec<Vec<u32>> = docs
        .par_iter()
        .map(|d| {
            let ids = tok.encode(&d.text);
            bar.inc(1);
            ids
        })
        .collect::<Result<_>>()?;
    bar.finish_and_clear();
    // A folder of this call's own: runs of one sweep on one machine prepare the same corpus at once.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = out.with_extension(format!("tmp-prepare-{}-{call}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).at(&tmp)?;
    let mut shards = Vec::new();
    let mut buf: Vec<u8> = Vec::with_capacity(2 * SHARD_TOKENS.min(1 << 24));
    let flush = |buf: &mut Vec<u8>, shards: &mut Vec<ShardInfo>| -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let file = format!("tokens-{:05}.bin", shards.len());
        let p = tmp.join(&file);
        std::fs::File::create(&p).and_then(|mut f| f.write_all(buf)).at(&p)?;
        shards.push(ShardInfo { file, tokens: buf.len() / 2 });
        buf.clear();
        Ok(())
    };
    let mut n_tokens = 0;
    for ids in &encoded {
        for &id in ids.iter().chain(std::iter::once(&EOD)) {
            buf.extend_from_slice(&(id as u16).to_le_bytes());
            if buf.len() / 2 == SHARD_TOKENS {
                flush(&mut buf, &mut shards)?;
            }
        }
        n_tokens += ids.len() + 1;
    }
    flush(&mut buf, &mut shards)?;
    let index = Index {
        format: "attnlab-shards-v1".into(),
        dtype: "u16".into(),
        eod: EOD,
        tokenizer: tok.origin.clone(),
        tokenizer_fingerprint: tok.fingerprint.clone(),
        vocab_size: tok.vocab_size(),
        source: source.to_string(),
        n_docs: docs.len(),
        n_tokens,
        shards,
    };
    let ip = tmp.join("index.json");
    std::fs::write(&ip, serde_json::to_string_pretty(&index)?).at(&ip)?;
    let complete = |d: &Path| d.join("index.json").exists();
    if !complete(out) {
        // A leftover without its index (never a finished corpus: those arrive by one rename).
        let _ = std::fs::remove_dir_all(out);
    }
    if let Some(parent) = out.parent() {
        std::fs::create_dir_all(parent).at(parent)?;
    }
    if let Err(e) = std::fs::rename(&tmp, out) {
        let _ = std::fs::remove_dir_all(&tmp);
        // Another process finished the same corpus first (same inputs, same bytes): use its copy.
        if !complete(out) {
            return Err(e).at(out);
        }
    }
    Ok(Prepared { dir: out.to_path_buf(), index, seconds: start.elapsed().as_secs_f64() })
}

/// All shards of a prepared corpus as one read-only token stream.
pub struct TokenStream {
    pub index: Index,
    maps: Vec<Mmap>,
    /// Start offset of each shard in the stream.
    starts: Vec<usize>,
}

impl TokenStream {
    pub fn open(dir: &Path) -> Result<TokenStream> {
        let ip = dir.join("index.json");
        let text = std::fs::read_to_string(&ip).at(&ip)?;
        let index: Index = serde_json::from_str(&text).map_err(|e| Error::Data(format!("{}: {e}", ip.display())))?;
        if index.dtype != "u16" {
            return Err(Error::Data(format!("{}: dtype {} is not supported", ip.display(), index.dtype)));
        }
        let (mut maps, mut starts, mut at) = (Vec::new(), Vec::new(), 0);
        for s in &index.shards {
            let p = dir.join(&s.file);
            let f = std::fs::File::open(&p).at(&p)?;
            // SAFETY: shard files are written once (then renamed into place) and never modified.
            let m = unsafe { Mmap::map(&f) }.at(&p)?;
            if m.len() != 2 * s.tokens {
                return Err(Error::Data(format!("{}: {} bytes, index says {} tokens", p.display(), m.len(), s.tokens)));
            }
            maps.push(m);
            starts.push(at);
            at += s.tokens;
        }
        Ok(TokenStream { index, maps, starts })
    }

    pub fn len(&self) -> usize {
        self.index.n_tokens
    }

    pub fn is_empty(&self) -> bool {
        self.index.n_tokens == 0
    }

    /// Tokens `[start, start + n)` of the stream, as i64 (may cross shard boundaries).
    pub fn read(&self, start: usize, n: usize, out: &mut Vec<i64>) {
        assert!(start + n <= self.len(), "read past the end of the token stream");
        let mut pos = start;
        while pos < start + n {
            let s = self.starts.partition_point(|&x| x <= pos) - 1;
            let local = pos - self.starts[s];
            let take = (self.index.shards[s].tokens - local).min(start + n - pos);
            let bytes = &self.maps[s][2 * local..2 * (local + take)];
            out.extend(bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as i64));
            pos += take;
        }
    }
}

impl super::batches::TokenSource for TokenStream {
    fn len(&self) -> usize {
        TokenStream::len(self)
    }
    fn read(&self, start: usize, n: usize, out: &mut Vec<i64>) {
        TokenStream::read(self, start, n, out)
    }
}

/// Shards for a training source: a prepared directory as is, otherwise tokenized once into
/// `cache/<hash of source + tokenizer>/` and reused by every later run.
pub fn ensure_prepared(src: &crate::spec::SourceSpec, tok: &Tok, cache: &Path, quiet: bool) -> Result<PathBuf> {
    if let crate::spec::SourceSpec::Local(l) = src {
        if l.path.join("index.json").is_file() {
            return Ok(l.path.clone());
        }
    }
    let key = serde_json::to_string(src)?;
    let hash = crate::util::short_hash(&format!("{key}|{}", tok.fingerprint));
    let dir = cache.join(hash);
    if dir.join("index.json").is_file() {
        return Ok(dir);
    }
    let docs = super::sources::read_documents(src)?;
    let p = prepare(&docs, tok, &key, &dir, quiet)?;
    if !quiet {
        eprintln!("prepared {} documents, {} tokens in {:.1}s → {}", p.index.n_docs, p.index.n_tokens, p.seconds, dir.display());
    }
    Ok(dir)
}

/// `attnlab data prepare`: the documents of `source` (a file or folder; `field` is the JSON /
/// parquet text field, `format` `text` or `wikitext`) or of `synthetic` documents of the built-in
/// corpus (exactly one of the two), tokenized with `tokenizer` (`super::tokenizer::spec_from_arg`)
/// into shards in `out`.
pub fn prepare_source(source: Option<&Path>, synthetic: Option<usize>, tokenizer: &str, field: &str, format: &str, out: &Path) -> Result<Prepared> {
    use crate::spec::{LocalSource, SourceSpec, SyntheticSpec, TextFormat};
    let format: TextFormat = serde_yaml::from_str(format).map_err(|e| Error::Other(format!("--format `{format}`: want text or wikitext ({e})")))?;
    let src = match (synthetic, source) {
        (Some(n), None) => SourceSpec::Synthetic { synthetic: SyntheticSpec { seed: 1, docs: n, recall_gap: None, recall_facts: None } },
        (None, Some(p)) => SourceSpec::Local(LocalSource { path: p.to_path_buf(), field: field.to_string(), format }),
        _ => return Err(Error::Other("give either a SOURCE path or --synthetic N".into())),
    };
    let tok = Tok::load(&super::tokenizer::spec_from_arg(tokenizer))?;
    let docs = super::sources::read_documents(&src)?;
    prepare(&docs, &tok, &serde_json::to_string(&src)?, out, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prepare_source_wants_exactly_one_source_and_a_known_format() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("c");
        let p = prepare_source(None, Some(5), "builtin", "text", "text", &out).unwrap();
        assert_eq!(p.index.n_docs, 5);
        let e = prepare_source(Some(Path::new("x.txt")), Some(5), "builtin", "text", "text", &out).err().unwrap().to_string();
        assert!(e.contains("either a SOURCE path or --synthetic"), "{e}");
        let e = prepare_source(None, Some(5), "builtin", "text", "markdown", &out).err().unwrap().to_string();
        assert!(e.contains("--format `markdown`"), "{e}");
    }

    /// Several preparations of one corpus at once (the runs of a sweep on one GPU) all succeed and
    /// leave one readable corpus; before, they shared one temporary folder and removed each other's.
    #[test]
    fn concurrent_preparations_of_one_corpus_all_succeed() {
        let tok = Tok::from_json(&super::super::tokenizer::builtin_json(), "builtin").unwrap();
        let docs: Vec<Doc> = (0..400).map(|i| Doc { text: format!("oslo lima red {i} the tree"), words: 0, bytes: 0 }).collect();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("c");
        let results: Vec<Result<Prepared>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..6).map(|_| s.spawn(|| prepare(&docs, &tok, "test", &out, true))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in &results {
            assert!(r.is_ok(), "{:?}", r.as_ref().err().map(|e| e.to_string()));
        }
        let s = TokenStream::open(&out).unwrap();
        assert_eq!(s.len(), results[0].as_ref().unwrap().index.n_tokens);
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(leftovers, vec![std::ffi::OsString::from("c")], "temporary folders left behind");
    }

    #[test]
    fn prepare_then_read_back_across_shards() {
        let tok = Tok::from_json(&super::super::tokenizer::builtin_json(), "builtin").unwrap();
        let docs: Vec<Doc> = ["oslo lima", "red", "the tree"].iter().map(|t| Doc { text: t.to_string(), words: 0, bytes: 0 }).collect();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("c");
        let p = prepare(&docs, &tok, "test", &out, true).unwrap();
        assert_eq!((p.index.n_docs, p.index.n_tokens), (3, 2 + 1 + 1 + 1 + 2 + 1));
        let s = TokenStream::open(&out).unwrap();
        let mut got = Vec::new();
        s.read(0, s.len(), &mut got);
        let want: Vec<i64> = [tok.encode("oslo lima").unwrap(), vec![0], tok.encode("red").unwrap(), vec![0], tok.encode("the tree").unwrap(), vec![0]]
            .concat()
            .into_iter()
            .map(i64::from)
            .collect();
        assert_eq!(got, want);
    }
}
