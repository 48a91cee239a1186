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
    // babilong: a one-record bAbI file and a plain-text essay; babilong.json gets one cell per length.
    let (babi, essay) = (cwd.join("qa1.jsonl"), cwd.join("essay.txt"));
    std::fs::write(&babi, r#"{"facts": ["Mary moved to the bathroom.", "John went to the hallway."], "question": "Where is Mary?", "answer": "bathroom"}"#).unwrap();
    std::fs::write(&essay, "Startups grow fast because the founders keep talking to their users every week. ".repeat(40)).unwrap();
    let args = ["--lengths", "1400", "--samples", "3", "--max-new-tokens", "2", "--babi", babi.to_str().unwrap(), "--essay", essay.to_str().unwrap()];
    let out = ok(&attnlab(&[&["eval", a.to_str().unwrap(), "--task", "babilong:qa1"][..], &args].concat(), cwd));
    assert!(out.contains("qa1") && out.contains("1 samples"), "{out}");
    let cells: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(a.join("babilong.json")).unwrap()).unwrap();
    assert_eq!((cells[0]["task"].as_str(), cells[0]["length"].as_u64(), cells[0]["samples"].as_u64()), (Some("qa1"), Some(1400), Some(1)));
    assert!(cells[0]["mean_prompt_tokens"].as_f64().unwrap() <= 1400.0);
    assert!(cells[0]["seconds"].as_f64().unwrap() > 0.0, "the cell's wall time: {cells}");
    let err = fails(&attnlab(&["eval", a.to_str().unwrap(), "--task", "babilong:qa1", "--babi", babi.to_str().unwrap()], cwd));
    assert!(err.contains("--essay"), "{err}");
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
    for cmd in ["train", "compare", "eval", "forward", "data", "bench", "saliency-words"] {
        assert!(out.lines().any(|l| l.trim_start().starts_with(cmd)), "--help lacks {cmd}:\n{out}");
    }
}

/// `saliency-words` refuses a missing text file and a JSON-lines file without the text field, naming
/// them, before loading any model.
#[test]
fn saliency_words_names_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.jsonl.zst");
    let e = fails(&attnlab(&["saliency-words", "gguf:smollm2", "--text", missing.to_str().unwrap(), "--quiet"], dir.path()));
    assert!(e.contains("nope.jsonl.zst") && e.contains("no such file"), "{e}");
    let jl = dir.path().join("docs.jsonl");
    std::fs::write(&jl, "{\"body\": \"It was not.\"}\n").unwrap();
    let e = fails(&attnlab(&["saliency-words", "gguf:smollm2", "--text", jl.to_str().unwrap(), "--quiet"], dir.path()));
    assert!(e.contains("docs.jsonl") && e.contains("`text`"), "{e}");
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
    // Vanilla (auto, reference); DAR and uniform by auto, band-split, SDPA and the reference.
    assert_eq!(out.lines().count(), 10, "{out}");
    assert!(out.lines().any(|l| l.starts_with("dar") && l.contains("bandsplit")), "{out}");
    // Decode cache sizes follow dar.md §3: DAR ≈ (d_down + 2·d·w/T)/(2·d) of vanilla per token.
    let out = ok(&attnlab(&["bench-decode", "--json", "--lengths", "256", "--new-tokens", "2", "--vocab", "384", "--set", "train.device=cpu"], cwd));
    let rows: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let bytes = |k: &str| rows.iter().find(|r| r["attention"] == k).unwrap()["cache_bytes"].as_f64().unwrap();
    // 256 prompt tokens + the first of the 2 generated cached (the last one is never fed back).
    let (d, d_down, w, t) = (64.0, 16.0, 16.0, 257.0);
    let predicted = (d_down * t + 2.0 * d * w) / (2.0 * d * t);
    assert!((bytes("dar") / bytes("vanilla") - predicted).abs() < 1e-6, "{} vs {predicted}", bytes("dar") / bytes("vanilla"));
    // STILL at the same size (2 layers, 4 heads of D = 16, fp32): still.md §6 per layer and head,
    // 2·(n_sel + n_win)·D·4 + (F·D + F)·4 + n_win·4 bytes with F = 2D, C = 64, κ = 4: after 257 tokens
    // chunks 0–2 are routed (n_sel = 12) and the window holds chunk 3 and the 1 token of chunk 4.
    let (n_sel, n_win, dh, f) = (12.0, 65.0, 16.0, 32.0);
    let still = 2.0 * 4.0 * (2.0 * (n_sel + n_win) * dh * 4.0 + (f * dh + f) * 4.0 + n_win * 4.0);
    assert_eq!(bytes("still"), still);
    assert!(bytes("lolcats") > 0.0 && bytes("still-budget") == still, "the budget (m = 384 for 4096 tokens) caps after 64 chunks");
    // Liger-GLA (a registered hybrid, benched by default): the 64-token window's keys and values and
    // S, z of D·D + D fp32 values per layer and head.
    assert_eq!(bytes("liger-gla"), 2.0 * 4.0 * (2.0 * 64.0 * dh * 4.0 + (dh * dh + dh) * 4.0));
}

