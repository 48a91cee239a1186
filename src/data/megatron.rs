//! Megatron's MMapIndexedDataset (`.bin` + `.idx`), read in place through memory maps: what
//! GPT-NeoX and Megatron-LM train from, and how EleutherAI publishes the Pile in Pythia's order.
//!
//! `.idx` layout (little-endian; megatron-core `indexed_dataset.py`):
//! ```text
//! b"MMIDIDX\x00\x00"   9 bytes magic
//! u64 version          = 1
//! u8  dtype code       1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f64, 7 f32, 8 u16
//! u64 sequence_count   S
//! u64 document_count   D (= documents + 1: the list starts with 0)
//! i32 sizes[S]         tokens per sequence
//! i64 pointers[S]      byte offset of each sequence in the .bin
//! i64 doc_idx[D]       document d = sequences doc_idx[d] .. doc_idx[d+1]
//! (i8 modes[S]         multimodal datasets only)
//! ```
//! `.bin` = the sequences' tokens back to back, in the dtype of the header. Without an index a
//! `.bin` is read as one flat token stream (Pythia's batch viewer: sample i = tokens
//! [i·2049, (i+1)·2049)). Several files are consecutive pieces of one `.bin` (Pythia's 20 shards).
use super::batches::TokenSource;
use crate::spec::MegatronSource;
use crate::{Error, IoContext, Result};
use memmap2::Mmap;
use std::path::{Path, PathBuf};

pub const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// Bytes before the sizes array.
const HEADER: usize = 9 + 8 + 1 + 8 + 8;

pub use crate::spec::MegatronDType as DType;

/// One token id of `dtype` from its little-endian bytes.
fn decode(dtype: DType, b: &[u8]) -> i64 {
    match dtype {
        DType::U8 => b[0] as i64,
        DType::I8 => b[0] as i8 as i64,
        DType::I16 => i16::from_le_bytes([b[0], b[1]]) as i64,
        DType::U16 => u16::from_le_bytes([b[0], b[1]]) as i64,
        DType::I32 => i32::from_le_bytes(b[..4].try_into().expect("4 bytes")) as i64,
        DType::I64 => i64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
    }
}

fn u64_at(m: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(m[at..at + 8].try_into().expect("8 bytes"))
}

fn map(path: &Path) -> Result<Mmap> {
    let f = std::fs::File::open(path).at(path)?;
    // SAFETY: datasets are read-only inputs; nothing in attnlab writes them while training.
    unsafe { Mmap::map(&f) }.at(path)
}

/// A parsed `.idx`: the header plus the three arrays, read from the map on demand (the Pile's index
/// is 1.7 GB; nothing is copied).
pub struct Index {
    pub path: PathBuf,
    pub dtype: DType,
    pub sequences: usize,
    /// Entries of doc_idx (documents + 1).
    pub doc_entries: usize,
    map: Mmap,
}

impl Index {
    pub fn open(path: &Path) -> Result<Index> {
        let map = map(path)?;
        let bad = |msg: String| Error::Data(format!("{}: {msg}", path.display()));
        if map.len() < HEADER {
            return Err(bad(format!("{} bytes: too short for a Megatron index header ({HEADER} bytes)", map.len())));
        }
        if &map[..9] != MAGIC {
            return Err(bad(format!("not a Megatron MMapIndexedDataset index: magic {:?}, want {:?}", String::from_utf8_lossy(&map[..9]), String::from_utf8_lossy(MAGIC))));
        }
        let version = u64_at(&map, 9);
        if version != 1 {
            return Err(bad(format!("index version {version}; only version 1 is known")));
        }
        let dtype = DType::from_code(map[17]).map_err(bad)?;
        let (sequences, doc_entries) = (u64_at(&map, 18) as usize, u64_at(&map, 26) as usize);
        let need = HEADER as u128 + 12 * sequences as u128 + 8 * doc_entries as u128;
        // The optional multimodal modes follow: exactly one byte per sequence.
        if (map.len() as u128) != need && (map.len() as u128) != need + sequences as u128 {
            return Err(bad(format!("{} bytes, but its header ({sequences} sequences, {doc_entries} document entries) needs {need}", map.len())));
        }
        let idx = Index { path: path.to_path_buf(), dtype, sequences, doc_entries, map };
        if doc_entries > 0 && (idx.doc_idx(0) != 0 || idx.doc_idx(doc_entries - 1) as u64 != sequences as u64) {
            return Err(bad(format!("document index runs {}..{}, want 0..{sequences}", idx.doc_idx(0), idx.doc_idx(doc_entries - 1))));
        }
        if let Some(d) = (1..doc_entries).find(|&d| idx.doc_idx(d) < idx.doc_idx(d - 1)) {
            return Err(bad(format!("document index entry {d} is {}, below entry {} ({}): documents are runs of sequences in order", idx.doc_idx(d), d - 1, idx.doc_idx(d - 1))));
        }
        if let Some(s) = (0..sequences).find(|&s| idx.size_raw(s) < 0) {
            return Err(bad(format!("sequence {s} has {} tokens", idx.size_raw(s))));
        }
        Ok(idx)
    }

