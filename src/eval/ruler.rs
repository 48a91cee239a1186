//! RULER's needle-in-a-haystack family (evaluation.md §3.1–3.2): the evaluation of a model on
//! samples of `data::niah` sized to a target length with the evaluated model's own tokenizer, and the
//! string-match metrics.
pub mod diagnose;

// The sample generator lives with the data (a training source uses it too, `data::needles`); these
// paths stay for the evaluators.
pub use crate::data::niah::{largest_fitting, read_essay, rng, split_sentences, task, Generator, Haystack, Kind, NiahTask, Sample, TASKS};
use crate::data::chat::ChatTemplate;
use rayon::prelude::*;

/// Tokens the model may generate (RULER's NIAH setting).
pub const TOKENS_TO_GENERATE: usize = 128;

/// RULER's post-processing: strip, control characters → newline, strip.
pub fn postprocess(prediction: &str) -> String {
    prediction.trim().chars().map(|c| if (c as u32) < 0x20 { '\n' } else { c }).collect::<String>().trim().to_string()
}

/// string_match_all: fraction of references contained in the prediction (case-insensitive), in %.
pub fn match_all(prediction: &str, refs: &[String]) -> f64 {
    let p = postprocess(prediction).to_lowercase();
    100.0 * refs.iter().filter(|r| p.contains(&r.to_lowercase())).count() as f64 / refs.len().max(1) as f64
}

/// string_match_part: 100 if any reference is contained, else 0.
pub fn match_part(prediction: &str, refs: &[String]) -> f64 {
    let p = postprocess(prediction).to_lowercase();
    if refs.iter().any(|r| p.contains(&r.to_lowercase())) { 100.0 } else { 0.0 }
}

/// The score of one (task, length) cell.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Cell {
    pub task: String,
    pub length: usize,
    pub samples: usize,
    /// string_match_all, % (the NIAH metric).
    pub score: f64,
    pub mean_prompt_tokens: f64,
    /// `--set` overrides the model was evaluated with (e.g. `attention.tokens_per_chunk=16`), joined
    /// by spaces; absent = the model as trained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overrides: Option<String>,
    /// Whether the prompts were wrapped in the model's chat template (a user turn, the answer after
    /// the assistant's generation prompt); false for models without one and with `--no-chat`.
    #[serde(default)]
    pub chat: bool,
    /// Hybrid (STILL) models: what the answer position's attention read, averaged over samples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diagnostics: Option<diagnose::CellDiagnostics>,
    /// Wall seconds the cell took (making the samples, prefill and decoding; 0 in older files):
    /// samples / seconds is the evaluation's throughput.
    #[serde(default)]
    pub seconds: f64,
}

impl Cell {
    /// The lines `eval --task` prints for the cell: its score, then any STILL diagnostics per layer.
    pub fn summary(&self) -> String {
        let c = self;
        let overrides = c.overrides.as_deref().map(|o| format!("  [{o}]")).unwrap_or_default();
        let chat = if c.chat { "  (chat template)" } else { "" };
        let rate = if c.seconds > 0.0 { format!(", {:.2} samples/s", c.samples as f64 / c.seconds) } else { String::new() };
        let mut out = format!("{:16} length {:6}: {:6.2}% over {} samples (mean prompt {:.0} tokens{rate}){overrides}{chat}\n", c.task, c.length, c.score, c.samples, c.mean_prompt_tokens);
        if let Some(d) = &c.diagnostics {
            out += &format!("  value tokens outside the window: {:.0}%\n", 100.0 * d.value_outside_window);
            let pct = |x: Option<f64>| x.map_or("  –".to_string(), |v| format!("{:3.0}%", 100.0 * v));
            for l in &d.layers {
                let [w, s, lin] = l.shares_mean.map(|x| 100.0 * x);
                out += &format!("  layer {:2}: selected (any head) {}  (best head) {}   normalizer share window {w:5.1}%  selected {s:5.1}%  linear {lin:5.1}%\n", l.layer, pct(l.recall_any_head), pct(l.recall_best_head));
            }
        }
        out
    }
}