/// A tiny Llama teacher trains on the built-in corpus and exports as a Hugging Face folder;
/// a GPT-NeoX DAR run exports as attnlab's architecture with its remote code and a model card.
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
    // It generates with its bounded cache, the same from the run directory and from its export folder;
    // a RULER task runs on it and writes into the run directory.
    let prompt = "mira lives in oslo . question :";
    let gen = |dir: &str| ok(&attnlab(&["generate", cwd.join(dir).to_str().unwrap(), "--prompt", prompt, "--max-new-tokens", "12", "--greedy"], cwd));
    let (from_run, from_export) = (gen("lin"), gen("lin/export"));
    assert!(from_run.starts_with(prompt) && from_run.trim().len() > prompt.len(), "{from_run}");
    assert_eq!(from_run, from_export);
    let out = ok(&attnlab(&["eval", cwd.join("lin").to_str().unwrap(), "--task", "ruler:niah_single_1", "--lengths", "128", "--samples", "1", "--max-new-tokens", "4"], cwd));
    assert!(out.contains("niah_single_1") && cwd.join("lin/ruler.json").is_file(), "{out}");
    // The same weights at another κ and with the oracle: cells tagged with their overrides beside the
    // plain one, per-sample records with the needle's token positions and per-layer reads.
    let lin = cwd.join("lin");
    let eval_set = |sets: &[&str]| {
        let mut args = vec!["eval", lin.to_str().unwrap(), "--task", "ruler:niah_single_1", "--lengths", "128", "--samples", "2", "--max-new-tokens", "4"];
        for s in sets {
            args.extend(["--set", s]);
        }
        attnlab(&args, cwd)
    };
    let out = ok(&eval_set(&["attention.routing=oracle", "attention.linear_branch=false"]));
    assert!(out.contains("[attention.routing=oracle attention.linear_branch=false]") && out.contains("normalizer share"), "{out}");
    ok(&eval_set(&["attention.tokens_per_chunk=16"]));
    let cells: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(lin.join("ruler.json")).unwrap()).unwrap();
    let tags: Vec<Option<&str>> = cells.as_array().unwrap().iter().map(|c| c["overrides"].as_str()).collect();
    assert_eq!(tags, [None, Some("attention.routing=oracle attention.linear_branch=false"), Some("attention.tokens_per_chunk=16")]);
    let records = std::fs::read_to_string(lin.join("ruler_samples/niah_single_1-128-attention_routing_oracle_attention_linear_branch_false.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(records.lines().next().unwrap()).unwrap();
    let needle = &first["needles"][0];
    assert!(needle["value_tokens"].as_array().is_some_and(|v| !v.is_empty()) && needle["span"][1].as_u64() > needle["span"][0].as_u64(), "{first}");
    let layers = first["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 2, "one record per layer: {first}");
    let shares: f64 = layers[0]["shares_mean"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).sum();
    assert!((shares - 1.0).abs() < 1e-3 && layers[0]["shares_mean"][2].as_f64() == Some(0.0), "linear branch off: {first}");
    // The oracle selects the needle sentence: no value token outside the window is missed.
    assert!(layers.iter().all(|l| l["value_neither"].as_u64() == Some(0)), "{first}");
    let err = fails(&eval_set(&["attention.no_such_key=1"]));
    assert!(err.contains("no_such_key") && err.contains("hybrid.yaml"), "{err}");
    let err = fails(&attnlab(&["eval", run.to_str().unwrap(), "--task", "ruler:niah_single_1", "--lengths", "128", "--samples", "1", "--set", "attention.window=4"], cwd));
    assert!(err.contains("linearized"), "{err}");
    // DAR exports with the remote code that runs it (scripts/hf_parity.py loads it in transformers).
    assert!(!cwd.join("hf/attnlab_attention.py").exists(), "a vanilla export carries no remote code");
    let dar = cwd.join("dar");
    ok(&attnlab(&["train", "--quiet", "--out", dar.to_str().unwrap(), "--set", "train.steps=2", "--set", "train.device=cpu", "--set", "data.train.synthetic.docs=50"], cwd));
    let x = cwd.join("x");
    ok(&attnlab(&["export", dar.to_str().unwrap(), "--out", x.to_str().unwrap()], cwd));
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(x.join("config.json")).unwrap()).unwrap();
    assert_eq!((cfg["model_type"].as_str(), cfg["architectures"][0].as_str()), (Some("attnlab_gpt_neox"), Some("AttnlabGPTNeoXForCausalLM")), "{cfg}");
    let module = cfg["auto_map"]["AutoModelForCausalLM"].as_str().unwrap().split('.').next().unwrap().to_string();
    let code = std::fs::read_to_string(x.join(format!("{module}.py"))).unwrap();
    assert!(code.contains("class AttnlabGPTNeoXForCausalLM") && x.join("attnlab_attention.py").is_file(), "the auto_map names code the folder holds");
    assert_eq!(cfg["attnlab_attention"]["kind"], "dar");
    let card = std::fs::read_to_string(x.join("README.md")).unwrap();
    let tokens = std::fs::read_to_string(dar.join("metrics.jsonl")).unwrap().lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["tokens"].as_u64()).last().unwrap();
    assert!(card.contains("trust_remote_code") && card.contains(&tokens.to_string()) && card.contains("d_down: 16"), "{card}");
}

/// An OLMo 2 flavor trains with DAR from the spec's `attention:` section, evaluates, and exports as
/// attnlab's OLMo 2 architecture (never the stock Olmo2ForCausalLM, which would drop the bottleneck)
/// whose config.json keeps the DAR settings (attnlab_attention) for reloading.
#[test]
fn olmo2_dar_trains_evaluates_and_exports() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let run = cwd.join("olmo2");
    let args = ["train", "--quiet", "--out", run.to_str().unwrap(), "--set", "model.flavor=olmo2-tiny", "--set", "attention={kind: dar, d_down: 16, window: 8, impl: reference}", "--set", "train.steps=20", "--set", "train.device=cpu", "--set", "data.train.synthetic.docs=200"];
    ok(&attnlab(&args, cwd));
    let l = losses(&run);
    assert!(l[&20] < l[&10], "loss did not decrease: {l:?}");
    let resolved = std::fs::read_to_string(run.join("config.yaml")).unwrap();
    assert!(resolved.contains("arch: olmo2") && resolved.contains("kind: dar"), "{resolved}");
    let out = ok(&attnlab(&["eval", run.to_str().unwrap()], cwd));
    assert!(out.contains("step 20"), "{out}");
    ok(&attnlab(&["export", run.to_str().unwrap(), "--out", cwd.join("hf").to_str().unwrap()], cwd));
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(cwd.join("hf/config.json")).unwrap()).unwrap();
    assert_eq!((cfg["architectures"][0].as_str(), cfg["model_type"].as_str()), (Some("AttnlabOlmo2ForCausalLM"), Some("attnlab_olmo2")));
    assert_eq!((cfg["attnlab_attention"]["d_down"].as_u64(), cfg["attnlab_attention"]["window"].as_u64()), (Some(16), Some(8)));
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

