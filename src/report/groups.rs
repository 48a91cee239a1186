//! Which runs may be compared: decided from the resolved config, never from directory names.
//! Two runs are "like with like" when their configs differ only in the attention section and in
//! bookkeeping (output, name, device, precision, logging/eval cadence, checkpoints, cache) and in
//! their seed: same model shape, training data, tokenizer, T, steps, batch, optimizer and evaluation
//! corpora. Runs of one recipe and configuration with different seeds are repeats: the tables
//! summarise them (stats.rs) and pair each with the vanilla run of its own seed.
//! A run's attention configuration, as tables and plots compare it, is `AttentionSpec::comparable`.
use super::load::Run;
use crate::spec::{AttentionSpec, CheckpointSpec, DarAct, Flavor, ModelSpec, Precision, SourceSpec, Spec};
use serde_json::Value;
use std::collections::BTreeMap;

/// Flattened config: dotted key → value (compact JSON), so that keys compare and differences can be named.
pub type Key = BTreeMap<String, String>;

/// The scale a run belongs to: its flavor's name when the shape is the flavor's, else the shape.
pub fn scale(spec: &Spec) -> String {
    let s = spec.shape();
    if let Some(f) = spec.model.flavor {
        let (l, d, h, _, _) = f.shape();
        if (l, d, h) == (s.layers, s.d_model, s.heads) {
            return flavor_name(f);
        }
    }
    format!("d{}-L{}-H{}", s.d_model, s.layers, s.heads)
}

pub fn flavor_name(f: Flavor) -> String {
    serde_json::to_value(f).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default()
}

/// A scale in words for captions and "missing" messages.
pub fn scale_words(spec: &Spec) -> String {
    let s = spec.shape();
    match spec.model.flavor.map(flavor_name).filter(|f| *f == scale(spec)) {
        Some(f) => format!("flavor {f} (d_model {})", s.d_model),
        None => format!("d_model {}, layers {}, heads {}", s.d_model, s.layers, s.heads),
    }
}

/// What must be equal for two runs to be compared at one scale.
pub fn recipe_key(spec: &Spec) -> Key {
    let mut s = spec.clone();
    s.name = None;
    s.output = None;
    s.attention = AttentionSpec::default();
    s.train.device = None;
    s.train.precision = Precision::Auto;
    s.train.log_every = None;
    s.eval.every = None;
    s.eval.batch_size = None;
    s.checkpoint = CheckpointSpec::default();
    s.data.cache = None;
    s.train.seed = None;
    flatten(&s)
}

/// As `recipe_key` without the model and its size-dependent learning rates, batch and steps: for
/// Table 2, which compares scales trained on the same data for the same token budget (to three
/// significant digits: the paper's 256 × 19,073 and 896 × 5,450 sequences of 2048 are both 1.00e10).
pub fn cross_scale_key(spec: &Spec) -> Key {
    let mut s = spec.clone();
    s.model = ModelSpec::default();
    s.train.lr = None;
    s.train.min_lr = None;
    s.train.steps = None;
    s.train.batch_size = None;
    s.train.grad_accum = None;
    let mut k = recipe_key(&s);
    k.retain(|name, _| !name.starts_with("model."));
    let tokens = spec.steps() as f64 * spec.batch_size() as f64 * spec.seq_len() as f64;
    k.insert("train.tokens (3 significant digits)".into(), format!("{tokens:.2e}"));
    k
}

/// Short stable id of a key (names recipe groups in tables and file names).
pub fn key_id(key: &Key) -> String {
    let text: String = key.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
    crate::util::short_hash(&text)[..6].to_string()
}

/// "train.steps: 336 here, 300 there" for every key whose value differs (at most `max`).
pub fn differences(here: &Key, there: &Key, max: usize) -> Vec<String> {
    let keys: std::collections::BTreeSet<&String> = here.keys().chain(there.keys()).collect();
    let none = "(unset)".to_string();
    keys.into_iter()
        .filter(|k| here.get(*k) != there.get(*k))
        .take(max)
        .map(|k| format!("{k}: {} vs {}", here.get(k).unwrap_or(&none), there.get(k).unwrap_or(&none)))
        .collect()
}

