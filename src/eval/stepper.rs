//! The decode loop after a prefill: one token per row per step, chosen on the device (greedy, or
//! sampled by the Gumbel-max trick: argmax(logits / T + Gumbel noise) is a draw from
//! softmax(logits / T)) and fed back without a trip through the host, which reads the tokens every
//! [`STOP_CHECK_EVERY`] steps when a stop token may end the rows.
//!
//! Where every layer has a device-side step (`LayerOp::decode_at`: vanilla, window, DAR, uniform,
//! STILL, LoLCATs' terrace window; GPT-NeoX and Llama alike), the step's position is a device tensor
//! and its shapes depend on a span of cache slots alone (the smallest power of two ≥ 256 holding the
//! position, at most the reservation); what a step cannot do at fixed shapes (STILL / LoLCATs route
//! a chunk every C tokens) runs before it on the host's side (`LayerOp::prepare_at`), outside the graph:
//! on CUDA one graph per span is captured (`kernels::cuda::Graph`, gpt-fast's design point: a
//! static cache, one graph launch per token) and replayed; elsewhere, or when capture fails, the
//! same step runs eagerly. Other models take `Model::extend` per token.
use super::generate::{Cache, Sampling};
use crate::attention::cache::StepAt;
use crate::kernels::cuda::Graph;
use crate::model::Model;
use tch::{Device, Kind, Tensor};

/// While generating with a stop token, the host reads the new tokens (and looks for it) once every
/// this many steps; the device runs ahead in between (tokens after the stop are dropped).
pub const STOP_CHECK_EVERY: usize = 16;

/// What [`decode`] chose.
pub struct Decoded {
    /// Per row, up to `max_new` tokens, ending after its first stop token (kept).
    pub rows: Vec<Vec<u32>>,
    /// Forward steps run after the prefill.
    pub steps: i64,
    /// Whether the steps ran as CUDA-graph replays.
    pub graphed: bool,
}

/// The next token of each row `[B, 1]` from logits `[B, 1, V]` (or `[B, V]`).
pub fn choose(logits: &Tensor, sampling: Sampling) -> Tensor {
    let l = logits.view([logits.size()[0], -1]);
    if sampling.temperature <= 0.0 {
        return l.argmax(-1, true);
    }
    let u = Tensor::rand_like(&l.to_kind(Kind::Float));
    // −log(−log u): u = 0 gives −∞ (never chosen), as it should.
    (l.to_kind(Kind::Float) / sampling.temperature - (-u.log()).log()).argmax(-1, true)
}

/// The cache slots a device-side step at position `pos` reads: one span serves every position
/// below it, so a graph is captured about log2(length) times at most.
fn span_for(pos: i64, reserved: i64) -> i64 {
    ((pos + 1).max(256) as u64).next_power_of_two().min(reserved as u64) as i64
}

/// Decode after the prefill (its last logits `[B, 1, V]`): up to `max_new` tokens per row, the
/// first chosen from `logits`, then one forward per further token. `reserved`: the tokens the
/// cache was reserved for (prompt + max_new at least).
pub fn decode(model: &Model, cache: &mut Cache, logits: &Tensor, max_new: usize, sampling: Sampling, stop: Option<u32>, reserved: i64) -> Decoded {
    if max_new == 0 {
        return Decoded { rows: vec![Vec::new(); logits.size()[0] as usize], steps: 0, graphed: false };
    }
    tch::manual_seed(sampling.seed as i64);
    let first = choose(logits, sampling);
    tch::no_grad(|| device_steps(model, cache, first, max_new, sampling, stop, reserved))
}

/// Rows of the chosen tokens `[B, n]` (device), each cut after its first stop; whether every row stopped.
fn rows_of(chosen: &Tensor, stop: Option<u32>) -> (Vec<Vec<u32>>, bool) {
    let (b, n) = (chosen.size()[0] as usize, chosen.size()[1] as usize);
    let ids: Vec<i64> = Vec::try_from(chosen.to_device(Device::Cpu).contiguous().view([-1])).expect("token ids");
    let mut all = true;
    let rows = (0..b)
        .map(|r| {
            let row = &ids[r * n..(r + 1) * n];
            let end = row.iter().position(|&t| Some(t as u32) == stop);
            all &= end.is_some();
            row[..end.map_or(n, |e| e + 1)].iter().map(|&t| t as u32).collect()
        })
        .collect();
    (rows, all)
}