/// A very small model (1 layer, d = 32, T = 32) so that data-parallel runs take seconds on 2 cores.
const DP: [&str; 24] = [
    "--set", "model.layers=1", "--set", "model.d_model=32", "--set", "model.heads=2", "--set", "data.seq_len=32",
    "--set", "train.batch_size=8", "--set", "train.grad_accum=2", "--set", "train.log_every=1", "--set", "train.device=cpu",
    "--set", "data.train.synthetic.docs=120", "--set", "data.eval.synthetic.synthetic.docs=10", "--set", "checkpoint.every=3", "--set", "checkpoint.keep=3",
];

fn dp_args<'a>(dir: &'a Path, steps: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["train", "--quiet", "--out", dir.to_str().unwrap(), "--set", steps];
    args.extend(DP);
    args.extend(extra);
    args
}

fn assert_close(reference: &std::collections::BTreeMap<u64, f64>, got: &std::collections::BTreeMap<u64, f64>) {
    assert_eq!(reference.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>(), "logged steps differ");
    for (s, a) in reference {
        // Same data and global batch; only the float summation order of the gradients differs.
        assert!((a - got[s]).abs() < 1e-5 * a.abs().max(1.0), "step {s}: one process {a}, data-parallel {}", got[s]);
    }
}

/// Two CPU workers (each half of every global batch, gradients averaged through the store) give the
/// loss curve and final perplexity of one process with gradient accumulation over the same batch.
#[test]
fn two_workers_reproduce_the_single_process_loss_curve() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let (one, two) = (cwd.join("one"), cwd.join("two"));
    ok(&attnlab(&dp_args(&one, "train.steps=8", &[]), cwd));
    ok(&attnlab(&dp_args(&two, "train.steps=8", &["--gpus", "cpu,cpu"]), cwd));
    let (l1, l2) = (losses(&one), losses(&two));
    assert_eq!(l1.len(), 8);
    assert_close(&l1, &l2);
    assert!(l1[&8] < l1[&1], "loss did not decrease: {l1:?}");
    // Only rank 0 wrote: one metrics row per step, marked with the world size.
    let text = std::fs::read_to_string(two.join("metrics.jsonl")).unwrap();
    assert_eq!(text.lines().filter(|l| l.contains("\"world_size\":2")).count(), 8, "{text}");
    let ppl = |d: &Path| -> f64 {
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(d.join("eval.json")).unwrap()).unwrap();
        v["corpora"]["synthetic"]["ppl"].as_f64().unwrap_or_else(|| panic!("{v}"))
    };
    assert!((ppl(&one) - ppl(&two)).abs() < 1e-4 * ppl(&one), "{} vs {}", ppl(&one), ppl(&two));
    // A world size that does not divide the global batch is refused up front.
    let err = fails(&attnlab(&dp_args(&cwd.join("three"), "train.steps=8", &["--gpus", "cpu,cpu,cpu"]), cwd));
    assert!(err.contains("train.devices") && err.contains("divide"), "{err}");
}

/// The pid of the launcher's worker with RANK=`rank` (from /proc), once it exists.
fn worker_pid(launcher: u32, rank: usize) -> Option<u32> {
    let kids = std::fs::read_to_string(format!("/proc/{launcher}/task/{launcher}/children")).ok()?;
    kids.split_whitespace().filter_map(|p| p.parse::<u32>().ok()).find(|p| {
        let env = std::fs::read(format!("/proc/{p}/environ")).unwrap_or_default();
        env.split(|&b| b == 0).any(|kv| kv == format!("RANK={rank}").as_bytes())
    })
}

/// SIGKILL of one worker stops the job with a message naming it and the checkpoint to resume from;
/// the checkpoints stay complete; the run then resumes with 1 worker, then with 2, and ends on the
/// loss curve of an uninterrupted single-process run.
#[test]
fn killed_worker_stops_the_job_and_the_run_resumes_with_one_or_two_workers() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let (reference, run) = (cwd.join("reference"), cwd.join("run"));
    ok(&attnlab(&dp_args(&reference, "train.steps=30", &[]), cwd));

    let mut job = Command::new(env!("CARGO_BIN_EXE_attnlab"))
        .args(dp_args(&run, "train.steps=30", &["--gpus", "cpu,cpu"]))
        .current_dir(cwd)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while !run.join("checkpoints/3/state.json").is_file() {
        assert!(start.elapsed().as_secs() < 300, "no checkpoint after 300 s");
        assert!(job.try_wait().unwrap().is_none(), "job ended before the kill");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let victim = worker_pid(job.id(), 1).expect("rank 1 worker is running");
    assert!(Command::new("kill").args(["-9", &victim.to_string()]).status().unwrap().success());
    let out = job.wait_with_output().unwrap();
    let err = fails(&out);
    assert!(err.contains("worker rank 1") && err.contains("killed by signal 9") && err.contains("stopped the other 1 worker"), "{err}");
    let last: u64 = err.split("last complete checkpoint is step ").nth(1).and_then(|s| s.split(' ').next()).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{err}"));
    assert!(last >= 3 && last < 30 && !run.join("DONE").exists(), "{err}");
    for e in std::fs::read_dir(run.join("checkpoints")).unwrap() {
        let p = e.unwrap().path();
        if p.file_name().unwrap().to_str().unwrap().parse::<u64>().is_ok() {
            for f in ["model.safetensors", "optimizer.safetensors", "state.json"] {
                assert!(p.join(f).is_file(), "{} lacks {f}", p.display());
            }
        }
    }
    // Resume on one process for a few steps, then on two to the end.
    let stop = (last + 4).to_string();
    ok(&attnlab(&dp_args(&run, "train.steps=30", &["--stop-after", &stop]), cwd));
    assert!(!run.join("DONE").exists());
    ok(&attnlab(&dp_args(&run, "train.steps=30", &["--gpus", "cpu,cpu"]), cwd));
    assert!(run.join("DONE").is_file());
    assert_close(&losses(&reference), &losses(&run));
}