/// The cells of a long-context task (RULER, BABILong): one per target length (prompt +
/// generation, in tokens), each scored over `samples` prompts.
#[derive(Debug, Clone, Default)]
pub struct Grid {
    pub lengths: Vec<usize>,
    pub samples: usize,
}

/// How much of a long-context task to run, where, and how prompts are given.
#[derive(Clone)]
pub struct Budget<'a> {
    pub grid: Grid,
    /// The model's chat template, when prompts are to be wrapped in it ([`wrap`]).
    pub chat: Option<&'a ChatTemplate>,
    /// Tokens generated per sample.
    pub max_new: usize,
    pub device: tch::Device,
    pub quiet: bool,
    /// Samples per forward (`--batch-size`; None: [`batch_for`]'s default).
    pub batch_size: Option<usize>,
}

/// Samples per batch on CPU when `--batch-size` is not given.
pub const CPU_BATCH: usize = 4;

/// Samples per forward for prompts of up to `len` tokens: one for STILL / LoLCATs models (their
/// chunks count from position 0, so rows cannot be padded), else `b.batch_size`, else 4 on CPU and,
/// on CUDA, what half of the free memory holds at [`crate::model::Model::sample_bytes`] each (at most 64).
pub fn batch_for(model: &crate::model::Model, b: &Budget, len: usize) -> usize {
    if !model.pads_rows() {
        return 1;
    }
    if let Some(n) = b.batch_size {
        return n.max(1);
    }
    match crate::kernels::cuda_free_memory(b.device) {
        None => CPU_BATCH,
        Some(free) => ((free / 2) / model.sample_bytes(len as u64 + b.max_new as u64)).clamp(1, 64) as usize,
    }
}

/// Generate `b.grid.samples` prompts per length, decode greedily (`b.max_new` tokens, RULER: 128), score.
/// The prompt is `input + answer_prefix` with the tokenizer's BOS (if any) prepended, as HF does.
pub fn evaluate(model: &crate::model::Model, tok: &crate::data::Tok, name: &str, essay: Option<&str>, b: &Budget) -> crate::Result<Vec<(Cell, Vec<Record>)>> {
    let overhead = chat_overhead(b.chat, tok)?;
    let (samples, max_new, device) = (b.grid.samples, b.max_new, b.device);
    let t = task(name).ok_or_else(|| crate::Error::Other(format!("unknown RULER task `{name}` (known: {})", TASKS.join(", "))))?;
    if t.haystack == Haystack::Essay && essay.is_none() {
        return Err(crate::Error::Other(format!("{name} needs the essay haystack: pass --essay (e.g. ../shared/data/haystack/ruler_paul_graham_essays.json.gz)")));
    }
    let g = Generator::new(essay);
    let greedy = Greedy::new(model, tok, device);
    let bos = greedy.bos;
    let count = |s: &str| tok.encode(s).map(|v| v.len()).unwrap_or(usize::MAX);
    let mut cells = Vec::new();
    for &len in &b.grid.lengths {
        let bar = crate::progress::bar(samples as u64, &format!("{name} @ {len}"), b.quiet);
        let started = std::time::Instant::now();
        let (mut total, mut prompt_tokens) = (0.0, 0usize);
        let mut records = Vec::new();
        let batch = batch_for(model, b, len);
        for first in (0..samples).step_by(batch) {
            let range = first..(first + batch).min(samples);
            // Sizing a sample's haystack tokenizes it several times (a binary search): CPU work that
            // held the GPU idle most of a batched evaluation, done for the batch's samples in parallel.
            let made: Vec<crate::Result<(Sample, String, Vec<u32>, Vec<(usize, usize)>)>> = range
                .clone()
                .into_par_iter()
                .map(|i| {
                    let s = g.sized(&t, len.saturating_sub(overhead), TOKENS_TO_GENERATE, &count, &mut rng(42, len, i));
                    let prompt = wrap(b.chat, &s.input, &s.answer_prefix)?;
                    let (ids, offsets) = encode(tok, bos, &prompt)?;
                    Ok((s, prompt, ids, offsets))
                })
                .collect();
            let mut group = Vec::new();
            for (i, one) in range.zip(made) {
                let (s, prompt, ids, offsets) = one?;
                let needles = diagnose::needle_positions(&prompt, &s.queried, &offsets);
                // `routing: oracle` selects the needle spans (a diagnostic); other routings ignore them.
                let hybrid = diagnose::set_oracle(model, &needles);
                let reads = if hybrid { diagnose::probe(model, &ids, &needles, device) } else { None };
                group.push((i, s, ids, needles, reads));
            }
            let answers = greedy.answers_ids(&group.iter().map(|g| g.2.as_slice()).collect::<Vec<_>>(), max_new)?;
            for ((i, s, ids, needles, reads), answer) in group.into_iter().zip(answers) {
                let score = match_all(&answer, &s.outputs);
                prompt_tokens += ids.len();
                total += score;
                let result = diagnose::SampleRecord { index: i, length: len, prompt_tokens: ids.len(), depths: s.depths.clone(), needles, prediction: answer, references: s.outputs.clone(), score, layers: reads };
                records.push(Record { sample: s, result });
                bar.inc(1);
            }
        }
        bar.finish_and_clear();
        let n = samples.max(1) as f64;
        let diagnostics = diagnose::summarize(records.iter().map(|r| &r.result));
        cells.push((Cell { task: name.to_string(), length: len, samples, score: total / n, mean_prompt_tokens: prompt_tokens as f64 / n, overrides: None, chat: b.chat.is_some(), diagnostics, seconds: started.elapsed().as_secs_f64() }, records));
    }
    Ok(cells)
}

