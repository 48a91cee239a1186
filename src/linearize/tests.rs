use super::*;
use crate::model::Llama;

#[test]
fn alpaca_prompt_tokens_are_masked_and_packed() {
    let _rng = crate::testutil::rng();
    // [BOS=1] prompt(10, 11, 12) answer(20, 21) EOS=2
    let (t, l) = alpaca_example(&[10, 11, 12], &[20, 21], Some(1), 2);
    assert_eq!(t, vec![1, 10, 11, 12, 20, 21, 2]);
    assert_eq!(l, vec![IGNORE, IGNORE, IGNORE, IGNORE, 20, 21, 2]);
    let (t2, l2) = alpaca_example(&[30, 31], &[40], None, 2);
    assert_eq!(l2, vec![IGNORE, IGNORE, 40, 2]);
    // Stream: 1 10 11 12 20 21 2 30 31 40 2 | rows of 4 + 1 tokens; the tail (1 token) is dropped.
    let rows = pack(&[(t, l), (t2, l2)], 4);
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].inputs, vec![1, 10, 11, 12]);
    assert_eq!(rows[0].targets, vec![IGNORE, IGNORE, IGNORE, 20]);
    assert_eq!(rows[1].inputs, vec![21, 2, 30, 31]);
    assert_eq!(rows[1].targets, vec![2, IGNORE, IGNORE, 40]);
    // A row whose targets are all prompt tokens is dropped.
    let rows = pack(&[(vec![5; 9], vec![IGNORE; 9])], 4);
    assert!(rows.is_empty());
    assert!(alpaca_prompt("do it", "").ends_with("### Instruction:\ndo it\n\n### Response:\n"));
    assert!(alpaca_prompt("do it", "x").contains("### Input:\nx\n\n### Response:\n"));
}

#[test]
fn spec_defaults_and_unknown_keys() {
    let _rng = crate::testutil::rng();
    let s = LinearizeSpec::from_yaml("{teacher: t, attention: {kind: still}, data: {train: {alpaca: a.jsonl}}, output: o}").unwrap().resolved();
    assert_eq!(s.data.seq_len, 1024);
    assert_eq!((s.stage1.lr, s.stage2.lr), (Some(1e-2), Some(1e-4)));
    assert_eq!(s.stage1.epochs, 2.0);
    assert_eq!(s.lora.rank, 8);
    assert_eq!(s.lora.targets, vec!["q_proj", "k_proj", "v_proj", "o_proj"]);
    assert!(matches!(s.attention, Variant::Still(ref c) if c.chunk == 64));
    let s2 = LinearizeSpec::from_yaml(&s.to_yaml()).unwrap();
    assert_eq!(s2, s);
    assert!(LinearizeSpec::from_yaml("{teacher: t, attention: {kind: still, chunkk: 3}, data: {train: {alpaca: a}}, output: o}").is_err());
    assert!(LinearizeSpec::from_yaml("{teacher: t, attention: {kind: still}, data: {train: {alpaca: a}}, output: o, bogus: 1}").is_err());
    let l = LinearizeSpec::from_yaml("{teacher: t, attention: {kind: lolcats, window: 8}, data: {train: {path: x.txt}}, output: o}").unwrap().resolved();
    assert!(matches!(l.data.train, TrainData::Text(_)));
    assert_eq!(l.stage1.weight_decay, Some(0.0));
    // A child of a STILL spec that changes the kind drops the inherited STILL keys with null (the
    // committed Liger-GLA experiment), and is told to when it does not.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments");
    let liger = LinearizeSpec::from_file(&root.join("liger-gla-smollm2.yaml")).unwrap();
    assert_eq!(liger.attention.name(), "liger-gla");
    let tmp = tempfile::tempdir().unwrap();
    let child = tmp.path().join("child.yaml");
    std::fs::write(&child, format!("base: {}\nattention: {{kind: liger-gla}}\n", root.join("still-smollm2.yaml").display())).unwrap();
    let e = LinearizeSpec::from_file(&child).unwrap_err().to_string();
    assert!(e.contains("unknown field `chunk`") && e.contains("`chunk: null`"), "{e}");
}

/// A tiny random Llama saved as an HF folder with the builtin tokenizer's vocabulary.
fn tiny_teacher(dir: &Path) {
    let tok = Tok::load(&TokenizerSpec::Path("builtin".into())).unwrap();
    let cfg = crate::testutil::tiny_llama(tok.padded_vocab(), Default::default());
    let _rng = crate::testutil::seeded(7);
    let vs = VarStore::new(Device::Cpu);
    let _m = Llama::new(&vs.root(), cfg.clone());
    crate::model::hf::save_llama(&vs, &cfg, dir).unwrap();
}

