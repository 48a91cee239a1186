//! `attnlab bench-decode`: KV-cache memory and decode speed of every attention variant at one model
//! size, over context lengths (issue 6). The GPT-NeoX variants (vanilla, DAR, uniform) are built from
//! the spec (and window: sliding-window only); the linearized hybrids' students (STILL, LoLCATs, …) are Llamas of the same width, depth, heads, MLP width and
//! vocabulary. Weights and prompt tokens are random: the numbers are speed and memory, not quality.
use super::generate::{decode_bench, DecodeBench, Traced};
use crate::attention::{Attention, Variant};
use crate::model::{Llama, Model};
use crate::spec::{AttentionKind, Spec};
use crate::{Error, Result};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use tch::{nn::VarStore, Device};

/// The attention names `--attention` knows, with what they build: every softmax kind, then every
/// registered hybrid's models (`HybridKind::DECODE_BENCH`).
pub fn names() -> Vec<(&'static str, String)> {
    let softmax = AttentionKind::ALL.iter().map(|k| (k.name(), k.decode_bench_model().to_string()));
    softmax.chain(Variant::decode_bench_models().into_iter().map(|(name, yaml, what)| (name, format!("{yaml}: {what}")))).collect()
}

/// What `--attention` benches when not given: vanilla, DAR and uniform, then every registered
/// hybrid's bench-decode models.
pub fn default_names() -> String {
    ["vanilla", "dar", "uniform"].into_iter().chain(Variant::decode_bench_models().into_iter().map(|m| m.0)).collect::<Vec<_>>().join(",")
}

/// The hybrid operator of a hybrid's bench-decode name, or of `name={kind: …, …}` (any hybrid.yaml).
fn hybrid_variant(name: &str) -> Option<Result<Variant>> {
    let yaml = match Variant::decode_bench_models().into_iter().find(|m| m.0 == name) {
        Some((_, yaml, _)) => yaml,
        None => name.split_once('=')?.1,
    };
    Some(serde_yaml::from_str(yaml).map_err(|e| Error::Other(format!("--attention `{name}`: {e}"))))
}

/// `--attention`'s list: split at commas outside `{…}`, so that `a={kind: still, chunk: 32},vanilla` is two names.
pub fn split_names(list: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth) = (Vec::new(), String::new(), 0i32);
    for ch in list.chars() {
        match ch {
            '{' | '[' => depth += 1,
            '}' | ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur).trim().to_string());
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    out.push(cur.trim().to_string());
    out.retain(|n| !n.is_empty());
    out
}

/// The label of a row: the name before any `=`.
fn label(name: &str) -> &str {
    name.split_once('=').map_or(name, |(n, _)| n)
}

/// Build the random-initialised model of `name` at the size of `base` (bf16 on CUDA).
pub fn bench_model(base: &Spec, name: &str, vocab: usize, device: Device) -> Result<(VarStore, Model)> {
    let bad = |k: String, m: String| Error::Other(format!("{k}: {m}"));
    let mut vs = VarStore::new(device);
    let model = match (AttentionKind::from_name(name), hybrid_variant(name)) {
        (_, Some(variant)) => {
            let mut s = base.with_attention(AttentionKind::Vanilla).map_err(|(k, m)| bad(k, m))?;
            s.model.vocab.get_or_insert(vocab);
            let mut cfg = crate::train::run::llama_config(&s);
            cfg.attention = Attention::Linearized(variant?);
            Model::Llama(Llama::build(&vs.root(), cfg)?)
        }
        (Some(kind), None) => {
            let mut s = base.with_attention(kind).map_err(|(k, m)| bad(k, m))?;
            s.model.vocab.get_or_insert(vocab);
            crate::train::run::build_model(&s, &vs)
        }
        (None, None) => {
            let known: Vec<&str> = names().iter().map(|n| n.0).collect();
            return Err(Error::Other(format!("--attention `{name}`: unknown (known: {}, or NAME={{kind: {}, …}})", known.join(", "), Variant::NAMES.join("|"))));
        }
    };
    if device.is_cuda() {
        vs.bfloat16();
    }
    Ok((vs, model))
}

/// The trace of one profiled (part, attention, context, repeat) in `bench-decode --profile DIR`.
pub fn trace_name(part: Traced, attention: &str, context: i64, repeat: usize) -> String {
    format!("{}-{attention}-{context}-r{repeat}.json", part.name())
}

