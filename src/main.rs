//! The `attnlab` command line. Errors print their cause chain and exit non-zero.
use anyhow::{bail, Context, Result};
use attnlab::spec::{self, AttentionKind, Spec};
use attnlab::train::{self, TrainOptions};
use clap::{Args, Parser, Subcommand};
use std::path::{Path, PathBuf};

#[derive(Parser)]
#[command(name = "attnlab", version, about = "Attention variants that spend less memory on distant tokens (DAR, uniform, vanilla) on GPT-NeoX/Pythia.", long_about = None)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Args, Clone)]
struct SpecArgs {
    /// Experiment spec (YAML). Omit for the built-in tiny model on the synthetic corpus.
    spec: Option<PathBuf>,
    /// Override any key: --set attention.window=64 (repeatable; values are YAML).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Run directory (overrides `output:` in the spec).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The arguments of the two-stage commands (`linearize`, `finetune`).
#[derive(clap::Args)]
struct StagedArgs {
    spec: PathBuf,
    /// Override any key: --set attention.d_down=96 (repeatable; values are YAML).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Run directory (overrides `output:` in the spec).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Stop after this many optimizer steps of both stages (as if interrupted; re-run to resume).
    #[arg(long, hide = true)]
    stop_after: Option<u64>,
    #[arg(long)]
    quiet: bool,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train (or resume) one run from a spec: writes config.yaml, metrics.jsonl, checkpoints/, eval.json, DONE.
    Train {
        #[command(flatten)]
        spec: SpecArgs,
        /// No progress bars.
        #[arg(long)]
        quiet: bool,
        /// Stop after this many steps in total (as if interrupted; re-run to resume).
        #[arg(long, hide = true)]
        stop_after: Option<u64>,
        /// Data-parallel training, one worker process per GPU: --gpus 0,1 (`cpu,cpu` runs CPU workers,
        /// for tests). Each worker takes a disjoint slice of every global batch (train.batch_size),
        /// so the run sees the same data and loss curve as one GPU with gradient accumulation; only
        /// rank 0 logs, evaluates and checkpoints. Same as `train.devices` in the spec. Under
        /// torchrun or srun, leave it out: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
        /// MASTER_PORT from the launcher are used instead.
        #[arg(long, value_delimiter = ',', value_name = "LIST")]
        gpus: Vec<String>,
    },
    /// Linearize a Llama teacher into a STILL / LoLCATs hybrid: stage 1 attention transfer, stage 2 LoRA
    /// (config.yaml, metrics.jsonl, checkpoints/, lora.safetensors, export/, eval.json, DONE; resumes).
    Linearize {
        #[command(flatten)]
        run: StagedArgs,
    },
    /// Fine-tune a pretrained Llama on chat data (loss on assistant tokens), optionally giving it DAR
    /// attention, in two stages as dar.md §4.2: stage 1 only the bottleneck (W_down, W_up; lr 3e-4),
    /// stage 2 everything (lr 3e-5). Spec keys: base (HF folder, hf:owner/name or attnlab run dir),
    /// chat_template, attention {kind: vanilla|dar, d_down, window, init: small_init|pca}, data {train,
    /// eval, seq_len, batch_size, micro_batch}, stage1/stage2 {epochs|steps, lr, warmup, schedule,
    /// params}, train, checkpoint, output. Writes config.yaml, metrics.jsonl, checkpoints/, eval.json
    /// (base vs fine-tuned held-out loss), export/, DONE; re-running resumes.
    Finetune {
        #[command(flatten)]
        run: StagedArgs,
    },
    /// Train one spec as vanilla, DAR and uniform (into OUT/<kind>) and print their perplexities side by side.
    Compare {
        #[command(flatten)]
        spec: SpecArgs,
        /// Attention kinds to train, comma-separated.
        #[arg(long, default_value = "vanilla,dar,uniform", value_delimiter = ',')]
        kinds: Vec<String>,
        #[arg(long)]
        quiet: bool,
    },
    /// Rolling perplexity of a run's checkpoint on its eval corpora (and any --corpus); writes eval.json.
    Eval {
        run: PathBuf,
        /// Checkpoint step (default: the newest complete one).
        #[arg(long)]
        step: Option<u64>,
        /// Extra corpus: NAME=PATH, or NAME=wikitext:PATH for lm-eval's WikiText split + detokenizer.
        #[arg(long = "corpus", value_name = "NAME=PATH")]
        corpora: Vec<String>,
        /// Device (default: the run's).
        #[arg(long)]
        device: Option<String>,
        /// Instead of perplexity, a task. Downstream (lm-eval style; writes tasks/NAME.json and
        /// tasks/NAME.samples.jsonl): mmlu (5-shot, acc), hellaswag (0-shot, acc_norm), commonsense_qa
        /// (0-shot, acc), gsm8k (5-shot, exact match), mbpp (3-shot, pass@1 in a sandbox), multi_news
        /// (0-shot, ROUGE-L), or a task YAML file (see data/tasks/README.md). Long context: a RULER
        /// task, e.g. ruler:niah_single_1 (writes ruler.json), or BABILong-style QA, babilong:qa1 or
        /// babilong:qa2 (writes babilong.json; needs --essay and --babi).
        /// RUN may also be a finished `attnlab linearize` run (STILL / LoLCATs, decoded with its bounded cache).
        #[arg(long)]
        task: Option<String>,
        /// Downstream task data: a .jsonl/.json/.parquet file (the evaluated split) or a folder of
        /// files named after the splits (test*, dev*, train*, validation*) in the Hugging Face
        /// dataset's column layout, or hf:OWNER/NAME. Default: the task's hub dataset.
        #[arg(long)]
        data: Option<String>,
        /// Downstream tasks: evaluate only the first N documents.
        #[arg(long)]
        limit: Option<usize>,
        /// Downstream tasks: few-shot examples per prompt (default: the task's, e.g. MMLU 5).
        #[arg(long)]
        shots: Option<usize>,
        /// Downstream tasks: leave out documents whose input is shorter than N tokens (default: the
        /// model's window for DAR models, as the DAR paper; 0 for vanilla).
        #[arg(long)]
        min_context: Option<usize>,
        /// Downstream multiple choice: padded tokens per forward pass.
        #[arg(long, default_value_t = 16384)]
        batch_tokens: usize,
        /// Target lengths (prompt + generation) for --task.
        #[arg(long, default_value = "512,1024", value_delimiter = ',')]
        lengths: Vec<usize>,
        /// Samples per length for --task (RULER: 500; 50 for smoke runs).
        #[arg(long, default_value_t = 50)]
        samples: usize,
        /// Essay haystack for essay tasks (RULER's PaulGrahamEssays JSON, .gz allowed, or plain text).
        #[arg(long)]
        essay: Option<PathBuf>,
        /// Tokens generated per sample for --task (default: RULER 128, BABILong 20).
        #[arg(long)]
        max_new_tokens: Option<usize>,
        /// bAbI samples for babilong tasks: a jsonl file, or a folder with {task}_test_first300.jsonl
        /// (e.g. ../shared/data/babi).
        #[arg(long)]
        babi: Option<PathBuf>,
        /// RULER / BABILong on a linearized model: change its operator without retraining, e.g.
        /// --set attention.tokens_per_chunk=16, --set attention.routing=oracle (selects the needle
        /// sentences: a diagnostic), --set attention.linear_branch=false,
        /// --set attention.normalizer=max_compensated (repeatable; recorded in the result cells).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
    },
    /// Write float32 logits [n, vocab] for whitespace-separated token ids in FILE to a safetensors file.
    Forward {
        run: PathBuf,
        #[arg(long)]
        tokens: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long)]
        step: Option<u64>,
        #[arg(long)]
        device: Option<String>,
    },
    /// Write a run's checkpoint as a Hugging Face folder (config.json + model.safetensors + tokenizer.json)
    /// that transformers loads (GPTNeoXForCausalLM or LlamaForCausalLM; vanilla attention only).
    Export {
        run: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long)]
        step: Option<u64>,
    },
    /// Continue a prompt with a trained run (KV cache per variant: DAR keeps d_down-wide latents for distant
    /// tokens), or with a linearized model: a finished `attnlab linearize` run directory or its export/
    /// folder (STILL / LoLCATs keep selected tokens, two chunks and a fixed-size linear state).
    Generate {
        /// A run directory (train or linearize) or a linearize export folder.
        run: PathBuf,
        /// Prompt text (or --prompt-file).
        #[arg(long, conflicts_with = "prompt_file")]
        prompt: Option<String>,
        #[arg(long)]
        prompt_file: Option<PathBuf>,
        #[arg(long, default_value_t = 64)]
        max_new_tokens: usize,
        /// Sampling temperature; 0 = greedy.
        #[arg(long, default_value_t = 0.0, conflicts_with = "greedy")]
        temperature: f64,
        /// Greedy decoding (the default; the same as --temperature 0).
        #[arg(long)]
        greedy: bool,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long)]
        step: Option<u64>,
        #[arg(long)]
        device: Option<String>,
    },
    /// Decode benchmark: KV-cache bytes (total and per token), prefill time and decode tokens/s at the
    /// spec's model size, for several context lengths, with random weights and tokens (speed and memory
    /// only). vanilla / dar / uniform / window are GPT-NeoX models with the spec's DAR settings; still /
    /// still-budget / lolcats are hybrid Llamas of the same width, depth, heads, MLP and vocabulary
    /// (still: κ = 4 per 64-token chunk, uncapped; still-budget: m = 384 for 4096 tokens, flat memory).
    /// A context that runs out of memory ends that variant's sweep. Prints a table (or JSON lines);
    /// --plot draws cache / decode / prefill charts; --from re-renders saved --json output.
    BenchDecode {
        #[command(flatten)]
        spec: SpecArgs,
        /// Context lengths, comma-separated.
        #[arg(long, default_value = "1024,2048,4096", value_delimiter = ',')]
        lengths: Vec<i64>,
        #[arg(long, default_value_t = 32)]
        new_tokens: usize,
        #[arg(long, default_value_t = 50304)]
        vocab: usize,
        /// Variants, comma-separated: vanilla, dar, uniform, window, still, still-budget, lolcats, or
        /// NAME={kind: still|lolcats, …} (a hybrid.yaml; quote it).
        #[arg(long, default_value = "vanilla,dar,uniform,still,still-budget,lolcats")]
        attention: String,
        /// Write STEM-cache, STEM-decode and STEM-prefill charts (.png, .svg; needs the `analysis` feature).
        #[arg(long, value_name = "STEM")]
        plot: Option<PathBuf>,
        /// Do not measure: read the rows of an earlier `--json` run (e.g. the GPU job's decode.jsonl).
        #[arg(long, value_name = "JSONL")]
        from: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Data tools.
    #[command(subcommand)]
    Data(DataCmd),
    /// Time training steps (or the attention op) on synthetic tokens: step time, tokens/s, MFU, peak memory.
    Bench {
        #[command(flatten)]
        spec: SpecArgs,
        /// Timed steps (after warm-up).
        #[arg(long, default_value_t = 10)]
        steps: usize,
        #[arg(long, default_value_t = 3)]
        warmup: usize,
        /// Vocabulary rows when the spec does not fix them (Pythia: 50304).
        #[arg(long, default_value_t = 50304)]
        vocab: usize,
        /// Time only the attention op (forward + backward) for vanilla, DAR and uniform.
        #[arg(long)]
        attention_only: bool,
        /// Check every fast DAR path against the reference (outputs and all input gradients) for
        /// windows 0, 1, 4, 64, 128, 256, T and > T; exits non-zero on a failure.
        #[arg(long)]
        check: bool,
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Expand a sweep file into runs and train them (one per GPU, N CPU processes, or a Slurm array); re-running skips finished runs and resumes partial ones.
    Sweep {
        /// Sweep file (YAML; see sweeps/README.md).
        file: PathBuf,
        /// Print the table of runs (name, overrides, run dir, status) and exit.
        #[arg(long)]
        dry_run: bool,
        /// GPUs to spread runs over, one run per GPU at a time: --gpus 0,1,2,3.
        #[arg(long, value_delimiter = ',')]
        gpus: Vec<String>,
        /// Without --gpus: how many CPU runs at once.
        #[arg(long, default_value_t = 1)]
        max_parallel: usize,
        /// Write a batch script instead of running anything (slurm: OUTPUT/sweep.sbatch, one array task per run).
        #[arg(long, value_enum)]
        emit: Option<attnlab::sweep::Emit>,
        /// Override any key in every run: --set train.steps=10 (repeatable; values are YAML; null deletes).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Sweep output folder (overrides `output:` in the sweep file).
        #[arg(long)]
        out: Option<PathBuf>,
        /// With --emit slurm: GPUs per node for each run (> 1 = data-parallel, one srun task per GPU).
        #[arg(long, default_value_t = 1)]
        gpus_per_run: usize,
        /// With --emit slurm: nodes per run (multi-node data parallelism; needs a shared file system).
        #[arg(long, default_value_t = 1)]
        nodes: usize,
    },
    /// Tables 1–3 of the DAR paper next to its numbers, its downstream Table 4 (from runs' tasks/*.json), Figure 3 and training curves from every run below RESULTS (writes runs.parquet, tables/, plots/, report.md).
    #[cfg(feature = "analysis")]
    Report {
        /// Folder searched recursively for run directories (folders holding config.yaml).
        results: PathBuf,
        /// Output folder (default: RESULTS/report).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Table files to write besides report.md: any of md, tex, csv.
        #[arg(long, default_value = "md,tex,csv", value_delimiter = ',')]
        format: Vec<String>,
        /// Perplexity the tables compare: word (lm-eval's word_perplexity; the paper's numbers look word-level) or token; the other is shown beside it.
        #[arg(long, default_value = "word", value_parser = ["word", "token"])]
        unit: String,
    },
    /// Print a spec with every default filled in, as a run directory would record it.
    Config {
        #[command(flatten)]
        spec: SpecArgs,
    },
    /// List the run directories below RESULTS (recursively): command, status (done / partial / new),
    /// step, last loss and final metrics, as a table.
    Runs {
        results: PathBuf,
    },
    /// (Re)write the TensorBoard event file (events.out.tfevents.attnlab) of every run directory at
    /// or below each DIR from its metrics.jsonl, eval.json and tasks/*.json (train, finetune and
    /// linearize write it as they log; this is for older runs). View: tensorboard --logdir DIR.
    Tensorboard {
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
    },
}

#[derive(Subcommand)]
enum DataCmd {
    /// Tokenize a source in parallel into u16 shards + index.json (documents separated by EOD = 0).
    Prepare {
        /// A file or directory (.txt, .jsonl[.zst|.gz], .json.gz, .parquet); omit with --synthetic.
        source: Option<PathBuf>,
        /// tokenizer.json path, `builtin`, or hf:OWNER/NAME.
        #[arg(long)]
        tokenizer: String,
        #[arg(long)]
        out: PathBuf,
        /// JSON/parquet text field.
        #[arg(long, default_value = "text")]
        field: String,
        /// `wikitext` applies lm-eval's WikiText document split and detokenizer.
        #[arg(long, default_value = "text")]
        format: String,
        /// Use N documents of the built-in synthetic corpus instead of a source.
        #[arg(long)]
        synthetic: Option<usize>,
    },
}

fn main() {
    // Before CUDA starts: a data-parallel worker sees only its own GPU.
    train::distributed::pin_local_gpu();
    let _ = attnlab::device::preload_torch_cuda();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e}");
        for cause in e.chain().skip(1) {
            eprintln!("  caused by: {cause}");
        }
        // Another process holds the run directory: a distinct status, so `sweep` reports it busy.
        let busy = e.chain().any(|c| matches!(c.downcast_ref::<attnlab::Error>(), Some(attnlab::Error::Busy { .. })));
        std::process::exit(if busy { train::lock::BUSY_EXIT } else { 1 });
    }
}

