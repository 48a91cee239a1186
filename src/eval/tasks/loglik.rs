//! Log-likelihood of continuations given contexts, as lm-evaluation-harness computes it.
//!
//! Tokenization (lm-eval `_encode_pair`): trailing whitespace of the context moves to the front of
//! the continuation; `whole = encode(context + continuation)`, `ctx = encode(context)`, and the
//! continuation tokens are `whole[len(ctx)..]`. An empty context is the prefix token (EOS) alone.
//! Scoring: the model reads `(ctx + cont)[-(max_len+1)..][..-1]` and the log-probabilities of the
//! continuation tokens at its last `len(cont)` positions are summed.
//!
//! Batching: requests whose model input is identical share one row (all single-token
//! continuations of one context: MMLU's " A"…" D", CSQA's letters cost one forward of the context);
//! rows are sorted by length and packed into batches of at most `batch_tokens` padded tokens; only
//! the scored positions go through the output projection.
use crate::data::Tok;
use crate::model::Model;
use crate::Result;
use std::collections::HashMap;
use tch::{Device, Kind, Tensor};

#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub context: Vec<u32>,
    pub continuation: Vec<u32>,
}

/// lm-eval's `_encode_pair` (see the module docs). `prefix` stands in for an empty context.
pub fn encode_pair(tok: &Tok, context: &str, continuation: &str, prefix: u32) -> Result<Request> {
    let trimmed = context.trim_end();
    let (ctx, cont) = (trimmed, format!("{}{continuation}", &context[trimmed.len()..]));
    if ctx.is_empty() {
        return Ok(Request { context: vec![prefix], continuation: tok.encode(&cont)? });
    }
    let whole = tok.encode(&format!("{ctx}{cont}"))?;
    let context_ids = tok.encode(ctx)?;
    let continuation = whole.get(context_ids.len()..).unwrap_or(&[]).to_vec();
    Ok(Request { context: context_ids, continuation })
}

/// The model input of a request and where its continuation is scored.
struct Plan {
    input: Vec<u32>,
    /// First scored position in `input` (positions `first..input.len()` predict the targets).
    first: usize,
    targets: Vec<u32>,
}

fn plan(r: &Request, max_len: usize) -> Plan {
    let mut full: Vec<u32> = r.context.iter().chain(&r.continuation).copied().collect();
    let keep = full.len().min(max_len + 1);
    full.drain(..full.len() - keep);
    let n = r.continuation.len().min(full.len() - 1);
    let input = full[..full.len() - 1].to_vec();
    Plan { first: input.len() - n, targets: full[full.len() - n..].to_vec(), input }
}

