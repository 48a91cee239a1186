//! Task files against hand-written prompts, and a tiny random model end to end.
use super::*;
use crate::model::llama::{Llama, LlamaConfig, RopeScaling};

fn fixture(task: &str) -> String {
    format!("{}/tests/fixtures/tasks/{task}", env!("CARGO_MANIFEST_DIR"))
}

fn docs(def: &TaskDef, task: &str, split: &SplitDef, eval: bool) -> Vec<Value> {
    let mut d = data::load_split(&def.dataset, split, Some(&fixture(task)), eval).unwrap();
    for x in d.iter_mut() {
        def.process(x).unwrap();
    }
    d
}

#[test]
fn builtin_task_files_parse_and_bad_ones_are_refused() {
    let _rng = crate::testutil::rng();
    for (name, _) in BUILTIN {
        let t = TaskDef::load(name).unwrap();
        assert_eq!(t.task, name);
    }
    let base = "task: t\noutput_type: multiple_choice\ndataset: {eval: {name: test}}\ndoc_to_text: \"{q}\"\ndoc_to_target: \"{a}\"\ndoc_to_choice: [A, B]\n";
    let e = TaskDef::parse(&format!("{base}metrics: [{{metric: acc}}]\nprimary: rouge_l\n"), "t.yaml").unwrap_err().to_string();
    assert!(e.contains("primary") && e.contains("rouge_l"), "{e}");
    let e = TaskDef::parse(&format!("{base}metrics: [{{metric: rouge_l}}]\nprimary: rouge_l\n"), "t.yaml").unwrap_err().to_string();
    assert!(e.contains("not a multiple-choice metric"), "{e}");
    let e = TaskDef::parse(&format!("{base}metrics: [{{metric: acc}}]\nprimary: acc\nextra: 1\n"), "t.yaml").unwrap_err().to_string();
    assert!(e.contains("extra"), "{e}");
    let e = TaskDef::parse(&base.replace("{q}", "{q|upper}").replace("dataset", "metrics: [{metric: acc}]\nprimary: acc\ndataset"), "t.yaml").unwrap_err().to_string();
    assert!(e.contains("unknown filter"), "{e}");
    assert!(TaskDef::load("nope").unwrap_err().to_string().contains("mmlu"));
}

/// MMLU: description with the subject, shots from the same subject's dev docs (first n), " A"-style answers.
#[test]
fn mmlu_prompt_is_lm_evals() {
    let _rng = crate::testutil::rng();
    let def = TaskDef::load("mmlu").unwrap();
    let test = docs(&def, "mmlu", &def.dataset.eval, true);
    let dev = docs(&def, "mmlu", def.dataset.fewshot.as_ref().unwrap(), false);
    assert_eq!((test.len(), dev.len()), (3, 10));
    let shots = pick_shots(&def, &dev, &test[0], 0, 2);
    let want = "The following are multiple choice questions (with answers) about elementary mathematics.\n\n\
What is 0 + 0?\nA. 0\nB. 1\nC. 2\nD. 3\nAnswer: A\n\n\
What is 1 + 1?\nA. 2\nB. 3\nC. 4\nD. 5\nAnswer: A\n\n\
What is 3 * 3?\nA. 6\nB. 9\nC. 12\nD. 33\nAnswer:";
    assert_eq!(build_prompt(&def, &test[0], &shots).unwrap(), want);
    // The astronomy doc gets astronomy shots, stripped questions, and gold answers written as letters.
    let shots = pick_shots(&def, &dev, &test[1], 1, 5);
    let p = build_prompt(&def, &test[1], &shots).unwrap();
    assert!(p.starts_with("The following are multiple choice questions (with answers) about astronomy.\n\nWhich planet is number 1 from the sun?\nA. Mercury"), "{p}");
    assert!(p.contains("number 2 from the sun?\nA. Mercury\nB. Venus\nC. Earth\nD. Mars\nAnswer: B\n\n"), "{p}");
    assert_eq!(def.gold(&test[1], &def.choices(&test[1]).unwrap()).unwrap(), 2);
}

