//! Perplexity. Convention A (evaluation.md §2.2, lm-eval's `loglikelihood_rolling`): each document
//! on its own, prefixed by one BOS/EOD token, cut into disjoint windows of at most T targets, every
//! token scored exactly once; the last partial window is given the T tokens before its last target
//! as context. Convention B ("stream PPL", fast tracking only): documents joined with EOD, blocks of
//! T+1 tokens with stride T. Token-level PPL, word-level PPL and bits/byte come from the same summed NLL.
//!
//! Below train (the trainer evaluates with it) and eval (`eval::perplexity` is this module).
use crate::data::{sources::Doc, Tok, EOD};
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

/// Bin edges for loss by position in a window of `t` tokens: 0, then powers of two below
/// `step = next_power_of_two(t) / 16` (the first tokens, where loss falls fast), then multiples of
/// `step` up to `t` (T 1024: 0, 1, 2, …, 32, 64, 128, 192, …, 1024), so that every power-of-two
/// window w ≥ step is an edge and the positions past it get bins of their own.
pub fn position_edges(t: usize) -> Vec<usize> {
    if t == 0 {
        return vec![0];
    }
    let step = (t.next_power_of_two() / 16).max(1);
    let mut edges = vec![0];
    let mut p = 1;
    while p < step.min(t) {
        edges.push(p);
        p *= 2;
    }
    let mut m = step;
    while m < t {
        edges.push(m);
        m += step;
    }
    edges.push(t);
    edges
}

/// Mean loss by position in the model's input window: position p is a target predicted from p + 1
/// tokens of context (the rolling protocol's later windows score only their last positions). A
/// DAR or window-only model with window w differs from full attention only at positions ≥ w, so a
/// distant path that carries information shows as a lower loss there than window-only's.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PositionLoss {
    /// Bin i holds positions `edges[i] .. edges[i + 1]`.
    pub edges: Vec<usize>,
    /// Scored tokens per bin.
    pub tokens: Vec<u64>,
    /// Mean NLL (nats / token) per bin; null for a bin without tokens.
    pub loss: Vec<Option<f64>>,
}

/// Sums behind a `PositionLoss`.
#[derive(Debug, Clone)]
pub struct PositionBins {
    edges: Vec<usize>,
    tokens: Vec<u64>,
    nll: Vec<f64>,
}

impl PositionBins {
    pub fn new(t: usize) -> PositionBins {
        let edges = position_edges(t);
        let n = edges.len() - 1;
        PositionBins { edges, tokens: vec![0; n], nll: vec![0.0; n] }
    }

    /// Count one scored token at window position `pos` with NLL `nll` (positions ≥ t: last bin).
    pub fn add(&mut self, pos: usize, nll: f64) {
        if self.tokens.is_empty() {
            return;
        }
        let bin = self.edges.partition_point(|&e| e <= pos).saturating_sub(1).min(self.tokens.len() - 1);
        self.tokens[bin] += 1;
        self.nll[bin] += nll;
    }