/// Downstream tasks through the CLI on the committed fixtures: tasks/NAME.json and the samples file
/// are written, bad task names and data paths fail with a clear message, and the report shows the
/// downstream table with the paper's row for the same d_model / d_down ratio.
#[test]
fn downstream_tasks_write_results_and_the_report_table() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let run = cwd.join("sweep/dar");
    let args = ["train", "--quiet", "--out", run.to_str().unwrap(), "--set", "train.steps=4", "--set", "train.device=cpu", "--set", "data.train.synthetic.docs=60"];
    ok(&attnlab(&args, cwd));
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tasks");
    let data = fixtures.join("mmlu");
    let out = ok(&attnlab(&["eval", run.to_str().unwrap(), "--task", "mmlu", "--data", data.to_str().unwrap(), "--shots", "2", "--limit", "2"], cwd));
    assert!(out.contains("mmlu over 2 documents (2-shot)") && out.contains("acc"), "{out}");
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(run.join("tasks/mmlu.json")).unwrap()).unwrap();
    assert_eq!((r["docs"].as_u64(), r["primary_metric"].as_str(), r["model"]["d_down"].as_u64(), r["model"]["d_model"].as_u64()), (Some(2), Some("acc"), Some(16), Some(64)));
    let acc = r["metrics"]["acc"].as_f64().unwrap();
    assert!(acc == 0.0 || acc == 0.5 || acc == 1.0, "{acc}");
    assert_eq!(std::fs::read_to_string(run.join("tasks/mmlu.samples.jsonl")).unwrap().lines().count(), 2);
    let err = fails(&attnlab(&["eval", run.to_str().unwrap(), "--task", "mmlux"], cwd));
    assert!(err.contains("unknown task `mmlux`") && err.contains("hellaswag"), "{err}");
    let err = fails(&attnlab(&["eval", run.to_str().unwrap(), "--task", "gsm8k", "--data", cwd.join("nowhere").to_str().unwrap()], cwd));
    assert!(err.contains("nowhere") && err.contains("no such file"), "{err}");
    let report = cwd.join("report");
    ok(&attnlab(&["report", cwd.join("sweep").to_str().unwrap(), "--out", report.to_str().unwrap()], cwd));
    let md = std::fs::read_to_string(report.join("report.md")).unwrap();
    assert!(md.contains("## Downstream tasks (DAR Table 4)") && md.contains("| 16 | "), "{md}");
    // d_model / d_down = 4 → the paper's d_down = 512 row (MMLU 0.4051).
    assert!(md.contains("0.4051"), "{md}");
}

