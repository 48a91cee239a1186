//! Perplexity. Convention A (evaluation.md §2.2, lm-eval's `loglikelihood_rolling`): each document
//! on its own, prefixed by one BOS/EOD token, cut into disjoint windows of at most T targets, every
//! token scored exactly once; the last partial window is given the T tokens before its last target
//! as context. Convention B ("stream PPL", fast tracking only): documents joined with EOD, blocks of
//! T+1 tokens with stride T. Token-level PPL, word-level PPL and bits/byte come from the same summed NLL.
use super::super::data::{sources::Doc, Tok, EOD};
use crate::model::Model;
use crate::spec::{EvalProtocol, SourceSpec};
use crate::Result;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// One rolling window over `y = [prefix] + doc`: inputs `y[start .. start + len)`, targets shifted by
/// one; only the last `scored` positions count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub start: usize,
    pub len: usize,
    pub scored: usize,
}

/// The windows of convention A for a document of `n` tokens and context length `t`.
pub fn rolling_windows(n: usize, t: usize) -> Vec<Window> {
    let mut out = Vec::new();
    if n == 0 {
        return out;
    }
    let first = n.min(t);
    out.push(Window { start: 0, len: first, scored: first });
    let mut done = first;
    while done < n {
        let k = t.min(n - done);
        // Input = the t tokens of y that end just before the last target y[done + k].
        out.push(Window { start: done + k - t, len: t, scored: k });
        done += k;
    }
    out
}

/// A tokenized evaluation corpus.
pub struct EvalCorpus {
    pub name: String,
    pub docs: Vec<(Vec<u32>, Doc)>,
    /// Token that conditions the first token of each document (BOS if the tokenizer has one, else EOD).
    pub prefix: u32,
}