    fn size_raw(&self, i: usize) -> i32 {
        let at = HEADER + 4 * i;
        i32::from_le_bytes(self.map[at..at + 4].try_into().expect("4 bytes"))
    }

    /// Tokens of sequence `i` (never negative: checked by `open`).
    pub fn size(&self, i: usize) -> usize {
        self.size_raw(i) as usize
    }

    /// Byte offset of sequence `i` in the `.bin`.
    pub fn pointer(&self, i: usize) -> u64 {
        u64_at(&self.map, HEADER + 4 * self.sequences + 8 * i)
    }

    pub fn doc_idx(&self, d: usize) -> i64 {
        u64_at(&self.map, HEADER + 12 * self.sequences + 8 * d) as i64
    }

    pub fn documents(&self) -> usize {
        self.doc_entries.saturating_sub(1)
    }
}

/// One or more files read as the consecutive pieces of one byte string.
struct Pieces {
    files: Vec<PathBuf>,
    maps: Vec<Mmap>,
    /// Byte offset of each piece.
    starts: Vec<u64>,
    len: u64,
}

impl Pieces {
    fn open(files: &[PathBuf]) -> Result<Pieces> {
        let (mut maps, mut starts, mut len) = (Vec::new(), Vec::new(), 0u64);
        for f in files {
            let m = map(f)?;
            starts.push(len);
            len += m.len() as u64;
            maps.push(m);
        }
        Ok(Pieces { files: files.to_vec(), maps, starts, len })
    }

    fn names(&self) -> String {
        self.files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(" + ")
    }

    /// Call `f` on the byte ranges covering [start, start + n) in order (ranges may cross pieces).
    fn each(&self, start: u64, n: u64, mut f: impl FnMut(&[u8])) {
        let mut pos = start;
        while pos < start + n {
            let p = self.starts.partition_point(|&s| s <= pos) - 1;
            let local = (pos - self.starts[p]) as usize;
            let take = ((self.maps[p].len() - local) as u64).min(start + n - pos) as usize;
            f(&self.maps[p][local..local + take]);
            pos += take as u64;
        }
    }
}

/// A `.bin` (in pieces), with or without its index, as a token stream.
pub struct MegatronData {
    pub index: Option<Index>,
    pub dtype: DType,
    bin: Pieces,
    /// Stream range in bytes: [first, first + tokens·size).
    first: u64,
    tokens: usize,
}