/// HellaSwag: lm-eval's process_docs (ctx_b capitalised, [title] → ". ", brackets dropped, double spaces collapsed).
#[test]
fn hellaswag_preprocessing() {
    let _rng = crate::testutil::rng();
    let def = TaskDef::load("hellaswag").unwrap();
    let d = docs(&def, "hellaswag", &def.dataset.eval, true);
    assert_eq!(build_prompt(&def, &d[0], &[]).unwrap(), "Roof shingle removal: A man is sitting on a roof. He");
    assert_eq!(d[1]["query"], "Home and Garden: How to grow tomatoes. Choose a sunny spot. Plant the seedlings deep.");
    assert_eq!(def.choices(&d[1]).unwrap(), [" Water them every day.", " Paint the fence.", "Eat the soil slowly.", "Sing to them."]);
    assert_eq!(def.gold(&d[0], &def.choices(&d[0]).unwrap()).unwrap(), 3);
}

#[test]
fn commonsense_qa_prompt_and_letter_targets() {
    let _rng = crate::testutil::rng();
    let def = TaskDef::load("commonsense_qa").unwrap();
    let d = docs(&def, "commonsense_qa", &def.dataset.eval, true);
    assert_eq!(
        build_prompt(&def, &d[0], &[]).unwrap(),
        "Question: Where would you put a plate after washing it?\nA. cupboard\nB. table\nC. restaurant\nD. flea market\nE. dishwasher\nAnswer:"
    );
    let golds: Vec<usize> = d.iter().map(|x| def.gold(x, &def.choices(x).unwrap()).unwrap()).collect();
    assert_eq!(golds, [0, 1]);
}

/// GSM8K: "Question: …\nAnswer: <full solution>" shots joined by blank lines; seeded random shots are
/// distinct, reproducible and vary across documents.
#[test]
fn gsm8k_fewshot_prompt() {
    let _rng = crate::testutil::rng();
    let mut def = TaskDef::load("gsm8k").unwrap();
    let test = docs(&def, "gsm8k", &def.dataset.eval, true);
    let train = docs(&def, "gsm8k", def.dataset.fewshot.as_ref().unwrap(), false);
    def.fewshot.sampler = Sampler::FirstN;
    let p = build_prompt(&def, &test[1], &pick_shots(&def, &train, &test[1], 1, 1)).unwrap();
    assert_eq!(
        p,
        "Question: Tom has 1 apples and buys 2 more. How many apples does he have?\nAnswer: He has 1 + 2 = <<1+2=3>>3 apples.\n#### 3\n\n\
Question: A pen costs $3. How much do 4 pens cost?\nAnswer:"
    );
    def.fewshot.sampler = Sampler::Random;
    let a = pick_shots(&def, &train, &test[0], 0, 5);
    assert_eq!(a, pick_shots(&def, &train, &test[0], 0, 5));
    let mut qs: Vec<&str> = a.iter().map(|d| d["question"].as_str().unwrap()).collect();
    qs.sort();
    qs.dedup();
    assert_eq!(qs.len(), 5);
    let differs = (1..20).any(|i| pick_shots(&def, &train, &test[0], i, 5) != a);
    assert!(differs, "per-document draws");
}

/// MBPP: the fixed three shots (text, tests, [BEGIN], code, [DONE]); each fixture's reference code
/// passes its own asserts in the sandbox and a wrong body fails them.
#[test]
fn mbpp_prompt_and_reference_programs() {
    let _rng = crate::testutil::rng();
    let def = TaskDef::load("mbpp").unwrap();
    let d = docs(&def, "mbpp", &def.dataset.eval, true);
    let shots: Vec<&Value> = def.fewshot.docs.iter().collect();
    let p = build_prompt(&def, &d[0], &shots).unwrap();
    assert!(p.starts_with(
        "You are an expert Python programmer, and here is your task: Write a function to find the similar elements from the given two tuple lists. Your code should pass these tests:\n\n\
assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)\nassert similar_elements((1, 2, 3, 4),(5, 4, 3, 7)) == (3, 4)\nassert similar_elements((11, 12, 14, 13),(17, 15, 14, 13)) == (13, 14)\n[BEGIN]\n\
def similar_elements(test_tup1, test_tup2):\r\n  res = tuple(set(test_tup1) & set(test_tup2))\r\n  return (res) \n[DONE]\n\nYou are an expert"
    ));
    assert!(p.ends_with("Write a python function to add two numbers. Your code should pass these tests:\n\nassert add(1, 2) == 3\nassert add(0, 0) == 0\nassert add(-1, 1) == 0\n[BEGIN]"));
    let limits = sandbox::Limits { wall: std::time::Duration::from_secs(5), cpu_s: 5, ..sandbox::Limits::default() };
    for doc in &d {
        let tests = references(&def, doc).unwrap().join("\n");
        let ok = sandbox::run_python(&sandbox::mbpp_program(doc["code"].as_str().unwrap(), &tests), limits).unwrap();
        assert_eq!(ok.status, sandbox::Status::Passed, "{ok:?}");
        let bad = sandbox::run_python(&sandbox::mbpp_program("def add(a, b):\n  return 0\ndef rev(s):\n  return s", &tests), limits).unwrap();
        assert_eq!(bad.status, sandbox::Status::Failed);
    }
}

