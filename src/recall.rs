//! The long-range recall test (data::synthetic's recall corpus): `attnlab eval RUN --task recall
//! --lengths G` scores a trained run, and the trainer scores it during training (`eval: {recall:
//! {gaps: […]}}`: rows `recall/g<G>/…` in metrics.jsonl at every evaluation, recall.json at the
//! end), so one run gives a learning curve. Each document states its codes once (2–4, or the
//! corpus's `recall_facts`), then at least G tokens later asks for every one; only the answer
//! digits are scored (teacher-forced: the loss at each digit and whether the most likely next token
//! is it). The digits are uniform and independent of everything else, so a model that cannot see
//! back G tokens is at chance: loss ln 10 per digit, 10% of digits and 0.1% of whole codes right. A
//! window-only model with window w and L layers sees at most L · (w − 1) tokens back (each layer
//! reaches w − 1 further), so with G above that it is provably at chance; DAR scores above chance
//! only through its compressed distant keys.
//!
//! Below train (the trainer evaluates with it) and eval (`eval::recall` is this module).
use crate::data::synthetic;
use crate::data::{Tok, EOD};
use crate::model::Model;
use crate::spec::{SourceSpec, Spec};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// The seed of the evaluation documents: not one a training spec uses by default (1).
pub const EVAL_SEED: u64 = 0x5ec0de;

/// One recall document as model input: the EOD prefix and the tokens, and the positions whose next
/// token is an answer digit (position p predicts `ids[p + 1]`).
#[derive(Debug, Clone)]
pub struct Item {
    pub ids: Vec<i64>,
    pub answers: Vec<usize>,
}

/// Documents `0..n` of the recall corpus with `gap` and `facts` codes each (None: 2–4), tokenized.
/// The tokenizer must keep words whole (the built-in one does), so that the three tokens after
/// `answer :` are the three digits.
pub fn items(tok: &Tok, seed: u64, n: usize, gap: usize, facts: Option<usize>) -> Result<Vec<Item>> {
    let id = |w: &str| tok.inner.token_to_id(w).ok_or_else(|| Error::Other(format!("--task recall: the tokenizer has no token `{w}`; recall needs the built-in word-level tokenizer (synthetic data)")));
    let (answer, colon) = (id("answer")? as i64, id(":")? as i64);
    let digits: Vec<i64> = (0..10).map(|d| id(&d.to_string()).map(|x| x as i64)).collect::<Result<_>>()?;
    let mut out = Vec::new();
    let corpus = synthetic::Recall { gap: (gap, gap), facts };
    for text in corpus.documents(seed, n) {
        let ids: Vec<i64> = std::iter::once(EOD as i64).chain(tok.encode(&text)?.into_iter().map(i64::from)).collect();
        if ids.len() != text.split(' ').count() + 1 {
            return Err(Error::Other("--task recall: the tokenizer splits words; recall needs the built-in word-level tokenizer (synthetic data)".into()));
        }
        let mut answers = Vec::new();
        for p in 1..ids.len() {
            if ids[p - 1] == answer && ids[p] == colon {
                for k in 0..3 {
                    if p + k + 1 < ids.len() && digits.contains(&ids[p + k + 1]) {
                        answers.push(p + k);
                    }
                }
            }
        }
        out.push(Item { ids, answers });
    }
    Ok(out)
}

/// Scores over answer digits, and what chance would score.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RecallScore {
    pub gap: usize,
    /// Codes stated (and asked) per document; None: 2–4 (the default corpus).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub facts: Option<usize>,
    pub docs: usize,
    /// Answer digits scored.
    pub digits: usize,
    /// Mean NLL (nats) at the answer digits.
    pub loss: f64,
    /// Fraction of answer digits that are the most likely next token.
    pub digit_accuracy: f64,
    /// Fraction of codes with all three digits right.
    pub code_accuracy: f64,
    /// Chance: ln 10, 0.1, 0.001.
    pub chance_loss: f64,
    pub chance_digit_accuracy: f64,
    pub chance_code_accuracy: f64,
    /// How far back a window-only model of this shape could see (layers · (w − 1)); None for
    /// full attention.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_reach: Option<usize>,
    pub mean_tokens: f64,
}