/// Whether every row of the chosen tokens `[B, n]` holds the stop token.
fn all_stopped(chosen: &Tensor, stop: u32) -> bool {
    chosen.eq(stop as i64).any_dim(1, false).all().int64_value(&[]) != 0
}

/// One `Model::extend` per token (models without a device-side step).
fn host_steps(model: &Model, cache: &mut Cache, first: Tensor, max_new: usize, sampling: Sampling, stop: Option<u32>) -> Decoded {
    let mut chosen = vec![first];
    let mut steps = 0;
    while chosen.len() < max_new {
        if let Some(s) = stop {
            if chosen.len() % STOP_CHECK_EVERY == 0 && all_stopped(&Tensor::cat(&chosen, 1), s) {
                break;
            }
        }
        let logits = model.extend(cache, chosen.last().expect("a token"));
        steps += 1;
        chosen.push(choose(&logits, sampling));
    }
    Decoded { rows: rows_of(&Tensor::cat(&chosen, 1), stop).0, steps, graphed: false }
}

/// The device-side steps: ids, position and the token matrix are buffers the step writes in place.
fn device_steps(model: &Model, cache: &mut Cache, first: Tensor, max_new: usize, sampling: Sampling, stop: Option<u32>, reserved: i64) -> Decoded {
    let device = first.device();
    let base = cache.len();
    assert!(base + max_new as i64 <= reserved + 1, "decode: {base} + {max_new} tokens beyond the {reserved} reserved");
    let ids = first.copy();
    let out = Tensor::zeros([first.size()[0], max_new as i64], (Kind::Int64, device));
    out.narrow(1, 0, 1).copy_(&first);
    let pos = Tensor::from_slice(&[base]).to_device(device);
    // The step at position p writes its token into column p − base + 1.
    let step = |cache: &mut Cache, span: i64| -> bool {
        let at = StepAt { pos: pos.shallow_clone(), span };
        let Some(h) = model.extend_hidden_at(cache, &ids, &at) else { return false };
        let next = choose(&model.logits(&h), sampling);
        let _ = ids.shallow_clone().copy_(&next);
        let _ = out.shallow_clone().index_copy_(1, &(&pos - (base - 1)), &next);
        let _ = pos.shallow_clone().g_add_scalar_(1);
        true
    };
    let (mut written, mut graph): (usize, Option<(i64, Graph)>) = (1, None);
    let mut graphs = matches!(device, Device::Cuda(_));
    let mut graphed = false;
    let mut checked = 1;
    while written < max_new {
        if let Some(s) = stop {
            if written - checked >= STOP_CHECK_EVERY {
                checked = written;
                if all_stopped(&out.narrow(1, 0, written as i64), s) {
                    break;
                }
            }
        }
        let p = base + written as i64 - 1;
        let span = span_for(p, reserved);
        // Outside the graph: what the step cannot do at fixed shapes (STILL / LoLCATs route a chunk).
        model.prepare_step_at(cache, p, reserved);
        match &graph {
            Some((s, g)) if *s == span => {
                g.replay().unwrap_or_else(|e| panic!("decode: replaying a CUDA graph: {e}"));
            }
            _ if graphs => {
                graph = None;
                let Device::Cuda(i) = device else { unreachable!() };
                let mut calls = 0;
                let mut supported = true;
                match Graph::capture(i, || {
                    calls += 1;
                    supported &= step(cache, span);
                }) {
                    Some(Ok(g)) if supported => {
                        graph = Some((span, g));
                        graphed = true;
                    }
                    Some(Ok(_)) => {
                        // The layers have no device-side step: nothing ran.
                        return host_steps(model, cache, first, max_new, sampling, stop);
                    }
                    Some(Err(e)) => {
                        eprintln!("attnlab: decode runs without CUDA graphs ({e})");
                        graphs = false;
                        if calls == 0 && !step(cache, span) {
                            return host_steps(model, cache, first, max_new, sampling, stop);
                        }
                    }
                    None => {
                        graphs = false;
                        if !step(cache, span) {
                            return host_steps(model, cache, first, max_new, sampling, stop);
                        }
                    }
                }
            }
            _ => {
                if !step(cache, span) {
                    return host_steps(model, cache, first, max_new, sampling, stop);
                }
            }
        }
        cache.advance(1);
        written += 1;
    }
    drop(graph);
    let steps = written as i64 - 1;
    Decoded { rows: rows_of(&out.narrow(1, 0, written as i64), stop).0, steps, graphed }
}