/// Measure every (attention, context) pair `repeats` times, interleaved (each repeat runs every
/// attention at every context, so that drifts of the machine spread over all of them), calling
/// `each` on every row as it comes. A context that fails (out of memory) is reported on stderr and
/// ends that attention's sweeps at it and beyond: larger ones would fail too. With `profile`, each
/// row's decode steps (or its prefill) run under libtorch's profiler, its trace in that folder
/// ([`trace_name`]).
#[allow(clippy::too_many_arguments)]
pub fn run(
    base: &Spec,
    names: &[String],
    lengths: &[i64],
    new_tokens: usize,
    repeats: usize,
    vocab: usize,
    device: Device,
    profile: Option<(&Path, Traced)>,
    mut each: impl FnMut(&DecodeBench),
) -> Result<Vec<DecodeBench>> {
    let mut models = Vec::new();
    for name in names {
        // Every model from the same seed: the greedy tokens (tokens_digest) of one model in two
        // processes (graphed and eager, say) are comparable.
        tch::manual_seed(0);
        let (vs, model) = bench_model(base, name, vocab, device)?;
        // Warm-up (CUDA context, cuBLAS handles, allocator) outside the timed runs.
        decode_bench(&model, label(name), 256, 4, device, None)?;
        models.push((name, vs, model));
    }
    let mut fails_at: Vec<Option<i64>> = vec![None; models.len()];
    let mut rows = Vec::new();
    for repeat in 0..repeats {
        for ((name, _vs, model), fail) in models.iter().zip(fails_at.iter_mut()) {
            for &t in lengths {
                if fail.is_some_and(|f| t >= f) {
                    break;
                }
                let trace = profile.map(|(dir, part)| (dir.join(trace_name(part, label(name), t, repeat)), part));
                match catch_unwind(AssertUnwindSafe(|| decode_bench(model, label(name), t, new_tokens, device, trace.as_ref().map(|(p, part)| (p.as_path(), *part))))) {
                    Ok(r) => {
                        let mut r = r?;
                        r.repeat = repeat;
                        each(&r);
                        rows.push(r);
                    }
                    Err(_) => {
                        eprintln!("{} at context {t}: failed (out of memory?); skipping it and longer contexts", label(name));
                        *fail = Some(t);
                        break;
                    }
                }
            }
        }
    }
    Ok(rows)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 { xs[n / 2] } else { (xs[n / 2 - 1] + xs[n / 2]) / 2.0 }
}

/// A Markdown table, one line per (attention, context): cache size (and its ratio to vanilla's at
/// the same context), and the medians over repeats of prefill time and decode speed.
pub fn table(rows: &[DecodeBench]) -> String {
    let vanilla = |ctx: i64| rows.iter().find(|r| r.attention == "vanilla" && r.context == ctx).map(|r| r.cache_bytes as f64);
    let mut out = String::from("| context | attention | cache MiB | cache bytes/token | × vanilla | prefill s | decode tok/s | runs |\n|---:|---|---:|---:|---:|---:|---:|---:|\n");
    let mut keys: Vec<(i64, &str)> = Vec::new();
    for r in rows {
        if !keys.contains(&(r.context, r.attention.as_str())) {
            keys.push((r.context, r.attention.as_str()));
        }
    }
    keys.sort_by_key(|k| k.0);
    for (ctx, att) in keys {
        let runs: Vec<&DecodeBench> = rows.iter().filter(|r| r.context == ctx && r.attention == att).collect();
        let r = runs[0];
        let ratio = vanilla(ctx).map_or("–".into(), |v| format!("{:.3}", r.cache_bytes as f64 / v));
        out += &format!(
            "| {} | {} | {:.2} | {:.1} | {} | {:.3} | {:.1} | {} |\n",
            ctx,
            att,
            r.cache_bytes as f64 / (1 << 20) as f64,
            r.cache_bytes_per_token,
            ratio,
            median(runs.iter().map(|r| r.prefill_s).collect()),
            median(runs.iter().map(|r| r.decode_tokens_per_s).collect()),
            runs.len()
        );
    }
    out
}

/// Read rows written by `bench-decode --json` (other lines, e.g. logs, are skipped).
pub fn read_rows(text: &str) -> Result<Vec<DecodeBench>> {
    text.lines().filter(|l| l.trim_start().starts_with('{')).map(|l| serde_json::from_str(l).map_err(Error::from)).collect()
}

/// The line style of a row's attention: its kind's, a hybrid's for its bench names and
/// `NAME={kind: …}` rows, solid when the name is neither.
#[cfg(feature = "analysis")]
fn dash_of(name: &str) -> crate::plots::Dash {
    match (AttentionKind::from_name(name), hybrid_variant(name)) {
        (Some(kind), _) => kind.line_style(),
        (None, Some(Ok(v))) => v.line_style(),
        (None, _) => crate::attention::LineStyle::Solid,
    }
}