/// Summed log-probability of each request's continuation (natural log), in request order.
pub fn loglikelihoods(model: &Model, requests: &[Request], max_len: usize, batch_tokens: usize, device: Device) -> Vec<f64> {
    let plans: Vec<Plan> = requests.iter().map(|r| plan(r, max_len)).collect();
    // One row per distinct input.
    let mut row_of: HashMap<&[u32], usize> = HashMap::new();
    let mut rows: Vec<&[u32]> = Vec::new();
    let req_row: Vec<usize> = plans
        .iter()
        .map(|p| {
            *row_of.entry(p.input.as_slice()).or_insert_with(|| {
                rows.push(p.input.as_slice());
                rows.len() - 1
            })
        })
        .collect();
    let mut by_row: Vec<Vec<usize>> = vec![Vec::new(); rows.len()];
    for (i, &r) in req_row.iter().enumerate() {
        by_row[r].push(i);
    }
    // Longest first, so each batch's padding is bounded by its first row.
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by_key(|&r| std::cmp::Reverse(rows[r].len()));
    let mut out = vec![0.0; requests.len()];
    let mut at = 0;
    while at < order.len() {
        let width = rows[order[at]].len().max(1);
        let per_batch = (batch_tokens / width).max(1);
        let batch: Vec<usize> = order[at..(at + per_batch).min(order.len())].to_vec();
        at += batch.len();
        let mut ids = vec![0i64; batch.len() * width];
        for (b, &r) in batch.iter().enumerate() {
            for (t, &x) in rows[r].iter().enumerate() {
                ids[b * width + t] = i64::from(x);
            }
        }
        // (flat position, target, request) for every scored token of the batch.
        let (mut pos, mut tgt, mut owner) = (Vec::new(), Vec::new(), Vec::new());
        for (b, &r) in batch.iter().enumerate() {
            for &q in &by_row[r] {
                for (k, &t) in plans[q].targets.iter().enumerate() {
                    pos.push((b * width + plans[q].first + k) as i64);
                    tgt.push(i64::from(t));
                    owner.push(q);
                }
            }
        }
        let lp: Vec<f64> = tch::no_grad(|| {
            let x = Tensor::from_slice(&ids).view([batch.len() as i64, width as i64]).to_device(device);
            let h = model.hidden(&x);
            let d = h.size()[2];
            let sel = h.view([-1, d]).index_select(0, &Tensor::from_slice(&pos).to_device(device));
            let logp = model.logits(&sel).to_kind(Kind::Float).log_softmax(-1, Kind::Float);
            let picked = logp.gather(1, &Tensor::from_slice(&tgt).to_device(device).unsqueeze(1), false).squeeze_dim(1);
            Vec::<f64>::try_from(picked.to_kind(Kind::Double).to_device(Device::Cpu)).expect("log-probs to Vec")
        });
        for (v, q) in lp.into_iter().zip(owner) {
            out[q] += v;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::llama::{Llama, LlamaConfig, RopeScaling};

    fn tiny_model() -> (tch::nn::VarStore, Model) {
        let _rng = crate::testutil::seeded(7);
        let vs = tch::nn::VarStore::new(Device::Cpu);
        let cfg = LlamaConfig {
            vocab_size: 50,
            hidden_size: 16,
            intermediate_size: 32,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::Default,
            tie_word_embeddings: false,
            max_position_embeddings: 64,
            family: Default::default(),
            attention: Default::default(),
        };
        let m = Model::Llama(Llama::new(&vs.root(), cfg));
        (vs, m)
    }

    /// The explicit computation: forward context + continuation alone, sum log-softmax at each
    /// continuation token's preceding position.
    fn explicit(model: &Model, r: &Request) -> f64 {
        let full: Vec<i64> = r.context.iter().chain(&r.continuation).map(|&x| i64::from(x)).collect();
        let logits = tch::no_grad(|| model.forward(&Tensor::from_slice(&full).view([1, -1])));
        let lp = logits.squeeze_dim(0).to_kind(Kind::Double).log_softmax(-1, Kind::Double);
        let c = r.context.len();
        (0..r.continuation.len()).map(|k| lp.double_value(&[(c + k - 1) as i64, i64::from(r.continuation[k])])).sum()
    }

    /// Batched, deduplicated, padded scoring equals the per-request computation, whatever the batch size.
    #[test]
    fn batched_scores_equal_explicit_per_choice_log_probs() {
        let _rng = crate::testutil::rng();
        let (_vs, model) = tiny_model();
        let reqs = vec![
            // Four single-token choices after one context (share a row).
            Request { context: vec![1, 2, 3, 4, 5], continuation: vec![10] },
            Request { context: vec![1, 2, 3, 4, 5], continuation: vec![11] },
            Request { context: vec![1, 2, 3, 4, 5], continuation: vec![12] },
            Request { context: vec![1, 2, 3, 4, 5], continuation: vec![13] },
            // Multi-token continuations of different lengths (padding inside a batch).
            Request { context: vec![7, 8], continuation: vec![20, 21, 22] },
            Request { context: vec![7, 8], continuation: vec![23] },
            Request { context: vec![9], continuation: vec![30, 31, 32, 33, 34, 35, 36] },
        ];
        let want: Vec<f64> = reqs.iter().map(|r| explicit(&model, r)).collect();
        for batch_tokens in [1, 8, 4096] {
            let got = loglikelihoods(&model, &reqs, 64, batch_tokens, Device::Cpu);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() < 1e-4, "batch_tokens {batch_tokens}, request {i}: {g} vs {w}");
            }
        }
        // Different choices of one context really get different scores (the test can fail).
        assert!((want[0] - want[1]).abs() > 1e-6);
    }

    /// Left truncation keeps the last max_len + 1 tokens, as lm-eval.
    #[test]
    fn long_inputs_are_left_truncated() {
        let _rng = crate::testutil::rng();
        let (_vs, model) = tiny_model();
        let long = Request { context: (1..30).collect(), continuation: vec![40, 41] };
        let cut = Request { context: (20..30).collect(), continuation: vec![40, 41] };
        let got = loglikelihoods(&model, &[long], 11, 4096, Device::Cpu)[0];
        assert!((got - explicit(&model, &cut)).abs() < 1e-4);
    }

    /// Whitespace at the end of the context moves to the continuation; the continuation is what
    /// the joint encoding adds after the context's tokens.
    #[test]
    fn encode_pair_moves_trailing_space() {
        let tok = Tok::from_json(&crate::testutil::shared_text("data/tokenizers/gpt-neox-20b.json"), "neox").unwrap();
        let a = encode_pair(&tok, "Answer: ", "B", 0).unwrap();
        let b = encode_pair(&tok, "Answer:", " B", 0).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.context, tok.encode("Answer:").unwrap());
        assert_eq!(a.continuation, tok.encode(" B").unwrap());
        assert_eq!(encode_pair(&tok, "", "Hello", 0).unwrap().context, vec![0]);
    }
}