impl MegatronData {
    /// Open `bin` pieces with an optional index (`dtype` applies without one; with one it must
    /// agree with the header, when given).
    pub fn open(bin: &[PathBuf], idx: Option<&Path>, dtype: Option<DType>) -> Result<MegatronData> {
        let pieces = Pieces::open(bin)?;
        if let Some(i) = pieces.maps.iter().position(|m| m.len() >= MAGIC.len() && &m[..MAGIC.len()] == MAGIC) {
            return Err(Error::Data(format!("{}: a Megatron index (.idx), not token data; name it as `idx` and its .bin as `bin`", pieces.files[i].display())));
        }
        let index = idx.map(Index::open).transpose()?;
        let dtype = match (&index, dtype) {
            (Some(i), Some(d)) if i.dtype != d => {
                return Err(Error::Data(format!("{}: the index header says dtype {:?}, the spec says {:?}", i.path.display(), i.dtype, d)));
            }
            (Some(i), _) => i.dtype,
            (None, d) => d.unwrap_or(DType::U16),
        };
        let (first, tokens) = match &index {
            None => {
                if pieces.len % dtype.size() as u64 != 0 {
                    return Err(Error::Data(format!("{}: {} bytes is not a whole number of {dtype:?} tokens", pieces.names(), pieces.len)));
                }
                (0, (pieces.len / dtype.size() as u64) as usize)
            }
            Some(i) => {
                // The training stream is the sequences back to back (the builder writes them so).
                let first = if i.sequences > 0 { i.pointer(0) } else { 0 };
                let mut end = first;
                for s in 0..i.sequences {
                    if i.pointer(s) != end {
                        return Err(Error::Data(format!(
                            "{}: sequence {s} starts at byte {}, not where sequence {} ends (byte {end}); only contiguous data is supported",
                            i.path.display(),
                            i.pointer(s),
                            s.wrapping_sub(1)
                        )));
                    }
                    // At most 2^31 tokens of at most 8 bytes each: only the sum can overflow.
                    end = end.checked_add((i.size(s) * dtype.size()) as u64).ok_or_else(|| Error::Data(format!("{}: sequence {s} ends past byte 2^64", i.path.display())))?;
                }
                if first != 0 || end < pieces.len {
                    return Err(Error::Data(format!(
                        "{}: its sequences cover bytes {first}..{end} of {}, which has {} bytes: the index and the .bin do not belong together",
                        i.path.display(),
                        pieces.names(),
                        pieces.len
                    )));
                }
                if end > pieces.len {
                    return Err(Error::Data(format!(
                        "{}: {} bytes, shorter than its index {} says ({end} bytes for {} sequences); is a piece missing?",
                        pieces.names(),
                        pieces.len,
                        i.path.display(),
                        i.sequences
                    )));
                }
                (first, ((end - first) / dtype.size() as u64) as usize)
            }
        };
        Ok(MegatronData { index, dtype, bin: pieces, first, tokens })
    }

    /// The files a spec's source names, downloaded through the hub (cached) when it names a repo.
    pub fn from_spec(src: &MegatronSource) -> Result<MegatronData> {
        let resolve = |name: &str| -> Result<PathBuf> {
            match &src.hf {
                Some(repo) => crate::hub::dataset_file(repo, src.revision.as_deref(), name),
                None => Ok(PathBuf::from(name)),
            }
        };
        let bins = src.bin.iter().map(|b| resolve(b)).collect::<Result<Vec<_>>>()?;
        let idx = src.idx.as_deref().map(resolve).transpose()?;
        let dtype = src.dtype.as_deref().map(|d| DType::from_name(d).ok_or_else(|| Error::Data(format!("megatron.dtype `{d}` is not one of u8, i8, i16, u16, i32, i64")))).transpose()?;
        MegatronData::open(&bins, idx.as_deref(), dtype)
    }

    fn read_bytes(&self, byte: u64, n: usize, out: &mut Vec<i64>) {
        let size = self.dtype.size();
        // A token split across two pieces is put together from `carry`.
        let mut carry: Vec<u8> = Vec::new();
        self.bin.each(byte, (n * size) as u64, |mut b| {
            if !carry.is_empty() {
                let take = (size - carry.len()).min(b.len());
                carry.extend_from_slice(&b[..take]);
                b = &b[take..];
                if carry.len() == size {
                    out.push(decode(self.dtype, &carry));
                    carry.clear();
                }
            }
            let whole = b.len() / size * size;
            out.extend(b[..whole].chunks_exact(size).map(|c| decode(self.dtype, c)));
            carry.extend_from_slice(&b[whole..]);
        });
    }

    /// Tokens of sequence `i` of the index.
    pub fn sequence(&self, i: usize) -> Result<Vec<i64>> {
        let idx = self.index.as_ref().ok_or_else(|| Error::Data("a .bin without index has no sequences".into()))?;
        if i >= idx.sequences {
            return Err(Error::Data(format!("{}: sequence {i} of {}", idx.path.display(), idx.sequences)));
        }
        let mut out = Vec::with_capacity(idx.size(i));
        self.read_bytes(idx.pointer(i), idx.size(i), &mut out);
        Ok(out)
    }

