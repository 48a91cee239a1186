//! `attnlab export RUN --out DIR`: a training run's checkpoint as a Hugging Face folder, or a llama
//! GGUF as one (`model::gguf::export`).
//!
//! A vanilla run is a stock architecture (GPTNeoXForCausalLM, LlamaForCausalLM, Olmo2ForCausalLM).
//! Every other kind (DAR, uniform, window, sink) is attnlab's own architecture with its remote code
//! (`python/attnlab_hf/`, copied into the folder; `model::hf::remote_code`): config.json names a
//! model_type stock transformers does not know, so the folder loads only with `trust_remote_code=True`,
//! as the model it is, never silently as the stock class. Beside the weights: tokenizer.json,
//! tokenizer_config.json and generation_config.json (EOS / BOS of the tokenizer), and a model card
//! (README.md: the spec, the training tokens, the final metrics, how to load it).
use crate::data::Tok;
use crate::model::{hf, Model};
use crate::{Error, IoContext, Result};
use serde_json::{json, Value};
use std::path::Path;

/// Write `run` at checkpoint `step` (default: the newest) to `out`; returns the step written.
pub fn export(run: &Path, out: &Path, step: Option<u64>) -> Result<u64> {
    if crate::model::gguf::is_gguf(&run.to_string_lossy()) {
        if let Some(s) = step {
            return Err(Error::Other(format!("{}: --step {s}: a GGUF file has no checkpoints", run.display())));
        }
        crate::model::gguf::export(&run.to_string_lossy(), out)?;
        return Ok(0);
    }
    let loaded = crate::train::run::load(run, step, Some("cpu"))?;
    let bad = |msg: String| Error::Run { dir: run.into(), msg };
    let mut config = match &loaded.model {
        Model::Llama(m) if m.variant().is_some() => return Err(bad("linearize runs write their export/ themselves".into())),
        Model::Llama(m) => m.cfg.to_hf_json(),
        Model::Neox(m) => hf::neox_config_json(&m.cfg, loaded.spec.seq_len()),
    };
    let (eos, bos) = (crate::data::tokenizer::eos_id(&loaded.tok), crate::data::tokenizer::bos_id(&loaded.tok));
    config["eos_token_id"] = json!(eos);
    config["bos_token_id"] = json!(bos);
    hf::save_folder(&loaded.vs, &config, out)?;
    let tok = loaded.tok.inner.to_string(true).map_err(|e| Error::Other(format!("tokenizer: {e}")))?;
    write(&out.join("tokenizer.json"), &tok)?;
    write_json(&out.join("tokenizer_config.json"), &tokenizer_config(&loaded.tok, eos, bos, loaded.spec.seq_len()))?;
    write_json(&out.join("generation_config.json"), &json!({"eos_token_id": eos, "bos_token_id": bos, "pad_token_id": eos}))?;
    write(&out.join("README.md"), &model_card(run, out, loaded.step, &config)?)?;
    Ok(loaded.step)
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).at(path)
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    write(path, &serde_json::to_string_pretty(v)?)
}

/// What `AutoTokenizer` needs besides tokenizer.json: the class and the special tokens by name.
fn tokenizer_config(tok: &Tok, eos: u32, bos: Option<u32>, max_len: usize) -> Value {
    let name = |id: u32| tok.inner.id_to_token(id);
    json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": name(eos), "pad_token": name(eos), "bos_token": bos.and_then(name),
        "model_max_length": max_len, "add_bos_token": bos.is_some(),
    })
}