/// `attnlab finetune`: a tiny Llama trained here is fine-tuned on the hand-written chat fixture
/// through both stages, first vanilla with stage 1 restricted to the attention projections:
/// interrupted runs (mid-stage and at the stage boundary) resume to the same losses; stage 1 leaves
/// every other weight untouched; DONE, eval.json and the export folder exist; a finished run is left
/// alone and a different config refused. Then with DAR (pca bottlenecks) through both stages.
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
    // DAR (pca init) through both stages: the bottleneck trains, the export holds it.
    let dar = cwd.join("dar.yaml");
    std::fs::write(&dar, std::fs::read_to_string(&sa).unwrap().replace("{kind: vanilla}", "{kind: dar, d_down: 16, window: 8, init: pca}").replace("params: self_attn", "params: bottleneck").replace("/a\n", "/dar\n")).unwrap();
    ok(&run(&dar, &[]));
    let eval: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(cwd.join("dar/eval.json")).unwrap()).unwrap();
    assert!(eval["finetuned"]["loss"].as_f64().unwrap() < eval["base"]["loss"].as_f64().unwrap(), "{eval}");
    let w: std::collections::HashMap<String, tch::Tensor> = tch::Tensor::read_safetensors(cwd.join("dar/export/model.safetensors")).unwrap().into_iter().collect();
    assert!(w.keys().filter(|k| k.contains("bottleneck_down")).count() == 2, "{:?}", w.keys());
    // The same for an OLMo 2 base (post-norms, QK-norm; the bottleneck reads the residual stream).
    let olmo = cwd.join("olmo");
    let args = ["train", "--quiet", "--out", olmo.to_str().unwrap(), "--set", "model.flavor=olmo2-tiny", "--set", "attention={kind: vanilla}", "--set", "train.steps=20", "--set", "train.device=cpu", "--set", "data.train.synthetic.docs=200"];
    ok(&attnlab(&args, cwd));
    let olmo_dar = cwd.join("olmo-dar.yaml");
    std::fs::write(&olmo_dar, std::fs::read_to_string(&dar).unwrap().replace(&teacher.display().to_string(), &olmo.display().to_string()).replace("/dar\n", "/olmo-dar\n")).unwrap();
    ok(&run(&olmo_dar, &[]));
    let eval: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(cwd.join("olmo-dar/eval.json")).unwrap()).unwrap();
    assert!(eval["finetuned"]["loss"].as_f64().unwrap() < eval["base"]["loss"].as_f64().unwrap(), "{eval}");
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(cwd.join("olmo-dar/export/config.json")).unwrap()).unwrap();
    assert!(cfg["model_type"] == "attnlab_olmo2" && cfg["attnlab_attention"]["d_down"] == 16 && cwd.join("olmo-dar/export/attnlab_olmo2.py").is_file(), "{cfg}");
    // A finetune run generates (from its export) with DAR's latent cache, and linearizes: a STILL
    // student of the DAR-fine-tuned OLMo 2, its teacher's held-out loss the DAR model's.
    let out = attnlab(&["generate", olmo_dar.with_extension("").to_str().unwrap(), "--prompt", "hello", "--max-new-tokens", "3"], cwd);
    assert!(String::from_utf8_lossy(&out.stderr).contains("decode"), "{}", fails(&out));
    let lin = cwd.join("lin.yaml");
    std::fs::write(&lin, format!("teacher: {}\nattention: {{kind: still, chunk: 8, tokens_per_chunk: 1}}\ndata: {{train: {{synthetic: {{seed: 1, docs: 40}}}}, seq_len: 32, batch_size: 2, val_rows: 2}}\nstage1: {{steps: 2}}\nstage2: {{steps: 1}}\ntrain: {{device: cpu}}\noutput: {}\n", cwd.join("olmo-dar").display(), cwd.join("lin").display())).unwrap();
    let out = ok(&attnlab(&["linearize", lin.to_str().unwrap(), "--quiet"], cwd));
    let eval: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(cwd.join("lin/eval.json")).unwrap()).unwrap();
    assert!(eval["student"]["loss"].as_f64().unwrap().is_finite() && eval["teacher"]["loss"].as_f64().unwrap().is_finite(), "{out} {eval}");
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(cwd.join("lin/export/config.json")).unwrap()).unwrap();
    // attnlab's architecture with the remote code that runs STILL (scripts/hf_parity.py loads students).
    assert!(cfg["model_type"] == "attnlab_olmo2" && cfg["attnlab_attention"]["kind"] == "still" && cfg["auto_map"].is_object(), "{cfg}");
    assert!(cwd.join("lin/export/attnlab_linearized.py").is_file() && cwd.join("lin/export/attnlab_olmo2.py").is_file());
    let out = attnlab(&["generate", cwd.join("lin").to_str().unwrap(), "--prompt", "hello", "--max-new-tokens", "3"], cwd);
    assert!(String::from_utf8_lossy(&out.stderr).contains("decode"), "{}", fails(&out));
}

/// scripts/fault_test.sh on the tiny spec: random SIGKILLs (some inside checkpoint writes), a
/// second writer, a truncated checkpoint, a full disk, a malformed metrics line and a killed and
/// relaunched sweep, each ending bit-identical to an uninterrupted run (see the script's header).
#[test]
fn fault_test_script_passes() {
    let tmp = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/fault_test.sh");
    let out = Command::new("bash").arg(&script).arg(env!("CARGO_BIN_EXE_attnlab")).arg(tmp.path()).output().expect("bash runs");
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "fault test failed (exit {:?})\nstdout:\n{so}\nstderr:\n{se}", out.status.code());
    assert!(so.contains("all fault checks passed"), "{so}");
}

/// Issue 17: a spec that inherits (`base:`) trains a tiny model on megatron-core's fixture, read
/// with its index and as a flat `.bin` (the same stream, so the same losses) from a start sample;
/// `attnlab config` prints the merged spec, config.yaml has no `base:`, `attnlab runs` lists the
/// runs with their status, and a bad start sample or a bad base is a clear error.
#[test]
fn megatron_source_inherited_spec_and_runs_table() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/megatron");
    std::fs::create_dir(cwd.join("common")).unwrap();
    // ids < 1000: the builtin tokenizer names the run's tokenizer, model.vocab the embedding rows.
    std::fs::write(
        cwd.join("common/base.yaml"),
        format!(
            "model: {{flavor: tiny, vocab: 1024}}\nattention: {{kind: dar, d_down: 16, window: 4}}\ndata:\n  tokenizer: builtin\n  seq_len: 8\n  train: {{megatron: {{bin: {}, idx: {}, start_sample: 2}}}}\ntrain: {{steps: 4, batch_size: 2, device: cpu, log_every: 1}}\n",
            fx.join("pythia_u16.bin").display(),
            fx.join("pythia_u16.idx").display()
        ),
    )
    .unwrap();
    std::fs::write(cwd.join("idx.yaml"), "base: common/base.yaml\ntrain: {steps: 3}\noutput: runs/idx\n").unwrap();
    std::fs::write(cwd.join("flat.yaml"), "base: idx.yaml\ndata: {train: {megatron: {idx: null}}}\noutput: runs/flat\n").unwrap();
    let merged = ok(&attnlab(&["config", "flat.yaml"], cwd));
    let top_base = |y: &str| y.lines().any(|l| l.starts_with("base:"));
    assert!(!top_base(&merged) && !merged.contains("idx:") && merged.contains("steps: 3") && merged.contains("start_sample: 2") && merged.contains("d_down: 16"), "{merged}");
    ok(&attnlab(&["train", "idx.yaml", "--quiet"], cwd));
    ok(&attnlab(&["train", "flat.yaml", "--quiet"], cwd));
    let (a, b) = (losses(&cwd.join("runs/idx")), losses(&cwd.join("runs/flat")));
    assert_eq!(a.len(), 3);
    assert_eq!(a, b, "index and flat reading give other batches");
    let cfg = std::fs::read_to_string(cwd.join("runs/idx/config.yaml")).unwrap();
    assert!(!top_base(&cfg) && cfg.contains("megatron:") && cfg.contains("steps: 3"), "{cfg}");
    // Another start sample: other data, other losses.
    ok(&attnlab(&["train", "idx.yaml", "--quiet", "--set", "data.train.megatron.start_sample=5", "--out", "runs/later", "--stop-after", "2"], cwd));
    assert_ne!(losses(&cwd.join("runs/later"))[&1], a[&1]);
    let table = ok(&attnlab(&["runs", "runs"], cwd));
    let line = |name: &str| table.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("no {name} row:\n{table}")).split_whitespace().collect::<Vec<_>>()[..4].join(" ");
    assert_eq!(line("idx"), "idx train done 3/3", "{table}");
    assert_eq!(line("later"), "later train partial 2/3", "{table}");
    // The fixture holds 14 samples of 9 tokens: starting at 12, 6 more do not fit.
    let err = fails(&attnlab(&["train", "idx.yaml", "--set", "data.train.megatron.start_sample=12", "--out", "runs/x"], cwd));
    assert!(err.contains("holds 14 samples") && err.contains("start_sample 12 + 6"), "{err}");
    std::fs::write(cwd.join("loop.yaml"), "base: loop2.yaml\n").unwrap();
    std::fs::write(cwd.join("loop2.yaml"), "base: loop.yaml\n").unwrap();
    let err = fails(&attnlab(&["config", "loop.yaml"], cwd));
    assert!(err.contains("loop2.yaml: `base`") && err.contains("cycle"), "{err}");
}