/// `tiny_teacher` saved under `dir`/teacher and loaded back: its folder, weights and config.
fn loaded_tiny_teacher(dir: &Path) -> (std::path::PathBuf, VarStore, crate::model::LlamaConfig) {
    let teacher = dir.join("teacher");
    tiny_teacher(&teacher);
    let (tvs, cfg, _tok) = load_teacher(teacher.to_str().unwrap(), Some(&TokenizerSpec::Path("builtin".into())), Device::Cpu).unwrap();
    (teacher, tvs, cfg)
}

fn e2e_spec(teacher: &Path, out: &Path, variant: &str) -> LinearizeSpec {
    LinearizeSpec::from_yaml(&format!(
        "{{teacher: '{}', tokenizer: builtin, attention: {variant}, lora: {{targets: [q_proj, v_proj, g_proj]}},
          data: {{train: {{synthetic: {{seed: 1, docs: 40}}}}, seq_len: 32, batch_size: 2, val_rows: 2}},
          stage1: {{steps: 4, eval_every: 1, patience: 0, factor: 0.5}}, stage2: {{steps: 3}}, train: {{device: cpu, log_every: 1}},
          checkpoint: {{every: 2, keep: 2}}, output: '{}'}}",
        teacher.display(),
        out.display()
    ))
    .unwrap()
}

/// `eval_every: 0` is refused where the plateau schedule needs the held-out loss (before the teacher
/// loads), and means no evaluation inside the stage under any other schedule.
#[test]
fn eval_every_zero_is_refused_with_plateau_and_means_no_evaluation_otherwise() {
    let _rng = crate::testutil::rng();
    let tmp = tempfile::tempdir().unwrap();
    let teacher = tmp.path().join("teacher");
    tiny_teacher(&teacher);
    let out = tmp.path().join("run");
    let mut spec = e2e_spec(&teacher, &out, "{kind: still, chunk: 4, tokens_per_chunk: 1}");
    spec.stage2.eval_every = Some(0);
    let mut missing_teacher = spec.clone();
    missing_teacher.teacher = tmp.path().join("no-such-teacher").display().to_string();
    let e = linearize(missing_teacher, &LinearizeOptions { quiet: true, stop_after: None }).unwrap_err().to_string();
    assert!(e.contains("stage2.eval_every") && e.contains("plateau"), "{e}");
    spec.stage2.schedule = Schedule::Cosine;
    linearize(spec, &LinearizeOptions { quiet: true, stop_after: None }).unwrap();
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let evaluated = |stage: u64| rows.iter().filter(|r| r["stage"] == stage && r["val_loss"].is_number()).count();
    assert_eq!((evaluated(1), evaluated(2)), (4, 0), "stage 1 evaluates every step, stage 2 never");
    assert!(rows.iter().any(|r| r["stage"] == 2 && r["loss"].is_number()));
}

