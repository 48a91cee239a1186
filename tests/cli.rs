//! End-to-end tests of the `attnlab` binary on the built-in tiny spec (CPU, seconds each).
use std::path::Path;
use std::process::{Command, Output};

fn attnlab(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_attnlab")).args(args).current_dir(cwd).output().expect("attnlab runs")
}

fn ok(out: &Output) -> String {
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "exit {:?}\nstdout:\n{so}\nstderr:\n{se}", out.status.code());
    so.into_owned()
}

fn fails(out: &Output) -> String {
    assert!(!out.status.success(), "expected failure, got success: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Per-step training losses of a run directory (last row wins when a resumed run logged a step twice).
fn losses(run: &Path) -> std::collections::BTreeMap<u64, f64> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("loss").is_some())
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

const SMALL: [&str; 10] = ["--set", "train.steps=24", "--set", "train.log_every=1", "--set", "checkpoint.every=8", "--set", "train.device=cpu", "--set", "data.train.synthetic.docs=300"];

#[test]
fn interrupted_and_resumed_run_matches_uninterrupted_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let (a, b) = (cwd.join("a"), cwd.join("b"));
    let run = |dir: &Path, extra: &[&str]| {
        let mut args = vec!["train", "--quiet", "--out", dir.to_str().unwrap()];
        args.extend(SMALL);
        args.extend(extra);
        attnlab(&args, cwd)
    };
    ok(&run(&a, &[]));
    ok(&run(&b, &["--stop-after", "12"]));
    assert!(!b.join("DONE").exists() && b.join("checkpoints/8/state.json").is_file());
    ok(&run(&b, &[]));
    let (la, lb) = (losses(&a), losses(&b));
    assert_eq!(la.len(), 24);
    assert_eq!(la, lb, "resumed run diverged from the uninterrupted one");
    assert!(la[&24] < la[&1], "loss did not decrease: {} → {}", la[&1], la[&24]);
    let eval = |d: &Path| std::fs::read_to_string(d.join("eval.json")).unwrap();
    assert_eq!(eval(&a), eval(&b));
    // Checkpoints kept: the newest `keep` (2 in the built-in spec).
    let mut kept: Vec<String> = std::fs::read_dir(a.join("checkpoints")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    kept.sort();
    assert_eq!(kept, ["16", "24"]);

    // A finished run is never overwritten; a different config in the same directory is refused.
    let again = ok(&run(&a, &[]));
    assert!(again.contains("finished"), "{again}");
    let err = fails(&run(&a, &["--set", "train.lr=0.01"]));
    assert!(err.contains("different config") && err.contains("lr"), "{err}");

    // forward writes [n, vocab] logits; eval rewrites eval.json at a chosen step.
    let toks = cwd.join("toks.txt");
    std::fs::write(&toks, "3 4 5\n6 7").unwrap();
    let out = ok(&attnlab(&["forward", a.to_str().unwrap(), "--tokens", toks.to_str().unwrap(), "--out", cwd.join("l.safetensors").to_str().unwrap()], cwd));
    assert!(out.contains("[5, 384]"), "{out}");
    let out = ok(&attnlab(&["eval", a.to_str().unwrap(), "--step", "16"], cwd));
    assert!(out.contains("step 16") && out.contains("synthetic"), "{out}");
    let out = attnlab(&["generate", a.to_str().unwrap(), "--prompt", "mira lives in oslo . question :", "--max-new-tokens", "5"], cwd);
    assert!(ok(&out).starts_with("mira lives in oslo . question :"));
    assert!(String::from_utf8_lossy(&out.stderr).contains("decode"), "generation stats missing");
    let out = ok(&attnlab(&["eval", a.to_str().unwrap(), "--task", "ruler:niah_single_1", "--lengths", "300", "--samples", "2", "--max-new-tokens", "4"], cwd));
    assert!(out.contains("niah_single_1") && out.contains("2 samples"), "{out}");
    let cells: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(a.join("ruler.json")).unwrap()).unwrap();
    assert_eq!((cells[0]["length"].as_u64(), cells[0]["samples"].as_u64()), (Some(300), Some(2)));
    std::fs::write(&toks, "3 x").unwrap();
    let err = fails(&attnlab(&["forward", a.to_str().unwrap(), "--tokens", toks.to_str().unwrap(), "--out", "l2.safetensors"], cwd));
    assert!(err.contains("token 2"), "{err}");
}

