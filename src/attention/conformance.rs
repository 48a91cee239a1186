//! One conformance suite over every attention kind on GPT-NeoX, Llama and OLMo 2 (issue 25). A new
//! kind is one line in [`KINDS`]: its options as a model config records them (config.json's
//! `attnlab_attention`), sized so that windows, chunks and bottlenecks all act within 13 tokens.
//!
//! For every (family, kind) the family can hold (GPT-NeoX holds the softmax kinds), in fp64:
//! - decode = the full forward on every prefix (prompts of 1 and 6 tokens, then one token at a time),
//!   the cache within the bound its layers declare (`KindCache::bound`);
//! - packed = alone: a packed row gives each document's logits run alone, or the model refuses packed
//!   rows (GPT-NeoX, and kinds that declare they do not pack) instead of mixing documents;
//! - reference = fast path, outputs and gradients of every parameter (softmax kinds: `impl: reference`
//!   against the default; a linearized operator holds its chunked path to its explicit reference in
//!   its own file, `still/reference.rs`, `lolcats.rs`);
//! - the parameters its layers declare (`LayerOp::parameters`) = the variables it adds (Llama family);
//! - config → config.json → reload (Llama family): the same config and the same logits.
use super::{Attention, AttentionKind, Variant};
use crate::model::llama::LlamaConfig;
use crate::model::{hf, GptNeox, Llama, Model, NeoxConfig};
use crate::spec::{AttentionImpl, Gelu};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

/// Every kind, one line each: (name, its config as config.json records it, whether it takes packed
/// rows, whether it has a device-side decode step, `LayerOp::decode_at`).
const KINDS: &[(&str, &str, bool, bool)] = &[
    ("vanilla", "{kind: vanilla}", true, true),
    ("dar", "{kind: dar, d_down: 12, window: 3}", true, true),
    ("dar-sigmoid", "{kind: dar, d_down: 12, window: 3, dar_act: sigmoid}", true, true),
    ("uniform", "{kind: uniform, d_down: 12}", true, true),
    ("window", "{kind: window, window: 3}", true, true),
    ("sink", "{kind: sink, window: 3, sinks: 2}", true, false),
    ("still", "{kind: still, chunk: 4, tokens_per_chunk: 1}", false, true),
    ("lolcats", "{kind: lolcats, window: 4, feature_dim: 8}", false, true),
    ("liger-gla", "{kind: liger-gla, window: 3, gate_temperature: 1.0}", false, false),
];

const T: i64 = 13;

enum Family {
    Neox,
    Llama(&'static str),
}

impl Family {
    fn name(&self) -> &'static str {
        match self {
            Family::Neox => "gpt-neox",
            Family::Llama(f) => f,
        }
    }
}

fn attention(yaml: &str) -> Attention {
    serde_yaml::from_str(yaml).unwrap_or_else(|e| panic!("{yaml}: {e}"))
}

fn fixture_config(name: &str) -> LlamaConfig {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    hf::load_llama(&dir, Device::Cpu).unwrap().1.cfg
}

/// The model of `family` with `a`, weights drawn from `seed`, in fp64; None when the family cannot
/// hold the kind (a linearized operator in GPT-NeoX).
fn build(family: &Family, a: &Attention, seed: i64) -> Option<(VarStore, Model)> {
    let _rng = crate::testutil::seeded(seed);
    let mut vs = VarStore::new(Device::Cpu);
    let model = match family {
        Family::Neox => {
            let Attention::Softmax(attention) = a else { return None };
            let cfg = NeoxConfig { vocab: 97, d_model: 32, layers: 2, heads: 4, ffn: 64, rotary_pct: 0.25, rotary_base: 10000.0, ln_eps: 1e-5, gelu: Gelu::Erf, attention: attention.clone() };
            Model::Neox(GptNeox::new(&vs.root(), cfg))
        }
        Family::Llama(fixture) => {
            let cfg = LlamaConfig { attention: a.clone(), ..fixture_config(fixture) };
            Model::Llama(Llama::build(&vs.root(), cfg).unwrap())
        }
    };
    vs.double();
    Some((vs, model))
}

