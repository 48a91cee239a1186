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
//! static cache, one graph launch per token) and replayed; when capture fails, the same step runs
//! eagerly. On the CPU, and for other models, each token takes `Model::extend` ([`Steps`]).
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
pub(crate) fn span_for(pos: i64, reserved: i64) -> i64 {
    ((pos + 1).max(256) as u64).next_power_of_two().min(reserved as u64) as i64
}

/// How the steps after the prefill run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Steps {
    /// Device-side steps on CUDA (graphed), host steps elsewhere: on a CPU fixed shapes save
    /// nothing and a step over a span of masked slots reads up to twice the keys. The tiny model
    /// on 2 cores, 256 new tokens, medians of 3 interleaved runs, host ÷ device-side tok/s: vanilla
    /// 1.19× at 1K, 1.02× at 4K; DAR 1.03× / 1.02×; STILL (budget) 1.06× / 1.06×; LoLCATs 0.99× / 1.06×.
    /// `ATTNLAB_DEVICE_STEPS=1` takes device-side steps on a CPU too: `bench-decode --profile` there
    /// then lists the ops a GPU step runs (aten's forms of the kernels).
    Auto,
    /// `Model::extend_hidden_at` per token (models without one fall back to host steps).
    DeviceSide,
    /// `Model::extend` per token.
    Host,
}

/// Decode after the prefill (its last logits `[B, 1, V]`): up to `max_new` tokens per row, the
/// first chosen from `logits`, then one forward per further token. `reserved`: the tokens the
/// cache was reserved for (prompt + max_new at least).
pub fn decode(model: &Model, cache: &mut Cache, logits: &Tensor, max_new: usize, sampling: Sampling, stop: Option<u32>, reserved: i64) -> Decoded {
    decode_with(model, cache, logits, max_new, sampling, stop, reserved, Steps::Auto)
}