#[test]
fn bad_specs_are_rejected_with_key_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let write = |name: &str, body: &str| {
        let p = cwd.join(name);
        std::fs::write(&p, body).unwrap();
        p.to_str().unwrap().to_string()
    };
    let base = "data: {train: {synthetic: {docs: 10}}}\ntrain: {steps: 5}\n";
    let cases = [
        (format!("{base}attention:\n  kind: dar\n  d_down: 0\n"), "attention.d_down", "line 5"),
        (format!("{base}attention:\n  kind: dar\n  d_down: 65\n"), "attention.d_down", "line 5"),
        (format!("{base}attention:\n  kind: dar\n  window: -1\n"), "attention.window", "line 5"),
        ("data: {train: {synthetic: {docs: 10}}}\ntrain: {steps: 0}\n".to_string(), "train.steps", "line 2"),
        (format!("{base}model: {{flavor: tiny, colour: red}}\n"), "colour", "line 3"),
        (format!("{base}attention: {{kind: uniform, window: 4}}\n"), "attention.window", "line 3"),
        (format!("{base}model: {{flavor: pythia-7b}}\n"), "pythia-7b", "line 3"),
    ];
    for (i, (body, key, line)) in cases.iter().enumerate() {
        let p = write(&format!("s{i}.yaml"), body);
        let err = fails(&attnlab(&["config", &p], cwd));
        assert!(err.contains(key) && err.contains(line), "case {i}: {err}");
    }
    // --set values are validated too, and uniform is recorded as DAR with window 0.
    let p = write("ok.yaml", base);
    let err = fails(&attnlab(&["config", &p, "--set", "train.grad_accum=3", "--set", "train.batch_size=16"], cwd));
    assert!(err.contains("train.grad_accum"), "{err}");
    let resolved = ok(&attnlab(&["config", &p, "--set", "attention.kind=uniform"], cwd));
    assert!(resolved.contains("window: 0") && resolved.contains("uniform = DAR with window 0"), "{resolved}");
}

#[test]
fn help_lists_every_command() {
    let out = ok(&attnlab(&["--help"], Path::new(".")));
    for cmd in ["train", "compare", "eval", "forward", "data", "bench"] {
        assert!(out.lines().any(|l| l.trim_start().starts_with(cmd)), "--help lacks {cmd}:\n{out}");
    }
}

#[test]
fn data_prepare_and_bench_run_on_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let out = ok(&attnlab(&["data", "prepare", "--synthetic", "50", "--tokenizer", "builtin", "--out", "shards"], cwd));
    assert!(out.contains("50 documents") && out.contains("tokens/s"), "{out}");
    assert!(cwd.join("shards/index.json").is_file());
    let out = ok(&attnlab(&["bench", "--steps", "2", "--warmup", "1", "--vocab", "384", "--json", "--set", "train.device=cpu"], cwd));
    let v: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0 && v["micro_batch"] == 16);
    let out = ok(&attnlab(&["bench", "--attention-only", "--steps", "1", "--set", "train.device=cpu", "--set", "train.batch_size=1"], cwd));
    assert_eq!(out.lines().count(), 6, "{out}");
    // Decode cache sizes follow dar.md §3: DAR ≈ (d_down + 2·d·w/T)/(2·d) of vanilla per token.
    let out = ok(&attnlab(&["bench-decode", "--json", "--lengths", "256", "--new-tokens", "2", "--vocab", "384", "--set", "train.device=cpu"], cwd));
    let rows: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let bytes = |k: &str| rows.iter().find(|r| r["attention"] == k).unwrap()["cache_bytes"].as_f64().unwrap();
    let (d, d_down, w, t) = (64.0, 16.0, 16.0, 258.0); // 256 prompt + 2 generated tokens cached
    let predicted = (d_down * t + 2.0 * d * w) / (2.0 * d * t);
    assert!((bytes("dar") / bytes("vanilla") - predicted).abs() < 1e-6, "{} vs {predicted}", bytes("dar") / bytes("vanilla"));
}