fn flatten(spec: &Spec) -> Key {
    let mut out = Key::new();
    flatten_into(&serde_json::to_value(spec).unwrap_or(Value::Null), String::new(), &mut out);
    out
}

fn flatten_into(v: &Value, prefix: String, out: &mut Key) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                flatten_into(v, key, out);
            }
        }
        Value::Null => {}
        other => {
            out.insert(prefix, other.to_string());
        }
    }
}

/// One line describing a recipe: T, steps × batch, training data and evaluation corpora.
pub fn recipe_summary(spec: &Spec) -> String {
    let corpora: Vec<&str> = spec.data.eval.keys().map(String::as_str).collect();
    format!(
        "T = {}, {} steps × {} sequences, train data: {}, eval: {}",
        spec.seq_len(),
        spec.steps(),
        spec.batch_size(),
        source_words(&spec.data.train),
        if corpora.is_empty() { "none".to_string() } else { corpora.join(", ") }
    )
}

fn source_words(src: &SourceSpec) -> String {
    match src {
        SourceSpec::Local(l) => format!("`{}`", l.path.display()),
        SourceSpec::Hub { hf } => format!("hf `{}` ({} files)", hf.repo, hf.files.len()),
        SourceSpec::Synthetic { synthetic } => match synthetic.recall_gap {
            Some(g) => format!(
                "synthetic recall (seed {}, {} docs, gap {g}{})",
                synthetic.seed,
                synthetic.docs,
                synthetic.recall_facts.map_or(String::new(), |k| format!(", {k} facts"))
            ),
            None => format!("synthetic (seed {}, {} docs)", synthetic.seed, synthetic.docs),
        },
        SourceSpec::Needles { needles } => format!("{} RULER-format needle documents ({})", needles.docs, needles.tasks.join(", ")),
        SourceSpec::Mix { mix } => mix.iter().map(source_words).collect::<Vec<_>>().join(" + "),
        SourceSpec::Megatron { megatron } => format!("Megatron tokens {}{}", megatron.hf.as_ref().map(|r| format!("hf `{r}` ")).unwrap_or_default(), megatron.bin.join(" + ")),
    }
}

/// Which arm comes first in a paired difference: DAR (with a window), then the window-only control,
/// then the other kinds in table order, vanilla last; so the headline reads DAR − window-only.
pub fn arm_rank(c: &AttentionSpec) -> usize {
    let kind = c.kind();
    if c.dar_window().is_some() {
        0
    } else if kind.is_local_only() {
        1
    } else if kind.is_vanilla() {
        usize::MAX
    } else {
        2 + kind.order()
    }
}

/// Runs with the variant the paper uses (linear bottleneck): sigmoid runs are listed, not tabulated.
pub fn tabulated(run: &Run) -> bool {
    run.spec.attention.dar_act() == DarAct::Linear || run.spec.attention.is_vanilla()
}

/// Runs grouped by recipe key (same scale and recipe), in order of first appearance.
pub fn by_recipe<'a>(runs: &[&'a Run]) -> Vec<(Key, Vec<&'a Run>)> {
    group(runs, recipe_key)
}

/// Runs grouped by cross-scale key (Table 2).
pub fn by_cross_scale<'a>(runs: &[&'a Run]) -> Vec<(Key, Vec<&'a Run>)> {
    group(runs, cross_scale_key)
}

fn group<'a>(runs: &[&'a Run], key: fn(&Spec) -> Key) -> Vec<(Key, Vec<&'a Run>)> {
    let mut out: Vec<(Key, Vec<&'a Run>)> = Vec::new();
    for &r in runs {
        let k = key(&r.spec);
        match out.iter_mut().find(|(g, _)| *g == k) {
            Some((_, members)) => members.push(r),
            None => out.push((k, vec![r])),
        }
    }
    out
}