/// [`decode`] with the steps chosen (tests run the device-side ones on the CPU).
#[allow(clippy::too_many_arguments)]
pub fn decode_with(model: &Model, cache: &mut Cache, logits: &Tensor, max_new: usize, sampling: Sampling, stop: Option<u32>, reserved: i64, steps: Steps) -> Decoded {
    if max_new == 0 {
        return Decoded { rows: vec![Vec::new(); logits.size()[0] as usize], steps: 0, graphed: false };
    }
    tch::manual_seed(sampling.seed as i64);
    let first = choose(logits, sampling);
    let device_side = match steps {
        Steps::Auto => first.device().is_cuda() || std::env::var("ATTNLAB_DEVICE_STEPS").as_deref() == Ok("1"),
        Steps::DeviceSide => true,
        Steps::Host => false,
    };
    tch::no_grad(|| if device_side { device_steps(model, cache, first, max_new, sampling, stop, reserved) } else { host_steps(model, cache, first, max_new, sampling, stop) })
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
    let mut timing = Timing::from_env(device);
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
        timing.start();
        model.prepare_step_at(cache, p, reserved);
        timing.lap(Lap::Prepare);
        let capturing = graphs && !matches!(&graph, Some((s, _)) if *s == span);
        match &graph {
            Some((s, g)) if *s == span => {
                g.replay().unwrap_or_else(|e| panic!("decode: replaying a CUDA graph: {e}"));
            }
            _ if graphs => {
                graph = None;
                let Device::Cuda(i) = device else { unreachable!() };
                let mut calls = 0;
                let mut supported = true;
                let key = CapturedStep { model: model as *const Model as usize, device: i, batch: first.size()[0], span, sampling: format!("{sampling:?}") };
                // The eager warm-up too where a layer's first call makes state (DAR's absorbed map):
                // recorded, it would be remade in every replay.
                let warm = !crate::kernels::cuda::graph_warm_once() || !key.seen() || !model.step_state_made(cache);
                let captured = Graph::capture(i, warm, || {
                    calls += 1;
                    supported &= step(cache, span);
                });
                // Without the warm-up nothing has run yet: the graph's first replay is this step.
                let captured = match captured {
                    Some(Ok(g)) if !warm && supported => Some(g.replay().map(|()| g)),
                    other => other,
                };
                match captured {
                    Some(Ok(g)) if supported => {
                        key.remember();
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
                        // The warm-up did the step if it was called; a capture alone did nothing.
                        if (calls == 0 || !warm) && !step(cache, span) {
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
        timing.lap(if capturing { Lap::Capture } else { Lap::Step });
        cache.advance(1);
        written += 1;
    }
    timing.report();
    drop(graph);
    let steps = written as i64 - 1;
    Decoded { rows: rows_of(&out.narrow(1, 0, written as i64), stop).0, steps, graphed }
}

/// A captured decode step as [`crate::kernels::cuda::graph_warm_once`] recognises it: what decides
/// the kernels its capture records (and so the lazy initialisations its warm-up did). The model by
/// address: a model dropped and another built at its address is at worst warmed again or, if its
/// capture fails, stepped without a graph.
#[derive(PartialEq)]
struct CapturedStep {
    model: usize,
    device: usize,
    batch: i64,
    span: i64,
    sampling: String,
}

static CAPTURED: std::sync::Mutex<Vec<CapturedStep>> = std::sync::Mutex::new(Vec::new());

impl CapturedStep {
    fn seen(&self) -> bool {
        CAPTURED.lock().unwrap_or_else(|e| e.into_inner()).contains(self)
    }

    fn remember(self) {
        let mut all = CAPTURED.lock().unwrap_or_else(|e| e.into_inner());
        if !all.contains(&self) {
            all.push(self);
        }
    }
}

/// What a part of [`device_steps`] took.
#[derive(Clone, Copy)]
enum Lap {
    /// `prepare_step_at` (STILL / LoLCATs: the fixed form, made once, and a chunk's routing).
    Prepare,
    /// A step that captured a graph.
    Capture,
    /// A step that replayed one (or ran eagerly).
    Step,
}

/// `ATTNLAB_DECODE_TIMING=1`: where a decode's wall time goes, each part timed to the device's end
/// (a sync before and after it, so slower than untimed), printed on stderr when it ends.
struct Timing {
    device: Option<Device>,
    at: std::time::Instant,
    /// Per lap: the first one, the sum of the others, their count.
    laps: [(f64, f64, usize); 3],
}

impl Timing {
    fn from_env(device: Device) -> Self {
        let on = std::env::var("ATTNLAB_DECODE_TIMING").as_deref() == Ok("1");
        Timing { device: on.then_some(device), at: std::time::Instant::now(), laps: [(0.0, 0.0, 0); 3] }
    }

    fn sync(&self) {
        if let Some(Device::Cuda(i)) = self.device {
            tch::Cuda::synchronize(i as i64);
        }
    }

    fn start(&mut self) {
        if self.device.is_some() {
            self.sync();
            self.at = std::time::Instant::now();
        }
    }

    fn lap(&mut self, lap: Lap) {
        if self.device.is_none() {
            return;
        }
        self.sync();
        let ms = self.at.elapsed().as_secs_f64() * 1e3;
        let l = &mut self.laps[lap as usize];
        if l.2 == 0 { l.0 = ms } else { l.1 += ms }
        l.2 += 1;
        self.at = std::time::Instant::now();
    }

    fn report(&self) {
        if self.device.is_none() {
            return;
        }
        let part = |name: &str, (first, rest, n): (f64, f64, usize)| (n > 0).then(|| format!("{name} {first:.3} ms first, then {:.4} ms × {}", rest / (n - 1).max(1) as f64, n - 1));
        let parts: Vec<String> = [("prepare", self.laps[0]), ("capturing step", self.laps[1]), ("step", self.laps[2])].into_iter().filter_map(|(n, l)| part(n, l)).collect();
        eprintln!("attnlab decode timing: {}", parts.join("; "));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::generate::{prefill, reserve};
    use crate::spec::AttentionKind;
    use tch::nn::VarStore;

    /// Weights 20× their init: logits far apart, so that a wrong key read changes the tokens.
    fn scale_up(vs: &VarStore) {
        tch::no_grad(|| {
            for v in vs.trainable_variables() {
                let _ = v.shallow_clone().g_mul_scalar_(20.0);
            }
        });
    }

    /// Every row's tokens from `prompts` (left-padded when several) by `steps`.
    fn run(m: &Model, prompts: &[Vec<u32>], max_new: usize, sampling: Sampling, stop: Option<u32>, steps: Steps) -> Decoded {
        let len = prompts.iter().map(Vec::len).max().unwrap();
        let mut cache = m.new_cache(prompts.len() as i64, Kind::Double, Device::Cpu);
        let reserved = (len + max_new) as i64;
        reserve(&mut cache, reserved);
        if prompts.len() > 1 {
            let pads: Vec<i64> = prompts.iter().map(|p| (len - p.len()) as i64).collect();
            match &mut cache {
                Cache::Neox(c) | Cache::Llama(c) => c.set_padding(&Tensor::from_slice(&pads)),
            }
        }
        let flat: Vec<i64> = prompts.iter().flat_map(|p| std::iter::repeat_n(0, len - p.len()).chain(p.iter().map(|&t| t as i64))).collect();
        let logits = prefill(m, &mut cache, &Tensor::from_slice(&flat).view([prompts.len() as i64, len as i64]));
        decode_with(m, &mut cache, &logits, max_new, sampling, stop, reserved, steps)
    }

    /// A capture is recognised again only where everything that decides its kernels is the same.
    #[test]
    fn a_captured_step_is_known_by_model_batch_span_and_sampling() {
        let key = |model: usize, span: i64, sampling: &str| CapturedStep { model, device: 0, batch: 1, span, sampling: sampling.into() };
        // An address no model has: the registry is shared with any other test that captures.
        let base = usize::MAX - 7;
        assert!(!key(base, 128, "greedy").seen());
        key(base, 128, "greedy").remember();
        assert!(key(base, 128, "greedy").seen());
        assert!(!key(base, 256, "greedy").seen(), "another span records other kernels");
        assert!(!key(base - 1, 128, "greedy").seen(), "another model");
        assert!(!key(base, 128, "t=0.7").seen(), "another sampling");
        key(base, 128, "greedy").remember();
        assert_eq!(CAPTURED.lock().unwrap().iter().filter(|k| k.model == base).count(), 1, "remembered once");
    }

    /// The device-side loop (`extend_hidden_at` per token, STILL / LoLCATs routing in `prepare_at`
    /// between steps, tokens written on the device, the stop token read every STOP_CHECK_EVERY
    /// steps) chooses what the host loop chooses, greedy and sampled, for GPT-NeoX's softmax kinds
    /// and Llama's vanilla and DAR (left-padded batches), STILL and LoLCATs: 40 tokens after a 7-token
    /// prompt cross five chunk starts of C = 8. With a stop token, both end the rows at its first
    /// occurrence. A sliding-window LoLCATs has no device-side step and takes host steps.
    #[test]
    fn device_side_steps_choose_what_host_steps_choose() {
        let _rng = crate::testutil::rng();
        let mut models: Vec<(String, VarStore, Model)> = Vec::new();
        for (kind, d_down, w) in [(AttentionKind::Vanilla, 0, 0), (AttentionKind::Dar, 8, 3), (AttentionKind::Window, 0, 4)] {
            let _rng = crate::testutil::seeded(5);
            let mut vs = VarStore::new(Device::Cpu);
            let attention = crate::testutil::softmax(kind, d_down, w);
            let cfg = crate::model::NeoxConfig { vocab: 61, d_model: 32, layers: 2, heads: 4, ffn: 64, rotary_pct: 0.25, rotary_base: 10000.0, ln_eps: 1e-5, gelu: crate::spec::Gelu::Erf, attention };
            let m = crate::model::GptNeox::new(&vs.root(), cfg);
            vs.double();
            scale_up(&vs);
            models.push((format!("{kind:?}"), vs, Model::Neox(m)));
        }
        for yaml in ["", "{kind: dar, d_down: 8, window: 3}", "{kind: still, chunk: 8, tokens_per_chunk: 2}", "{kind: still, chunk: 8, budget: {m: 20, max_len: 48}, routing: random}", "{kind: lolcats, window: 8}", "{kind: lolcats, window: 8, decode_window: sliding}"] {
            let (vs, m) = crate::testutil::tiny_llama_model(yaml, 61, 6);
            scale_up(&vs);
            models.push((format!("llama {yaml}"), vs, m));
        }
        let prompt: Vec<u32> = vec![3, 17, 42, 8, 8, 29, 1];
        for (name, _vs, m) in &models {
            let batch = if m.pads_rows() { vec![prompt.clone(), vec![9, 4], vec![11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]] } else { vec![prompt.clone()] };
            for sampling in [Sampling { temperature: 0.0, seed: 0 }, Sampling { temperature: 1.0, seed: 3 }] {
                let host = run(m, &batch, 40, sampling, None, Steps::Host);
                let device = run(m, &batch, 40, sampling, None, Steps::DeviceSide);
                assert_eq!(device.rows, host.rows, "{name} T={}", sampling.temperature);
                assert_eq!((device.steps, host.steps), (39, 39), "{name}");
                // A stop token from the second read-back window of row 0.
                let stop = host.rows[0][STOP_CHECK_EVERY + 9];
                let at = host.rows[0].iter().position(|&t| t == stop).unwrap();
                let (h, d) = (run(m, &batch, 40, sampling, Some(stop), Steps::Host), run(m, &batch, 40, sampling, Some(stop), Steps::DeviceSide));
                assert_eq!(d.rows, h.rows, "{name}: stop token");
                assert_eq!(d.rows[0], host.rows[0][..=at], "{name}: ends at the stop token");
            }
        }
    }
}