/// Both stages end to end, interrupted and resumed: metrics rows per stage, checkpoints, DONE,
/// lora.safetensors, the merged export and the eval.
#[test]
fn linearize_end_to_end_with_resume() {
    let _rng = crate::testutil::rng();
    let tmp = tempfile::tempdir().unwrap();
    let teacher = tmp.path().join("teacher");
    tiny_teacher(&teacher);
    let out = tmp.path().join("run");
    let spec = e2e_spec(&teacher, &out, "{kind: still, chunk: 4, tokens_per_chunk: 1}");
    // Interrupted at the end of stage 1 and again inside stage 2 (both checkpoint steps).
    for stop in [4, 6] {
        let o = linearize(spec.clone(), &LinearizeOptions { quiet: true, stop_after: Some(stop) }).unwrap();
        assert_eq!(o.step, stop);
        assert!(!out.join("DONE").exists());
    }
    let o = linearize(spec.clone(), &LinearizeOptions { quiet: true, stop_after: None }).unwrap();
    assert_eq!(o.step, 7);
    assert!(out.join("DONE").is_file());
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(rows.iter().any(|r| r["stage"] == 1 && r["attn_mse"].is_number()));
    assert!(rows.iter().any(|r| r["stage"] == 2 && r["loss"].is_number()));
    let steps: Vec<u64> = rows.iter().filter(|r| r["loss"].is_number()).map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, (1..=7).collect::<Vec<_>>(), "resume repeats or skips no step");
    // Stage 1 evaluates every step and the plateau schedule (patience 0) sets the next step's lr.
    let val: Vec<(u64, f64, f64)> = rows.iter().filter(|r| r["val_loss"].is_number()).map(|r| (r["step"].as_u64().unwrap(), r["val_loss"].as_f64().unwrap(), r["lr"].as_f64().unwrap())).collect();
    assert_eq!(val.iter().map(|v| v.0).collect::<Vec<_>>(), [1, 2, 3, 4]);
    let mut expect = crate::train::optim::Plateau::new(1e-2, 0.5, 0, 1e-5);
    for (step, loss, lr) in &val {
        assert_eq!(*lr, expect.observe(*loss), "lr after the eval at step {step}");
        if *step < 4 {
            let next = rows.iter().find(|r| r["loss"].is_number() && r["step"] == step + 1).unwrap();
            assert_eq!(next["lr"].as_f64().unwrap(), *lr, "step {} trains with the scheduled lr", step + 1);
        }
    }
    let lora: Vec<String> = Tensor::read_safetensors(out.join("lora.safetensors")).unwrap().into_iter().map(|(n, _)| n).collect();
    assert!(lora.contains(&"model.layers.0.self_attn.q_proj.lora_A".to_string()));
    assert!(lora.contains(&"model.layers.1.self_attn.g_proj.lora_B".to_string()));
    assert_eq!(lora.len(), 2 * 3 * 2);
    let export: Vec<String> = Tensor::read_safetensors(out.join("export/model.safetensors")).unwrap().into_iter().map(|(n, _)| n).collect();
    assert!(export.iter().all(|n| !n.contains("lora")) && export.iter().any(|n| n.ends_with("g_proj.weight")));
    assert!(o.eval["student"]["ppl"].as_f64().unwrap().is_finite());
    // Resuming is exact: the same adapters as one uninterrupted run.
    let out2 = tmp.path().join("run2");
    let mut straight = spec.clone();
    straight.output = out2.clone();
    linearize(straight, &LinearizeOptions { quiet: true, stop_after: None }).unwrap();
    let mut a = Tensor::read_safetensors(out.join("lora.safetensors")).unwrap();
    let mut b = Tensor::read_safetensors(out2.join("lora.safetensors")).unwrap();
    a.sort_by(|x, y| x.0.cmp(&y.0));
    b.sort_by(|x, y| x.0.cmp(&y.0));
    for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert!(ta.equal(tb), "{na} differs after resume");
    }
    // Finished: left alone. A different config in the same directory: refused.
    assert!(linearize(spec.clone(), &LinearizeOptions { quiet: true, stop_after: None }).unwrap().already_done);
    let mut other = spec;
    other.stage2.steps = Some(9);
    assert!(linearize(other, &LinearizeOptions { quiet: true, stop_after: None }).is_err());
}

/// Stage 2 trains the LoRA adapters and nothing else.
#[test]
fn stage2_freezes_all_but_lora() {
    let _rng = crate::testutil::rng();
    let tmp = tempfile::tempdir().unwrap();
    let (_teacher, tvs, cfg) = loaded_tiny_teacher(tmp.path());
    let vs = VarStore::new(Device::Cpu);
    let variant: Variant = serde_yaml::from_str("{kind: lolcats, window: 4, feature_dim: 4}").unwrap();
    let h = Llama::linearized(&vs, &tvs, cfg, &variant, &LoraConfig::default()).unwrap();
    let mut opt = optimizer_for(&vs, &h, 2, 0.0);
    assert!(!opt.slots.is_empty() && opt.slots.iter().all(|s| is_lora(&s.name)));
    let before: Vec<(String, Tensor)> = vs.variables().into_iter().map(|(n, t)| (n, t.detach().copy())).collect();
    let x = Tensor::randint(100, [2, 16], (Kind::Int64, Device::Cpu));
    for _ in 0..2 {
        opt.zero_grad();
        h.masked_loss(&x.narrow(1, 0, 15), &x.narrow(1, 1, 15), Pass::Train).backward();
        opt.step(1e-2).unwrap();
    }
    let now = vs.variables();
    let mut changed = 0;
    for (n, b) in &before {
        let same = now[n].equal(b);
        if is_lora(n) {
            changed += (!same) as usize;
        } else {
            assert!(same, "{n} changed in stage 2");
        }
    }
    assert!(changed > 0, "no LoRA weight moved");
}