/// Score `items` with `predict`, which returns, for one item, the log-probabilities over the
/// vocabulary at each of its answer positions (in order).
pub fn score(items: &[Item], gap: usize, mut predict: impl FnMut(&Item) -> Result<Vec<Vec<f32>>>) -> Result<RecallScore> {
    let (mut nll, mut right, mut digits, mut codes, mut codes_right) = (0.0, 0usize, 0usize, 0usize, 0usize);
    for item in items {
        let logp = predict(item)?;
        let mut ok = Vec::with_capacity(item.answers.len());
        for (&p, lp) in item.answers.iter().zip(&logp) {
            let target = item.ids[p + 1] as usize;
            nll -= lp[target] as f64;
            let best = lp.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i);
            ok.push(best == Some(target));
        }
        right += ok.iter().filter(|&&x| x).count();
        digits += ok.len();
        for code in ok.chunks(3) {
            codes += 1;
            codes_right += usize::from(code.iter().all(|&x| x));
        }
    }
    let per = |x: f64, n: usize| if n == 0 { f64::NAN } else { x / n as f64 };
    Ok(RecallScore {
        gap,
        facts: None,
        docs: items.len(),
        digits,
        loss: per(nll, digits),
        digit_accuracy: per(right as f64, digits),
        code_accuracy: per(codes_right as f64, codes),
        chance_loss: 10f64.ln(),
        chance_digit_accuracy: 0.1,
        chance_code_accuracy: 0.001,
        window_reach: None,
        mean_tokens: per(items.iter().map(|i| i.ids.len() as f64).sum(), items.len()),
    })
}

/// How far back a model with the spec's attention can see in one forward: layers · (w − 1) for
/// window-only attention, None for kinds with a path to every earlier token.
pub fn window_reach(spec: &Spec) -> Option<usize> {
    let a = spec.attention.comparable();
    a.kind().is_local_only().then(|| spec.shape().layers * a.window_len().unwrap_or(0).saturating_sub(1))
}

/// Codes per document a run's recall scores use by default: `eval.recall.facts`, else its training
/// corpus's `recall_facts` (a run trained on k facts is scored on k), else None (2–4).
pub fn default_facts(spec: &Spec) -> Option<usize> {
    spec.eval.recall.as_ref().and_then(|r| r.facts).or(match &spec.data.train {
        SourceSpec::Synthetic { synthetic } => synthetic.recall_facts,
        _ => None,
    })
}

/// Score `model` on `n` recall documents per gap, `facts` codes each (None: 2–4), `batch` documents
/// per forward (right-padded: causal attention never looks right, so padding changes nothing
/// before it), under bf16 autocast on CUDA as perplexity is. `quiet`: no progress bar.
#[allow(clippy::too_many_arguments)]
pub fn evaluate(model: &Model, tok: &Tok, spec: &Spec, gaps: &[usize], n: usize, facts: Option<usize>, batch: usize, device: Device, quiet: bool) -> Result<Vec<RecallScore>> {
    let t = spec.seq_len();
    let mut out = Vec::new();
    for &gap in gaps {
        let items = items(tok, EVAL_SEED, n, gap, facts)?;
        if let Some(long) = items.iter().map(|i| i.ids.len()).max().filter(|&l| l > t) {
            return Err(Error::Other(format!("--task recall: documents with gap {gap} reach {long} tokens, more than the model's T = {t}; give a smaller --lengths")));
        }
        let bar = crate::progress::bar(items.len() as u64, &format!("recall gap {gap}"), quiet);
        let mut logp: Vec<Vec<Vec<f32>>> = Vec::with_capacity(items.len());
        for chunk in items.chunks(batch.max(1)) {
            logp.extend(batch_logp(model, chunk, device));
            bar.inc(chunk.len() as u64);
        }
        bar.finish_and_clear();
        let mut each = logp.into_iter();
        let mut s = score(&items, gap, |_| Ok(each.next().unwrap_or_default()))?;
        s.window_reach = window_reach(spec);
        s.facts = facts;
        out.push(s);
    }
    Ok(out)
}