/// A tiny Llama teacher trains on the built-in corpus and exports as a Hugging Face folder;
/// a DAR run refuses to export (no HF architecture has its bottleneck).
#[test]
fn llama_teacher_trains_and_exports() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let run = cwd.join("llama");
    let args = ["train", "--quiet", "--out", run.to_str().unwrap(), "--set", "model.flavor=llama-tiny", "--set", "model.tie_embeddings=false", "--set", "attention={kind: vanilla}", "--set", "train.steps=20", "--set", "train.device=cpu", "--set", "data.train.synthetic.docs=200"];
    let out = ok(&attnlab(&args, cwd));
    assert!(out.contains("synthetic"), "{out}");
    let l = losses(&run);
    assert!(l[&20] < l[&10], "loss did not decrease: {l:?}");
    ok(&attnlab(&["export", run.to_str().unwrap(), "--out", cwd.join("hf").to_str().unwrap()], cwd));
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(cwd.join("hf/config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
    assert_eq!((cfg["num_key_value_heads"].as_u64(), cfg["tie_word_embeddings"].as_bool()), (Some(2), Some(false)));
    // An untied Llama run's checkpoint (with lm_head.weight) loads back for evaluation.
    let out = ok(&attnlab(&["eval", run.to_str().unwrap()], cwd));
    assert!(out.contains("step 20"), "{out}");
    assert!(cwd.join("hf/model.safetensors").is_file() && cwd.join("hf/tokenizer.json").is_file());
    // The teacher linearizes into a STILL hybrid (both stages) through the CLI.
    let spec = cwd.join("still.yaml");
    std::fs::write(&spec, format!("teacher: {}\nattention: {{kind: still, chunk: 16, tokens_per_chunk: 2}}\nlora: {{rank: 4, alpha: 4}}\ndata: {{train: {{synthetic: {{seed: 1, docs: 60}}}}, eval: {{synthetic: {{seed: 2, docs: 8}}}}, seq_len: 64, batch_size: 4}}\nstage1: {{steps: 3}}\nstage2: {{steps: 3}}\ntrain: {{device: cpu}}\noutput: {}\n", run.display(), cwd.join("lin").display())).unwrap();
    let out = ok(&attnlab(&["linearize", spec.to_str().unwrap(), "--quiet"], cwd));
    assert!(out.contains("linearized") && cwd.join("lin/DONE").is_file() && cwd.join("lin/lora.safetensors").is_file(), "{out}");
    // DAR has no Hugging Face architecture.
    let dar = cwd.join("dar");
    ok(&attnlab(&["train", "--quiet", "--out", dar.to_str().unwrap(), "--set", "train.steps=2", "--set", "train.device=cpu", "--set", "data.train.synthetic.docs=50"], cwd));
    let err = fails(&attnlab(&["export", dar.to_str().unwrap(), "--out", cwd.join("x").to_str().unwrap()], cwd));
    assert!(err.contains("only vanilla"), "{err}");
}

/// A diverging run stops with a clear message and keeps its last good checkpoint.
#[test]
fn nan_loss_stops_the_run_keeping_the_last_good_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("nan");
    let args = ["train", "--quiet", "--out", run.to_str().unwrap(), "--set", "train.lr=1e12", "--set", "train.clip=0", "--set", "train.steps=40", "--set", "train.log_every=1", "--set", "checkpoint.every=1", "--set", "checkpoint.keep=40", "--set", "train.device=cpu", "--set", "data.train.synthetic.docs=100"];
    let err = fails(&attnlab(&args, tmp.path()));
    let step: u64 = err.split("training stopped at step ").nth(1).and_then(|s| s.split(':').next()).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{err}"));
    assert!(err.contains("loss is") && err.contains(&format!("last good checkpoint: step {}", step - 1)), "{err}");
    assert!(run.join(format!("checkpoints/{}/state.json", step - 1)).is_file());
    assert!(!run.join(format!("checkpoints/{step}")).exists() && !run.join("DONE").exists());
}