fn ids(model: &Model) -> Tensor {
    let _rng = crate::testutil::seeded(3);
    Tensor::randint(model.vocab() as i64, [2, T], (Kind::Int64, Device::Cpu))
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// Prefill `prompt` tokens, then one at a time: every step's logits against the full forward of that
/// prefix, and the cache within the bound its layers declare (`KindCache::bound`).
fn decode_gap(model: &Model, x: &Tensor, prompt: i64) -> f64 {
    let full: Vec<Tensor> = (1..=T).map(|t| tch::no_grad(|| model.forward(&x.narrow(1, 0, t)))).collect();
    let mut worst = 0f64;
    let mut cache = model.new_cache(2, Kind::Double, Device::Cpu);
    let mut at = 0;
    for n in std::iter::once(prompt).chain(std::iter::repeat_n(1, (T - prompt) as usize)) {
        let logits = model.extend(&mut cache, &x.narrow(1, at, n));
        at += n;
        worst = worst.max(max_diff(&logits, &full[at as usize - 1].narrow(1, at - n, n)));
        if let Some(bound) = cache.bound(at) {
            assert!(cache.bytes() <= bound, "after {at} tokens the cache holds {} bytes, over its declared {bound}", cache.bytes());
        }
    }
    worst
}

/// Prefill `prompt` tokens, then one at a time through the device-side step (`Model::prepare_step_at`,
/// `Model::extend_hidden_at` with the reservation as its span, what a CUDA graph replays): the worst
/// gap to the full forward of each prefix (the cache within its declared bound); None when the kind
/// has no such step.
fn device_step_gap(model: &Model, x: &Tensor, prompt: i64) -> Option<f64> {
    use crate::attention::cache::StepAt;
    let mut cache = model.new_cache(2, Kind::Double, Device::Cpu);
    crate::eval::generate::reserve(&mut cache, T);
    let _ = model.extend(&mut cache, &x.narrow(1, 0, prompt));
    let mut worst = 0f64;
    for t in prompt..T {
        model.prepare_step_at(&mut cache, t, T);
        let h = model.extend_hidden_at(&mut cache, &x.narrow(1, t, 1), &StepAt { pos: Tensor::from_slice(&[t]), span: T })?;
        cache.advance(1);
        if let Some(bound) = cache.bound(t + 1) {
            assert!(cache.bytes() <= bound, "device-side steps: after {} tokens the cache holds {} bytes, over its declared {bound}", t + 1, cache.bytes());
        }
        let want = tch::no_grad(|| model.forward(&x.narrow(1, 0, t + 1))).narrow(1, t, 1);
        worst = worst.max(max_diff(&model.logits(&h), &want));
    }
    Some(worst)
}

/// Logits and the gradient of ⟨logits, g⟩ for every parameter, by name.
fn outputs_and_grads(vs: &VarStore, model: &Model, x: &Tensor) -> (Tensor, Vec<(String, Tensor)>) {
    let logits = model.forward(x);
    let _rng = crate::testutil::seeded(4);
    let g = Tensor::randn(logits.size(), (Kind::Double, Device::Cpu));
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let wrt: Vec<&Tensor> = vars.iter().map(|v| &v.1).collect();
    let grads = Tensor::run_backward(&[(&logits * g).sum(Kind::Double)], &wrt, false, false);
    (logits.detach(), vars.into_iter().map(|v| v.0).zip(grads).collect())
}

#[test]
fn every_kind_on_every_family() {
    let _rng = crate::testutil::rng();
    let families = [Family::Neox, Family::Llama("llama_tiny"), Family::Llama("olmo2_tiny")];
    let mut checked = 0;
    for family in &families {
        for &(kind, yaml, packs, device_step) in KINDS {
            let a = attention(yaml);
            let Some((vs, model)) = build(family, &a, 1) else { continue };
            let what = format!("{} {kind}", family.name());
            let x = ids(&model);

            // Decode = the full forward on every prefix.
            for prompt in [1, 6] {
                let gap = decode_gap(&model, &x, prompt);
                assert!(gap < 1e-9, "{what}: decode after a {prompt}-token prompt differs from the forward by {gap}");
                // The same through the device-side step, where the kind has one (OLMo 2's DAR reads
                // its latents by rebuilding, its k_norm not being linear: the step still exists).
                match device_step_gap(&model, &x, prompt) {
                    Some(gap) => assert!(device_step && gap < 1e-9, "{what}: device-side step after a {prompt}-token prompt: {gap} (declared: {device_step})"),
                    None => assert!(!device_step, "{what}: declared a device-side step, has none"),
                }
            }

            // Left-padded prompts of several lengths in one batch = each prompt alone (softmax kinds;
            // the linearized caches take one prompt per row).
            if matches!(a, Attention::Softmax(_)) {
                use crate::eval::generate::{generate, generate_batch, Sampling};
                let prompts: [&[u32]; 3] = [&[3, 17, 42, 8, 8, 29, 1], &[9, 4], &[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]];
                let greedy = Sampling { temperature: 0.0, seed: 0 };
                let alone: Vec<Vec<u32>> = prompts.iter().map(|p| generate(&model, p, 9, greedy, None, Device::Cpu).tokens).collect();
                assert_eq!(generate_batch(&model, &prompts, 9, None, Device::Cpu), alone, "{what}: left-padded batch vs alone");
            }

            // Packed = alone, or refused.
            let docs = Tensor::from_slice(&[1i64, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2]).view([1, T]).repeat([2, 1]);
            // A guard, not tch::no_grad: a refusal unwinds, and the guard restores grad mode as it does.
            let packed = catch_unwind(AssertUnwindSafe(|| {
                let _no_grad = tch::no_grad_guard();
                model.logits(&model.hidden_docs(&x, Some(&docs)))
            }));
            if packs && matches!(family, Family::Llama(_)) {
                let packed = packed.unwrap_or_else(|_| panic!("{what}: packed rows refused"));
                for (at, n) in [(0, 5), (5, 8)] {
                    let alone = tch::no_grad(|| model.forward(&x.narrow(1, at, n)));
                    let gap = max_diff(&packed.narrow(1, at, n), &alone);
                    assert!(gap < 1e-9, "{what}: document at {at} packed vs alone: {gap}");
                }
            } else {
                assert!(packed.is_err(), "{what}: packed rows must be refused, not mixed");
            }

            // Reference = fast path, outputs and gradients (softmax kinds).
            if let Attention::Softmax(c) = &a {
                let (vs_ref, reference) = build(family, &Attention::Softmax(c.clone().with_implementation(AttentionImpl::Reference)), 1).unwrap();
                let (o_fast, g_fast) = outputs_and_grads(&vs, &model, &x);
                let (o_ref, g_ref) = outputs_and_grads(&vs_ref, &reference, &x);
                assert!(max_diff(&o_fast, &o_ref) < 1e-9, "{what}: fast path vs reference outputs");
                assert_eq!(g_fast.len(), g_ref.len());
                for ((name, a), (name_ref, b)) in g_fast.iter().zip(&g_ref) {
                    assert_eq!(name, name_ref);
                    assert!(a.defined() && b.defined(), "{what}: {name} gets no gradient");
                    assert!(max_diff(a, b) < 1e-9, "{what}: gradient of {name}: {}", max_diff(a, b));
                }
            }

            // The parameters the layers declare (`LayerOp::parameters`: what linearize's stage 1
            // trains) are exactly the variables the kind adds to a vanilla model of the family.
            if let Model::Llama(m) = &model {
                let (plain, _) = build(family, &Attention::default(), 1).unwrap();
                let added: std::collections::BTreeSet<String> = vs.variables().into_keys().filter(|n| !plain.variables().contains_key(n)).collect();
                assert_eq!(m.operator_params(&vs), added, "{what}: the parameters its layers declare");
            }

            // Config → config.json → reload.
            if let Model::Llama(m) = &model {
                let dir = tempfile::tempdir().unwrap();
                hf::save_llama(&vs, &m.cfg, dir.path()).unwrap();
                let (_vs2, again) = hf::load_llama(dir.path(), Device::Cpu).unwrap();
                assert_eq!(again.cfg, m.cfg, "{what}: config.json round trip");
                let again = Model::Llama(again);
                let logits = tch::no_grad(|| again.forward(&x.narrow(0, 0, 1)));
                let want = tch::no_grad(|| model.forward(&x.narrow(0, 0, 1)));
                assert!(max_diff(&logits.to_kind(Kind::Double), &want) < 1e-5, "{what}: reloaded logits (saved weights in fp32)");
            }
            checked += 1;
        }
    }
    // Softmax kinds on all three families, linearized operators on the two Llama-family ones.
    let want: usize = KINDS.iter().map(|k| if matches!(attention(k.1), Attention::Softmax(_)) { 3 } else { 2 }).sum();
    assert_eq!(checked, want);
}

/// Every registered kind, softmax and hybrid, has a line in `KINDS` (a kind registered without one
/// would go unchecked).
#[test]
fn every_registered_kind_is_checked() {
    for kind in AttentionKind::ALL {
        let listed = KINDS.iter().any(|(_, yaml, _, _)| matches!(attention(yaml), Attention::Softmax(a) if a.kind() == kind));
        assert!(listed, "kind {} has no line in conformance::KINDS", kind.name());
    }
    for &name in Variant::NAMES {
        let listed = KINDS.iter().any(|(_, yaml, _, _)| matches!(attention(yaml), Attention::Linearized(v) if v.name() == name));
        assert!(listed, "hybrid {name} has no line in conformance::KINDS");
    }
    // Every bench-decode model of a hybrid is that hybrid.
    for (name, yaml, _) in Variant::decode_bench_models() {
        let v: Variant = serde_yaml::from_str(yaml).unwrap_or_else(|e| panic!("bench-decode model {name}: {e}"));
        assert!(name.starts_with(v.name()), "bench-decode model {name} builds {}", v.name());
    }
}

/// Model configs (config.json `attnlab_attention`) and run configs (config.yaml `attention:`) as
/// versions before the per-kind options wrote them still read, as the same options as today's form.
#[test]
fn configs_written_before_the_per_kind_options_still_load() {
    let _rng = crate::testutil::rng();
    // (as written then, as written now): DarConfig's config.json wrote d_down and window for every kind.
    let model_configs = [
        (r#"{"kind":"vanilla","d_down":0,"window":0,"dar_act":"linear","impl":"auto"}"#, "{kind: vanilla}"),
        (r#"{"kind":"dar","d_down":16,"window":8,"dar_act":"sigmoid","impl":"sdpa"}"#, "{kind: dar, d_down: 16, window: 8, dar_act: sigmoid, impl: sdpa}"),
        (r#"{"kind":"uniform","d_down":16,"window":0,"dar_act":"linear","impl":"auto"}"#, "{kind: uniform, d_down: 16, window: 0}"),
        (r#"{"kind":"window","d_down":0,"window":128,"dar_act":"linear","impl":"auto"}"#, "{kind: window, window: 128}"),
    ];
    for (old, new) in model_configs {
        let read: Attention = serde_json::from_str(old).unwrap_or_else(|e| panic!("{old}: {e}"));
        assert_eq!(read, attention(new), "{old}");
    }
    // config.yaml of resolved train specs: read, and written back byte for byte (sweeps name run
    // directories by the hash of this text, so an existing sweep finds its runs again).
    let run_configs = [
        "kind: vanilla\ndar_act: linear\nimpl: auto\n",
        "kind: dar\nd_down: 32\nwindow: 4\ndar_act: linear\nimpl: auto\ninit: small_init\nnote: 'dar: keys at distance < 4 (the current token included) full width, farther keys through the d_down bottleneck'\n",
        "kind: uniform\nd_down: 128\nwindow: 0\ndar_act: linear\nimpl: auto\ninit: orthogonal\nnote: 'uniform = DAR with window 0: every key, the current token''s included, uses the d_down bottleneck'\n",
        "kind: window\nwindow: 16\ndar_act: linear\nimpl: auto\nnote: 'window: keys at distance < 16 (the current token included), nothing farther'\n",
    ];
    for old in run_configs {
        let read: crate::spec::AttentionSpec = serde_yaml::from_str(old).unwrap_or_else(|e| panic!("{old}: {e}"));
        assert_eq!(serde_yaml::to_string(&read).unwrap(), old);
        // And resolving it again changes nothing.
        let mut again = read.clone();
        again.resolve(128).unwrap();
        assert_eq!(again, read, "{old}");
    }
    // A fine-tuned model's config.json records `init: pca` (its start); it builds (the weights load over it).
    assert!(build(&Family::Llama("llama_tiny"), &attention("{kind: dar, d_down: 12, window: 3, init: pca}"), 1).is_some());
    // A key set to null is unset (`--set attention.d_down=null` when switching kinds).
    assert_eq!(attention("{kind: window, window: 8, d_down: null}"), attention("{kind: window, window: 8}"));
    // `compare` once carried a DAR spec's init into its window-only run.
    let carried: crate::spec::AttentionSpec = serde_yaml::from_str("{kind: window, window: 16, init: small_init}").unwrap();
    assert_eq!(carried, serde_yaml::from_str("{kind: window, window: 16}").unwrap());
}

/// A key belongs to one kind: every other kind refuses it in every spec that takes an attention
/// (train through `Spec`, finetune through its form, model configs through `Attention`).
#[test]
fn a_key_of_one_kind_is_refused_by_the_others() {
    let cases = [("{kind: vanilla, d_down: 8}", "d_down"), ("{kind: window, d_down: 8}", "d_down"), ("{kind: vanilla, init: orthogonal}", "init"), ("{kind: uniform, d_down: 8, routing: random}", "routing")];
    for (yaml, key) in cases {
        let e = serde_yaml::from_str::<crate::spec::AttentionSpec>(yaml).unwrap_err().to_string();
        assert!(e.contains(&format!("unknown field `{key}`")), "{yaml}: {e}");
        let e = serde_yaml::from_str::<Attention>(yaml).unwrap_err().to_string();
        assert!(e.contains(&format!("unknown field `{key}`")), "{yaml}: {e}");
        let train = format!("attention: {yaml}\ndata: {{train: {{synthetic: {{docs: 4}}}}}}\ntrain: {{steps: 1}}\n");
        let e = crate::spec::from_str(&train, "t.yaml", &[]).unwrap_err().to_string();
        assert!(e.contains(&format!("unknown field `{key}`")), "train spec {yaml}: {e}");
    }
    // The hybrids' options are their own too, and a refusal says how a spec that changed the kind
    // (a child of another kind's spec) drops what it inherited.
    for (yaml, key) in [("{kind: still, window: 8}", "window"), ("{kind: lolcats, feature_map: np_map}", "feature_map"), ("{kind: lolcats, chunk: 64}", "chunk")] {
        let e = serde_yaml::from_str::<Attention>(yaml).unwrap_err().to_string();
        assert!(e.contains(&format!("unknown field `{key}`")) && e.contains(&format!("`{key}: null`")), "{yaml}: {e}");
    }
    // Null keys are unset: `{kind: lolcats, feature_map: null}` is LoLCATs' defaults.
    assert_eq!(attention("{kind: lolcats, feature_map: null, routing: null}"), attention("{kind: lolcats}"));
}

/// A value of the wrong type under any key of any registered kind names the key path and its line
/// in the spec file, in block and in flow form (serde alone names neither for a kind's options).
#[test]
fn a_wrong_type_under_any_kind_names_the_key_and_its_line() {
    let rest = "data: {train: {synthetic: {docs: 4}}}\ntrain: {steps: 1}\n";
    for kind in AttentionKind::ALL {
        let mut spec = kind.spec();
        spec.resolve(64).unwrap();
        let serde_yaml::Value::Mapping(m) = serde_yaml::to_value(&spec).unwrap() else { panic!("{kind:?}: not a mapping") };
        let keys: Vec<&str> = m.keys().filter_map(|k| k.as_str()).filter(|&k| k != "kind").collect();
        assert!(!keys.is_empty(), "{kind:?} has no options");
        for key in keys {
            let block = format!("# {kind:?}\nattention:\n  kind: {}\n  {key}: [1, 2]\n{rest}", kind.name());
            let e = crate::spec::from_str(&block, "t.yaml", &[]).unwrap_err().to_string();
            assert!(e.contains(&format!("t.yaml: `attention.{key}` (line 4): invalid type: sequence")), "{kind:?} {key}: {e}");
            let flow = format!("attention: {{kind: {}, {key}: [1, 2]}}\n{rest}", kind.name());
            let e = crate::spec::from_str(&flow, "t.yaml", &[]).unwrap_err().to_string();
            assert!(e.contains(&format!("t.yaml: `attention.{key}` (line 1): invalid type: sequence")), "{kind:?} {key}: {e}");
        }
    }
    // The case of the issue: once "attention (kind: dar): invalid type: string "sixteen", expected i64 at line 2 column 1".
    let e = crate::spec::from_str(&format!("attention:\n  kind: dar\n  d_down: sixteen\n{rest}"), "t.yaml", &[]).unwrap_err().to_string();
    assert!(e.contains("t.yaml: `attention.d_down` (line 3): invalid type: string \"sixteen\", expected i64 (kind: dar)"), "{e}");
    // Through --set the key is named too (the value is not in the file, its key's line is).
    let e = crate::spec::from_str(&format!("attention: {{kind: sink}}\n{rest}"), "t.yaml", &["attention.sinks=four".into()]).unwrap_err().to_string();
    assert!(e.contains("`attention.sinks`") && e.contains("four"), "{e}");
}