fn load_spec(a: &SpecArgs) -> Result<Spec> {
    let mut spec = match &a.spec {
        Some(p) => spec::load(p, &a.sets)?,
        None => spec::from_str(spec::BUILTIN_TINY, "<builtin tiny-synthetic>", &a.sets)?,
    };
    if let Some(out) = &a.out {
        spec.output = Some(out.clone());
        spec.name.get_or_insert_with(|| out.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default());
    }
    Ok(spec)
}

fn tokenizer_spec(s: &str) -> spec::TokenizerSpec {
    match s.strip_prefix("hf:") {
        Some(repo) => spec::TokenizerSpec::Hub { hf: repo.to_string() },
        None => spec::TokenizerSpec::Path(s.to_string()),
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Train { spec, quiet, stop_after, gpus } => {
            let mut spec = load_spec(&spec)?;
            if !gpus.is_empty() {
                spec.train.devices = Some(gpus.into_iter().map(spec::DeviceEntry::Name).collect());
                spec = spec.resolve().map_err(|(key, msg)| anyhow::anyhow!("--gpus: `{key}`: {msg}"))?;
            }
            let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
            let dist = match train::workers::launch_or_join(&mut spec, &args)? {
                train::workers::Role::Launched => return Ok(()),
                train::workers::Role::Train(dist) => dist,
            };
            let rank0 = dist.as_ref().is_none_or(|d| d.rank == 0);
            let o = train::train(spec, &TrainOptions { quiet, stop_after, dist })?;
            if !rank0 {
                return Ok(());
            }
            if o.already_done {
                println!("{} is finished (DONE); nothing to do", o.dir.display());
            } else {
                println!("trained {} to step {}", o.dir.display(), o.step);
            }
            print_eval_table(&[(o.dir.display().to_string(), o.eval)]);
        }
        Cmd::Linearize { run: StagedArgs { spec, sets, out, stop_after, quiet } } => {
            use attnlab::linearize::{linearize, LinearizeOptions, LinearizeSpec};
            let mut s = LinearizeSpec::from_file_with(&spec, &sets)?;
            if let Some(o) = out {
                s.output = o;
            }
            let o = linearize(s, &LinearizeOptions { quiet, stop_after })?;
            if o.already_done {
                println!("{} is finished (DONE); nothing to do", o.dir.display());
            } else {
                println!("linearized {} to step {}", o.dir.display(), o.step);
            }
            if !o.eval.is_null() {
                print!("{}", attnlab::runs::linearize_summary(&o.dir, &o.eval));
            }
        }
        Cmd::Finetune { run: StagedArgs { spec, sets, out, stop_after, quiet } } => {
            use attnlab::finetune::{finetune, FinetuneOptions, FinetuneSpec};
            let mut s = FinetuneSpec::from_file(&spec, &sets)?;
            if let Some(o) = out {
                s.output = o;
            }
            let o = finetune(s, &FinetuneOptions { quiet, stop_after }).with_context(|| format!("finetune {}", spec.display()))?;
            if o.already_done {
                println!("{} is finished (DONE); nothing to do", o.dir.display());
            } else {
                println!("fine-tuned {} to step {}", o.dir.display(), o.step);
            }
            if !o.eval.is_null() {
                print!("{}", attnlab::runs::finetune_summary(&o.dir, &o.eval));
            }
        }
        Cmd::Compare { spec, kinds, quiet } => {
            let base = load_spec(&spec)?;
            let root = match (&spec.out, &base.output) {
                (Some(o), _) => o.clone(),
                (None, Some(o)) => o.parent().map(Path::to_path_buf).unwrap_or_else(|| o.clone()),
                (None, None) => PathBuf::from("results/compare"),
            };
            let mut rows = Vec::new();
            for k in &kinds {
                let kind: AttentionKind = serde_yaml::from_str(k).with_context(|| format!("unknown attention kind `{k}`"))?;
                let mut s = base.with_attention(kind).map_err(|(key, msg)| anyhow::anyhow!("{key}: {msg}"))?;
                s.output = Some(root.join(k));
                s.name = Some(k.clone());
                if !quiet {
                    eprintln!("== {k}: {}", s.attention.note.clone().unwrap_or_else(|| "full-width keys everywhere".into()));
                }
                let o = train::train(s, &TrainOptions { quiet, ..Default::default() })?;
                rows.push((k.clone(), o.eval));
            }
            print_eval_table(&rows);
        }
        Cmd::Eval { run, step, corpora, device, task: Some(task), data, limit, shots, min_context, batch_tokens, .. } if !task.starts_with("ruler:") && !task.starts_with("babilong:") => {
            if !corpora.is_empty() {
                bail!("--corpus is for perplexity; --task {task} is a downstream task (give one or the other)");
            }
            use attnlab::eval::tasks;
            let def = tasks::TaskDef::load(&task)?;
            let loaded = train::run::load(&run, step, device.as_deref())?;
            let min_context = min_context.unwrap_or(loaded.spec.attention.min_context());
            let opts = tasks::Options { data, limit, shots, max_len: loaded.spec.seq_len(), min_context, batch_tokens, quiet: false };
            let (mut result, samples) = tasks::evaluate(&loaded.model, &loaded.tok, &def, &opts, loaded.device).with_context(|| format!("task {task} on {}", run.display()))?;
            let a = &loaded.spec.attention;
            let vanilla = a.is_vanilla();
            result.model = tasks::ModelInfo {
                step: loaded.step,
                arch: format!("{:?}", loaded.spec.model.arch.unwrap_or_default()).to_lowercase(),
                attention: a.kind.name().into(),
                d_model: loaded.spec.shape().d_model,
                d_down: if vanilla { None } else { a.d_down.map(|x| x as usize) },
                window: if vanilla { None } else { a.window.map(|x| x as usize) },
            };
            let path = tasks::write(&run, &result, &samples)?;
            let info = attnlab::eval::lm_eval::RunInfo { run: run.clone(), step: loaded.step, device: format!("{:?}", loaded.device), limit, seconds: result.seconds };
            let lm = attnlab::eval::lm_eval::write(&info, &[attnlab::eval::lm_eval::downstream_task(&def, &result, &samples)])?;
            attnlab::tensorboard::refresh(&run);
            println!("{} at step {}: {} over {} documents ({}-shot) in {:.1}s → {} (lm-eval format: {})", run.display(), loaded.step, result.task, result.docs, result.num_fewshot, result.seconds, path.display(), lm.display());
            if result.min_context > 0 {
                println!("  kept {} of {} documents: inputs ≥ {} tokens (--min-context)", result.docs, result.docs_total, result.min_context);
            }
            for (k, v) in &result.metrics {
                println!("  {k:32} {v:.4}{}", if *k == result.primary_metric { "  (primary)" } else { "" });
            }
            for n in &result.notes {
                println!("  note: {n}");
            }
        }
        Cmd::Eval { run, step, corpora, device, task: Some(task), lengths, samples, essay, max_new_tokens, babi, set, .. } => {
            if !corpora.is_empty() {
                bail!("--corpus is for perplexity; --task {task} evaluates generation (give one or the other)");
            }
            let loaded = attnlab::eval::generate::load_with(&run, step, device.as_deref(), &set)?;
            let overrides = (!set.is_empty()).then(|| set.join(" "));
            let essay = essay.as_deref().map(attnlab::eval::ruler::read_essay).transpose()?;
            let (cells, file) = if let Some(name) = task.strip_prefix("babilong:") {
                let babi = babi.as_deref().context("--task babilong:… needs --babi (e.g. ../shared/data/babi)")?;
                let essay = essay.as_deref().context("--task babilong:… needs --essay (e.g. ../shared/data/haystack/ruler_paul_graham_essays.json.gz)")?;
                let records = attnlab::eval::babilong::read_records(babi, name)?;
                let max_new = max_new_tokens.unwrap_or(attnlab::eval::babilong::TOKENS_TO_GENERATE);
                let cells = attnlab::eval::babilong::evaluate(&loaded.model, &loaded.tok, name, &records, &lengths, samples, essay, max_new, loaded.device, false)?;
                (cells.into_iter().map(|c| attnlab::eval::ruler::Cell { overrides: overrides.clone(), ..c }).collect::<Vec<_>>(), "babilong.json")
            } else {
                let name = task.strip_prefix("ruler:").with_context(|| format!("--task `{task}`: want ruler:<task> or babilong:<task>"))?;
                let max_new = max_new_tokens.unwrap_or(attnlab::eval::ruler::TOKENS_TO_GENERATE);
                let t0 = std::time::Instant::now();
                let (mut cells, mut all_records) = (Vec::new(), Vec::new());
                for (cell, records) in attnlab::eval::ruler::evaluate(&loaded.model, &loaded.tok, name, &lengths, samples, essay.as_deref(), max_new, loaded.device, false)? {
                    let cell = attnlab::eval::ruler::Cell { overrides: overrides.clone(), ..cell };
                    attnlab::eval::ruler::write_samples(&run, &cell, &records)?;
                    cells.push(cell);
                    all_records.extend(records);
                }
                let info = attnlab::eval::lm_eval::RunInfo { run: run.clone(), step: loaded.step, device: format!("{:?}", loaded.device), limit: Some(samples), seconds: t0.elapsed().as_secs_f64() };
                let lm = attnlab::eval::lm_eval::write(&info, &[attnlab::eval::lm_eval::ruler_task(name, &cells, &all_records, max_new)])?;
                println!("lm-eval format: {}", lm.display());
                (cells, "ruler.json")
            };
            let path = attnlab::eval::ruler::write_cells(&run, file, &cells)?;
            println!("{} at step {} ({}{}):", run.display(), loaded.step, path.display(), if file == "ruler.json" { ", per-sample records in ruler_samples/" } else { "" });
            for c in &cells {
                println!("{:16} length {:6}: {:6.2}% over {} samples (mean prompt {:.0} tokens){}", c.task, c.length, c.score, c.samples, c.mean_prompt_tokens, c.overrides.as_deref().map(|o| format!("  [{o}]")).unwrap_or_default());
                if let Some(d) = &c.diagnostics {
                    println!("  value tokens outside the window: {:.0}%", 100.0 * d.value_outside_window);
                    for l in &d.layers {
                        let pct = |x: Option<f64>| x.map_or("  –".to_string(), |v| format!("{:3.0}%", 100.0 * v));
                        println!("  layer {:2}: selected (any head) {}  (best head) {}   normalizer share window {:5.1}%  selected {:5.1}%  linear {:5.1}%", l.layer, pct(l.recall_any_head), pct(l.recall_best_head), 100.0 * l.shares_mean[0], 100.0 * l.shares_mean[1], 100.0 * l.shares_mean[2]);
                    }
                }
            }
        }
        Cmd::Eval { run, step, corpora, device, task: None, .. } => {
            // A linearize run directory, or its export folder (hybrid.yaml, no config.yaml).
            if run.join("hybrid.yaml").is_file() || attnlab::run_kind::RunKind::of(&run).ok() == Some(attnlab::run_kind::RunKind::Linearize) {
                bail!("{}: a linearized model; its held-out perplexity is in the run's eval.json (for RULER give --task)", run.display());
            }
            let loaded = train::run::load(&run, step, device.as_deref())?;
            let mut spec = loaded.spec.clone();
            for c in &corpora {
                let (name, path) = c.split_once('=').with_context(|| format!("--corpus `{c}` is not NAME=PATH"))?;
                let (format, path) = match path.strip_prefix("wikitext:") {
                    Some(p) => (spec::TextFormat::Wikitext, p),
                    None => (spec::TextFormat::Text, path),
                };
                spec.data.eval.insert(name.to_string(), spec::SourceSpec::Local(spec::LocalSource { path: path.into(), field: "text".into(), format }));
            }
            let corpora = train::load_eval_corpora(&spec, &loaded.tok)?;
            if corpora.is_empty() {
                bail!("no evaluation corpora: the run's spec lists none; add --corpus NAME=PATH");
            }
            let t0 = std::time::Instant::now();
            let scored = attnlab::eval::lm_eval::evaluate_perplexity(&loaded.model, &corpora, &spec, loaded.device);
            let results: std::collections::BTreeMap<_, _> = scored.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect();
            train::run::RunDir { path: run.clone() }.write_eval(loaded.step, &results)?;
            let lm_tasks: Vec<_> = corpora.iter().filter_map(|c| scored.get(&c.name).and_then(|(r, d)| attnlab::eval::lm_eval::perplexity_task(c, r, d))).collect();
            let info = attnlab::eval::lm_eval::RunInfo { run: run.clone(), step: loaded.step, device: format!("{:?}", loaded.device), limit: None, seconds: t0.elapsed().as_secs_f64() };
            if !lm_tasks.is_empty() {
                let lm = attnlab::eval::lm_eval::write(&info, &lm_tasks)?;
                println!("lm-eval format: {}", lm.display());
            }
            attnlab::tensorboard::refresh(&run);
            println!("{} at step {}:", run.display(), loaded.step);
            print_eval_table(&[(run.display().to_string(), results)]);
        }
        Cmd::Forward { run, tokens, out, step, device } => {
            let loaded = train::run::load(&run, step, device.as_deref())?;
            let text = std::fs::read_to_string(&tokens).with_context(|| format!("reading {}", tokens.display()))?;
            let ids: Vec<i64> = text
                .split_whitespace()
                .enumerate()
                .map(|(i, w)| w.parse::<i64>().with_context(|| format!("{}: token {} (`{w}`) is not an integer", tokens.display(), i + 1)))
                .collect::<Result<_>>()?;
            let vocab = loaded.model.vocab() as i64;
            if let Some(bad) = ids.iter().find(|&&i| i < 0 || i >= vocab) {
                bail!("{}: token id {bad} is outside the vocabulary [0, {vocab})", tokens.display());
            }
            let x = tch::Tensor::from_slice(&ids).view([1, -1]).to_device(loaded.device);
            let logits = tch::no_grad(|| loaded.model.forward(&x)).squeeze_dim(0).to_kind(tch::Kind::Float).to_device(tch::Device::Cpu);
            tch::Tensor::write_safetensors(&[("logits", &logits)], &out)?;
            println!("wrote logits {:?} to {}", logits.size(), out.display());
        }
        Cmd::Generate { run, prompt, prompt_file, max_new_tokens, temperature, greedy, seed, step, device } => {
            let loaded = attnlab::eval::generate::load(&run, step, device.as_deref())?;
            let text = match (prompt, prompt_file) {
                (Some(p), _) => p,
                (None, Some(f)) => std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?,
                (None, None) => bail!("give --prompt TEXT or --prompt-file FILE"),
            };
            // The tokenizer's BOS first when it has one (Llama), as Hugging Face and `eval --task` do.
            let mut ids: Vec<u32> = attnlab::linearize::bos_id(&loaded.tok).into_iter().collect();
            ids.extend(loaded.tok.encode(&text)?);
            if ids.is_empty() {
                bail!("the prompt encodes to no tokens");
            }
            let sampling = attnlab::eval::generate::Sampling { temperature: if greedy { 0.0 } else { temperature }, seed };
            let g = attnlab::eval::generate::generate(&loaded.model, &ids, max_new_tokens, sampling, Some(loaded.eos), loaded.device);
            println!("{}{}", text, loaded.tok.decode(&g.tokens)?);
            eprintln!(
                "{} prompt + {} new tokens; prefill {:.3}s, decode {:.1} tokens/s, cache {} bytes",
                g.prompt_tokens, g.tokens.len(), g.prefill_s, g.decode_tokens_per_s, g.cache_bytes
            );
        }
        Cmd::BenchDecode { spec, lengths, new_tokens, vocab, attention, plot, from, json } => {
            use attnlab::eval::decode_bench;
            let rows = match from {
                Some(f) => decode_bench::read_rows(&std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?)?,
                None => {
                    let base = load_spec(&spec)?;
                    let device = attnlab::device::parse_device(base.train.device.as_deref().unwrap_or("auto"))?;
                    eprintln!("random-initialised weights and random prompt tokens: cache memory and speed only, not quality");
                    decode_bench::run(&base, &decode_bench::split_names(&attention), &lengths, new_tokens, vocab, device, |r| {
                        if json {
                            println!("{}", serde_json::to_string(r).expect("serializes"));
                        } else {
                            eprintln!(
                                "{:12} context {:6}: cache {:>12} bytes ({:8.1} B/token), prefill {:7.3}s, decode {:8.1} tokens/s",
                                r.attention, r.context, r.cache_bytes, r.cache_bytes_per_token, r.prefill_s, r.decode_tokens_per_s
                            );
                        }
                    })?
                }
            };
            if !json {
                print!("{}", decode_bench::table(&rows));
            }
            if let Some(stem) = plot {
                #[cfg(feature = "analysis")]
                for f in decode_bench::plot(&rows, &stem)? {
                    eprintln!("wrote {}", f.display());
                }
                #[cfg(not(feature = "analysis"))]
                bail!("--plot {}: this binary was built without the `analysis` feature; plot the --json rows elsewhere with --from", stem.display());
            }
        }
        Cmd::Export { run, out, step } => {
            let step = attnlab::export::export(&run, &out, step)?;
            println!("wrote {} (step {}) to {}", run.display(), step, out.display());
        }
        Cmd::Data(DataCmd::Prepare { source, tokenizer, out, field, format, synthetic }) => {
            let tok = attnlab::data::Tok::load(&tokenizer_spec(&tokenizer))?;
            let format: spec::TextFormat = serde_yaml::from_str(&format).with_context(|| format!("--format `{format}`: want text or wikitext"))?;
            let src = match (synthetic, source) {
                (Some(n), None) => spec::SourceSpec::Synthetic { synthetic: spec::SyntheticSpec { seed: 1, docs: n } },
                (None, Some(p)) => spec::SourceSpec::Local(spec::LocalSource { path: p, field, format }),
                _ => bail!("give either a SOURCE path or --synthetic N"),
            };
            let docs = attnlab::data::sources::read_documents(&src)?;
            let p = attnlab::data::shards::prepare(&docs, &tok, &serde_json::to_string(&src)?, &out, false)?;
            println!(
                "{} documents, {} tokens in {:.1}s ({:.0} tokens/s) → {}",
                p.index.n_docs,
                p.index.n_tokens,
                p.seconds,
                p.index.n_tokens as f64 / p.seconds.max(1e-9),
                p.dir.display()
            );
        }
        Cmd::Bench { spec, steps, warmup, vocab, attention_only, check, json } => {
            let base = load_spec(&spec)?;
            if check {
                check_attention(&base, json)?;
            } else if attention_only {
                bench_attention(&base, steps, json)?;
            } else {
                let r = attnlab::bench::train_bench(&base, vocab, warmup, steps)?;
                if json {
                    println!("{}", serde_json::to_string(&r)?);
                } else {
                    println!(
                        "{} ({}), micro-batch {} × T {} on {}: {:.1} ms/step, {:.0} tokens/s, MFU {:.1}%, peak {:.2} GiB, {} params",
                        r.name, r.attention, r.micro_batch, r.seq_len, r.device, r.step_ms, r.tokens_per_s, 100.0 * r.mfu, r.peak_mem_gib, r.params
                    );
                }
            }
        }
        Cmd::Config { spec } => match spec.spec.as_deref().map(|p| spec::staged_config_yaml(p, &spec.sets)).transpose()?.flatten() {
            Some(staged) => print!("{staged}"),
            None => print!("{}", load_spec(&spec)?.to_yaml()),
        },
        Cmd::Runs { results } => print!("{}", attnlab::runs::table(&results, &attnlab::runs::list(&results)?)),
        Cmd::Tensorboard { dirs } => {
            for d in &dirs {
                let runs = attnlab::tensorboard::find_runs(d);
                if runs.is_empty() {
                    bail!("{}: no run directory (a folder with metrics.jsonl) at or below it", d.display());
                }
                for r in runs {
                    let (path, s) = attnlab::tensorboard::regenerate(&r)?;
                    println!("{}: {} tags, {} points", path.display(), s.tags.len(), s.points());
                }
            }
        }
        Cmd::Sweep { file, dry_run, gpus, max_parallel, emit, sets, out, gpus_per_run, nodes } => {
            if (gpus_per_run > 1 || nodes > 1) && emit.is_none() {
                bail!("--gpus-per-run / --nodes shape the runs of an emitted batch script (--emit slurm); a local sweep runs one GPU per run (or `attnlab train --gpus` for one data-parallel run)");
            }
            let shape = attnlab::sweep::RunShape { nodes, gpus_per_node: gpus_per_run };
            let opts = attnlab::sweep::SweepOptions { dry_run, gpus, max_parallel, emit, sets, out, exe: None, shape };
            let summary = attnlab::sweep::run_sweep(&file, &opts)?;
            if summary.failed() > 0 {
                bail!("{} of {} runs failed (logs listed above)", summary.failed(), summary.runs.len());
            }
        }
        #[cfg(feature = "analysis")]
        Cmd::Report { results, out, format, unit } => {
            let out = out.unwrap_or_else(|| results.join("report"));
            println!("{}", attnlab::report::run_report(&results, &out, &format, &unit)?);
        }
    }
    Ok(())
}