#[test]
fn prompt_truncation() {
    let ids: Vec<u32> = (0..10).collect();
    assert_eq!(truncate(ids.clone(), 4, Truncate::Left), [6, 7, 8, 9]);
    assert_eq!(truncate(ids.clone(), 5, Truncate::Middle), [0, 1, 7, 8, 9]);
    assert_eq!(truncate(ids.clone(), 10, Truncate::Middle), ids);
}

fn neox_tok() -> Tok {
    Tok::from_json(&crate::testutil::shared_text("data/tokenizers/gpt-neox-20b.json"), "neox").unwrap()
}

fn tiny_model(vocab: usize) -> (tch::nn::VarStore, Model) {
    let _rng = crate::testutil::seeded(3);
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let cfg = LlamaConfig {
        vocab_size: vocab,
        hidden_size: 16,
        intermediate_size: 32,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::Default,
        tie_word_embeddings: true,
        max_position_embeddings: 512,
        family: Default::default(),
        attention: Default::default(),
    };
    let m = Model::Llama(Llama::new(&vs.root(), cfg));
    (vs, m)
}

/// MMLU end to end with a tiny random model: each choice's log-likelihood equals log-softmax of the
/// " A"…" D" token after the whole prompt, computed directly; acc follows from those.
#[test]
fn mmlu_end_to_end_matches_direct_log_probs() {
    let _rng = crate::testutil::rng();
    let tok = neox_tok();
    let (_vs, model) = tiny_model(tok.padded_vocab());
    let def = TaskDef::load("mmlu").unwrap();
    let opts = Options { request: Request { data: Some(fixture("mmlu")), limit: None, shots: Some(2), batch_tokens: 256 }, max_len: 512, min_context: 0, quiet: true };
    let (res, samples) = evaluate(&model, &tok, &def, &opts, Device::Cpu).unwrap();
    assert_eq!((res.docs, res.num_fewshot, samples.len()), (3, 2, 3));
    let test = docs(&def, "mmlu", &def.dataset.eval, true);
    let dev = docs(&def, "mmlu", def.dataset.fewshot.as_ref().unwrap(), false);
    let mut correct = 0.0;
    for (i, s) in samples.iter().enumerate() {
        let prompt = build_prompt(&def, &test[i], &pick_shots(&def, &dev, &test[i], i, 2)).unwrap();
        let ids: Vec<i64> = tok.encode(&prompt).unwrap().into_iter().map(i64::from).collect();
        let logits = tch::no_grad(|| model.forward(&Tensor::from_slice(&ids).view([1, -1])));
        let lp = logits.get(0).get(ids.len() as i64 - 1).to_kind(Kind::Double).log_softmax(-1, Kind::Double);
        for (c, letter) in ["A", "B", "C", "D"].iter().enumerate() {
            let t = tok.encode(&format!(" {letter}")).unwrap();
            assert_eq!(t.len(), 1);
            let want = lp.double_value(&[i64::from(t[0])]);
            assert!((s.loglikelihoods[c] - want).abs() < 1e-4, "doc {i} choice {c}: {} vs {want}", s.loglikelihoods[c]);
        }
        correct += f64::from(u8::from(metrics::argmax(&s.loglikelihoods) == s.gold.unwrap()));
    }
    assert!((res.metrics["acc"] - correct / 3.0).abs() < 1e-12);
    assert_eq!(res.breakdown["astronomy"]["n"], 1.0);
    assert_eq!(res.breakdown["elementary_mathematics"]["n"], 2.0);
}