    /// Tokens of document `d` (its sequences back to back).
    pub fn document(&self, d: usize) -> Result<Vec<i64>> {
        let idx = self.index.as_ref().ok_or_else(|| Error::Data("a .bin without index has no documents".into()))?;
        if d >= idx.documents() {
            return Err(Error::Data(format!("{}: document {d} of {}", idx.path.display(), idx.documents())));
        }
        let mut out = Vec::new();
        for s in idx.doc_idx(d) as usize..idx.doc_idx(d + 1) as usize {
            out.extend(self.sequence(s)?);
        }
        Ok(out)
    }
}

impl TokenSource for MegatronData {
    fn len(&self) -> usize {
        self.tokens
    }

    fn read(&self, start: usize, n: usize, out: &mut Vec<i64>) {
        assert!(start + n <= self.tokens, "read past the end of the token stream");
        self.read_bytes(self.first + (start * self.dtype.size()) as u64, n, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/megatron")).join(name)
    }

    /// The documents the fixture script gave megatron-core's IndexedDatasetBuilder.
    fn expected() -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap()
    }

    #[test]
    fn reads_megatron_core_fixture_documents_exactly() {
        let want = expected();
        for set in want["datasets"].as_array().unwrap() {
            let prefix = set["prefix"].as_str().unwrap();
            let d = MegatronData::open(&[fixture(&format!("{prefix}.bin"))], Some(fixture(&format!("{prefix}.idx")).as_path()), None).unwrap();
            assert_eq!(d.dtype.code() as u64, set["dtype_code"].as_u64().unwrap(), "{prefix}");
            let docs = set["documents"].as_array().unwrap();
            let idx = d.index.as_ref().unwrap();
            assert_eq!(idx.documents(), docs.len(), "{prefix}");
            let mut stream = Vec::new();
            for (i, doc) in docs.iter().enumerate() {
                let got = d.document(i).unwrap();
                let w: Vec<i64> = doc.as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
                assert_eq!(got, w, "{prefix} document {i}");
                stream.extend(w);
            }
            // Sequences as megatron-core itself read them back (IndexedDataset[i]).
            for (i, seq) in set["sequences"].as_array().unwrap().iter().enumerate() {
                let w: Vec<i64> = seq.as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
                assert_eq!(d.sequence(i).unwrap(), w, "{prefix} sequence {i}");
            }
            let mut all = Vec::new();
            d.read(0, d.len(), &mut all);
            assert_eq!(all, stream, "{prefix}: the stream is the documents back to back");
        }
    }

    #[test]
    fn flat_bin_in_pieces_is_one_stream() {
        let set = &expected()["datasets"][0];
        let prefix = set["prefix"].as_str().unwrap();
        let bytes = std::fs::read(fixture(&format!("{prefix}.bin"))).unwrap();
        let whole = MegatronData::open(&[fixture(&format!("{prefix}.bin"))], None, Some(DType::from_code(set["dtype_code"].as_u64().unwrap() as u8).unwrap())).unwrap();
        let dir = tempfile::tempdir().unwrap();
        // Cut inside a token: the reader puts it back together.
        let (a, b) = bytes.split_at(13);
        std::fs::write(dir.path().join("a.bin"), a).unwrap();
        std::fs::write(dir.path().join("b.bin"), b).unwrap();
        let split = MegatronData::open(&[dir.path().join("a.bin"), dir.path().join("b.bin")], None, Some(whole.dtype)).unwrap();
        assert_eq!(split.len(), whole.len());
        let (mut x, mut y) = (Vec::new(), Vec::new());
        whole.read(3, whole.len() - 3, &mut x);
        split.read(3, split.len() - 3, &mut y);
        assert_eq!(x, y);
    }