/// TensorBoard: an interrupted and resumed run's event file holds one curve (every step once, the
/// values of metrics.jsonl), and `attnlab tensorboard` rebuilds the same from metrics.jsonl. lm-eval
/// files: `attnlab eval` writes results_<date>.json and per-sample files for a perplexity corpus,
/// a downstream task and a RULER task, with the numbers of eval.json / tasks/*.json / ruler.json.
#[test]
fn tensorboard_curve_survives_resume_and_eval_writes_lm_eval_files() {
    use attnlab::tensorboard::{read_scalars, FILE_NAME};
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let run = cwd.join("results/r");
    let args = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["train", "--quiet", "--out", run.to_str().unwrap(), "--set", "train.steps=8", "--set", "train.log_every=1", "--set", "checkpoint.every=4", "--set", "eval.every=6"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.extend(["--set", "train.device=cpu", "--set", "data.train.synthetic.docs=200", "--set", "data.eval.synthetic.synthetic.docs=20"].map(String::from));
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let call = |a: Vec<String>| attnlab(&a.iter().map(String::as_str).collect::<Vec<_>>(), cwd);
    ok(&call(args(&["--stop-after", "6"])));
    ok(&call(args(&[])));
    let events = run.join(FILE_NAME);
    let tb = read_scalars(&events).unwrap();
    let want: Vec<(i64, f64)> = losses(&run).into_iter().map(|(s, l)| (s as i64, l as f32 as f64)).collect();
    assert_eq!(want.len(), 8);
    assert_eq!(tb["train/loss"], want, "one curve, each step once, metrics.jsonl's values");
    assert_eq!(tb["eval/synthetic/ppl"].iter().map(|p| p.0).collect::<Vec<_>>(), [6, 8]);
    for tag in ["train/lr", "train/grad_norm", "train/tokens_per_s", "eval/synthetic/loss"] {
        assert!(tb.contains_key(tag), "{tag} missing: {:?}", tb.keys());
    }
    // Rebuilt from metrics.jsonl (the interrupted session's rows 5, 6 are there twice): the same.
    std::fs::remove_file(&events).unwrap();
    let out = ok(&attnlab(&["tensorboard", cwd.join("results").to_str().unwrap()], cwd));
    assert!(out.contains(FILE_NAME), "{out}");
    assert_eq!(read_scalars(&events).unwrap()["train/loss"], want);

    // lm-eval format: perplexity (eval.json's corpus), a downstream task, RULER.
    let r = run.to_str().unwrap();
    ok(&attnlab(&["eval", r], cwd));
    let lm = |name: &str| -> (serde_json::Value, Vec<serde_json::Value>) {
        let dir = run.join("lm_eval");
        let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
        files.sort();
        let res = files.iter().rev().find(|p| p.file_name().unwrap().to_str().unwrap().starts_with("results_") && {
            let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
            v["results"].get(name).is_some()
        });
        let res = res.unwrap_or_else(|| panic!("no results file with {name}: {files:?}"));
        let date = res.file_name().unwrap().to_str().unwrap().trim_start_matches("results_").trim_end_matches(".json").to_string();
        let samples = std::fs::read_to_string(dir.join(format!("samples_{name}_{date}.jsonl"))).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        (serde_json::from_str(&std::fs::read_to_string(res).unwrap()).unwrap(), samples)
    };
    let eval: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(run.join("eval.json")).unwrap()).unwrap();
    let (res, samples) = lm("synthetic");
    let c = &eval["corpora"]["synthetic"];
    assert_eq!(res["results"]["synthetic"]["word_perplexity,none"], c["word_ppl"]);
    assert_eq!(res["results"]["synthetic"]["bits_per_byte,none"], c["bits_per_byte"]);
    assert_eq!(res["results"]["synthetic"]["word_perplexity_stderr,none"], "N/A");
    assert!(res["versions"]["synthetic"].as_str().unwrap().starts_with("attnlab-"));
    assert_eq!(samples.len() as u64, c["docs"].as_u64().unwrap());
    // lm-eval's weighted perplexity from the per-document [loglikelihood, words] pairs.
    let (ll, words) = samples.iter().fold((0.0, 0.0), |(a, w), s| (a + s["word_perplexity"][0].as_f64().unwrap(), w + s["word_perplexity"][1].as_f64().unwrap()));
    let wp = (-ll / words).exp();
    assert!((wp - c["word_ppl"].as_f64().unwrap()).abs() < 1e-6 * wp, "{wp} vs {}", c["word_ppl"]);
    assert_eq!(samples[0]["doc_hash"].as_str().unwrap().len(), 64);

    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tasks/hellaswag");
    ok(&attnlab(&["eval", r, "--task", "hellaswag", "--data", data.to_str().unwrap(), "--limit", "2", "--shots", "0", "--min-context", "0"], cwd));
    let (res, samples) = lm("hellaswag");
    let task: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(run.join("tasks/hellaswag.json")).unwrap()).unwrap();
    assert_eq!(res["results"]["hellaswag"]["acc_norm,none"], task["metrics"]["acc_norm"]);
    assert!(res["results"]["hellaswag"].get("acc_norm_stderr,none").is_some());
    assert_eq!(samples.len(), 2);
    assert_eq!(samples[0]["arguments"].as_object().unwrap().len(), 4, "one request per ending");
    assert!(samples[0]["arguments"]["gen_args_0"]["arg_1"].as_str().unwrap().starts_with(' '));
    // The event file now has the task's score too.
    assert!(read_scalars(&events).unwrap().contains_key("tasks/hellaswag/acc_norm"));

    ok(&attnlab(&["eval", r, "--task", "ruler:niah_single_1", "--lengths", "300", "--samples", "2", "--max-new-tokens", "4"], cwd));
    let (res, samples) = lm("niah_single_1");
    let cells: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(run.join("ruler.json")).unwrap()).unwrap();
    assert_eq!(res["results"]["niah_single_1"]["300,none"].as_f64().unwrap(), cells[0]["score"].as_f64().unwrap() / 100.0);
    assert_eq!(samples.len(), 2);
    assert_eq!(samples[1]["doc"]["max_length"], 300);
}