/// The prompt a model is asked: with a chat template, `input` as the user's turn and `answer_prefix`
/// after the assistant's generation prompt (RULER's chat format); without, `input + answer_prefix`.
pub fn wrap(chat: Option<&ChatTemplate>, input: &str, answer_prefix: &str) -> crate::Result<String> {
    let Some(t) = chat else { return Ok(format!("{input}{answer_prefix}")) };
    let turn = [crate::data::chat::Message { role: "user".into(), content: input.into() }];
    Ok(format!("{}{answer_prefix}", t.render(&turn, true)?))
}

/// Tokens a chat template adds around a user turn (system prompt, role markers): taken off the
/// length a sample is sized to, so that wrapped prompts still fit the target length.
pub fn chat_overhead(chat: Option<&ChatTemplate>, tok: &crate::data::Tok) -> crate::Result<usize> {
    match chat {
        None => Ok(0),
        Some(_) => Ok(tok.encode(&wrap(chat, "", "")?)?.len()),
    }
}

/// One scored sample: the generated sample and what `ruler_samples/*.jsonl` records of it.
#[derive(Debug, Clone)]
pub struct Record {
    pub sample: Sample,
    pub result: diagnose::SampleRecord,
}

/// Merge `cells` into the run's `file` (`ruler.json` / `babilong.json`): a cell replaces the one of
/// the same task, length and overrides. Returns the file's path.
pub fn write_cells(run: &std::path::Path, file: &str, cells: &[Cell]) -> crate::Result<std::path::PathBuf> {
    let path = run.join(file);
    let mut all: Vec<Cell> = std::fs::read_to_string(&path).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default();
    all.retain(|c| !cells.iter().any(|n| n.task == c.task && n.length == c.length && n.overrides == c.overrides && n.chat == c.chat));
    all.extend(cells.iter().cloned());
    std::fs::write(&path, serde_json::to_string_pretty(&all)?).map_err(|e| crate::Error::io(&path, e))?;
    Ok(path)
}

