//! WikiText document split, detokenizer and word/byte counting, as in lm-evaluation-harness's
//! `wikitext` task (`EleutherAI/wikitext_document_level`, `wikitext-2-raw-v1`, split `test`,
//! and `lm_eval/tasks/wikitext/preprocess_wikitext.py::wikitext_detokenizer`).
//!
//! Spec: `shared/specs/evaluation.md` §2.3. Golden values:
//! `shared/data/text/wikitext-2/test_docs_reference.json` (62 documents, W = 241,335,
//! B = 1,290,527). Word and byte counts are taken on the split but *not* detokenized text;
//! the model scores the detokenized text.
//!
//! Python parity notes: `str.strip()`, `str.isspace()` and the `\s` of Python's `re` (str
//! patterns) treat U+001C..U+001F as whitespace, which Rust's `char::is_whitespace` and the
//! `regex` crate's `\s` do not; every whitespace test here includes them. Python's
//! `str.replace` and Rust's `str::replace` both replace non-overlapping matches left to right,
//! and the `regex` crate's leftmost-first semantics give the same matches as Python's
//! backtracking engine for the lazy bracket/quote patterns.

use regex::Regex;
use std::sync::OnceLock;

/// One evaluation document: the text the model scores and the counts word/byte perplexities divide by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvalDoc {
    /// Detokenized document text (what the model is scored on).
    pub text: String,
    /// Word count of the original (split, not detokenized) text: Python `len(re.split(r"\s+", doc))`.
    pub words: usize,
    /// UTF-8 byte length of the original (split, not detokenized) text.
    pub bytes: usize,
}

/// Python `str.isspace()` for one character (also what `\s` matches in Python `re` str patterns).
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python `str.strip()` with no arguments.
fn py_strip(s: &str) -> &str {
    s.trim_matches(py_isspace)
}

/// Splits a raw WikiText file into documents with lm-eval's rule: a line whose
/// `line.replace("= = =", "===").replace("= =", "==").strip()` starts with `"= "` and ends with
/// `" ="` starts a new document; the lines collected before it are emitted (joined with `"\n"`)
/// unless they are all whitespace. The last document is emitted unconditionally.
pub fn split_documents(raw: &str) -> Vec<String> {
    let mut docs = Vec::new();
    let mut current: Vec<&str> = Vec::new();
    for line in raw.split('\n') {
        let r = line.replace("= = =", "===").replace("= =", "==");
        let r = py_strip(&r);
        if r.starts_with("= ") && r.ends_with(" =") {
            let page = current.join("\n");
            if !py_strip(&page).is_empty() {
                docs.push(page);
            }
            current.clear();
        }
        current.push(line);
    }
    docs.push(current.join("\n"));
    docs
}

struct DetokRegexes {
    odd_contraction: Regex,
    paren: Regex,
    bracket: Regex,
    brace: Regex,
    dquote: Regex,
    squote: Regex,
}

fn detok_regexes() -> &'static DetokRegexes {
    static RE: OnceLock<DetokRegexes> = OnceLock::new();
    RE.get_or_init(|| {
        // `WS` stands for Python's `\s` (see the module notes on U+001C..U+001F).
        const WS: &str = r"[\s\x1C-\x1F]";
        let lazy = |open: &str, not_close: &str, close: &str| {
            Regex::new(&format!(r"{open}{WS}*([^{not_close}]*?){WS}*{close}"))
                .expect("valid detokenizer regex")
        };
        DetokRegexes {
            // Python: re.sub(r"/' [0-9]/", r"/'[0-9]/", s). A real regex (matches e.g. "/' 5/"),
            // replaced by the literal text "/'[0-9]/". Never matches in WikiText.
            odd_contraction: Regex::new(r"/' [0-9]/").expect("valid regex"),
            paren: lazy(r"\(", r"\)", r"\)"),
            bracket: lazy(r"\[", r"\]", r"\]"),
            brace: lazy(r"\{", r"\}", r"\}"),
            dquote: lazy("\"", "\"", "\""),
            squote: lazy("'", "'", "'"),
        }
    })
}

