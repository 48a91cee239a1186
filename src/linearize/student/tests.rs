use super::*;
use crate::model::hf;
use crate::spec::{AttentionImpl, AttentionKind};
use crate::train::optim::{AdamW, Hyper};
use tch::{Device, Kind};

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// A teacher: the fixture `name` (llama_tiny: Llama with GQA; olmo2_tiny: OLMo 2), given DAR
/// (d_down 16, window 5, a random small_init bottleneck) when `dar`.
fn teacher(name: &str, dar: bool) -> (nn::VarStore, Llama) {
    let (vs, mut m) = hf::load_llama(&fixture(name), Device::Cpu).unwrap();
    if dar {
        let _rng = crate::testutil::seeded(11);
        let c = crate::testutil::softmax(AttentionKind::Dar, 16, 5).with_implementation(AttentionImpl::Reference);
        m.add_dar(&vs.root(), c).unwrap();
    }
    (vs, m)
}

fn variant(yaml: &str) -> Variant {
    serde_yaml::from_str(yaml).unwrap()
}

fn still(yaml: &str) -> Variant {
    variant(&format!("{{kind: still, {yaml}}}"))
}

fn no_lora() -> LoraConfig {
    LoraConfig { targets: vec![], ..LoraConfig::default() }
}

fn ids(t: i64) -> Tensor {
    Tensor::randint(128, [2, t], (Kind::Int64, Device::Cpu))
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

fn logits(m: &Llama, x: &Tensor, pass: Pass) -> Tensor {
    tch::no_grad(|| m.logits(&m.hidden_pass(x, None, pass)))
}

fn student(t: &(nn::VarStore, Llama), v: &Variant, lora: &LoraConfig) -> (nn::VarStore, Llama) {
    let vs = nn::VarStore::new(Device::Cpu);
    let s = Llama::linearized(&vs, &t.0, t.1.cfg.clone(), v, lora).unwrap();
    (vs, s)
}

/// Any teacher the Llama family loads linearizes: Llama, OLMo 2 and DAR versions of both. The
/// student's teacher pass is the teacher's own forward; with still.md §12's exact setting (L ≤ 2C,
/// every query sees its whole prefix by softmax) a softmax teacher's student equals it, while a DAR
/// teacher's does not (its distant keys are bottlenecked), so attention transfer has a positive loss
/// that AdamW lowers; the export (LoRA merged, the teacher's bottlenecks dropped) reloads to the same
/// student.
#[test]
fn llama_olmo2_and_dar_teachers_linearize() {
    let _rng = crate::testutil::rng();
    for (name, dar) in [("llama_tiny", false), ("olmo2_tiny", false), ("llama_tiny", true), ("olmo2_tiny", true)] {
        let t = teacher(name, dar);
        let _rng = crate::testutil::seeded(1);
        let x = ids(32);
        let want = logits(&t.1, &x, Pass::Eval);
        let (vs, s) = student(&t, &still("chunk: 16"), &LoraConfig::default());
        assert!(max_diff(&logits(&s, &x, Pass::Teacher), &want) < 1e-5, "{name} dar={dar}: the teacher pass is not the teacher");
        let exact = max_diff(&logits(&s, &x, Pass::Eval), &want);
        let (loss, per_layer) = tch::no_grad(|| s.attention_transfer_loss(&x));
        assert_eq!(per_layer.size(), vec![2]);
        if dar {
            assert!(exact > 1e-4 && loss.double_value(&[]) > 1e-4, "{name}: a DAR teacher cannot equal a full-width softmax student ({exact})");
        } else {
            assert!(exact < 1e-4 && loss.double_value(&[]) < 1e-6, "{name}: exact STILL differs from its teacher: {exact}");
        }
        let dir = tempfile::tempdir().unwrap();
        s.save_export(&vs, dir.path()).unwrap();
        let names: Vec<String> = Tensor::read_safetensors(dir.path().join(EXPORT_WEIGHTS)).unwrap().into_iter().map(|(n, _)| n).collect();
        assert!(names.iter().all(|n| !n.contains("lora") && !n.contains("bottleneck")), "{name}: {names:?}");
        let (_vs2, back) = Llama::load_export_with(dir.path(), Device::Cpu, &[]).unwrap();
        assert!(max_diff(&logits(&back, &x, Pass::Eval), &logits(&s, &x, Pass::Eval)) < 1e-5, "{name} dar={dar}: export round trip");
        assert_eq!(back.cfg.family, t.1.cfg.family);
    }
    // A DAR teacher's transfer loss decreases under AdamW on the operators alone.
    let t = teacher("olmo2_tiny", true);
    let (vs, s) = student(&t, &still("chunk: 4, tokens_per_chunk: 1"), &no_lora());
    assert_transfer_trains(&vs, &t.0, &s, "olmo2 dar");
}

fn snapshot(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vs.variables().into_iter().map(|(n, t)| (n, t.detach().copy())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Stage 1 on `s`: the loss is 1000 · mean over layers of the per-head MSE, it decreases under AdamW,
/// and only the new attention parameters change.
fn assert_transfer_trains(vs: &nn::VarStore, teacher_vs: &nn::VarStore, s: &Llama, what: &str) {
    // What the operators declare is what replacing the attention added: every variable the teacher
    // lacks, the LoRA adapters aside.
    let added = s.operator_params(vs);
    let new: std::collections::BTreeSet<String> = vs.variables().into_keys().filter(|n| !teacher_vs.variables().contains_key(n) && !n.contains(".lora_")).collect();
    assert_eq!(added, new, "{what}: the operators' declared parameters");
    for (n, t) in vs.variables() {
        let _ = t.shallow_clone().set_requires_grad(added.contains(&n));
    }
    let before = snapshot(vs);
    let params = crate::train::named_parameters(vs);
    assert!(!params.is_empty() && params.iter().all(|(n, _)| added.contains(n)));
    let mut opt = AdamW::new(params, Hyper { betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.0 });
    let _rng = crate::testutil::seeded(2);
    let x = ids(32);
    let mut losses = Vec::new();
    for _ in 0..15 {
        opt.zero_grad();
        let (loss, per_layer) = s.attention_transfer_loss(&x);
        assert_eq!(per_layer.size(), vec![2]);
        assert!((loss.double_value(&[]) - 1000.0 * per_layer.mean(Kind::Float).double_value(&[])).abs() < 1e-6 * loss.double_value(&[]).max(1.0));
        loss.backward();
        opt.step(1e-2).unwrap();
        losses.push(loss.double_value(&[]));
    }
    assert!(losses[14] < 0.9 * losses[0], "{what}: stage-1 loss did not decrease: {losses:?}");
    let after = snapshot(vs);
    let mut changed = 0;
    for ((n, a), (_, b)) in before.iter().zip(&after) {
        let same = a.equal(b);
        if added.contains(n) {
            changed += (!same) as usize;
        } else {
            assert!(same, "{what}: {n} changed in stage 1");
        }
    }
    assert!(changed > 0);
}

/// Stage 1 trains only the operators' parameters, for STILL and LoLCATs.
#[test]
fn stage1_loss_decreases_and_only_new_params_change() {
    let _rng = crate::testutil::rng();
    let t = teacher("llama_tiny", false);
    for v in [still("chunk: 4, tokens_per_chunk: 1"), variant("{kind: lolcats, window: 4, feature_dim: 8}")] {
        let (vs, s) = student(&t, &v, &LoraConfig::default());
        assert_transfer_trains(&vs, &t.0, &s, &format!("{v:?}"));
    }
}

/// The llama_tiny teacher, 24 random tokens and its `v` student with LoRA on `targets` (seeded by `seed`).
fn adapted(seed: i64, v: &Variant, targets: &[&str]) -> ((nn::VarStore, Llama), Tensor, (nn::VarStore, Llama)) {
    let _rng = crate::testutil::seeded(seed);
    let t = teacher("llama_tiny", false);
    let x = ids(24);
    let lora = LoraConfig { targets: targets.iter().map(|s| s.to_string()).collect(), ..LoraConfig::default() };
    let s = student(&t, v, &lora);
    (t, x, s)
}

/// B ≠ 0 in every adapter (at init B = 0: an adapter changes nothing).
fn perturb_adapters(s: &Llama) {
    tch::no_grad(|| {
        for l in s.adapters().values() {
            l.b.shallow_clone().copy_(&(Tensor::randn(l.b.size(), (Kind::Float, Device::Cpu)) * 0.05));
        }
    });
}

/// LoRA with B = 0 leaves the student unchanged; with B ≠ 0 the merged export gives the same logits.
#[test]
fn lora_identity_at_init_and_merge_matches() {
    let _rng = crate::testutil::rng();
    let v = still("chunk: 4, tokens_per_chunk: 1");
    let (t, x, (vs, s)) = adapted(3, &v, &["q_proj", "k_proj", "v_proj", "o_proj", "g_proj"]);
    assert_eq!(s.adapters().len(), 2 * 5);
    assert!(vs.variables().contains_key("model.layers.1.self_attn.g_proj.lora_B"));
    let (_vs0, plain) = student(&t, &v, &no_lora());
    tch::no_grad(|| {
        // The same operators in both (same seed, same draws before them): copy them to be sure.
        let src = vs.variables();
        for (n, mut p) in _vs0.variables() {
            p.copy_(&src[&n]);
        }
    });
    let without = logits(&plain, &x, Pass::Eval);
    assert!(logits(&s, &x, Pass::Eval).equal(&without), "B = 0 must leave the logits unchanged");
    perturb_adapters(&s);
    let unmerged = logits(&s, &x, Pass::Eval);
    assert!(max_diff(&unmerged, &without) > 1e-4);
    crate::model::weights::copy_into(&_vs0, s.merged_weights(&vs).into_iter().collect(), Path::new("merged")).unwrap();
    let merged = logits(&plain, &x, Pass::Eval);
    assert!(max_diff(&merged, &unmerged) < 1e-4, "merged ≠ unmerged: {}", max_diff(&merged, &unmerged));
    let names: Vec<String> = s.lora_weights().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names.len(), 2 * 2 * 5);
    assert!(names.contains(&"model.layers.1.self_attn.g_proj.lora_B".to_string()));
}

/// The export folder (merged weights, config.json, hybrid.yaml) loads back into the same model: a LoRA'd
/// LoLCATs student (B ≠ 0, so merging matters) gives the same logits after the round trip.
#[test]
fn export_round_trip() {
    let _rng = crate::testutil::rng();
    let v = variant("{kind: lolcats, window: 4, feature_dim: 8}");
    let (_t, x, (vs, s)) = adapted(4, &v, &["q_proj", "v_proj"]);
    perturb_adapters(&s);
    tch::no_grad(|| {
        let _ = vs.variables()["model.layers.0.self_attn.window_factors"].shallow_clone().fill_(0.7);
    });
    let dir = tempfile::tempdir().unwrap();
    s.save_export(&vs, dir.path()).unwrap();
    let (_vs2, back) = Llama::load_export_with(dir.path(), Device::Cpu, &[]).unwrap();
    assert!(max_diff(&logits(&back, &x, Pass::Eval), &logits(&s, &x, Pass::Eval)) < 1e-4);
    let l = back.layers[0].attn.get::<crate::attention::lolcats::Lolcats>().expect("variant lost");
    assert!((l.gamma() - 0.7f64.exp() / (1.0 + 0.7f64.exp())).abs().max().double_value(&[]) < 1e-6, "trained γ kept");
    // --set on the operator's options, and a clear error for anything else.
    let (_vs3, k16) = Llama::load_export_with(dir.path(), Device::Cpu, &["attention.window=8".into()]).unwrap();
    assert!(matches!(k16.variant(), Some(Variant::Lolcats(c)) if c.window == 8));
    let e = Llama::load_export_with(dir.path(), Device::Cpu, &["train.lr=1".into()]).err().unwrap().to_string();
    assert!(e.contains("hybrid.yaml") && e.contains("attention.KEY=VALUE"), "{e}");
}

const VARIANTS: [&str; 3] = [
    "{kind: still, chunk: 4, tokens_per_chunk: 1}",
    "{kind: still, chunk: 4, budget: {m: 12, max_len: 16}, routing: key_norm}",
    "{kind: lolcats, window: 4, feature_dim: 8}",
];

/// Token-by-token decoding, and extending in uneven blocks (a prefill block, then blocks that cross
/// chunk boundaries), give the full forward's logits on every prefix, for STILL and LoLCATs students of
/// a Llama and of an OLMo 2 teacher. The student must also differ from its teacher there (routing and
/// the linear state matter at T = 30).
#[test]
fn cached_decoding_matches_the_full_forward() {
    let _rng = crate::testutil::rng();
    for name in ["llama_tiny", "olmo2_tiny"] {
        let t = teacher(name, false);
        for (n, yaml) in VARIANTS.iter().enumerate() {
            let _rng = crate::testutil::seeded(n as i64);
            let (_vs, s) = student(&t, &variant(yaml), &no_lora());
            let _rng = crate::testutil::seeded(10 + n as i64);
            let ids = Tensor::randint(128, [2, 30], (Kind::Int64, Device::Cpu));
            let full = logits(&s, &ids, Pass::Eval);
            assert!(max_diff(&full, &logits(&s, &ids, Pass::Teacher)) > 1e-3, "{yaml}: the student equals its teacher; the test would prove nothing");
            for blocks in [vec![1i64; 30], vec![7, 1, 5, 9, 1, 7], vec![30]] {
                let mut cache = s.new_cache(2, Kind::Float, Device::Cpu);
                let mut at = 0;
                for &len in &blocks {
                    let got = s.extend(&mut cache, &ids.narrow(1, at, len));
                    let want = full.narrow(1, at, len);
                    let err = max_diff(&got, &want);
                    assert!(err < 1e-4 * (1.0 + want.abs().max().double_value(&[])), "{name} {yaml} blocks {blocks:?} at {at}: logits differ by {err}");
                    at += len;
                }
                assert_eq!(cache.len, 30);
            }
        }
    }
}

/// still.md §6's memory, per layer H·[2·(n_sel + n_win)·D·b_kv + (F·D + F)·4 + n_win·4] with n_win
/// = tokens of chunks c−1 and c, n_sel = κ per routed chunk (capped by the budget), is what the
/// caches declare (`KindCache::bound`); they hold exactly that after every decoded token, and with
/// a budget (or κ = 0) they stop growing. (VARIANTS use chunks of C = 4 tokens; `growth` is the
/// tokens a cache keeps per further chunk.)
#[test]
fn cache_bytes_follow_the_bounded_formula() {
    let _rng = crate::testutil::rng();
    const C: usize = 4;
    let t = teacher("llama_tiny", false);
    let cfg = t.1.cfg.clone();
    for (n, (yaml, growth)) in VARIANTS.iter().zip([1, 0, 0]).enumerate() {
        let _rng = crate::testutil::seeded(n as i64);
        let (_vs, s) = student(&t, &variant(yaml), &no_lora());
        let (heads, d) = (cfg.num_attention_heads as i64, cfg.head_dim() as i64);
        let _rng = crate::testutil::seeded(20);
        let ids = Tensor::randint(128, [1, 60], (Kind::Int64, Device::Cpu));
        let mut cache = s.new_cache(1, Kind::Float, Device::Cpu);
        let mut bytes = vec![];
        for p in 0..60 {
            let _ = s.extend(&mut cache, &ids.narrow(1, p, 1));
            assert_eq!(Some(cache.bytes()), cache.bound(p + 1), "{yaml} after {} tokens", p + 1);
            bytes.push(cache.bytes());
        }
        // Once the selections stop (budget, κ = 0) the size is periodic in the chunk: no growth with
        // context. Uncapped STILL grows by κ tokens per chunk.
        let (now, chunk_ago) = (bytes[59], bytes[59 - C]);
        assert_eq!(now - chunk_ago, cfg.num_hidden_layers as i64 * heads * 2 * growth * d * 4, "{yaml}: growth per chunk");
    }
}

/// `attnlab linearize` end to end on an OLMo 2 teacher and on a DAR teacher (HF folders written by
/// attnlab: DAR settings in `attnlab_attention`, bottleneck weights): both stages run, the export loads
/// as a student of the teacher's family, without the teacher's bottlenecks, and the held-out eval
/// compares it with the teacher's own loss.
#[test]
fn linearize_runs_on_olmo2_and_dar_teachers() {
    let _rng = crate::testutil::rng();
    use crate::data::Tok;
    use crate::linearize::{linearize, LinearizeOptions, LinearizeSpec};
    use crate::model::Family;
    use crate::spec::TokenizerSpec;
    let tmp = tempfile::tempdir().unwrap();
    let tok = Tok::load(&TokenizerSpec::Path("builtin".into())).unwrap();
    for (family, dar) in [(Family::Olmo2, false), (Family::Llama, true), (Family::Olmo2, true)] {
        let name = format!("{family:?}-{dar}");
        let cfg = crate::testutil::tiny_llama(tok.padded_vocab(), family);
        let _rng = crate::testutil::seeded(7);
        let vs = nn::VarStore::new(Device::Cpu);
        let mut m = Llama::new(&vs.root(), cfg);
        if dar {
            m.add_dar(&vs.root(), crate::testutil::softmax(AttentionKind::Dar, 8, 4)).unwrap();
        }
        let teacher = tmp.path().join(format!("teacher-{name}"));
        hf::save_llama(&vs, &m.cfg, &teacher).unwrap();
        let out = tmp.path().join(format!("run-{name}"));
        let spec = LinearizeSpec::from_yaml(&format!(
            "{{teacher: '{}', tokenizer: builtin, attention: {{kind: still, chunk: 4, tokens_per_chunk: 1}},
              data: {{train: {{synthetic: {{seed: 1, docs: 40}}}}, seq_len: 32, batch_size: 2, val_rows: 2}},
              stage1: {{steps: 3}}, stage2: {{steps: 2}}, train: {{device: cpu}}, output: '{}'}}",
            teacher.display(),
            out.display()
        ))
        .unwrap();
        let o = linearize(spec, &LinearizeOptions { quiet: true, stop_after: None }).unwrap();
        assert!(out.join("DONE").is_file(), "{name}");
        let (lt, ls) = (o.eval["teacher"]["loss"].as_f64().unwrap(), o.eval["student"]["loss"].as_f64().unwrap());
        assert!(lt.is_finite() && ls.is_finite() && lt != ls, "{name}: teacher {lt}, student {ls}");
        let (_vs, s, _tok) = crate::student_export::load_exported(&out, Device::Cpu).unwrap();
        assert_eq!(s.cfg.family, family, "{name}");
        assert!(matches!(s.variant(), Some(Variant::Still(_))), "{name}");
        assert!(s.layers.iter().all(|b| b.attn.bottleneck().is_none() && b.teacher.is_none()), "{name}");
        // The teacher's held-out loss is the teacher model's own.
        let x = Tensor::randint(100, [1, 17], (Kind::Int64, Device::Cpu));
        let (inp, tgt) = (x.narrow(1, 0, 16), x.narrow(1, 1, 16));
        let (tvs, _cfg, _t) = crate::linearize::load_teacher(teacher.to_str().unwrap(), Some(&TokenizerSpec::Path("builtin".into())), Device::Cpu).unwrap();
        let st = Llama::linearized(&nn::VarStore::new(Device::Cpu), &tvs, m.cfg.clone(), &still("chunk: 4"), &no_lora()).unwrap();
        let own = tch::no_grad(|| m.masked_loss(&inp, &tgt, Pass::Eval)).double_value(&[]);
        let via = tch::no_grad(|| st.masked_loss(&inp, &tgt, Pass::Teacher)).double_value(&[]);
        assert!((own - via).abs() < 1e-5, "{name}: teacher pass {via} vs teacher {own}");
    }
}