/// A spec's `eval.ruler` on the model the trainer holds before it marks the run done
/// (`train::TrainOptions::finish`): ruler.json and ruler_samples/ into `run`, as `attnlab eval
/// --task ruler:<task>` writes them (without the lm-eval file), no chat template (models trained
/// here), on the spec's training device. Nothing without `eval.ruler`.
pub fn score_trained(model: &crate::model::Model, tok: &crate::data::Tok, spec: &crate::spec::Spec, run: &std::path::Path, quiet: bool) -> crate::Result<()> {
    let Some(r) = &spec.eval.ruler else { return Ok(()) };
    let essay = r.essay.as_deref().map(read_essay).transpose()?;
    let device = crate::device::parse_device(spec.train.device.as_deref().unwrap_or("auto"))?;
    let grid = Grid { lengths: r.lengths.clone(), samples: r.samples.unwrap_or(100) };
    let b = Budget { grid, chat: None, max_new: r.max_new_tokens.unwrap_or(TOKENS_TO_GENERATE), device, quiet, batch_size: None };
    let (cells, _) = evaluate_into(run, model, tok, &r.task, essay.as_deref(), &b, None)?;
    write_cells(run, "ruler.json", &cells)?;
    Ok(())
}

/// [`evaluate`], each cell (tagged with `overrides`) and its per-sample records written under `run`
/// as it comes ([`write_samples`]): the cells, and every record.
#[allow(clippy::too_many_arguments)]
pub fn evaluate_into(
    run: &std::path::Path,
    model: &crate::model::Model,
    tok: &crate::data::Tok,
    name: &str,
    essay: Option<&str>,
    b: &Budget,
    overrides: Option<String>,
) -> crate::Result<(Vec<Cell>, Vec<Record>)> {
    let (mut cells, mut all) = (Vec::new(), Vec::new());
    for (cell, records) in evaluate(model, tok, name, essay, b)? {
        let cell = Cell { overrides: overrides.clone(), ..cell };
        write_samples(run, &cell, &records)?;
        cells.push(cell);
        all.extend(records);
    }
    Ok((cells, all))
}

/// Write one cell's per-sample records to `ruler_samples/<task>-<length>[-<overrides>].jsonl`.
pub fn write_samples(run: &std::path::Path, cell: &Cell, records: &[Record]) -> crate::Result<std::path::PathBuf> {
    let slug: String = cell.overrides.as_deref().map(|o| format!("-{}", o.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect::<String>())).unwrap_or_default();
    let dir = run.join("ruler_samples");
    std::fs::create_dir_all(&dir).map_err(|e| crate::Error::io(&dir, e))?;
    let path = dir.join(format!("{}-{}{slug}.jsonl", cell.task, cell.length));
    let mut text = String::new();
    for r in records {
        text.push_str(&serde_json::to_string(&r.result)?);
        text.push('\n');
    }
    std::fs::write(&path, text).map_err(|e| crate::Error::io(&path, e))?;
    Ok(path)
}

/// The token ids of `prompt` with `bos` first (if any) and each token's byte span in `prompt` (BOS: (0, 0)).
fn encode(tok: &crate::data::Tok, bos: Option<u32>, prompt: &str) -> crate::Result<(Vec<u32>, Vec<(usize, usize)>)> {
    let enc = tok.inner.encode(prompt, false).map_err(|e| crate::Error::Tokenizer(e.to_string()))?;
    let mut ids: Vec<u32> = bos.into_iter().collect();
    let mut offsets: Vec<(usize, usize)> = bos.iter().map(|_| (0, 0)).collect();
    ids.extend_from_slice(enc.get_ids());
    offsets.extend_from_slice(enc.get_offsets());
    Ok((ids, offsets))
}

/// Greedy answers to text prompts: the tokenizer's BOS (if any) is prepended, as HF tokenizers do.
pub struct Greedy<'a> {
    model: &'a crate::model::Model,
    tok: &'a crate::data::Tok,
    bos: Option<u32>,
    device: tch::Device,
}