/// lm-eval's `wikitext_detokenizer`, applied in its order: contractions, number separators,
/// punctuation, lazy bracket/quote regexes, headings, miscellaneous.
pub fn detokenize(s: &str) -> String {
    let re = detok_regexes();
    let replace_all = |mut s: String, pairs: &[(&str, &str)]| {
        for (from, to) in pairs {
            s = s.replace(from, to);
        }
        s
    };
    // 1. Contractions.
    let mut s = s.replace("s '", "s'");
    s = re
        .odd_contraction
        .replace_all(&s, regex::NoExpand("/'[0-9]/"))
        .into_owned();
    // 2. Number separators. 3. Punctuation.
    s = replace_all(s, &[(" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" : ", ": "), (" ; ", "; "), (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", ")]);
    // 4. Brackets and quotes (lazy; strip whitespace just inside the delimiters).
    for (r, with) in [(&re.paren, "(${1})"), (&re.bracket, "[${1}]"), (&re.brace, "{${1}}"), (&re.dquote, "\"${1}\""), (&re.squote, "'${1}'")] {
        s = r.replace_all(&s, with).into_owned();
    }
    // 5. Headings. 6. Miscellaneous.
    replace_all(s, &[("= = = =", "===="), ("= = =", "==="), ("= =", "=="), (" \u{b0} ", "\u{b0}"), (" \n", "\n"), ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s")])
}

/// Python `len(re.split(r"\s+", s))`: one more than the number of maximal whitespace runs, so
/// leading/trailing whitespace counts an empty word and `""` counts 1.
pub fn count_words(s: &str) -> usize {
    let mut runs = 0;
    let mut in_ws = false;
    for c in s.chars() {
        let ws = py_isspace(c);
        if ws && !in_ws {
            runs += 1;
        }
        in_ws = ws;
    }
    runs + 1
}

/// Splits a raw WikiText file into documents, counts words and bytes on each original document,
/// and detokenizes the text the model will score.
pub fn wikitext_docs(raw: &str) -> Vec<EvalDoc> {
    split_documents(raw)
        .into_iter()
        .map(|doc| EvalDoc {
            words: count_words(&doc),
            bytes: doc.len(),
            text: detokenize(&doc),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    /// `<shared>/data/text/wikitext-2/<name>` (crate::testutil: $ATTNLAB_SHARED, ../shared, or the
    /// vendored copy in tests/fixtures/shared).
    fn read(name: &str) -> String {
        crate::testutil::shared_text(&format!("data/text/wikitext-2/{name}"))
    }

    fn sha256_hex(s: &str) -> String {
        Sha256::digest(s.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    #[test]
    fn wikitext_test_set_matches_reference() {
        let raw = read("test.raw.txt");
        let reference: serde_json::Value =
            serde_json::from_str(&read("test_docs_reference.json")).expect("reference JSON");
        let ref_docs = reference["docs"].as_array().expect("docs array");
        let originals = split_documents(&raw);
        let docs = wikitext_docs(&raw);

        assert_eq!(docs.len(), 62, "document count");
        assert_eq!(docs.len(), reference["n_docs"].as_u64().unwrap() as usize);
        assert_eq!(ref_docs.len(), docs.len());
        assert_eq!(originals.len(), docs.len());

        for (i, ((doc, orig), r)) in docs.iter().zip(&originals).zip(ref_docs).enumerate() {
            let title = r["title"].as_str().unwrap();
            assert!(
                orig.starts_with(r["page_starts"].as_str().unwrap()),
                "doc {i} ({title}) start"
            );
            assert!(
                orig.ends_with(r["page_ends"].as_str().unwrap()),
                "doc {i} ({title}) end"
            );
            assert_eq!(
                doc.words,
                r["n_words"].as_u64().unwrap() as usize,
                "doc {i} ({title}) words"
            );
            assert_eq!(
                doc.bytes,
                r["n_bytes"].as_u64().unwrap() as usize,
                "doc {i} ({title}) bytes"
            );
            assert_eq!(
                sha256_hex(&doc.text),
                r["detok_sha256"].as_str().unwrap(),
                "doc {i} ({title}) detokenized SHA-256"
            );
        }

        let w: usize = docs.iter().map(|d| d.words).sum();
        let b: usize = docs.iter().map(|d| d.bytes).sum();
        assert_eq!(w, reference["total_words"].as_u64().unwrap() as usize);
        assert_eq!(b, reference["total_bytes"].as_u64().unwrap() as usize);
        // Spec values (evaluation.md §2.3), independent of the JSON file.
        assert_eq!((w, b), (241_335, 1_290_527));
    }

    #[test]
    fn split_rule() {
        let raw = " \n = A = \n x \n = = Sub = = \n y \n = B = \n z \n";
        let docs = split_documents(raw);
        assert_eq!(
            docs,
            vec![
                " = A = \n x \n = = Sub = = \n y ".to_string(),
                " = B = \n z \n".to_string(),
            ]
        );
        // Whitespace-only prefix dropped; trailing list emitted even if empty.
        assert_eq!(split_documents(" = A = "), vec![" = A = ".to_string()]);
        assert_eq!(split_documents(""), vec![String::new()]);
    }

    #[test]
    fn detokenizer_rules() {
        assert_eq!(detokenize("1 @-@ 2 @,@ 3 @.@ 4"), "1-2,3.4");
        assert_eq!(detokenize("( a b )"), "(a b)");
        assert_eq!(detokenize("[ x ] { y } \" q \""), "[x] {y} \"q\"");
        // Lazy: each pair collapses separately.
        assert_eq!(detokenize("( a ) b ( c )"), "(a) b (c)");
        assert_eq!(detokenize(" = = = = D = = = = \n"), " ==== D ====\n");
        assert_eq!(
            detokenize(" = = Sub = = \n = = = S = = = "),
            " == Sub ==\n=== S === "
        );
        assert_eq!(
            detokenize("a , b . c ; d : e ! f ? g"),
            "a, b. c; d: e! f? g"
        );
        assert_eq!(detokenize("John 's dogs ' toys"), "John's dogs' toys");
        assert_eq!(detokenize("5 ° C and N people"), "5°C and 1 people");
        assert_eq!(detokenize("x N y"), "x 1 y");
        // The odd contraction rule is a regex with a literal replacement.
        assert_eq!(detokenize("a/' 5/b"), "a/'[0-9]/b");
        assert_eq!(detokenize("a/' [0-9]/b"), "a/' [0-9]/b");
    }

    #[test]
    fn word_count_python_split_semantics() {
        assert_eq!(count_words(""), 1);
        assert_eq!(count_words("a"), 1);
        assert_eq!(count_words("a b"), 2);
        assert_eq!(count_words(" a  b \n"), 4);
        assert_eq!(count_words("a\u{a0}b\u{1f}c"), 3);
    }
}