/// Log-probabilities over the vocabulary at every answer position of each item (one forward over
/// the right-padded batch).
fn batch_logp(model: &Model, items: &[Item], device: Device) -> Vec<Vec<Vec<f32>>> {
    let len = items.iter().map(|i| i.ids.len()).max().unwrap_or(0);
    let flat: Vec<i64> = items.iter().flat_map(|i| i.ids.iter().copied().chain(std::iter::repeat(EOD as i64).take(len - i.ids.len()))).collect();
    let pos: Vec<i64> = items.iter().enumerate().flat_map(|(r, i)| i.answers.iter().map(move |&p| (r * len + p) as i64)).collect();
    if pos.is_empty() {
        return vec![Vec::new(); items.len()];
    }
    let lp: Vec<Vec<f32>> = tch::no_grad(|| {
        crate::kernels::autocast(device.is_cuda(), || {
            let x = Tensor::from_slice(&flat).view([items.len() as i64, len as i64]).to_device(device);
            let h = model.hidden(&x).flatten(0, 1).index_select(0, &Tensor::from_slice(&pos).to_device(device));
            let lp = model.logits(&h).to_kind(Kind::Float).log_softmax(-1, Kind::Float).to_device(Device::Cpu);
            Vec::<Vec<f32>>::try_from(lp).unwrap_or_default()
        })
    });
    let mut rows = lp.into_iter();
    items.iter().map(|i| rows.by_ref().take(i.answers.len()).collect()).collect()
}

/// The spec's `eval.recall` (None: nothing to score), as the trainer runs it: its gaps, samples and
/// facts, `eval.batch_size` documents per forward, no progress bar.
pub fn evaluate_spec(model: &Model, tok: &Tok, spec: &Spec, device: Device) -> Result<Vec<RecallScore>> {
    let Some(r) = &spec.eval.recall else { return Ok(Vec::new()) };
    let batch = spec.eval.batch_size.unwrap_or(8).max(1) as usize;
    evaluate(model, tok, spec, &r.gaps, r.samples.unwrap_or(100), r.facts, batch, device, true)
}

/// The metrics.jsonl columns of `scores`: `recall/g<gap>/digits`, `/codes` (fractions right) and
/// `/loss` (nats per answer digit).
pub fn metrics(scores: &[RecallScore]) -> Vec<(String, f64)> {
    scores
        .iter()
        .flat_map(|s| {
            let g = s.gap;
            [(format!("recall/g{g}/digits"), s.digit_accuracy), (format!("recall/g{g}/codes"), s.code_accuracy), (format!("recall/g{g}/loss"), s.loss)]
        })
        .collect()
}

/// The gap of a metrics column `recall/g<gap>/<field>` and its field.
pub fn parse_metric(key: &str) -> Option<(usize, &str)> {
    let (g, field) = key.strip_prefix("recall/g")?.split_once('/')?;
    Some((g.parse().ok()?, field))
}