/// Issue 18: the evidence smoke sweep with three seeds (steps cut to 10) → report tables with
/// mean ± s.d. (n) and 95% t-intervals, and Rel.% paired by seed: recomputed here from each run's
/// eval.json (DAR of seed s against vanilla of seed s, then averaged; t quantile from a printed
/// table), and equal to the CSV's values.
#[test]
fn seeded_smoke_sweep_reports_intervals_and_paired_rel() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let sweep = repo.join("sweeps/dar-evidence-smoke.yaml");
    let out = cwd.join("runs");
    let args = ["sweep", sweep.to_str().unwrap(), "--out", out.to_str().unwrap(), "--max-parallel", "2", "--set", "train.steps=10", "--set", "eval.every=5", "--set", "data.train.synthetic.docs=200"];
    ok(&attnlab(&args, cwd));
    let report = cwd.join("report");
    ok(&attnlab(&["report", out.to_str().unwrap(), "--out", report.to_str().unwrap()], cwd));
    let md = std::fs::read_to_string(report.join("report.md")).unwrap();
    assert!(md.contains("seed-to-seed variance") && md.contains(" ± ") && md.contains("(3) ["), "{md}");
    assert!(md.contains("| DAR (orthogonal) | 16 | 8 |"), "the orthogonal arm has its own row: {md}");

    // Per-seed word PPL from eval.json; run directories are named <name>-s<seed>-<hash>.
    let ppl = |prefix: &str| -> Vec<f64> {
        (1..=3)
            .map(|s| {
                let dir = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().path()).find(|p| p.file_name().unwrap().to_string_lossy().starts_with(&format!("{prefix}-s{s}-"))).unwrap_or_else(|| panic!("no {prefix}-s{s}"));
                let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("eval.json")).unwrap()).unwrap();
                v["corpora"]["synthetic"]["word_ppl"].as_f64().unwrap()
            })
            .collect()
    };
    let (vanilla, dar) = (ppl("2x64-vanilla"), ppl("2x64-dar-d16-w8-small_init"));
    let rels: Vec<f64> = dar.iter().zip(&vanilla).map(|(d, v)| 100.0 * d / v).collect();
    let mean = rels.iter().sum::<f64>() / 3.0;
    let sd = (rels.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / 2.0).sqrt();
    let half = 4.302_652_729_911_275 * sd / 3f64.sqrt(); // t(0.975, 2 df)
    assert!(sd > 0.0, "seeds gave identical runs: {rels:?}");

    let csv = std::fs::read_dir(report.join("tables")).unwrap().map(|e| e.unwrap().path()).find(|p| { let n = p.file_name().unwrap().to_string_lossy(); n.starts_with("table1-") && !n.contains("-paired") && p.extension().unwrap() == "csv" }).expect("Table 1 CSV");
    let csv = std::fs::read_to_string(csv).unwrap();
    let head: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let row: Vec<&str> = csv.lines().find(|l| l.starts_with("DAR,16,8,")).unwrap_or_else(|| panic!("{csv}")).split(',').collect();
    let col = |name: &str| -> f64 { row[head.iter().position(|h| *h == name).unwrap_or_else(|| panic!("no column {name}: {head:?}"))].parse().unwrap() };
    let close = |a: f64, b: f64| (a - b).abs() < 1e-6 * b.abs().max(1.0);
    assert!(close(col("Rel.% (word)"), mean), "paired Rel.% {} vs {mean} from {rels:?}", col("Rel.% (word)"));
    assert!(close(col("Rel.% (word) sd"), sd) && col("Rel.% (word) n") == 3.0);
    assert!(close(col("Rel.% (word) ci95_lo"), mean - half) && close(col("Rel.% (word) ci95_hi"), mean + half));
    let dar_mean = dar.iter().sum::<f64>() / 3.0;
    assert!(close(col("synthetic (word)"), dar_mean));
    // Figure 3 with the seed band, and runs.parquet's seed column.
    assert!(md.contains("bands: ± 1 s.d. over seeds"), "{md}");
    assert!(std::fs::metadata(report.join("runs.parquet")).unwrap().len() > 0);
}

