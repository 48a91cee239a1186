//! Per-sample records of the RULER needle tasks and, for hybrid (STILL) models, what the answer
//! position's attention reads in every layer: where the queried needles' value tokens sit (its
//! window, selected, or neither; per head and for the head that selected most) and the shares of its
//! output's normalizer held by the window, selected and linear terms (`Still::probe`). The answer
//! position is the prompt's last token, whose output predicts the first answer token.
use crate::model::Model;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// One queried needle located in the tokenized prompt (token indices count the BOS, if any).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NeedlePositions {
    pub key: String,
    pub value: String,
    /// Tokens `[first, end)` of the needle sentence ("One of the special magic … is: VALUE.").
    pub span: [usize; 2],
    pub key_tokens: Vec<usize>,
    pub value_tokens: Vec<usize>,
}

/// Locate each queried (key, value) needle of `prompt` in its tokens, from the tokens' byte spans
/// (`offsets`, one per token; BOS = (0, 0)). A token belongs to a span it overlaps.
pub fn needle_positions(prompt: &str, queried: &[(String, String)], offsets: &[(usize, usize)]) -> Vec<NeedlePositions> {
    let tokens = |a: usize, b: usize| -> Vec<usize> { offsets.iter().enumerate().filter(|(_, o)| o.1 > o.0 && o.0 < b && o.1 > a).map(|(i, _)| i).collect() };
    queried
        .iter()
        .filter_map(|(key, value)| {
            let at = prompt.find(&format!("for {key} is: {value}."))?;
            let start = prompt[..at].rfind("One of the special magic").unwrap_or(at);
            let key_at = at + "for ".len();
            let value_at = key_at + key.len() + " is: ".len();
            let end = value_at + value.len() + 1;
            let span = tokens(start, end);
            Some(NeedlePositions {
                key: key.clone(),
                value: value.clone(),
                span: [*span.first()?, span.last()? + 1],
                key_tokens: tokens(key_at, key_at + key.len()),
                value_tokens: tokens(value_at, value_at + value.len()),
            })
        })
        .collect()
}

/// Give a linearized model's `routing: oracle` layers the needle sentences to select. Returns whether
/// `model` is a hybrid (the only kind with something to probe).
pub fn set_oracle(model: &Model, needles: &[NeedlePositions]) -> bool {
    let Model::Llama(h) = model else { return false };
    if h.variant().is_none() {
        return false;
    }
    let positions: Vec<i64> = needles.iter().flat_map(|n| (n.span[0] as i64)..(n.span[1] as i64)).collect();
    h.set_oracle(Some(positions));
    true
}

/// What one layer's attention at the answer position reads of the needles' value tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerReads {
    pub layer: usize,
    /// Value tokens in the answer position's window (chunk c−1 and its own chunk).
    pub value_in_window: usize,
    /// Value tokens outside the window selected by at least one head, and by none.
    pub value_selected: usize,
    pub value_neither: usize,
    /// Per value token (in order): the number of heads whose Sel holds it (0 inside the window).
    pub heads_selecting: Vec<usize>,
    /// The head that selected the most value tokens, and how many.
    pub best_head: usize,
    pub value_selected_best_head: usize,
    /// Shares of the answer position's normalizer [window, selected, linear]: mean over heads, and the best head's.
    pub shares_mean: [f64; 3],
    pub shares_best_head: [f64; 3],
}

/// Prompts longer than this are not probed: the probe runs the chunked prefill over the whole prompt
/// at once (O(T · |Sel|) memory), where generation prefills in blocks.
pub const PROBE_MAX_TOKENS: usize = 16384;