    pub fn finish(&self) -> PositionLoss {
        let loss = self.nll.iter().zip(&self.tokens).map(|(s, &n)| (n > 0).then(|| s / n as f64)).collect();
        PositionLoss { edges: self.edges.clone(), tokens: self.tokens.clone(), loss }
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
    /// Mean loss by window position (absent from eval.json files written before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by_position: Option<PositionLoss>,
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
            by_position: None,
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

/// Sum of −log p(target) over the last `scored[i]` positions of each row of a right-padded batch
/// (summed on the device in double, per chunk), and each scored position's own value, row by row.
fn batch_nll(model: &Model, inputs: &[Vec<i64>], targets: &[Vec<i64>], scored: &[usize], device: Device) -> (f64, Vec<f64>) {
    let t = inputs.iter().map(Vec::len).max().unwrap_or(0);
    let pad = |rows: &[Vec<i64>]| -> Tensor {
        let flat: Vec<i64> = rows.iter().flat_map(|r| r.iter().copied().chain(std::iter::repeat(0).take(t - r.len()))).collect();
        Tensor::from_slice(&flat).view([rows.len() as i64, t as i64]).to_device(device)
    };
    let (x, y) = (pad(inputs), pad(targets));
    // Positions scored: the last `scored` of each row's real length.
    let mut pos = Vec::new();
    for (r, (row, &s)) in inputs.iter().zip(scored).enumerate() {
        pos.extend((row.len() - s..row.len()).map(|p| (r * t + p) as i64));
    }
    let pos = Tensor::from_slice(&pos).to_device(device);
    tch::no_grad(|| {
        let autocast = device.is_cuda();
        crate::kernels::autocast(autocast, || {
            let h = model.hidden(&x).flatten(0, 1).index_select(0, &pos);
            let y = y.flatten(0, 1).index_select(0, &pos);
            // Logits for at most 4096 positions at a time: never a [B·T, V] fp32 tensor.
            let (mut total, mut each) = (0.0, Vec::with_capacity(pos.size()[0] as usize));
            for (hc, yc) in h.split(4096, 0).iter().zip(y.split(4096, 0)) {
                let lp = model.logits(hc).to_kind(Kind::Float).log_softmax(-1, Kind::Float);
                let g = lp.gather(1, &yc.unsqueeze(1), false);
                total -= g.sum(Kind::Double).double_value(&[]);
                let v = Vec::<f64>::try_from(g.flatten(0, -1).to_kind(Kind::Double).to_device(Device::Cpu)).unwrap_or_default();
                each.extend(v.iter().map(|x| -x));
            }
            (total, each)
        })
    })
}

/// Evaluate `corpus` with context length `t`, `batch` windows per forward, stopping after the
/// document during which `max_tokens` scored tokens is reached.
pub fn evaluate(model: &Model, corpus: &EvalCorpus, t: usize, batch: usize, max_tokens: Option<usize>, protocol: EvalProtocol, device: Device) -> CorpusResult {
    evaluate_docs(model, corpus, t, batch, max_tokens, protocol, device, &indicatif::ProgressBar::hidden()).0
}

/// `evaluate`, and under the rolling protocol the summed NLL of each evaluated document (for
/// lm-eval's per-document samples; empty for the stream protocol). The corpus total is summed
/// exactly as `evaluate` always did. `bar` counts the tokens scored.
#[allow(clippy::too_many_arguments)]
pub fn evaluate_docs(model: &Model, corpus: &EvalCorpus, t: usize, batch: usize, max_tokens: Option<usize>, protocol: EvalProtocol, device: Device, bar: &indicatif::ProgressBar) -> (CorpusResult, Vec<f64>) {
    let limit = max_tokens.unwrap_or(usize::MAX);
    bar.set_length(planned_tokens(corpus, limit, protocol) as u64);
    let (mut docs, mut tokens, mut words, mut bytes, mut nll) = (0, 0, 0, 0, 0.0);
    let mut doc_nll: Vec<f64> = Vec::new();
    // Windows waiting for a forward: inputs, targets, scored positions, document index.
    type Pending = (Vec<Vec<i64>>, Vec<Vec<i64>>, Vec<usize>, Vec<usize>);
    let mut pending: Pending = Default::default();
    let mut by_pos = PositionBins::new(t);
    let mut flush = |p: &mut Pending, nll: &mut f64, doc_nll: &mut Vec<f64>| {
        if !p.0.is_empty() {
            let (total, each) = batch_nll(model, &p.0, &p.1, &p.2, device);
            *nll += total;
            bar.inc(p.2.iter().sum::<usize>() as u64);
            let mut each = each.into_iter();
            for (i, (row, &s)) in p.0.iter().zip(&p.2).enumerate() {
                let mut row_sum = 0.0;
                for position in row.len() - s..row.len() {
                    let x = each.next().unwrap_or(f64::NAN);
                    by_pos.add(position, x);
                    row_sum += x;
                }
                if protocol == EvalProtocol::Rolling {
                    doc_nll[p.3[i]] += row_sum;
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
    bar.finish_and_clear();
    let result = CorpusResult { by_position: Some(by_pos.finish()), ..CorpusResult::new(protocol, docs, tokens, words, bytes, nll) };
    (result, doc_nll)
}

/// The tokens `evaluate_docs` will score: whole documents until `limit` is reached (rolling), or
/// the stream of documents (each with its end-of-document token) cut at `limit`, less its first.
fn planned_tokens(corpus: &EvalCorpus, limit: usize, protocol: EvalProtocol) -> usize {
    let mut total = 0;
    for (ids, _) in &corpus.docs {
        if total >= limit {
            break;
        }
        total += ids.len() + usize::from(protocol == EvalProtocol::Stream);
    }
    match protocol {
        EvalProtocol::Rolling => total,
        EvalProtocol::Stream => total.saturating_sub(1),
    }
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

/// Rolling perplexity of each corpus with every document's NLL (the spec's batch, context length,
/// token budget and protocol, as `train::evaluate_all`), with a bar per corpus unless `quiet`.
pub fn evaluate_perplexity(model: &Model, corpora: &[EvalCorpus], spec: &crate::spec::Spec, device: tch::Device, quiet: bool) -> std::collections::BTreeMap<String, (CorpusResult, Vec<f64>)> {
    corpora
        .iter()
        .map(|c| {
            let batch = spec.eval.batch_size.unwrap_or(8) as usize;
            let bar = crate::progress::bar(0, &format!("perplexity {}", c.name), quiet);
            (c.name.clone(), evaluate_docs(model, c, spec.seq_len(), batch, spec.eval.max_tokens, spec.eval.protocol, device, &bar))
        })
        .collect()
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
        let _rng = crate::testutil::rng();
        let mut spec = crate::spec::from_str(crate::spec::BUILTIN_TINY, "tiny", &[]).unwrap();
        spec.model.vocab = Some(128);
        let _rng = crate::testutil::seeded(3);
        let vs = tch::nn::VarStore::new(Device::Cpu);
        let model = Model::Neox(crate::model::GptNeox::new(&vs.root(), crate::train::run::model_config(&spec)));
        let doc = |n: usize, k: u32| ((0..n as u32).map(|i| (i * 7 + k) % 120 + 1).collect::<Vec<u32>>(), Doc { text: String::new(), words: n, bytes: n });
        let corpus = EvalCorpus { name: "c".into(), docs: vec![doc(5, 1), doc(19, 2), doc(1, 3), doc(11, 4)], prefix: 0 };
        let (all, per) = evaluate_docs(&model, &corpus, 8, 3, None, EvalProtocol::Rolling, Device::Cpu, &indicatif::ProgressBar::hidden());
        assert_eq!(per.len(), 4);
        assert!((per.iter().sum::<f64>() - all.nll).abs() < 1e-6 * all.nll, "{per:?} vs {}", all.nll);
        assert_eq!(all, evaluate(&model, &corpus, 8, 3, None, EvalProtocol::Rolling, Device::Cpu));
        for (i, d) in corpus.docs.iter().enumerate() {
            let alone = EvalCorpus { name: "one".into(), docs: vec![d.clone()], prefix: 0 };
            let r = evaluate(&model, &alone, 8, 1, None, EvalProtocol::Rolling, Device::Cpu);
            assert!((r.nll - per[i]).abs() < 1e-4 * r.nll.max(1.0), "doc {i}: {} alone vs {} in the corpus", r.nll, per[i]);
        }
        let (_, none) = evaluate_docs(&model, &corpus, 8, 3, None, EvalProtocol::Stream, Device::Cpu, &indicatif::ProgressBar::hidden());
        assert!(none.is_empty());
        // The progress bar's length is what is then scored, with and without a token budget.
        for protocol in [EvalProtocol::Rolling, EvalProtocol::Stream] {
            for limit in [None, Some(1), Some(6), Some(24), Some(1000)] {
                let bar = indicatif::ProgressBar::hidden();
                let (r, _) = evaluate_docs(&model, &corpus, 8, 3, limit, protocol, Device::Cpu, &bar);
                assert_eq!((bar.length(), bar.position()), (Some(r.tokens as u64), r.tokens as u64), "{protocol:?}, limit {limit:?}");
            }
        }
    }

    /// Bin edges by hand: T 1024 → 0, 1, 2, 4, …, 32, then every 64; T 8 → every position; T 100
    /// → 0, 1, 2, 4, then every 8 and the end. Positions land in the bin whose range holds them.
    #[test]
    fn position_bins_by_hand() {
        let mut want: Vec<usize> = vec![0, 1, 2, 4, 8, 16, 32];
        want.extend((1..=16).map(|k| 64 * k));
        assert_eq!(position_edges(1024), want);
        assert_eq!(position_edges(8), (0..=8).collect::<Vec<_>>());
        let mut want: Vec<usize> = vec![0, 1, 2, 4];
        want.extend((1..=12).map(|k| 8 * k));
        want.push(100);
        assert_eq!(position_edges(100), want);
        let mut b = PositionBins::new(1024);
        for (pos, nll) in [(0, 5.0), (3, 1.0), (2, 3.0), (127, 2.0), (128, 4.0), (191, 6.0), (1023, 1.5)] {
            b.add(pos, nll);
        }
        let p = b.finish();
        let bin = |pos: usize| p.edges.iter().rposition(|&e| e <= pos).unwrap();
        // Bins 0 [0, 1), 2 [2, 4), 7 [64, 128), 8 [128, 192), 21 [960, 1024): 22 bins in all.
        assert_eq!(p.tokens.len(), 22);
        assert_eq!((bin(0), bin(2), bin(3), bin(127), bin(128), bin(191), bin(1023)), (0, 2, 2, 7, 8, 8, 21));
        assert_eq!((p.tokens[0], p.tokens[2], p.tokens[7], p.tokens[8], p.tokens[21]), (1, 2, 1, 2, 1));
        assert_eq!((p.loss[0], p.loss[2], p.loss[7], p.loss[8], p.loss[21]), (Some(5.0), Some(2.0), Some(2.0), Some(5.0), Some(1.5)));
        assert_eq!(p.loss[1], None, "an empty bin has no mean");
        assert_eq!(p.tokens.iter().sum::<u64>(), 7);
    }

    /// Loss by position from `evaluate` against the model's own logits computed window by window
    /// here: one 11-token document at T = 8 → window 1 scores positions 0–7, window 2 (start 3)
    /// positions 5–7, so positions 5–7 average two tokens; the bins add up to the corpus NLL.
    #[test]
    fn loss_by_position_matches_the_logits() {
        let _rng = crate::testutil::rng();
        let mut spec = crate::spec::from_str(crate::spec::BUILTIN_TINY, "tiny", &[]).unwrap();
        spec.model.vocab = Some(128);
        let _rng = crate::testutil::seeded(5);
        let vs = tch::nn::VarStore::new(Device::Cpu);
        let model = Model::Neox(crate::model::GptNeox::new(&vs.root(), crate::train::run::model_config(&spec)));
        let ids: Vec<u32> = (0..11u32).map(|i| (i * 13 + 5) % 120 + 1).collect();
        let corpus = EvalCorpus { name: "c".into(), docs: vec![(ids.clone(), Doc { text: String::new(), words: 11, bytes: 11 })], prefix: 0 };
        let r = evaluate(&model, &corpus, 8, 2, None, EvalProtocol::Rolling, Device::Cpu);
        let p = r.by_position.clone().unwrap();
        assert_eq!(p.edges, (0..=8).collect::<Vec<_>>());
        assert_eq!(p.tokens, vec![1, 1, 1, 1, 1, 2, 2, 2]);
        // Reference: y = [0] + ids; window 1 = y[0..8] → y[1..9]; window 2 = y[3..11] → y[4..12], last 3.
        let y: Vec<i64> = std::iter::once(0).chain(ids.iter().map(|&x| x as i64)).collect();
        let nll_at = |start: usize| -> Vec<f64> {
            let x = Tensor::from_slice(&y[start..start + 8]).view([1, 8]);
            let lp = tch::no_grad(|| model.logits(&model.hidden(&x)).log_softmax(-1, Kind::Double)).squeeze_dim(0);
            (0..8).map(|q| -lp.double_value(&[q as i64, y[start + q + 1]])).collect()
        };
        let (w1, w2) = (nll_at(0), nll_at(3));
        let mut want: Vec<f64> = w1.clone();
        for q in 5..8 {
            want[q] = (w1[q] + w2[q]) / 2.0;
        }
        for (q, (got, want)) in p.loss.iter().zip(&want).enumerate() {
            assert!((got.unwrap() - want).abs() < 1e-4, "position {q}: {got:?} vs {want}");
        }
        let total: f64 = p.loss.iter().zip(&p.tokens).map(|(l, &n)| l.unwrap() * n as f64).sum();
        assert!((total - r.nll).abs() < 1e-6 * r.nll, "{total} vs {}", r.nll);
    }

    /// Every token of a document is scored exactly once, windows never exceed T, full windows start
    /// one token before their first target, and partial windows end just before their last target.
    #[test]
    fn rolling_windows_score_every_token_once() {
        let _rng = crate::testutil::rng();
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