    /// Random single defects of an index (sizes, pointers, document entries, counts, dtype): each
    /// refused naming the file, or the token stream reads as the original's (document boundaries are
    /// free: any increasing split of the sequences is a valid index). Then every truncation of the .bin.
    #[test]
    fn mutated_indexes_are_refused_or_read_the_same_tokens() {
        let set = &expected()["datasets"][0];
        let prefix = set["prefix"].as_str().unwrap();
        let (idx, bin) = (fixture(&format!("{prefix}.idx")), fixture(&format!("{prefix}.bin")));
        let stream = |idx: &Path, bin: &Path| -> Result<Vec<i64>> {
            let d = MegatronData::open(&[bin.to_path_buf()], Some(idx), None)?;
            let mut out = Vec::new();
            d.read(0, d.len(), &mut out);
            for doc in 0..d.index.as_ref().unwrap().documents() {
                d.document(doc)?;
            }
            Ok(out)
        };
        let want = stream(&idx, &bin).unwrap();
        let original = std::fs::read(&idx).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let t = crate::testutil::mutate::run("megatron .idx", &original, &dir.path().join("m.idx"), 0..original.len(), 38, 1000, 1 << 28, |p| match stream(p, &bin) {
            Ok(got) if got == want => Ok(crate::testutil::mutate::Loaded::Same),
            Ok(got) => Ok(crate::testutil::mutate::Loaded::Differs(format!("{} tokens", got.len()))),
            Err(e) => Err(e.to_string()),
        });
        assert!(t.refused > t.tried / 2, "{t:?}");
        let bytes = std::fs::read(&bin).unwrap();
        for len in 0..bytes.len() {
            let cut = dir.path().join("cut.bin");
            std::fs::write(&cut, &bytes[..len]).unwrap();
            let e = stream(&idx, &cut).err().unwrap().to_string();
            assert!(e.contains("cut.bin"), "{len}: {e}");
        }
        let long = dir.path().join("long.bin");
        std::fs::write(&long, [bytes.as_slice(), &[0, 0]].concat()).unwrap();
        let e = stream(&idx, &long).err().unwrap().to_string();
        assert!(e.contains("do not belong together"), "{e}");
    }

    #[test]
    fn bad_magic_version_dtype_and_short_bin_are_named() {
        let set = &expected()["datasets"][0];
        let prefix = set["prefix"].as_str().unwrap();
        let idx = std::fs::read(fixture(&format!("{prefix}.idx"))).unwrap();
        let bin = fixture(&format!("{prefix}.bin"));
        let dir = tempfile::tempdir().unwrap();
        let try_idx = |bytes: Vec<u8>| {
            let p = dir.path().join("x.idx");
            std::fs::write(&p, bytes).unwrap();
            MegatronData::open(&[bin.clone()], Some(p.as_path()), None).err().map(|e| e.to_string()).unwrap_or_default()
        };
        // One corrupted header byte each: (offset, value, what the error must say).
        let cases: [(usize, u8, &[&str]); 4] = [(0, b'X', &["x.idx", "magic"]), (9, 2, &["version 2"]), (17, 7, &["dtype code 7", "float32"]), (17, 9, &["unknown dtype code 9"])];
        for (at, value, want) in cases {
            let mut bytes = idx.clone();
            bytes[at] = value;
            let e = try_idx(bytes);
            assert!(want.iter().all(|w| e.contains(w)), "byte {at} = {value}: {e}");
        }
        let e = try_idx(idx[..idx.len() - 3].to_vec());
        assert!(e.contains("header") && e.contains("needs"), "{e}");
        // A .bin shorter than the index says.
        let bytes = std::fs::read(&bin).unwrap();
        let short = dir.path().join("short.bin");
        std::fs::write(&short, &bytes[..bytes.len() - 2]).unwrap();
        let e = MegatronData::open(&[short], Some(fixture(&format!("{prefix}.idx")).as_path()), None).err().unwrap().to_string();
        assert!(e.contains("short.bin") && e.contains("shorter than its index"), "{e}");
        // An index given as data.
        let e = MegatronData::open(&[fixture(&format!("{prefix}.idx"))], None, None).err().unwrap().to_string();
        assert!(e.contains("a Megatron index (.idx), not token data"), "{e}");
        // A dtype in the spec that contradicts the header.
        let e = MegatronData::open(&[bin.clone()], Some(fixture(&format!("{prefix}.idx")).as_path()), Some(DType::I64)).err().unwrap().to_string();
        assert!(e.contains("header says"), "{e}");
    }
}