/// `attnlab finetune`: a tiny Llama trained here is fine-tuned on the hand-written chat fixture
/// through both stages (stage 1 restricted to the attention projections, as the DAR bottleneck is
/// not in this build); interrupted runs (mid-stage and at the stage boundary) resume to the same
/// losses; stage 1 leaves every other weight untouched; DONE, eval.json and the export folder exist;
/// a finished run is left alone and a different config refused.
#[test]
fn finetune_two_stages_resume_and_eval() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let teacher = cwd.join("teacher");
    let args = ["train", "--quiet", "--out", teacher.to_str().unwrap(), "--set", "model.flavor=llama-tiny", "--set", "attention={kind: vanilla}", "--set", "train.steps=20", "--set", "train.device=cpu", "--set", "data.train.synthetic.docs=200"];
    ok(&attnlab(&args, cwd));
    let chat = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/tiny.jsonl");
    let spec = |out: &str, stage2_steps: u64| {
        let p = cwd.join(format!("{out}.yaml"));
        std::fs::write(&p, format!("base: {}\nattention: {{kind: vanilla}}\ndata: {{train: {{path: {}}}, seq_len: 48, batch_size: 2, val_rows: 2}}\nstage1: {{steps: 3, lr: 3.0e-3, warmup: 0.0, params: self_attn}}\nstage2: {{steps: {stage2_steps}, lr: 3.0e-3}}\ntrain: {{device: cpu, log_every: 1}}\ncheckpoint: {{every: 2, keep: 10}}\noutput: {}\n", teacher.display(), chat.display(), cwd.join(out).display())).unwrap();
        p
    };
    let run = |p: &Path, extra: &[&str]| {
        let mut a = vec!["finetune", p.to_str().unwrap(), "--quiet"];
        a.extend(extra);
        attnlab(&a, cwd)
    };
    let (sa, sb, sc) = (spec("a", 4), spec("b", 4), spec("c", 4));
    let out = ok(&run(&sa, &[]));
    assert!(out.contains("fine-tuned") && cwd.join("a/DONE").is_file(), "{out}");
    ok(&run(&sb, &["--stop-after", "5"])); // mid-stage 2
    ok(&run(&sc, &["--stop-after", "3"])); // exactly at the stage boundary
    assert!(!cwd.join("b/DONE").exists() && !cwd.join("c/DONE").exists());
    ok(&run(&sb, &[]));
    ok(&run(&sc, &[]));
    let la = losses(&cwd.join("a"));
    assert_eq!(la.keys().copied().collect::<Vec<_>>(), (1..=7).collect::<Vec<_>>());
    assert_eq!(la, losses(&cwd.join("b")), "resumed mid-stage diverged");
    assert_eq!(la, losses(&cwd.join("c")), "resumed at the boundary diverged");

    // Rows: stages, and the held-out loss before any update and after each stage.
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(cwd.join("a/metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let stage_of = |s: u64| rows.iter().find(|r| r["step"] == s && r.get("loss").is_some()).unwrap()["stage"].as_u64().unwrap();
    assert_eq!((stage_of(3), stage_of(4)), (1, 2));
    let at = |a: &str| rows.iter().find(|r| r["at"] == a).unwrap_or_else(|| panic!("no `{a}` row")).clone();
    assert_eq!((at("start")["step"].as_u64(), at("end of stage 1")["step"].as_u64()), (Some(0), Some(3)));

    // eval.json: the base model's held-out loss equals the loss logged before any update (same
    // weights, same rows); fine-tuning lowered it.
    let eval: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(cwd.join("a/eval.json")).unwrap()).unwrap();
    let (base, tuned) = (eval["base"]["loss"].as_f64().unwrap(), eval["finetuned"]["loss"].as_f64().unwrap());
    assert!((base - at("start")["eval_loss"].as_f64().unwrap()).abs() < 1e-5, "{eval}");
    assert!(tuned < base, "fine-tuning did not lower the held-out loss: {eval}");
    assert!(eval["rows"].as_u64().unwrap() == 2 && eval["scored_tokens"].as_u64().unwrap() > 0, "{eval}");

    // Stage 1 trains only the attention projections: at its last checkpoint every other weight is
    // the teacher's.
    let read = |p: &Path| -> std::collections::HashMap<String, tch::Tensor> { tch::Tensor::read_safetensors(p).unwrap().into_iter().collect() };
    let (t, s1) = (read(&teacher.join("checkpoints/20/model.safetensors")), read(&cwd.join("b/checkpoints/3/model.safetensors")));
    let mut moved = 0;
    for (name, w) in &s1 {
        if name.contains("self_attn") {
            moved += (!w.equal(&t[name])) as usize;
        } else {
            assert!(w.equal(&t[name]), "{name} changed in stage 1");
        }
    }
    assert_eq!(moved, 8, "2 layers × q, k, v, o should move in stage 1");

    // Export: an HF folder with the tokenizer and the chat template.
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(cwd.join("a/export/config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
    let tc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(cwd.join("a/export/tokenizer_config.json")).unwrap()).unwrap();
    assert!(tc["chat_template"].as_str().unwrap().contains("<|assistant|>") && tc["eos_token"] == "<|endoftext|>");
    assert!(cwd.join("a/export/model.safetensors").is_file() && cwd.join("a/export/tokenizer.json").is_file());

    // Finished: left alone. Another config in the same directory: refused.
    assert!(ok(&run(&sa, &[])).contains("finished"));
    let err = fails(&run(&spec("a", 5), &[]));
    assert!(err.contains("different config"), "{err}");
    // DAR needs the DAR-for-Llama layers (swap point in src/finetune.rs).
    let dar = cwd.join("dar.yaml");
    std::fs::write(&dar, std::fs::read_to_string(&sa).unwrap().replace("{kind: vanilla}", "{kind: dar, d_down: 16, window: 8}").replace("/a\n", "/dar\n")).unwrap();
    let err = fails(&run(&dar, &[]));
    assert!(err.contains("dar"), "{err}");
}