/// Per-layer reads of a hybrid model on prompt `ids`; `None` for other models and for prompts over
/// [`PROBE_MAX_TOKENS`] (LoLCATs layers are skipped).
pub fn probe(model: &Model, ids: &[u32], needles: &[NeedlePositions], device: Device) -> Option<Vec<LayerReads>> {
    let Model::Llama(h) = model else { return None };
    h.variant()?;
    if ids.len() > PROBE_MAX_TOKENS {
        return None;
    }
    let input = Tensor::from_slice(&ids.iter().map(|&i| i as i64).collect::<Vec<_>>()).view([1, -1]).to_device(device);
    let values: Vec<usize> = needles.iter().flat_map(|n| n.value_tokens.iter().copied()).collect();
    let probes = h.probe(&input);
    let layers = probes
        .iter()
        .enumerate()
        .filter_map(|(layer, p)| {
            let p = p.as_ref()?;
            let t = ids.len();
            let heads = p.selected.size()[1] as usize;
            let sel: Vec<bool> = Vec::try_from(p.selected.select(0, 0).flatten(0, -1)).ok()?;
            let win: Vec<bool> = Vec::try_from(p.window.select(0, 0).select(0, 0).contiguous()).ok()?;
            let shares: Vec<f64> = Vec::try_from(p.shares.select(0, 0).to_kind(Kind::Double).flatten(0, -1)).ok()?;
            let selected_by = |head: usize, j: usize| sel[head * t + j];
            let heads_selecting: Vec<usize> = values.iter().map(|&j| if win[j] { 0 } else { (0..heads).filter(|&hd| selected_by(hd, j)).count() }).collect();
            let per_head: Vec<usize> = (0..heads).map(|hd| values.iter().filter(|&&j| !win[j] && selected_by(hd, j)).count()).collect();
            let best_head = (0..heads).max_by_key(|&hd| (per_head[hd], std::cmp::Reverse(hd))).unwrap_or(0);
            let mean = |i: usize| (0..heads).map(|hd| shares[hd * 3 + i]).sum::<f64>() / heads.max(1) as f64;
            let in_window = values.iter().filter(|&&j| win[j]).count();
            let selected = heads_selecting.iter().zip(&values).filter(|(&n, &j)| !win[j] && n > 0).count();
            Some(LayerReads {
                layer,
                value_in_window: in_window,
                value_selected: selected,
                value_neither: values.len() - in_window - selected,
                heads_selecting,
                best_head,
                value_selected_best_head: per_head[best_head],
                shares_mean: [mean(0), mean(1), mean(2)],
                shares_best_head: [shares[best_head * 3], shares[best_head * 3 + 1], shares[best_head * 3 + 2]],
            })
        })
        .collect();
    Some(layers)
}

/// One sample of a (task, length) cell, as `ruler_samples/*.jsonl` records it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SampleRecord {
    pub index: usize,
    pub length: usize,
    pub prompt_tokens: usize,
    pub depths: Vec<f64>,
    pub needles: Vec<NeedlePositions>,
    pub prediction: String,
    pub references: Vec<String>,
    /// string_match_all of this sample, %.
    pub score: f64,
    /// Hybrid models: per layer, what the answer position reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<Vec<LayerReads>>,
}

/// A cell's diagnostics: per layer, over its samples.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellDiagnostics {
    /// Share of the needles' value tokens that lie outside the answer position's window.
    pub value_outside_window: f64,
    pub layers: Vec<LayerSummary>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerSummary {
    pub layer: usize,
    /// Of the value tokens outside the window: the share selected by at least one head, and by the
    /// best head (None when every value token was in the window).
    pub recall_any_head: Option<f64>,
    pub recall_best_head: Option<f64>,
    /// Mean shares of the answer position's normalizer [window, selected, linear] (mean over heads).
    pub shares_mean: [f64; 3],
}

