//! `attnlab eval RUN --task recall --lengths G`: the long-range recall test (data::synthetic's
//! recall corpus). Each document states 2–4 three-digit codes once, then at least G tokens later asks
//! for every one; only the answer digits are scored (teacher-forced: the loss at each digit and
//! whether the most likely next token is it). The digits are uniform and independent of everything
//! else, so a model that cannot see back G tokens is at chance: loss ln 10 per digit, 10% of digits
//! and 0.1% of whole codes right. A window-only model with window w and L layers sees at most
//! L · (w − 1) tokens back (each layer reaches w − 1 further), so with G above that it is provably at
//! chance; DAR scores above chance only through its compressed distant keys.
use crate::data::synthetic;
use crate::data::{Tok, EOD};
use crate::model::Model;
use crate::spec::Spec;
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

/// Documents `0..n` of the recall corpus with `gap`, tokenized. The tokenizer must keep words whole
/// (the built-in one does), so that the three tokens after `answer :` are the three digits.
pub fn items(tok: &Tok, seed: u64, n: usize, gap: usize) -> Result<Vec<Item>> {
    let id = |w: &str| tok.inner.token_to_id(w).ok_or_else(|| Error::Other(format!("--task recall: the tokenizer has no token `{w}`; recall needs the built-in word-level tokenizer (synthetic data)")));
    let (answer, colon) = (id("answer")? as i64, id(":")? as i64);
    let digits: Vec<i64> = (0..10).map(|d| id(&d.to_string()).map(|x| x as i64)).collect::<Result<_>>()?;
    let mut out = Vec::new();
    for text in synthetic::recall_documents(seed, n, gap) {
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

/// Score `model` on `n` recall documents per gap.
pub fn evaluate(model: &Model, tok: &Tok, spec: &Spec, gaps: &[usize], n: usize, device: Device) -> Result<Vec<RecallScore>> {
    let t = spec.seq_len();
    let mut out = Vec::new();
    for &gap in gaps {
        let items = items(tok, EVAL_SEED, n, gap)?;
        if let Some(long) = items.iter().map(|i| i.ids.len()).max().filter(|&l| l > t) {
            return Err(Error::Other(format!("--task recall: documents with gap {gap} reach {long} tokens, more than the model's T = {t}; give a smaller --lengths")));
        }
        let bar = crate::progress::bar(items.len() as u64, &format!("recall gap {gap}"), false);
        let mut s = score(&items, gap, |item| {
            bar.inc(1);
            Ok(tch::no_grad(|| {
                let x = Tensor::from_slice(&item.ids).view([1, -1]).to_device(device);
                let pos: Vec<i64> = item.answers.iter().map(|&p| p as i64).collect();
                let h = model.hidden(&x).squeeze_dim(0).index_select(0, &Tensor::from_slice(&pos).to_device(device));
                let lp = model.logits(&h).to_kind(Kind::Float).log_softmax(-1, Kind::Float).to_device(Device::Cpu);
                Vec::<Vec<f32>>::try_from(lp).unwrap_or_default()
            }))
        })?;
        bar.finish_and_clear();
        s.window_reach = window_reach(spec);
        out.push(s);
    }
    Ok(out)
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
        let items = items(&tok, 3, 20, 40).unwrap();
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
        let items = items(&tok, 11, 200, gap).unwrap();
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

    #[test]
    fn window_reach_is_layers_times_window_minus_one() {
        let _rng = crate::testutil::rng();
        let mut spec = crate::spec::from_str(crate::spec::BUILTIN_TINY, "tiny", &[]).unwrap();
        assert_eq!(window_reach(&spec), None);
        spec.attention = serde_yaml::from_str("{kind: window, window: 16}").unwrap();
        assert_eq!(window_reach(&spec), Some(spec.shape().layers * 15));
    }
}