fn check_attention(spec: &Spec, json: bool) -> Result<()> {
    let failed = attnlab::bench::check_all(spec, |r| {
        if json {
            println!("{}", serde_json::to_string(r).expect("serializes"));
        } else {
            let e = r.rel_err.iter().map(|e| format!("{e:.1e}")).collect::<Vec<_>>().join(" ");
            println!("{:18} {:?} w {:5}: rel err out/dq/dkl/dvl/dkg/dvg {e}  {}", r.implementation, r.shape, r.window, if r.pass { "ok" } else { "FAIL" });
        }
    })?;
    if failed > 0 {
        bail!("{failed} attention checks failed");
    }
    Ok(())
}

fn bench_attention(spec: &Spec, reps: usize, json: bool) -> Result<()> {
    attnlab::bench::bench_all(spec, reps, |r, base| {
        if json {
            println!("{}", serde_json::to_string(r).expect("serializes"));
        } else {
            println!("{:8} {:10} B·H {} T {} hd {} w {:4}: {:8.3} ms fwd+bwd ({:.2}× vanilla)", r.attention, r.implementation, r.batch_heads, r.seq_len, r.head_dim, r.window, r.fwd_bwd_ms, r.fwd_bwd_ms / base);
        }
    })?;
    Ok(())
}

fn print_eval_table(rows: &[(String, std::collections::BTreeMap<String, attnlab::eval::CorpusResult>)]) {
    let corpora: std::collections::BTreeSet<&String> = rows.iter().flat_map(|r| r.1.keys()).collect();
    if corpora.is_empty() {
        return;
    }
    let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(3).max(3);
    print!("{:width$}", "run");
    for c in &corpora {
        print!("  {:>14} {:>9}", format!("{c} ppl"), "tokens");
    }
    println!();
    for (name, res) in rows {
        print!("{name:width$}");
        for c in &corpora {
            match res.get(*c) {
                Some(r) => print!("  {:>14.3} {:>9}", r.ppl, r.tokens),
                None => print!("  {:>14} {:>9}", "-", "-"),
            }
        }
        println!();
    }
}