/// Averages of the samples' layer reads; `None` when no sample has any (not a hybrid model).
pub fn summarize<'a>(records: impl IntoIterator<Item = &'a SampleRecord>) -> Option<CellDiagnostics> {
    let with: Vec<&Vec<LayerReads>> = records.into_iter().filter_map(|r| r.layers.as_ref()).filter(|l| !l.is_empty()).collect();
    let first = with.first()?;
    let (mut outside, mut total) = (0usize, 0usize);
    for l in &with {
        outside += l[0].value_selected + l[0].value_neither;
        total += l[0].value_selected + l[0].value_neither + l[0].value_in_window;
    }
    let layers = (0..first.len())
        .map(|i| {
            let rows: Vec<&LayerReads> = with.iter().filter_map(|l| l.get(i)).collect();
            let out: usize = rows.iter().map(|r| r.value_selected + r.value_neither).sum();
            let any: usize = rows.iter().map(|r| r.value_selected).sum();
            let best: usize = rows.iter().map(|r| r.value_selected_best_head).sum();
            let recall = |n: usize| (out > 0).then(|| n as f64 / out as f64);
            let mean = |k: usize| rows.iter().map(|r| r.shares_mean[k]).sum::<f64>() / rows.len().max(1) as f64;
            LayerSummary { layer: rows[0].layer, recall_any_head: recall(any), recall_best_head: recall(best), shares_mean: [mean(0), mean(1), mean(2)] }
        })
        .collect();
    Some(CellDiagnostics { value_outside_window: if total > 0 { outside as f64 / total as f64 } else { 0.0 }, layers })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Token positions from byte offsets: the value's tokens decode to the value, the key's to the key,
    /// and the span covers the sentence; BOS shifts everything by one.
    #[test]
    fn needles_are_located_in_the_tokens() {
        let _rng = crate::testutil::rng();
        let tok = crate::data::Tok::from_json(&crate::testutil::shared_text("data/tokenizers/gpt-neox-20b.json"), "neox").unwrap();
        let prompt = "Noise. The grass is green.\nOne of the special magic number for brave-lion is: 4821937.\nMore noise. What is the number for brave-lion?";
        let enc = tok.inner.encode(prompt, false).unwrap();
        let mut ids = vec![999u32];
        ids.extend_from_slice(enc.get_ids());
        let mut offsets = vec![(0, 0)];
        offsets.extend_from_slice(enc.get_offsets());
        let found = needle_positions(prompt, &[("brave-lion".into(), "4821937".into())], &offsets);
        assert_eq!(found.len(), 1);
        let n = &found[0];
        let text = |pos: &[usize]| tok.decode(&pos.iter().map(|&i| ids[i]).collect::<Vec<_>>()).unwrap();
        assert!(text(&n.value_tokens).contains("4821937"), "value tokens decode to {:?}", text(&n.value_tokens));
        assert!(text(&n.key_tokens).contains("brave-lion") || text(&n.key_tokens).replace(' ', "").contains("brave-lion"), "{:?}", text(&n.key_tokens));
        let span: Vec<usize> = (n.span[0]..n.span[1]).collect();
        let sentence = text(&span);
        assert!(sentence.contains("One of the special magic") && sentence.contains("4821937"), "{sentence:?}");
        assert!(n.span[0] >= 1 && n.value_tokens.iter().all(|v| span.contains(v)) && n.key_tokens.iter().all(|k| span.contains(k)));
        assert!(needle_positions(prompt, &[("other-key".into(), "1".into())], &offsets).is_empty());
    }

    #[test]
    fn summary_of_layer_reads() {
        let _rng = crate::testutil::rng();
        let reads = |sel: usize, neither: usize, best: usize| LayerReads {
            layer: 0,
            value_in_window: 1,
            value_selected: sel,
            value_neither: neither,
            heads_selecting: vec![],
            best_head: 0,
            value_selected_best_head: best,
            shares_mean: [0.5, 0.25, 0.25],
            shares_best_head: [0.0; 3],
        };
        let rec = |l: Option<Vec<LayerReads>>| SampleRecord { index: 0, length: 1, prompt_tokens: 1, depths: vec![], needles: vec![], prediction: String::new(), references: vec![], score: 0.0, layers: l };
        assert!(summarize(&[rec(None)]).is_none());
        let s = summarize(&[rec(Some(vec![reads(2, 1, 1)])), rec(Some(vec![reads(0, 3, 0)]))]).unwrap();
        assert_eq!(s.layers[0].recall_any_head, Some(2.0 / 6.0));
        assert_eq!(s.layers[0].recall_best_head, Some(1.0 / 6.0));
        assert_eq!(s.value_outside_window, 6.0 / 8.0);
        assert_eq!(s.layers[0].shares_mean, [0.5, 0.25, 0.25]);
    }
}