/// The model card: what the folder holds and how it was made (the run's resolved spec, the tokens it
/// trained on up to the exported step, its final metrics) and how to load it.
fn model_card(run: &Path, out: &Path, step: u64, config: &Value) -> Result<String> {
    let cfg = run.join("config.yaml");
    let spec = std::fs::read_to_string(&cfg).at(&cfg)?;
    let rows = crate::train::metrics::read(&run.join("metrics.jsonl"))?.rows;
    let tokens = rows.iter().rev().filter(|(_, r)| r.get("step").and_then(Value::as_u64).is_some_and(|s| s <= step)).find_map(|(_, r)| r.get("tokens").and_then(Value::as_u64));
    let tokens = tokens.map_or("not recorded in metrics.jsonl".to_string(), |t| format!("{t}"));
    let eval = std::fs::read_to_string(run.join("eval.json")).ok();
    let metrics = match eval.as_deref().map(serde_json::from_str::<Value>) {
        Some(Ok(v)) => metrics_table(&v),
        _ => "No eval.json in the run directory (run `attnlab eval RUN` for held-out perplexity).\n".to_string(),
    };
    let arch = config["architectures"][0].as_str().unwrap_or("?");
    let remote = config.get("auto_map").is_some();
    let dir = out.display();
    let load = if remote {
        format!(
            "This is attnlab's own architecture (`{arch}`, model_type `{}`): its modeling code is in this folder\n\
             ({files}). **`trust_remote_code=True` runs that Python code** on your machine; read it first.\n\
             Without it transformers refuses the folder (it does not know the model_type) rather than load\n\
             another model.\n\n\
             ```python\nimport torch\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\
             tok = AutoTokenizer.from_pretrained(\"{dir}\")\n\
             model = AutoModelForCausalLM.from_pretrained(\"{dir}\", trust_remote_code=True, dtype=torch.float32)\n\
             ids = tok(\"mira lives in\", return_tensors=\"pt\").input_ids\n\
             print(tok.decode(model.generate(ids, max_new_tokens=16, do_sample=False)[0]))\n```\n\n\
             The remote code keeps its own bounded decode cache (DAR / uniform: full-width keys of the last\n\
             `window` tokens and a d_down-wide latent per token; window / sink: the window and the sinks).\n\
             Batches with left padding are refused.\n",
            config["model_type"].as_str().unwrap_or("?"),
            files = hf::REMOTE_CODE.iter().map(|(n, _)| format!("`{n}`")).collect::<Vec<_>>().join(", ")
        )
    } else {
        format!(
            "A stock `{arch}` (vanilla attention): no remote code.\n\n\
             ```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\
             tok = AutoTokenizer.from_pretrained(\"{dir}\")\nmodel = AutoModelForCausalLM.from_pretrained(\"{dir}\")\n```\n"
        )
    };
    let trust = if remote { ",trust_remote_code=True" } else { "" };
    Ok(format!(
        "# {name} (attnlab export)\n\n\
         Exported by `attnlab export` from the run directory `{run}` at step {step}.\n\n\
         - architecture: `{arch}`\n- attention: `{attention}`\n- training tokens (to step {step}): {tokens}\n\n\
         ## How to load\n\n{load}\n\
         lm-evaluation-harness:\n\n\
         ```sh\nlm_eval --model hf --model_args pretrained={dir}{trust},dtype=float32 --tasks TASK --device cpu\n```\n\n\
         ## Final metrics\n\n{metrics}\n\
         ## The spec (the run's config.yaml)\n\n```yaml\n{spec}```\n",
        name = run.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned()),
        run = run.display(),
        attention = config.get(hf::ATTENTION_KEY).map_or("vanilla".to_string(), |a| a.to_string()),
    ))
}

/// eval.json as a table: per corpus (train runs) its tokens, loss and perplexities; else the JSON.
fn metrics_table(v: &Value) -> String {
    let Some(corpora) = v.get("corpora").and_then(Value::as_object) else {
        return format!("```json\n{}\n```\n", serde_json::to_string_pretty(v).unwrap_or_default());
    };
    let at = v.get("step").and_then(Value::as_u64).map_or(String::new(), |s| format!(" at step {s}"));
    let mut s = format!("The run's held-out evaluation{at} (eval.json):\n\n| corpus | tokens | loss | ppl | word ppl | bits/byte |\n|---|---|---|---|---|---|\n");
    for (name, c) in corpora {
        let num = |k: &str| c.get(k).and_then(Value::as_f64).map_or("–".to_string(), |x| format!("{x:.4}"));
        let tokens = c.get("tokens").and_then(Value::as_u64).map_or("–".to_string(), |t| t.to_string());
        s += &format!("| {name} | {tokens} | {} | {} | {} | {} |\n", num("loss"), num("ppl"), num("word_ppl"), num("bits_per_byte"));
    }
    s
}