/// Merge `scores` into `RUN/recall.json` (one entry per gap, the newest kept).
pub fn write(run: &std::path::Path, step: u64, scores: &[RecallScore]) -> Result<std::path::PathBuf> {
    let path = run.join("recall.json");
    let mut all: Vec<RecallScore> = std::fs::read_to_string(&path).ok().and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok()).and_then(|v| serde_json::from_value(v["gaps"].clone()).ok()).unwrap_or_default();
    all.retain(|a| !scores.iter().any(|s| s.gap == a.gap));
    all.extend(scores.iter().cloned());
    all.sort_by_key(|s| s.gap);
    let v = serde_json::json!({"step": step, "gaps": all});
    std::fs::write(&path, serde_json::to_string_pretty(&v)?).map_err(|e| Error::io(&path, e))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> Tok {
        Tok::load(&crate::spec::TokenizerSpec::Path("builtin".into())).unwrap()
    }

    /// A predictor that reads back at most `reach` tokens (all: `usize::MAX`): it finds the asked
    /// name's `NAME is d d d` and puts all mass on the digit; when the statement is out of its reach
    /// it spreads the mass evenly over the ten digits.
    fn reader(tok: &Tok, reach: usize) -> impl FnMut(&Item) -> Result<Vec<Vec<f32>>> + '_ {
        let v = tok.vocab_size();
        let is = tok.inner.token_to_id("is").unwrap() as i64;
        let digits: Vec<usize> = (0..10).map(|d| tok.inner.token_to_id(&d.to_string()).unwrap() as usize).collect();
        move |item: &Item| {
            let mut out = Vec::new();
            for (j, &p) in item.answers.iter().enumerate() {
                let k = j % 3; // digit k of the code; the name is 3 + k tokens before p
                let name = item.ids[p - 3 - k];
                let from = (p + 1).saturating_sub(reach);
                let seen = &item.ids[from..=p];
                let hit = seen.windows(5).position(|w| w[0] == name && w[1] == is).map(|i| seen[i + 2 + k] as usize);
                let mut lp = vec![f32::NEG_INFINITY; v];
                match hit {
                    Some(d) => lp[d] = 0.0,
                    None => digits.iter().for_each(|&d| lp[d] = -(10f32.ln())),
                }
                out.push(lp);
            }
            Ok(out)
        }
    }

    /// The answer positions are the three digits after every `answer :`, and nothing else.
    #[test]
    fn answer_positions_are_the_code_digits() {
        let tok = tok();
        let items = items(&tok, 3, 20, 40, None).unwrap();
        for (i, it) in items.iter().enumerate() {
            let words: Vec<&str> = synthetic::recall_document(3, i as u64, 40).leak().split(' ').collect();
            let asked = words.iter().filter(|w| **w == "answer").count();
            assert_eq!(it.answers.len(), 3 * asked);
            for &p in &it.answers {
                // ids = [EOD] + words: position p predicts words[p].
                assert!(words[p].len() == 1 && words[p].chars().all(|c| c.is_ascii_digit()), "{}", words[p]);
            }
        }
    }

    /// An oracle that reads everything scores 1 (loss 0); one that cannot see back as far as the
    /// gap scores the chance loss ln 10 exactly, and its accuracy is chance's (10% of digits, over
    /// ~1,800 uniform digits: within 3 points).
    #[test]
    fn an_oracle_scores_one_and_a_short_reader_scores_chance() {
        let _rng = crate::testutil::rng();
        let tok = tok();
        let gap = 64;
        let items = items(&tok, 11, 200, gap, None).unwrap();
        let all = score(&items, gap, reader(&tok, usize::MAX)).unwrap();
        assert_eq!((all.digit_accuracy, all.code_accuracy, all.loss), (1.0, 1.0, 0.0));
        assert_eq!(all.digits % 3, 0);
        assert!(all.digits > 1000, "{}", all.digits);
        let short = score(&items, gap, reader(&tok, gap)).unwrap();
        assert!((short.loss - 10f64.ln()).abs() < 1e-5, "{}", short.loss);
        assert_eq!(short.chance_loss, 10f64.ln());
        // Ties among equal digits go to the last maximum: one fixed digit, right 1 time in 10.
        assert!((short.digit_accuracy - 0.1).abs() < 0.03, "{}", short.digit_accuracy);
        assert!(short.code_accuracy < 0.02, "{}", short.code_accuracy);
    }

    /// k facts per document: every stated code is asked and scored (3k answer digits a document),
    /// and an oracle reads all of them.
    #[test]
    fn every_asked_code_of_a_multi_fact_document_is_scored() {
        let tok = tok();
        for k in [1usize, 8, 32] {
            let items = items(&tok, 4, 6, 256, Some(k)).unwrap();
            assert!(items.iter().all(|i| i.answers.len() == 3 * k), "{k}");
            let all = score(&items, 256, reader(&tok, usize::MAX)).unwrap();
            assert_eq!((all.digits, all.code_accuracy), (18 * k, 1.0));
            let short = score(&items, 256, reader(&tok, 256)).unwrap();
            assert!((short.loss - 10f64.ln()).abs() < 1e-5, "{k}: {}", short.loss);
        }
    }

    /// `eval.recall` and the recall corpus's options: defaults filled, every bad key or value
    /// refused naming it.
    #[test]
    fn recall_spec_keys_are_checked_and_named() {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/experiments/tiny-recall-smoke.yaml")).unwrap();
        let load = |sets: &[&str]| crate::spec::from_str(&text, "smoke", &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let s = load(&["eval.recall={gaps: [8, 64]}"]).unwrap();
        let r = s.eval.recall.as_ref().unwrap();
        assert_eq!((r.samples, r.facts), (Some(100), None));
        let s = load(&["eval.recall={gaps: [64]}", "data.train.synthetic.recall_facts=6", "data.train.synthetic.recall_gap=[16, 64]"]).unwrap();
        assert_eq!(s.eval.recall.as_ref().unwrap().facts, Some(6), "scored on the training corpus's facts");
        assert_eq!(default_facts(&s), Some(6));
        for (sets, key, want) in [
            (&["eval.recall={gap: [8]}"][..], "unknown field `gap`", "expected one of `gaps`, `samples`, `facts`"),
            (&["eval.recall={gaps: []}"], "`eval.recall.gaps`", "lists no gap"),
            (&["eval.recall={gaps: [8, 64, 8]}"], "`eval.recall.gaps`", "gap 8 is listed twice"),
            (&["eval.recall={gaps: [8], samples: 0}"], "`eval.recall.samples`", "must be > 0"),
            (&["eval.recall={gaps: [8], facts: 200}"], "`eval.recall.facts`", "200 must be in 1..=144"),
            (&["eval.recall={gaps: [8, 250]}"], "`eval.recall.gaps`", "gap 250: its documents reach 354 tokens, more than data.seq_len = 256"),
            (&["eval.recall={gaps: [8]}", "data.tokenizer=some/tokenizer.json"], "`eval.recall`", "the recall test needs the built-in word-level tokenizer"),
            (&["data.train.synthetic.recall_facts=0"], "`data.train.synthetic.recall_facts`", "0 must be in 1..=144"),
            (&["data.train.synthetic.recall_gap=[64, 8]"], "`data.train.synthetic.recall_gap`", "[64, 8]: want [LO, HI] with LO ≤ HI"),
            (&["data.train.synthetic.recall_gap=null", "data.train.synthetic.recall_facts=4"], "`data.train.synthetic.recall_facts`", "is an option of the recall corpus"),
        ] {
            let e = load(sets).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains(want), "{sets:?}: {e}");
        }
    }

    #[test]
    fn window_reach_is_layers_times_window_minus_one() {
        let _rng = crate::testutil::rng();
        let mut spec = crate::spec::from_str(crate::spec::BUILTIN_TINY, "tiny", &[]).unwrap();
        assert_eq!(window_reach(&spec), None);
        spec.attention = serde_yaml::from_str("{kind: window, window: 16}").unwrap();
        assert_eq!(window_reach(&spec), Some(spec.shape().layers * 15));
    }
}
