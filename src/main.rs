//! The `attnlab` command line. Errors print their cause chain and exit non-zero.
use anyhow::{bail, Context, Result};
use attnlab::eval::command::{DownstreamArgs, EvalArgs, Evaluated, LongContextArgs};
use attnlab::eval::{self, perplexity};
use attnlab::spec::SpecSource;
use attnlab::{bench, train};
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
    /// The command's spec (YAML): a linearize spec names a `teacher`, a finetune spec a `base` model.
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
    /// No progress bars.
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
    /// stage 2 everything (lr 3e-5). Spec keys: base (HF folder, hf:owner/name, .gguf / gguf:NAME or attnlab run dir),
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
        #[arg(long, default_value = "vanilla,dar,uniform", value_delimiter = ',', help = format!("Attention kinds to train, comma-separated: any of {}", attnlab::spec::AttentionKind::names()))]
        kinds: Vec<String>,
        /// No progress bars.
        #[arg(long)]
        quiet: bool,
    },
    /// Rolling perplexity of a run's checkpoint on its eval corpora (and any --corpus); writes eval.json.
    /// RUN may be a pretrained llama GGUF (a .gguf file or gguf:smollm2): results then go to --out.
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
        /// babilong:qa2 (writes babilong.json; needs --essay and --babi). `recall`: the synthetic
        /// long-range recall test (codes stated once, asked for --lengths tokens later; scored at the
        /// answer digits only; writes recall.json and ruler.json cells; built-in tokenizer runs only).
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
        /// RULER / BABILong: give the prompt as it is, not wrapped in the model's chat template (models
        /// that carry one, e.g. a GGUF, are asked as a user turn by default; result cells record which).
        #[arg(long)]
        no_chat: bool,
        /// Where a pretrained model's results go (RUN a GGUF; default results/<file stem>).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Perplexity: score at most N tokens per corpus (a slice of a long corpus).
        #[arg(long)]
        max_tokens: Option<usize>,
        /// RULER / BABILong on a linearized model: change its operator without retraining, e.g.
        /// --set attention.tokens_per_chunk=16, --set attention.routing=oracle (selects the needle
        /// sentences: a diagnostic), --set attention.linear_branch=false,
        /// --set attention.normalizer=max_compensated (repeatable; recorded in the result cells).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// RULER / BABILong: samples per forward, left-padded to the longest (softmax models; STILL
        /// and LoLCATs take one at a time). Default: 4 on CPU; on CUDA what half of the free memory
        /// holds (at most 64). The scores equal batch 1's up to rounding.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        batch_size: Option<u64>,
    },
    /// Which tokens STILL's routing score (self-saliency by default) selects on prose: per layer and
    /// head, the top κ of every chunk of C tokens, and the selection rate of token classes (negations,
    /// modals, quantifiers, digits, punctuation, a chunk's first and last token, other) against chance
    /// κ/C. Writes saliency_words.json, saliency_words.md and saliency_words_heatmap.png to --out.
    SaliencyWords {
        /// A llama GGUF (a .gguf file or gguf:smollm2), or a STILL student (a linearize run or its export/).
        model: PathBuf,
        /// Held-out text: .txt, .jsonl[.zst|.gz], .parquet, or a folder of them (one document per file / row).
        #[arg(long)]
        text: PathBuf,
        /// The text field of JSON lines / parquet rows.
        #[arg(long, default_value = "text")]
        field: String,
        /// Score about this many tokens (the run stops after the sequence that reaches it).
        #[arg(long, default_value_t = 50_000)]
        max_tokens: usize,
        /// Tokens per sequence (each document cut into pieces of this length; chunk 0 of each is not scored).
        #[arg(long, default_value_t = 1024)]
        seq_len: usize,
        /// STILL's options for a softmax teacher (defaults: C 64, κ 4, self_saliency), e.g.
        /// --set attention.routing=diag_attn, --set attention.tokens_per_chunk=8; a student's own are
        /// changed the same way.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Output folder (default results/<model name>/saliency-words).
        #[arg(long)]
        out: Option<PathBuf>,
        /// List tokens seen at least this often, by rate.
        #[arg(long, default_value_t = 20)]
        min_count: u64,
        /// Device (default: auto).
        #[arg(long)]
        device: Option<String>,
        /// No progress bar.
        #[arg(long)]
        quiet: bool,
    },
    /// Write float32 logits [n, vocab] for whitespace-separated token ids in FILE to a safetensors file.
    Forward {
        /// A training run directory, a linearize run or export folder, or a llama GGUF (a .gguf file or
        /// gguf:smollm2).
        run: PathBuf,
        /// Text file of whitespace-separated token ids, each inside the model's vocabulary.
        #[arg(long)]
        tokens: PathBuf,
        /// Output safetensors file (one tensor, `logits`).
        #[arg(long)]
        out: PathBuf,
        /// Checkpoint step (default: the newest complete one).
        #[arg(long)]
        step: Option<u64>,
        /// Device (default: the run's).
        #[arg(long)]
        device: Option<String>,
    },
    /// Write a run's checkpoint as a Hugging Face folder (config.json, model.safetensors, tokenizer files,
    /// a model card) that transformers loads: vanilla as the stock GPTNeoX / Llama / Olmo2ForCausalLM,
    /// every other kind as attnlab's architecture with its modeling code in the folder
    /// (trust_remote_code=True); or a llama GGUF as one (fp32, dequantized, with its chat template).
    Export {
        /// A training run directory, or a llama GGUF (a .gguf file or gguf:smollm2).
        run: PathBuf,
        /// Output folder.
        #[arg(long)]
        out: PathBuf,
        /// Checkpoint step (default: the newest complete one).
        #[arg(long)]
        step: Option<u64>,
    },
    /// Continue a prompt with a trained run (KV cache per variant: DAR keeps d_down-wide latents for distant
    /// tokens), or with a linearized model: a finished `attnlab linearize` run directory or its export/
    /// folder (STILL / LoLCATs keep selected tokens, two chunks and a fixed-size linear state).
    Generate {
        /// A run directory (train or linearize), a linearize export folder, or a pretrained llama GGUF
        /// (a .gguf file, or gguf:smollm2 after `make smollm2`).
        run: PathBuf,
        /// Prompt text (or --prompt-file).
        #[arg(long, conflicts_with = "prompt_file")]
        prompt: Option<String>,
        /// Read the prompt from this file.
        #[arg(long)]
        prompt_file: Option<PathBuf>,
        /// Wrap the prompt as a user turn in the model's chat template (with the assistant's
        /// generation prompt); the model must carry one (a GGUF, a finetune export).
        #[arg(long)]
        chat: bool,
        /// Tokens to generate at most (generation also stops at the tokenizer's end-of-text token).
        #[arg(long, default_value_t = 64)]
        max_new_tokens: usize,
        /// Sampling temperature; 0 = greedy.
        #[arg(long, default_value_t = 0.0, conflicts_with = "greedy")]
        temperature: f64,
        /// Greedy decoding (the default; the same as --temperature 0).
        #[arg(long)]
        greedy: bool,
        /// Sampling seed (with --temperature > 0).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Checkpoint step of a training run (default: the newest complete one).
        #[arg(long)]
        step: Option<u64>,
        /// Device (default: the run's).
        #[arg(long)]
        device: Option<String>,
    },
    /// Decode benchmark: KV-cache bytes (total and per token), prefill time and decode tokens/s at the
    /// spec's model size, for several context lengths, with random weights and tokens (speed and memory
    /// only). The softmax kinds (vanilla, dar, …) are GPT-NeoX models with the spec's settings; still /
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
        /// Tokens decoded after the prefill, for the decode speed.
        #[arg(long, default_value_t = 32)]
        new_tokens: usize,
        /// Measure every (attention, length) this many times, interleaved (each repeat sweeps every
        /// attention and length); --json prints one line per repeat, the table shows medians.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
        repeats: u64,
        /// Vocabulary rows of the random models (Pythia: 50304).
        #[arg(long, default_value_t = 50304)]
        vocab: usize,
        #[arg(long, default_value_t = attnlab::eval::decode_bench::default_names(), help = format!("Variants, comma-separated: {}, or NAME={{kind: {}, …}} (a hybrid.yaml; quote it)", attnlab::eval::decode_bench::names().iter().map(|n| n.0).collect::<Vec<_>>().join(", "), attnlab::attention::Variant::NAMES.join("|")))]
        attention: String,
        /// Write STEM-cache, STEM-decode and STEM-prefill charts (.png, .svg; needs the `analysis` feature).
        #[arg(long, value_name = "STEM")]
        plot: Option<PathBuf>,
        /// Do not measure: read the rows of an earlier `--json` run (e.g. the GPU job's decode.jsonl).
        #[arg(long, value_name = "JSONL")]
        from: Option<PathBuf>,
        /// Print one JSON line per row (on stdout) instead of progress lines and the table.
        #[arg(long)]
        json: bool,
        /// Run every row's decode steps (not its prefill) under libtorch's profiler: one Chrome trace
        /// per row in DIR and a line per trace in DIR/runs.jsonl; `scripts/profile_table.py DIR` says
        /// which kernels a step spends its time in. Rows measured so are slower than without.
        /// ATTNLAB_PROFILE_PREFILL=1 traces each row's prefill instead (use --repeats 2: the second
        /// finds every per-shape plan built).
        #[arg(long, value_name = "DIR", conflicts_with = "from")]
        profile: Option<PathBuf>,
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
        /// Untimed steps first (CUDA context, kernel selection, allocator).
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
        /// Profile the same measurement instead (the training step; with --attention-only the op of
        /// vanilla and of the spec's attention): libtorch's profiler (CUDA kernels through CUPTI)
        /// around the timed steps, a Chrome trace per measurement in DIR and a line per trace in
        /// DIR/runs.jsonl; `scripts/profile_table.py DIR` prints where the time goes.
        #[arg(long, value_name = "DIR", conflicts_with = "check")]
        profile: Option<PathBuf>,
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
        /// Folder searched recursively for run directories (folders holding config.yaml).
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
        /// Output folder for the shards and index.json.
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