/// experiments/{still,lolcats}-smollm2.yaml end to end on CPU at smoke size (the real SmolLM2 teacher
/// from its GGUF, prose plus Alpaca, one step per stage of 128 tokens), and the routing sweep on it
/// expanding into valid runs.
#[test]
fn smollm2_experiments_linearize_at_smoke_size() {
    let _rng = crate::testutil::rng();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    crate::model::gguf::tests_support::smollm2();
    let tmp = tempfile::tempdir().unwrap();
    let (prose, alpaca) = crate::testutil::smoke_prose_and_alpaca(tmp.path());
    let mix = format!("data.train=[{{path: {}}}, {{alpaca: {}}}]", prose.display(), alpaca.display());
    for name in ["still", "lolcats"] {
        let out = tmp.path().join(name);
        let sets: Vec<String> = [
            "stage1.steps=1", "stage2.steps=1", "stage1.eval_every=1", "stage2.eval_every=1", "data.seq_len=128", "data.batch_size=1",
            "data.max_examples=2", "data.eval=null", "data.val_rows=1", "data.eval_rows=1", "train.device=cpu", "checkpoint.every=0",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("output={}", out.display()), mix.clone()])
        .collect();
        let spec = LinearizeSpec::from_file_with(&root.join(format!("experiments/{name}-smollm2.yaml")), &sets).unwrap();
        assert_eq!(spec.teacher, "gguf:smollm2");
        let o = linearize(spec, &LinearizeOptions { quiet: true, stop_after: None }).unwrap();
        assert_eq!(o.step, 2, "{name}");
        assert!(out.join("DONE").is_file() && out.join("export/tokenizer.json").is_file(), "{name}");
        let (s, t) = (o.eval["student"]["ppl"].as_f64().unwrap(), o.eval["teacher"]["ppl"].as_f64().unwrap());
        assert!(s.is_finite() && t.is_finite() && t < 1000.0, "{name}: student {s}, teacher {t}");
        // The student is prompted as the teacher is: its ChatML template and <|im_end|> (id 2) as EOS.
        let loaded = crate::eval::generate::load(&out, None, Some("cpu")).unwrap();
        let chat = loaded.chat.as_ref().unwrap_or_else(|| panic!("{name}: the export lost the teacher's chat template"));
        assert!(chat.source.contains("<|im_start|>"), "{name}: {}", chat.source);
        assert_eq!(loaded.eos, 2, "{name}");
    }
    let plan = crate::sweep::plan(&root.join("sweeps/still-routing-smollm2.yaml"), &[], Some(tmp.path())).unwrap();
    let names: Vec<&str> = plan.runs.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(plan.runs.len(), 11, "{names:?}");
    assert!(names.iter().any(|n| n.starts_with("still-random-k4")) && names.iter().any(|n| n.starts_with("still-self_saliency-k16")), "{names:?}");
}

/// `data.micro_batch`: the accumulated gradient (and the logged loss) of a step equals the whole
/// batch's in both stages, for equal and unequal micro-batches, with rows whose scored tokens differ.
#[test]
fn micro_batches_accumulate_to_the_whole_batch_gradient() {
    let _rng = crate::testutil::rng();
    let tmp = tempfile::tempdir().unwrap();
    let (teacher, tvs, cfg) = loaded_tiny_teacher(tmp.path());
    let vs = VarStore::new(Device::Cpu);
    let mut spec = e2e_spec(&teacher, &tmp.path().join("run"), "{kind: still, chunk: 4, tokens_per_chunk: 1}").resolved();
    let h = Llama::linearized(&vs, &tvs, cfg, &spec.attention, &spec.lora).unwrap();
    // Three rows of 16 tokens with 15, 9 and 3 scored targets (a prompt masked as Alpaca's is).
    let rows: Vec<Row> = [0usize, 6, 12]
        .iter()
        .enumerate()
        .map(|(i, &masked)| {
            let ids: Vec<i64> = (0..17).map(|t| ((t * 7 + i * 13) % 90 + 5) as i64).collect();
            let targets = ids[1..].iter().enumerate().map(|(j, &t)| if j < masked { IGNORE } else { t }).collect();
            Row { inputs: ids[..16].to_vec(), targets }
        })
        .collect();
    spec.data.batch_size = 3;
    for stage in [1u64, 2] {
        let mut opt = optimizer_for(&vs, &h, stage, 0.0);
        let mut run = |micro: Option<usize>| {
            spec.data.micro_batch = micro;
            let mut task = LinearizeTask { spec: &spec, hybrid: &h, added: h.operator_params(&vs), rows: &rows, val_rows: &[], device: Device::Cpu };
            opt.zero_grad();
            let (loss, extra) = task.step(stage as usize, 0, true).unwrap();
            let grads: Vec<Tensor> = opt.slots.iter().map(|s| s.param.grad().copy()).collect();
            (loss.double_value(&[]), extra.get("attn_mse").and_then(|v| v.as_f64()), grads)
        };
        let (loss, mse, whole) = run(None);
        for micro in [1, 2] {
            let (l, m, g) = run(Some(micro));
            assert!((l - loss).abs() <= 1e-5 * loss.abs(), "stage {stage}, micro {micro}: loss {l} vs {loss}");
            assert_eq!(m.is_some(), stage == 1);
            if let (Some(m), Some(mse)) = (m, mse) {
                assert!((m - mse).abs() <= 1e-5 * mse.abs(), "stage {stage}, micro {micro}: attn_mse {m} vs {mse}");
            }
            for (a, b) in g.iter().zip(&whole) {
                let err = (a - b).abs().max().double_value(&[]) / b.abs().max().double_value(&[]).max(1e-12);
                assert!(err < 1e-4, "stage {stage}, micro {micro}: gradient differs by {err:.2e} of its scale");
            }
        }
    }
}