impl EvalCorpus {
    pub fn load(name: &str, src: &SourceSpec, tok: &Tok) -> Result<EvalCorpus> {
        let docs = crate::data::sources::read_documents(src)?;
        let ids: Vec<Vec<u32>> = docs.par_iter().map(|d| tok.encode(&d.text)).collect::<Result<_>>()?;
        let prefix = ["<|begin_of_text|>", "<s>"].iter().find_map(|b| tok.inner.token_to_id(b)).unwrap_or(EOD);
        Ok(EvalCorpus { name: name.to_string(), docs: ids.into_iter().zip(docs).collect(), prefix })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CorpusResult {
    pub protocol: String,
    pub docs: usize,
    pub tokens: usize,
    pub words: usize,
    pub bytes: usize,
    /// Summed negative log-likelihood (nats).
    pub nll: f64,
    /// Mean NLL per token.
    pub loss: f64,
    pub ppl: f64,
    pub word_ppl: f64,
    pub byte_ppl: f64,
    pub bits_per_byte: f64,
}

impl CorpusResult {
    fn new(protocol: EvalProtocol, docs: usize, tokens: usize, words: usize, bytes: usize, nll: f64) -> Self {
        let per = |n: usize| if n == 0 { f64::NAN } else { nll / n as f64 };
        CorpusResult {
            protocol: match protocol {
                EvalProtocol::Rolling => "rolling".into(),
                EvalProtocol::Stream => "stream".into(),
            },
            docs,
            tokens,
            words,
            bytes,
            nll,
            loss: per(tokens),
            ppl: per(tokens).exp(),
            word_ppl: per(words).exp(),
            byte_ppl: per(bytes).exp(),
            bits_per_byte: per(bytes) / std::f64::consts::LN_2,
        }
    }

    /// Metric keys for metrics.jsonl: `eval/<corpus>/ppl` etc. (stream numbers are labelled `stream_ppl`).
    pub fn metrics(&self, corpus: &str) -> Vec<(String, f64)> {
        if self.protocol == "stream" {
            return vec![(format!("eval/{corpus}/stream_ppl"), self.ppl), (format!("eval/{corpus}/stream_loss"), self.loss)];
        }
        vec![
            (format!("eval/{corpus}/ppl"), self.ppl),
            (format!("eval/{corpus}/loss"), self.loss),
            (format!("eval/{corpus}/word_ppl"), self.word_ppl),
            (format!("eval/{corpus}/bits_per_byte"), self.bits_per_byte),
        ]
    }
}

/// Sum of −log p(target) over the last `scored[i]` positions of each row of a right-padded batch,
/// and the same sum per row (`rows[i]` += row i's part; the total is summed as before, per chunk).
fn batch_nll(model: &Model, inputs: &[Vec<i64>], targets: &[Vec<i64>], scored: &[usize], device: Device, rows: Option<&mut [f64]>) -> f64 {
    let t = inputs.iter().map(Vec::len).max().unwrap_or(0);
    let pad = |rows: &[Vec<i64>]| -> Tensor {
        let flat: Vec<i64> = rows.iter().flat_map(|r| r.iter().copied().chain(std::iter::repeat(0).take(t - r.len()))).collect();
        Tensor::from_slice(&flat).view([rows.len() as i64, t as i64]).to_device(device)
    };
    let (x, y) = (pad(inputs), pad(targets));
    // Positions scored: the last `scored` of each row's real length (and the row each belongs to).
    let (mut pos, mut row_of) = (Vec::new(), Vec::new());
    for (r, (row, &s)) in inputs.iter().zip(scored).enumerate() {
        pos.extend((row.len() - s..row.len()).map(|p| (r * t + p) as i64));
        row_of.extend(std::iter::repeat(r).take(s));
    }
    let pos = Tensor::from_slice(&pos).to_device(device);
    let mut rows = rows;
    tch::no_grad(|| {
        let autocast = device.is_cuda();
        crate::kernels::autocast(autocast, || {
            let h = model.hidden(&x).flatten(0, 1).index_select(0, &pos);
            let y = y.flatten(0, 1).index_select(0, &pos);
            // Logits for at most 4096 positions at a time: never a [B·T, V] fp32 tensor.
            let mut total = 0.0;
            for (c, (hc, yc)) in h.split(4096, 0).iter().zip(y.split(4096, 0)).enumerate() {
                let lp = model.logits(hc).to_kind(Kind::Float).log_softmax(-1, Kind::Float);
                let g = lp.gather(1, &yc.unsqueeze(1), false);
                total -= g.sum(Kind::Double).double_value(&[]);
                if let Some(rows) = rows.as_deref_mut() {
                    let v = Vec::<f64>::try_from(g.flatten(0, -1).to_kind(Kind::Double).to_device(Device::Cpu)).unwrap_or_default();
                    for (i, x) in v.iter().enumerate() {
                        rows[row_of[c * 4096 + i]] -= x;
                    }
                }
            }
            total
        })
    })
}

/// Evaluate `corpus` with context length `t`, `batch` windows per forward, stopping after the
/// document during which `max_tokens` scored tokens is reached.
pub fn evaluate(model: &Model, corpus: &EvalCorpus, t: usize, batch: usize, max_tokens: Option<usize>, protocol: EvalProtocol, device: Device) -> CorpusResult {
    evaluate_docs(model, corpus, t, batch, max_tokens, protocol, device).0
}

/// `evaluate`, and under the rolling protocol the summed NLL of each evaluated document (for
/// lm-eval's per-document samples; empty for the stream protocol). The corpus total is summed
/// exactly as `evaluate` always did.
pub fn evaluate_docs(model: &Model, corpus: &EvalCorpus, t: usize, batch: usize, max_tokens: Option<usize>, protocol: EvalProtocol, device: Device) -> (CorpusResult, Vec<f64>) {
    let limit = max_tokens.unwrap_or(usize::MAX);
    let (mut docs, mut tokens, mut words, mut bytes, mut nll) = (0, 0, 0, 0, 0.0);
    let mut doc_nll: Vec<f64> = Vec::new();
    // Windows waiting for a forward: inputs, targets, scored positions, document index.
    type Pending = (Vec<Vec<i64>>, Vec<Vec<i64>>, Vec<usize>, Vec<usize>);
    let mut pending: Pending = Default::default();
    let flush = |p: &mut Pending, nll: &mut f64, doc_nll: &mut Vec<f64>| {
        if !p.0.is_empty() {
            let mut rows = vec![0.0; p.0.len()];
            *nll += batch_nll(model, &p.0, &p.1, &p.2, device, (protocol == EvalProtocol::Rolling).then_some(&mut rows[..]));
            if protocol == EvalProtocol::Rolling {
                for (&d, r) in p.3.iter().zip(&rows) {
                    doc_nll[d] += r;
                }
            }
            *p = Default::default();
        }
    };
    match protocol {
        EvalProtocol::Rolling => {
            for (ids, doc) in &corpus.docs {
                if tokens >= limit {
                    break;
                }
                doc_nll.push(0.0);
                let y: Vec<i64> = std::iter::once(corpus.prefix).chain(ids.iter().copied()).map(i64::from).collect();
                for w in rolling_windows(ids.len(), t) {
                    pending.0.push(y[w.start..w.start + w.len].to_vec());
                    pending.1.push(y[w.start + 1..w.start + w.len + 1].to_vec());
                    pending.2.push(w.scored);
                    pending.3.push(docs);
                    if pending.0.len() == batch {
                        flush(&mut pending, &mut nll, &mut doc_nll);
                    }
                }
                docs += 1;
                tokens += ids.len();
                words += doc.words;
                bytes += doc.bytes;
            }
        }
        EvalProtocol::Stream => {
            let mut stream: Vec<i64> = Vec::new();
            for (ids, doc) in &corpus.docs {
                if stream.len() >= limit {
                    break;
                }
                stream.extend(ids.iter().map(|&i| i as i64));
                stream.push(EOD as i64);
                docs += 1;
                words += doc.words;
                bytes += doc.bytes;
            }
            let mut start = 0;
            while start + 1 < stream.len() {
                let len = t.min(stream.len() - 1 - start);
                pending.0.push(stream[start..start + len].to_vec());
                pending.1.push(stream[start + 1..start + len + 1].to_vec());
                pending.2.push(len);
                pending.3.push(0);
                tokens += len;
                if pending.0.len() == batch {
                    flush(&mut pending, &mut nll, &mut doc_nll);
                }
                start += t;
            }
        }
    }
    flush(&mut pending, &mut nll, &mut doc_nll);
    (CorpusResult::new(protocol, docs, tokens, words, bytes, nll), doc_nll)
}

/// Perplexity and scored tokens per corpus, one row per named run (`-` where a run lacks a corpus),
/// what `train`, `compare` and `eval` print. Empty when no run has a corpus.
pub fn table(rows: &[(String, std::collections::BTreeMap<String, CorpusResult>)]) -> String {
    use std::fmt::Write;
    let corpora: std::collections::BTreeSet<&String> = rows.iter().flat_map(|r| r.1.keys()).collect();
    if corpora.is_empty() {
        return String::new();
    }
    let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(3).max(3);
    let mut out = format!("{:width$}", "run");
    for c in &corpora {
        let _ = write!(out, "  {:>14} {:>9}", format!("{c} ppl"), "tokens");
    }
    out.push('\n');
    for (name, res) in rows {
        let _ = write!(out, "{name:width$}");
        for c in &corpora {
            let _ = match res.get(*c) {
                Some(r) => write!(out, "  {:>14.3} {:>9}", r.ppl, r.tokens),
                None => write!(out, "  {:>14} {:>9}", "-", "-"),
            };
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_has_a_column_pair_per_corpus_and_dashes_for_missing_ones() {
        let r = |nll: f64| CorpusResult::new(EvalProtocol::Rolling, 1, 100, 80, 400, nll);
        let rows = vec![("vanilla".to_string(), [("a".to_string(), r(100.0)), ("b".to_string(), r(200.0))].into()), ("dar".to_string(), [("a".to_string(), r(50.0))].into())];
        let t = table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], format!("run      {:>14} {:>9}  {:>14} {:>9}", "a ppl", "tokens", "b ppl", "tokens"));
        assert_eq!(lines[1], format!("vanilla  {:>14.3} {:>9}  {:>14.3} {:>9}", 1f64.exp(), 100, 2f64.exp(), 100));
        assert_eq!(lines[2], format!("dar      {:>14.3} {:>9}  {:>14} {:>9}", 0.5f64.exp(), 100, "-", "-"));
        assert_eq!(table(&[("x".into(), Default::default())]), "");
    }

    /// Per-document NLLs (windows of several documents share a forward) equal each document scored
    /// alone, and add up to the corpus total.
    #[test]
    fn per_document_nll_matches_each_document_alone() {
        let mut spec = crate::spec::from_str(crate::spec::BUILTIN_TINY, "tiny", &[]).unwrap();
        spec.model.vocab = Some(128);
        tch::manual_seed(3);
        let vs = tch::nn::VarStore::new(Device::Cpu);
        let model = Model::Neox(crate::model::GptNeox::new(&vs.root(), crate::train::run::model_config(&spec)));
        let doc = |n: usize, k: u32| ((0..n as u32).map(|i| (i * 7 + k) % 120 + 1).collect::<Vec<u32>>(), Doc { text: String::new(), words: n, bytes: n });
        let corpus = EvalCorpus { name: "c".into(), docs: vec![doc(5, 1), doc(19, 2), doc(1, 3), doc(11, 4)], prefix: 0 };
        let (all, per) = evaluate_docs(&model, &corpus, 8, 3, None, EvalProtocol::Rolling, Device::Cpu);
        assert_eq!(per.len(), 4);
        assert!((per.iter().sum::<f64>() - all.nll).abs() < 1e-6 * all.nll, "{per:?} vs {}", all.nll);
        assert_eq!(all, evaluate(&model, &corpus, 8, 3, None, EvalProtocol::Rolling, Device::Cpu));
        for (i, d) in corpus.docs.iter().enumerate() {
            let alone = EvalCorpus { name: "one".into(), docs: vec![d.clone()], prefix: 0 };
            let r = evaluate(&model, &alone, 8, 1, None, EvalProtocol::Rolling, Device::Cpu);
            assert!((r.nll - per[i]).abs() < 1e-4 * r.nll.max(1.0), "doc {i}: {} alone vs {} in the corpus", r.nll, per[i]);
        }
        let (_, none) = evaluate_docs(&model, &corpus, 8, 3, None, EvalProtocol::Stream, Device::Cpu);
        assert!(none.is_empty());
    }

    /// Every token of a document is scored exactly once, windows never exceed T, full windows start
    /// one token before their first target, and partial windows end just before their last target.
    #[test]
    fn rolling_windows_score_every_token_once() {
        for t in [1usize, 2, 3, 7, 16] {
            for n in 0..60 {
                let mut count = vec![0u32; n + 1];
                for w in rolling_windows(n, t) {
                    assert!(w.len <= t && w.scored <= w.len && w.scored > 0);
                    // Targets are y[start+1 ..= start+len]; scored ones are the last `scored`.
                    for target in w.start + w.len - w.scored + 1..=w.start + w.len {
                        count[target] += 1;
                    }
                    if w.start > 0 {
                        assert_eq!(w.len, t, "later windows carry full context");
                    }
                }
                assert_eq!(count[0], 0, "the prefix token is never a target");
                assert!(count[1..].iter().all(|&c| c == 1), "n={n} t={t}: {count:?}");
            }
        }
        // Hand-checked: n = 5, T = 2 → windows over y = [p, x0..x4].
        let w = rolling_windows(5, 2);
        assert_eq!(w, vec![
            Window { start: 0, len: 2, scored: 2 }, // [p x0] → x0 x1
            Window { start: 2, len: 2, scored: 2 }, // [x1 x2] → x2 x3
            Window { start: 3, len: 2, scored: 1 }, // [x2 x3] → x4 only
        ]);
    }
}