/// Issue 27: the recall smoke spec trains a window-only model, `eval --task recall` scores only the
/// answer digits (recall.json with chance values and the window's reach, a ruler.json cell for the
/// report) and eval.json records loss by window position in the bins of T 256.
#[test]
fn recall_smoke_run_scores_answer_digits_and_loss_by_position() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments/tiny-recall-smoke.yaml");
    let run = cwd.join("win");
    let sets = ["--set", "attention.kind=window", "--set", "attention.d_down=null", "--set", "train.steps=6", "--set", "data.train.synthetic.docs=100"];
    let mut args = vec!["train", spec.to_str().unwrap(), "--quiet", "--out", run.to_str().unwrap()];
    args.extend(sets);
    ok(&attnlab(&args, cwd));
    let eval: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(run.join("eval.json")).unwrap()).unwrap();
    let p = &eval["corpora"]["recall"]["by_position"];
    let edges: Vec<u64> = p["edges"].as_array().unwrap().iter().map(|e| e.as_u64().unwrap()).collect();
    assert_eq!(&edges[..6], &[0, 1, 2, 4, 8, 16]);
    assert_eq!((edges[6], *edges.last().unwrap(), edges.len()), (32, 256, 21));
    let tokens: u64 = p["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).sum();
    assert_eq!(tokens, eval["corpora"]["recall"]["tokens"].as_u64().unwrap());

    let out = ok(&attnlab(&["eval", run.to_str().unwrap(), "--task", "recall", "--lengths", "8,64", "--samples", "20"], cwd));
    assert!(out.contains("recall gap 64") && out.contains("at chance by construction"), "{out}");
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(run.join("recall.json")).unwrap()).unwrap();
    let g = &r["gaps"][1];
    assert_eq!((g["gap"].as_u64(), g["docs"].as_u64(), g["window_reach"].as_u64()), (Some(64), Some(20), Some(30)));
    assert!((g["chance_loss"].as_f64().unwrap() - 10f64.ln()).abs() < 1e-12);
    let digits = g["digits"].as_u64().unwrap();
    assert!(digits >= 3 * 2 * 20 && digits % 3 == 0, "{digits}");
    let cells: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(run.join("ruler.json")).unwrap()).unwrap();
    assert!(cells.as_array().unwrap().iter().any(|c| c["task"] == "recall" && c["length"] == 64), "{cells}");
    // A gap whose documents do not fit T is refused with the reason.
    let err = fails(&attnlab(&["eval", run.to_str().unwrap(), "--task", "recall", "--lengths", "400", "--samples", "2"], cwd));
    assert!(err.contains("more than the model's T = 256"), "{err}");
}

/// Issue 36: the recall test scored while training (`eval.recall`) on the mixed-gap corpus: rows
/// `recall/g<G>/{digits,codes,loss}` at every `eval.every` step and at the last, recall.json at the
/// end (the final scores), and `attnlab report` draws the learning curve and tabulates steps to 50%.
#[test]
fn recall_is_scored_at_every_evaluation_while_training() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments/tiny-recall-smoke.yaml");
    let run = cwd.join("results/dar");
    let sets = ["--set", "train.steps=7", "--set", "eval.every=3", "--set", "eval.recall={gaps: [8, 64], samples: 3}", "--set", "data.train.synthetic.docs=60", "--set", "data.train.synthetic.recall_gap=[8, 64]"];
    let mut args = vec!["train", spec.to_str().unwrap(), "--quiet", "--out", run.to_str().unwrap()];
    args.extend(sets);
    ok(&attnlab(&args, cwd));
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let scored: Vec<u64> = rows.iter().filter(|r| r.get("recall/g64/codes").is_some()).map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(scored, [3, 6, 7]);
    for r in rows.iter().filter(|r| r.get("recall/g8/codes").is_some()) {
        for g in [8, 64] {
            for (f, hi) in [("digits", 1.0), ("codes", 1.0), ("loss", f64::INFINITY)] {
                let v = r[format!("recall/g{g}/{f}")].as_f64().unwrap_or_else(|| panic!("{r}"));
                assert!((0.0..=hi).contains(&v), "{f} {v}");
            }
        }
    }
    let recall: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(run.join("recall.json")).unwrap()).unwrap();
    assert_eq!(recall["step"], 7);
    let gaps: Vec<(u64, u64)> = recall["gaps"].as_array().unwrap().iter().map(|g| (g["gap"].as_u64().unwrap(), g["docs"].as_u64().unwrap())).collect();
    assert_eq!(gaps, [(8, 3), (64, 3)]);
    let last = rows.iter().rev().find(|r| r.get("recall/g64/codes").is_some()).unwrap();
    assert_eq!(last["recall/g64/digits"].as_f64(), recall["gaps"][1]["digit_accuracy"].as_f64());

    let out = ok(&attnlab(&["report", cwd.join("results").to_str().unwrap(), "--unit", "token"], cwd));
    assert!(out.contains("Recall learning curves"), "{out}");
    let md = std::fs::read_to_string(cwd.join("results/report/report.md")).unwrap();
    assert!(md.contains("## Recall: learning curves and capacity") && md.contains("codes-g64.png"), "{md}");
}
