//! Tokenizers: any Hugging Face `tokenizer.json` (file or hub repo), or the built-in word-level
//! vocabulary of the synthetic corpus.
use crate::spec::TokenizerSpec;
use crate::{Error, Result};
use sha2::{Digest, Sha256};
use tokenizers::Tokenizer;

fn special(tok: &Tok, names: &[&str]) -> Option<u32> {
    names.iter().find_map(|n| tok.inner.token_to_id(n))
}

/// EOS of the tokenizer (`</s>`, `<|end_of_text|>`, `<|endoftext|>`, `<|eot_id|>`; else id 0).
pub fn eos_id(tok: &Tok) -> u32 {
    special(tok, &["</s>", "<|end_of_text|>", "<|endoftext|>", "<|eot_id|>"]).unwrap_or(super::EOD)
}

/// BOS of the tokenizer if it has one.
pub fn bos_id(tok: &Tok) -> Option<u32> {
    special(tok, &["<s>", "<|begin_of_text|>"])
}

pub struct Tok {
    pub inner: Tokenizer,
    /// Where it came from, e.g. `builtin` or a path (recorded in shard indexes).
    pub origin: String,
    /// Short content hash: shards made with another tokenizer are never mixed up.
    pub fingerprint: String,
}

impl Tok {
    pub fn load(spec: &TokenizerSpec) -> Result<Tok> {
        match spec {
            TokenizerSpec::Path(p) if p == "builtin" => Self::from_json(&builtin_json(), "builtin"),
            TokenizerSpec::Path(p) => {
                let json = std::fs::read_to_string(p).map_err(|e| Error::io(p, e))?;
                Self::from_json(&json, p)
            }
            TokenizerSpec::Hub { hf } => {
                let path = crate::hub::model_file(hf, "tokenizer.json")?;
                let json = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
                Self::from_json(&json, &format!("hf:{hf}"))
            }
        }
    }

    pub fn from_json(json: &str, origin: &str) -> Result<Tok> {
        let inner: Tokenizer = json.parse().map_err(|e| Error::Tokenizer(format!("{origin}: {e}")))?;
        let fingerprint = format!("{:x}", Sha256::digest(json.as_bytes()))[..16].to_string();
        Ok(Tok { inner, origin: origin.to_string(), fingerprint })
    }

    /// Token ids without special tokens (documents are separated by EOD elsewhere).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode_fast(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Number of ids in use, including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Embedding rows: the vocabulary padded up to a multiple of 128 (Pythia: 50277 → 50304).
    pub fn padded_vocab(&self) -> usize {
        self.vocab_size().div_ceil(128) * 128
    }
}

/// tokenizer.json of the synthetic corpus: word-level model, split on whitespace.
pub fn builtin_json() -> String {
    let vocab: serde_json::Map<String, serde_json::Value> =
        super::synthetic::vocabulary().into_iter().enumerate().map(|(i, w)| (w, serde_json::json!(i))).collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    })
    .to_string()
}

/// The tokenizer a command-line argument names: `hf:OWNER/NAME` (a hub repo's tokenizer.json),
/// `builtin`, or a tokenizer.json path.
pub fn spec_from_arg(arg: &str) -> TokenizerSpec {
    match arg.strip_prefix("hf:") {
        Some(repo) => TokenizerSpec::Hub { hf: repo.to_string() },
        None => TokenizerSpec::Path(arg.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_name_hub_repos_or_paths() {
        assert_eq!(spec_from_arg("hf:EleutherAI/pythia-70m"), TokenizerSpec::Hub { hf: "EleutherAI/pythia-70m".into() });
        assert_eq!(spec_from_arg("builtin"), TokenizerSpec::Path("builtin".into()));
        assert_eq!(spec_from_arg("x/hf:tokenizer.json"), TokenizerSpec::Path("x/hf:tokenizer.json".into()));
    }

    #[test]
    fn builtin_round_trips_synthetic_text() {
        let tok = Tok::load(&TokenizerSpec::Path("builtin".into())).unwrap();
        let doc = super::super::synthetic::document(1, 0);
        let ids = tok.encode(&doc).unwrap();
        assert_eq!(ids.len(), doc.split(' ').count());
        assert!(!ids.contains(&2), "no <unk> in synthetic text");
        assert_eq!(tok.decode(&ids).unwrap(), doc);
        assert_eq!(tok.inner.token_to_id("<|endoftext|>"), Some(super::super::EOD));
    }

    /// GPT-NeoX-20B: the ids evaluation.md §1 gives, and decode(encode(x)) = x on real text.
    #[test]
    fn neox_tokenizer_round_trip() {
        let tok = Tok::from_json(&crate::testutil::shared_text("data/tokenizers/gpt-neox-20b.json"), "gpt-neox-20b").unwrap();
        assert_eq!(tok.encode("Hello world").unwrap(), vec![12092, 1533]);
        assert_eq!(tok.vocab_size(), 50277);
        assert_eq!(tok.padded_vocab(), 50304);
        let text = crate::testutil::shared_text("data/text/wikitext-2/test.raw.txt");
        let sample: String = text.chars().take(20_000).collect();
        assert_eq!(tok.decode(&tok.encode(&sample).unwrap()).unwrap(), sample);
    }
}