/// Three charts against log2(context): cache memory, decode tokens/s and prefill seconds, one line
/// per attention; writes `STEM-{cache,decode,prefill}.{png,svg}`.
#[cfg(feature = "analysis")]
pub fn plot(rows: &[DecodeBench], stem: &std::path::Path) -> Result<Vec<std::path::PathBuf>> {
    use crate::plots::{save, Chart, Line};
    let mut names: Vec<&str> = Vec::new();
    for r in rows {
        if !names.contains(&r.attention.as_str()) {
            names.push(&r.attention);
        }
    }
    let chart = |title: &str, y_label: &str, y: &dyn Fn(&DecodeBench) -> f64| {
        let lines = names
            .iter()
            .enumerate()
            .map(|(i, n)| Line {
                label: n.to_string(),
                points: rows.iter().filter(|r| r.attention == *n).map(|r| ((r.context as f64).log2(), y(r))).collect(),
                band: Vec::new(),
                // Vanilla black, as in the report's charts; each kind's registered line style.
                color: (*n != "vanilla").then_some(i),
                dash: dash_of(n),
                reference: false,
            })
            .collect();
        Chart { title: format!("{title} (random weights)"), x_label: "log2 context length (10 = 1K, 16 = 64K tokens)".into(), y_label: y_label.into(), lines, log_y: false, log_x: false }.log_y_if_wide()
    };
    let mut files = Vec::new();
    let with = |suffix: &str| std::path::PathBuf::from(format!("{}-{suffix}", stem.display()));
    files.extend(save(&chart("KV cache memory after prefill + decode", "cache MiB", &|r| r.cache_bytes as f64 / (1 << 20) as f64), &with("cache"))?);
    files.extend(save(&chart("Decode speed", "tokens / s", &|r| r.decode_tokens_per_s), &with("decode"))?);
    files.extend(save(&chart("Prefill time", "seconds", &|r| r.prefill_s), &with("prefill"))?);
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(attention: &str, context: i64, cache_bytes: i64) -> DecodeBench {
        DecodeBench { attention: attention.into(), context, cache_bytes, cache_bytes_per_token: cache_bytes as f64 / context as f64, prefill_s: 0.5, decode_tokens_per_s: 100.0, repeat: 0, new_tokens: 32, graphed: false, tokens_digest: String::new(), tokens: Vec::new(), steps: 31 }
    }

    /// The ratio column divides by vanilla's cache at the same context; repeats collapse into one
    /// line of medians; rows survive a JSON round trip.
    #[test]
    fn table_ratios_and_json_rows() {
        let _rng = crate::testutil::rng();
        let rows = vec![row("vanilla", 2048, 4 << 20), row("still", 1024, 1 << 20), row("vanilla", 1024, 2 << 20), row("still", 2048, 1 << 20)];
        let t = table(&rows);
        assert!(t.contains("| 1024 | still | 1.00 | 1024.0 | 0.500 | 0.500 | 100.0 | 1 |"), "{t}");
        assert!(t.contains("| 2048 | still | 1.00 | 512.0 | 0.250 |"), "{t}");
        let speeds = [(0, 0.9, 80.0), (1, 0.1, 300.0), (2, 0.4, 120.0)];
        let repeated: Vec<DecodeBench> = speeds.iter().map(|&(repeat, prefill_s, tps)| DecodeBench { repeat, prefill_s, decode_tokens_per_s: tps, ..row("dar", 4096, 1 << 20) }).collect();
        let t = table(&repeated);
        assert!(t.contains("| 4096 | dar | 1.00 | 256.0 | – | 0.400 | 120.0 | 3 |"), "{t}");
        let text = format!("# note\n{}\n", rows.iter().map(|r| serde_json::to_string(r).unwrap()).collect::<Vec<_>>().join("\n"));
        let back = read_rows(&text).unwrap();
        assert_eq!(back.len(), 4);
        assert_eq!((back[1].attention.as_str(), back[1].context, back[1].cache_bytes), ("still", 1024, 1 << 20));
    }

    /// Hybrids are Llamas at the spec's size; unknown names are refused with the known ones listed.
    #[test]
    fn models_at_the_spec_size() {
        let _rng = crate::testutil::rng();
        let base = crate::spec::from_str("model: {flavor: tiny}\nattention: {kind: dar, d_down: 16, window: 8}\ndata: {train: {synthetic: {seed: 1, docs: 10}}}\ntrain: {steps: 1}\n", "test", &[]).unwrap();
        let (_vs, m) = bench_model(&base, "still-budget", 128, Device::Cpu).unwrap();
        let (_vs2, n) = bench_model(&base, "vanilla", 128, Device::Cpu).unwrap();
        let (Model::Llama(h), Model::Neox(x)) = (&m, &n) else { panic!("wrong families") };
        let c = &h.cfg;
        assert_eq!((c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.vocab_size), (x.cfg.d_model, x.cfg.layers, x.cfg.heads, x.cfg.vocab));
        let s = h.layers[0].attn.still().expect("still");
        assert_eq!(s.selection.kappa, 4, "λ = ⌊(384 − 128)/⌈4096/64⌉⌋");
        let custom = bench_model(&base, "mine={kind: lolcats, window: 32}", 128, Device::Cpu).unwrap().1;
        assert!(matches!(custom, Model::Llama(ref h) if h.layers[0].attn.get::<crate::attention::lolcats::Lolcats>().is_some_and(|l| l.cfg.window == 32)));
        assert_eq!(split_names("vanilla, mine={kind: still, budget: {m: 200, max_len: 64}},dar"), ["vanilla", "mine={kind: still, budget: {m: 200, max_len: 64}}", "dar"]);
        let err = bench_model(&base, "flash", 128, Device::Cpu).err().unwrap().to_string();
        assert!(err.contains("still-budget"), "{err}");
    }
}