impl SpecArgs {
    fn source(&self) -> SpecSource {
        SpecSource { path: self.spec.clone(), sets: self.sets.clone(), out: self.out.clone() }
    }
}

/// The first line of `train`, `linearize` and `finetune`: what happened to the run directory.
fn print_outcome(verb: &str, dir: &Path, step: u64, already_done: bool) {
    if already_done {
        println!("{} is finished (DONE); nothing to do", dir.display());
    } else {
        println!("{verb} {} to step {step}", dir.display());
    }
}

/// `print_outcome`, then the held-out comparison of a two-stage run (`summary` of its eval.json).
fn print_staged(verb: &str, dir: &Path, step: u64, already_done: bool, eval: &serde_json::Value, summary: fn(&Path, &serde_json::Value) -> String) {
    print_outcome(verb, dir, step, already_done);
    if !eval.is_null() {
        print!("{}", summary(dir, eval));
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Train { spec, quiet, stop_after, gpus } => {
            let s = spec.source().load()?;
            let Some(o) = train::workers::train_command(s, &gpus, quiet, stop_after, Some(attnlab::eval::ruler::score_trained))? else { return Ok(()) };
            print_outcome("trained", &o.dir, o.step, o.already_done);
            print!("{}", perplexity::table(&[(o.dir.display().to_string(), o.eval)]));
        }
        Cmd::Linearize { run } => {
            let mut s = attnlab::linearize::LinearizeSpec::from_file_with(&run.spec, &run.sets)?;
            s.output = run.out.clone().unwrap_or(s.output);
            let o = attnlab::linearize::linearize(s, &attnlab::linearize::LinearizeOptions { quiet: run.quiet, stop_after: run.stop_after }).with_context(|| format!("linearize {}", run.spec.display()))?;
            print_staged("linearized", &o.dir, o.step, o.already_done, &o.eval, attnlab::runs::linearize_summary);
        }
        Cmd::Finetune { run } => {
            let mut s = attnlab::finetune::FinetuneSpec::from_file(&run.spec, &run.sets)?;
            s.output = run.out.clone().unwrap_or(s.output);
            let o = attnlab::finetune::finetune(s, &attnlab::finetune::FinetuneOptions { quiet: run.quiet, stop_after: run.stop_after }).with_context(|| format!("finetune {}", run.spec.display()))?;
            print_staged("fine-tuned", &o.dir, o.step, o.already_done, &o.eval, attnlab::runs::finetune_summary);
        }
        Cmd::Compare { spec, kinds, quiet } => {
            let rows = attnlab::sweep::compare::compare(&spec.source(), &kinds, quiet)?;
            print!("{}", perplexity::table(&rows));
        }
        Cmd::Eval { run, step, corpora, device, task, data, limit, shots, min_context, batch_tokens, lengths, samples, essay, max_new_tokens, babi, no_chat, out, max_tokens, set, batch_size } => {
            let downstream = DownstreamArgs { request: eval::tasks::Request { data, limit, shots, batch_tokens }, min_context };
            let long_context = LongContextArgs { grid: eval::ruler::Grid { lengths, samples }, max_new_tokens, essay, babi, sets: set, no_chat, batch_size: batch_size.map(|n| n as usize) };
            let args = EvalArgs { corpora, task: task.clone(), downstream, long_context, out, max_tokens };
            let what = task.as_deref().map_or_else(|| "perplexity".to_string(), |t| format!("--task {t}"));
            match eval::command::eval(&run, step, device.as_deref(), &args).with_context(|| format!("eval {} ({what})", run.display()))? {
                Evaluated::Perplexity { step, results, lm_eval } => {
                    if let Some(lm) = lm_eval {
                        println!("lm-eval format: {}", lm.display());
                    }
                    println!("{} at step {step}:", run.display());
                    print!("{}", perplexity::table(&[(run.display().to_string(), results)]));
                }
                Evaluated::Task { step, result: r, path, lm_eval } => {
                    println!("{} at step {step}: {} over {} documents ({}-shot) in {:.1}s → {} (lm-eval format: {})", run.display(), r.task, r.docs, r.num_fewshot, r.seconds, path.display(), lm_eval.display());
                    if r.min_context > 0 {
                        println!("  kept {} of {} documents: inputs ≥ {} tokens (--min-context)", r.docs, r.docs_total, r.min_context);
                    }
                    for (k, v) in &r.metrics {
                        println!("  {k:32} {v:.4}{}", if *k == r.primary_metric { "  (primary)" } else { "" });
                    }
                    for n in &r.notes {
                        println!("  note: {n}");
                    }
                }
                Evaluated::LongContext { step, cells, path, lm_eval } => {
                    if let Some(lm) = &lm_eval {
                        println!("lm-eval format: {}", lm.display());
                    }
                    println!("{} at step {step} ({}{}):", run.display(), path.display(), if lm_eval.is_some() { ", per-sample records in ruler_samples/" } else { "" });
                    cells.iter().for_each(|c| print!("{}", c.summary()));
                }
            }
        }
        Cmd::SaliencyWords { model, text, field, max_tokens, seq_len, set, out, min_count, device, quiet } => {
            let name = model.to_string_lossy().rsplit([':', '/']).find(|s| !s.is_empty()).unwrap_or("model").trim_end_matches(".gguf").to_string();
            let out = out.unwrap_or_else(|| Path::new("results").join(name).join("saliency-words"));
            let o = eval::saliency_words::Options { max_tokens, seq_len, min_count, quiet };
            let (r, files) = eval::saliency_words::command(&model, &text, &field, &set, device.as_deref(), &out, &o).with_context(|| format!("saliency-words {} on {}", model.display(), text.display()))?;
            println!("{} tokens in {} chunks, {} layers × {} heads, {:.0}s; chance κ/C = {:.4}", r.tokens, r.chunks, r.layers, r.heads, r.seconds, r.chance);
            println!("{:12} {:>8} {:>8} {:>8}  95% interval", "class", "tokens", "rate", "/chance");
            for c in &r.classes {
                println!("{:12} {:>8} {:>8.4} {:>8.3}  [{:.3}, {:.3}]", c.class.name(), c.count, c.rate, c.rate_over_chance, c.ci95_over_chance.0, c.ci95_over_chance.1);
            }
            files.iter().for_each(|f| println!("wrote {}", f.display()));
        }
        Cmd::Forward { run, tokens, out, step, device } => {
            let shape = eval::infer::forward_file(&run, &tokens, &out, step, device.as_deref()).with_context(|| format!("forward {} on {}", run.display(), tokens.display()))?;
            println!("wrote logits {shape:?} to {}", out.display());
        }
        Cmd::Generate { run, prompt, prompt_file, chat, max_new_tokens, temperature, greedy, seed, step, device } => {
            let text = match (prompt, prompt_file) {
                (Some(p), _) => p,
                (None, Some(f)) => std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?,
                (None, None) => bail!("give --prompt TEXT or --prompt-file FILE"),
            };
            let sampling = eval::generate::Sampling { temperature: if greedy { 0.0 } else { temperature }, seed };
            let c = eval::infer::continue_prompt(&run, &text, chat, max_new_tokens, sampling, step, device.as_deref()).with_context(|| format!("generate with {}", run.display()))?;
            println!("{}{}", c.prompt, c.text);
            let g = c.stats;
            eprintln!("{} prompt + {} new tokens; prefill {:.3}s, decode {:.1} tokens/s, cache {} bytes", g.prompt_tokens, g.tokens.len(), g.prefill_s, g.decode_tokens_per_s, g.cache_bytes);
        }
        Cmd::BenchDecode { spec, lengths, new_tokens, repeats, vocab, attention, plot, from, json, profile } => {
            let each = |r: &_| if json { println!("{}", bench::json_line(r)) } else { eprintln!("{}", bench::decode_line(r)) };
            let rows = bench::decode_rows(from.as_deref(), &spec.source(), &attention, &lengths, new_tokens, repeats as usize, vocab, profile.as_deref(), each)?;
            if !json {
                print!("{}", eval::decode_bench::table(&rows));
            }
            if let Some(stem) = plot {
                #[cfg(feature = "analysis")]
                for f in eval::decode_bench::plot(&rows, &stem)? {
                    eprintln!("wrote {}", f.display());
                }
                #[cfg(not(feature = "analysis"))]
                bail!("--plot {}: this binary was built without the `analysis` feature; plot the --json rows elsewhere with --from", stem.display());
            }
        }
        Cmd::Export { run, out, step } => {
            let step = attnlab::export::export(&run, &out, step).with_context(|| format!("export {}", run.display()))?;
            println!("wrote {} (step {}) to {}", run.display(), step, out.display());
        }
        Cmd::Data(DataCmd::Prepare { source, tokenizer, out, field, format, synthetic }) => {
            let p = attnlab::data::shards::prepare_source(source.as_deref(), synthetic, &tokenizer, &field, &format, &out).context("data prepare")?;
            let rate = p.index.n_tokens as f64 / p.seconds.max(1e-9);
            println!("{} documents, {} tokens in {:.1}s ({rate:.0} tokens/s) → {}", p.index.n_docs, p.index.n_tokens, p.seconds, p.dir.display());
        }
        Cmd::Bench { spec, steps, warmup, vocab, attention_only, check, profile, json } => {
            let mode = match (profile, check, attention_only) {
                (Some(dir), _, _) => bench::BenchMode::Profile { dir, attention_only, vocab, warmup, steps },
                (None, true, _) => bench::BenchMode::Check,
                (None, false, true) => bench::BenchMode::AttentionOnly { reps: steps },
                (None, false, false) => bench::BenchMode::Steps { vocab, warmup, steps },
            };
            bench::bench_command(&spec.source().load()?, mode, json, |line| println!("{line}"))?;
        }
        Cmd::Config { spec } => print!("{}", attnlab::runs::config_yaml(&spec.source())?),
        Cmd::Runs { results } => print!("{}", attnlab::runs::listing(&results)?),
        Cmd::Tensorboard { dirs } => attnlab::tensorboard::regenerate_below(&dirs, |path, s| println!("{}: {} tags, {} points", path.display(), s.tags.len(), s.points()))?,
        Cmd::Sweep { file, dry_run, gpus, max_parallel, emit, sets, out, gpus_per_run, nodes } => {
            let shape = attnlab::sweep::RunShape { nodes, gpus_per_node: gpus_per_run };
            let opts = attnlab::sweep::SweepOptions { dry_run, gpus, max_parallel, emit, sets, out, exe: None, shape };
            attnlab::sweep::sweep_command(&file, &opts)?;
        }
        #[cfg(feature = "analysis")]
        Cmd::Report { results, out, format, unit } => {
            let out = out.unwrap_or_else(|| results.join("report"));
            println!("{}", attnlab::report::run_report(&results, &out, &format, &unit)?);
        }
    }
    Ok(())
}