impl<'a> Greedy<'a> {
    pub fn new(model: &'a crate::model::Model, tok: &'a crate::data::Tok, device: tch::Device) -> Greedy<'a> {
        let bos = ["<|begin_of_text|>", "<s>"].iter().find_map(|b| tok.inner.token_to_id(b));
        Greedy { model, tok, bos, device }
    }

    /// The decoded greedy continuation of `prompt` (`max_new` tokens) and the prompt's length in tokens.
    pub fn answer(&self, prompt: &str, max_new: usize) -> crate::Result<(String, usize)> {
        let (ids, _) = self.encode(prompt)?;
        Ok((self.answer_ids(&ids, max_new)?, ids.len()))
    }

    /// The prompt's token ids (BOS first, if any) and each token's byte span in `prompt` (BOS: (0, 0)).
    pub fn encode(&self, prompt: &str) -> crate::Result<(Vec<u32>, Vec<(usize, usize)>)> {
        encode(self.tok, self.bos, prompt)
    }

    /// The decoded greedy continuation of the token ids `ids`.
    pub fn answer_ids(&self, ids: &[u32], max_new: usize) -> crate::Result<String> {
        let out = crate::eval::generate::generate(self.model, ids, max_new, crate::eval::generate::Sampling { temperature: 0.0, seed: 0 }, None, self.device);
        self.tok.decode(&out.tokens)
    }

    /// [`Greedy::answer_ids`] of several prompts, in one left-padded batch when there are several
    /// (`generate::generate_batch`).
    pub fn answers_ids(&self, prompts: &[&[u32]], max_new: usize) -> crate::Result<Vec<String>> {
        match prompts {
            [one] => Ok(vec![self.answer_ids(one, max_new)?]),
            _ => crate::eval::generate::generate_batch(self.model, prompts, max_new, None, self.device).iter().map(|t| self.tok.decode(t)).collect(),
        }
    }

    /// [`Greedy::answer`] of several prompts: the answers and the prompts' lengths in tokens.
    pub fn answers(&self, prompts: &[&str], max_new: usize) -> crate::Result<Vec<(String, usize)>> {
        let ids: Vec<Vec<u32>> = prompts.iter().map(|p| self.encode(p).map(|e| e.0)).collect::<crate::Result<_>>()?;
        let answers = self.answers_ids(&ids.iter().map(|i| i.as_slice()).collect::<Vec<_>>(), max_new)?;
        Ok(answers.into_iter().zip(ids.iter().map(|i| i.len())).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Several samples per forward (left-padded prompts of different lengths) give batch 1's
    /// predictions, scores and prompt lengths: a tiny random Llama with grouped-query heads in f64,
    /// vanilla, DAR and window.
    #[test]
    fn batched_evaluation_equals_batch_one() {
        let _rng = crate::testutil::rng();
        use crate::attention::Attention;
        use crate::spec::AttentionKind;
        let tok = crate::data::Tok::load(&crate::spec::TokenizerSpec::Path("builtin".into())).unwrap();
        for (kind, d_down, window) in [(AttentionKind::Vanilla, 0, 0), (AttentionKind::Dar, 8, 16), (AttentionKind::Window, 0, 24)] {
            let _rng = crate::testutil::seeded(3);
            let mut cfg = crate::testutil::tiny_llama(tok.padded_vocab(), crate::model::Family::Llama);
            cfg.attention = Attention::Softmax(crate::testutil::softmax(kind, d_down, window));
            let mut vs = tch::nn::VarStore::new(tch::Device::Cpu);
            let m = crate::model::Model::Llama(crate::model::Llama::new(&vs.root(), cfg));
            vs.double();
            let budget = |batch_size| Budget { grid: Grid { lengths: vec![400], samples: 5 }, chat: None, max_new: 12, device: tch::Device::Cpu, quiet: true, batch_size: Some(batch_size) };
            // A haystack of needles: prompts of different lengths.
            let one = evaluate(&m, &tok, "niah_multikey_2", None, &budget(1)).unwrap().remove(0).1;
            let three = evaluate(&m, &tok, "niah_multikey_2", None, &budget(3)).unwrap().remove(0).1;
            let lens: std::collections::BTreeSet<usize> = one.iter().map(|r| r.result.prompt_tokens).collect();
            assert!(lens.len() > 1, "the prompts must differ in length for padding to happen: {lens:?}");
            for (a, b) in one.iter().zip(&three) {
                assert_eq!((&a.result.prediction, a.result.prompt_tokens, a.result.score), (&b.result.prediction, b.result.prompt_tokens, b.result.score), "{kind:?} sample {}", a.result.index);
            }
            assert!(one.iter().any(|r| !r.result.prediction.is_empty()), "{kind:?}: something was generated");
        }
    }

    #[test]
    fn cell_summary_shows_overrides_and_layer_diagnostics() {
        let _rng = crate::testutil::rng();
        let layer = diagnose::LayerSummary { layer: 3, recall_any_head: Some(0.5), recall_best_head: None, shares_mean: [0.25, 0.5, 0.25] };
        let c = Cell { task: "niah_single_1".into(), length: 512, samples: 2, score: 50.0, mean_prompt_tokens: 480.4, overrides: Some("attention.routing=oracle".into()), chat: false, diagnostics: Some(diagnose::CellDiagnostics { value_outside_window: 0.75, layers: vec![layer] }), seconds: 1.5 };
        let lines: Vec<String> = c.summary().lines().map(String::from).collect();
        assert_eq!(lines[0], "niah_single_1    length    512:  50.00% over 2 samples (mean prompt 480 tokens, 1.33 samples/s)  [attention.routing=oracle]");
        assert_eq!(lines[1], "  value tokens outside the window: 75%");
        assert_eq!(lines[2], "  layer  3: selected (any head)  50%  (best head)   –   normalizer share window  25.0%  selected  50.0%  linear  25.0%");
        assert_eq!(Cell { diagnostics: None, ..c.clone() }.summary().lines().count(), 1);
        // The chat mark stays on the score's line (a cell's lines are read one by one).
        let chat = Cell { diagnostics: None, chat: true, ..c }.summary();
        assert_eq!(chat, "niah_single_1    length    512:  50.00% over 2 samples (mean prompt 480 tokens, 1.33 samples/s)  [attention.routing=oracle]  (chat template)\n");
    }

    #[test]
    fn scoring_on_hand_made_cases() {
        let refs = vec!["1234567".to_string(), "7654321".to_string()];
        assert_eq!(match_all(" 1234567 and 7654321\n", &refs), 100.0);
        assert_eq!(match_all("only 1234567", &refs), 50.0);
        assert_eq!(match_part("only 1234567", &refs), 100.0);
        assert_eq!(match_part("nothing", &refs), 0.0);
        assert_eq!(match_all("ABC-def", &["abc-DEF".to_string()]), 100.0);
        assert_eq!(postprocess("  a\tb\u{1}c  "), "a\nb\nc");
    }

    /// With a chat template the input is the user's turn and the answer prefix follows the
    /// assistant's generation prompt; without one, input + answer prefix.
    #[test]
    fn prompts_wrap_in_the_chat_template() {
        let _rng = crate::testutil::rng();
        let t = ChatTemplate::new("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}", "", "</s>").unwrap();
        assert_eq!(wrap(Some(&t), "Find the key.", " The key is").unwrap(), "<user>Find the key.</s><assistant> The key is");
        assert_eq!(wrap(None, "Find the key.", " The key is").unwrap(), "Find the key. The key is");
        let old: Cell = serde_json::from_str(r#"{"task": "niah_single_1", "length": 512, "samples": 2, "score": 50.0, "mean_prompt_tokens": 480.0}"#).unwrap();
        assert!(!old.chat, "result files written before the flag were plain prompts");
    }
}