/// Generation end to end: greedy output equals generate.rs's greedy tokens (cut at a stop string),
/// and GSM8K's metrics are 0/1 per document.
#[test]
fn generation_end_to_end() {
    let _rng = crate::testutil::rng();
    let tok = neox_tok();
    let (_vs, model) = tiny_model(tok.padded_vocab());
    let def = TaskDef::load("gsm8k").unwrap();
    let opts = Options { request: Request { data: Some(fixture("gsm8k")), limit: Some(1), shots: Some(2), batch_tokens: 256 }, max_len: 300, min_context: 0, quiet: true };
    let mut short = def.clone();
    short.generation.max_gen_toks = 8;
    let (res, samples) = evaluate(&model, &tok, &short, &opts, Device::Cpu).unwrap();
    assert_eq!(res.docs, 1);
    for k in ["exact_match,strict-match", "exact_match,flexible-extract"] {
        assert!(res.metrics[k] == 0.0 || res.metrics[k] == 1.0);
    }
    let prompt_ids = tok.encode(&{
        let test = docs(&def, "gsm8k", &def.dataset.eval, true);
        let train = docs(&def, "gsm8k", def.dataset.fewshot.as_ref().unwrap(), false);
        build_prompt(&def, &test[0], &pick_shots(&def, &train, &test[0], 0, 2)).unwrap()
    })
    .unwrap();
    assert_eq!(samples[0].prompt_tokens, prompt_ids.len());
    let g = crate::eval::generate::generate(&model, &prompt_ids, 8, crate::eval::generate::Sampling { temperature: 0.0, seed: 0 }, Some(eos_id(&tok)), Device::Cpu);
    let toks: Vec<u32> = g.tokens.into_iter().filter(|&t| t != eos_id(&tok)).collect();
    let full = tok.decode(&toks).unwrap();
    let want = ["Question:", "</s>", "<|im_end|>"].iter().filter_map(|u| full.find(u)).min().map_or(full.clone(), |at| full[..at].to_string());
    assert_eq!(samples[0].response.as_deref(), Some(want.as_str()));
}

/// `min_context` keeps exactly the documents whose prompt (with its shots) has at least that many
/// tokens, samples keep their index in the split, and the result says how many of how many were kept.
#[test]
fn min_context_drops_short_inputs_and_reports_the_count() {
    let _rng = crate::testutil::rng();
    let tok = neox_tok();
    let (_vs, model) = tiny_model(tok.padded_vocab());
    let def = TaskDef::load("mmlu").unwrap();
    let test = docs(&def, "mmlu", &def.dataset.eval, true);
    let dev = docs(&def, "mmlu", def.dataset.fewshot.as_ref().unwrap(), false);
    let lens: Vec<usize> = (0..test.len()).map(|i| tok.encode(&build_prompt(&def, &test[i], &pick_shots(&def, &dev, &test[i], i, 2)).unwrap()).unwrap().len()).collect();
    let mut sorted = lens.clone();
    sorted.sort_unstable();
    let min = sorted[2];
    assert!(sorted[0] < min, "fixture prompts need different lengths: {lens:?}");
    let opts = Options { request: Request { data: Some(fixture("mmlu")), limit: None, shots: Some(2), batch_tokens: 256 }, max_len: 512, min_context: min, quiet: true };
    let (res, samples) = evaluate(&model, &tok, &def, &opts, Device::Cpu).unwrap();
    let want: Vec<usize> = (0..lens.len()).filter(|&i| lens[i] >= min).collect();
    assert_eq!(samples.iter().map(|s| s.doc).collect::<Vec<_>>(), want);
    assert_eq!((res.docs, res.docs_total, res.min_context), (want.len(), 3, min));
    let none = Options { min_context: sorted[2] + 1, ..opts };
    let err = evaluate(&model, &tok, &def, &none, Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("min_context") && err.contains("none of 3"), "{err}");
}

/// A task result records the attention's width and window only where the model has them.
#[test]
fn model_info_and_min_context_follow_the_attention() {
    let _rng = crate::testutil::rng();
    let dar = crate::spec::SpecSource::default().load().unwrap();
    let info = ModelInfo::of(&dar, 7);
    assert_eq!((info.step, info.attention.as_str(), info.d_down, info.window, info.d_model), (7, "dar", Some(16), Some(16), dar.shape().d_model));
    assert_eq!(default_min_context(&dar), 16);
    let vanilla = crate::spec::SpecSource { sets: vec!["attention={kind: vanilla}".into()], ..Default::default() }.load().unwrap();
    let info = ModelInfo::of(&vanilla, 7);
    assert_eq!((info.attention.as_str(), info.d_down, info.window), ("vanilla", None, None));
    assert_eq!(default_min_context(&vanilla), 0);
}
