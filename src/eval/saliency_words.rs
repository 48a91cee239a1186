//! `attnlab saliency-words MODEL --text FILE`: which words STILL's routing score selects on prose
//! (issue 37, item 4; the paper says self-saliency prefers negations, modals and quantifiers).
//!
//! The model (a Llama teacher such as `gguf:smollm2`, or a STILL student's export) runs over held-out
//! documents cut into sequences of `seq_len` tokens. In every layer, each head's q and k (k expanded
//! to the query heads) are scored by the routing STILL would use (`attention::still::routing_scores`:
//! the same routine, metric, C and κ as the operator; a student's own options, a teacher's from
//! `StillConfig`'s defaults with `--set attention.KEY=V`), and the top κ of every chunk of C tokens
//! are selected (ties to the lower position, as the operator). The first chunk of every sequence is
//! left out: its tokens' windows are cut by the sequence start (token 0 scores the maximum), which
//! the rest of a long context never sees. Every chunk that is scored is complete.
//!
//! Each scored token falls in exactly one class (a partition, so counts add up):
//! - `chunk_first` / `chunk_last`: index 0 / C−1 inside its chunk, whatever its word;
//! - otherwise its word class, decided on the decoded token text with the leading space marker (and
//!   any other surrounding whitespace) stripped, lower-cased: [`NEGATIONS`], [`MODALS`],
//!   [`QUANTIFIERS`] (exact word lists below), `digit` (ASCII digits only), `punctuation` (only
//!   punctuation characters, [`is_punctuation`]), else `other`.
//!
//! The selection rate of a class is selected / (tokens × layers × heads); chance is κ/C. Intervals:
//! per (layer, head) a Wilson 95% interval over the class's tokens; overall a normal 95% interval
//! over tokens of each token's share of (layer, head) pairs that selected it (heads of one token
//! are not independent, tokens nearly are).
use crate::attention::cache::repeat_kv;
use crate::attention::still::{routing_scores, top_kappa, StillConfig};
use crate::attention::Variant;
use crate::data::Tok;
use crate::model::llama::{Llama, Pass};
use crate::{Error, Result};
use serde::Serialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

/// Negations (the paper's "not, no, never"). `'t` is how a GPT-2 style pre-tokenizer splits the
/// n't of don't / can't / isn't (SmolLM2's does); `n't` stays for tokenizers that keep it whole.
pub const NEGATIONS: &[&str] = &["not", "no", "never", "n't", "'t", "’t", "nor", "neither", "nothing", "nobody", "nowhere", "cannot"];
/// Modal verbs (the paper's "will, would"); `'ll` is will's contracted form.
pub const MODALS: &[&str] = &["can", "could", "may", "might", "must", "shall", "should", "will", "would", "ought", "'ll", "’ll"];
/// Quantifiers (the paper's "all, any"): determiners and the quantified pronouns.
pub const QUANTIFIERS: &[&str] = &[
    "all", "some", "every", "each", "any", "many", "few", "fewer", "most", "more", "much", "none", "several", "both", "either", "everyone", "everything", "everybody", "anyone", "anything", "anybody",
    "someone", "something", "somebody",
];
/// Punctuation beyond ASCII's.
const UNICODE_PUNCTUATION: &str = "–—‘’“”…«»¡¿·•′″„‹›§¶";

/// The classes of a scored token, in table order (a partition: see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    Negation,
    Modal,
    Quantifier,
    Digit,
    Punctuation,
    ChunkFirst,
    ChunkLast,
    Other,
}

impl Class {
    pub const ALL: [Class; 8] = [Class::Negation, Class::Modal, Class::Quantifier, Class::Digit, Class::Punctuation, Class::ChunkFirst, Class::ChunkLast, Class::Other];

    pub fn name(self) -> &'static str {
        match self {
            Class::Negation => "negation",
            Class::Modal => "modal",
            Class::Quantifier => "quantifier",
            Class::Digit => "digit",
            Class::Punctuation => "punctuation",
            Class::ChunkFirst => "chunk_first",
            Class::ChunkLast => "chunk_last",
            Class::Other => "other",
        }
    }

    fn index(self) -> usize {
        Class::ALL.iter().position(|&c| c == self).expect("a class")
    }
}

/// A punctuation character: ASCII punctuation or one of [`UNICODE_PUNCTUATION`] (not U+FFFD, the
/// replacement a lone byte of a multi-byte character decodes to).
pub fn is_punctuation(c: char) -> bool {
    c.is_ascii_punctuation() || UNICODE_PUNCTUATION.contains(c)
}

/// The word class of a decoded token's text (never a positional class): the leading space marker
/// (a decoded space, or a raw `Ġ` / `▁`) and surrounding whitespace stripped, lower-cased.
pub fn word_class(text: &str) -> Class {
    let t = text.trim().trim_start_matches(['Ġ', '▁']).trim();
    if t.is_empty() {
        return Class::Other;
    }
    let lower = t.to_lowercase();
    let w = lower.as_str();
    if NEGATIONS.contains(&w) {
        Class::Negation
    } else if MODALS.contains(&w) {
        Class::Modal
    } else if QUANTIFIERS.contains(&w) {
        Class::Quantifier
    } else if t.chars().all(|c| c.is_ascii_digit()) {
        Class::Digit
    } else if t.chars().all(is_punctuation) {
        Class::Punctuation
    } else {
        Class::Other
    }
}

/// The class of a token with word class `word` at index `i` of a chunk of `c` tokens.
pub fn class_at(word: Class, i: i64, c: i64) -> Class {
    if i == 0 {
        Class::ChunkFirst
    } else if i == c - 1 {
        Class::ChunkLast
    } else {
        word
    }
}

/// The top-κ selection `[H, R, C]` (bool) of scores `[H, R, C]` (R chunks of C tokens per head).
pub fn select(scores: &Tensor, kappa: i64) -> Tensor {
    let idx = top_kappa(scores, kappa);
    scores.zeros_like().to_kind(Kind::Bool).scatter_value(-1, &idx, 1)
}

/// Selection counts by class, per (layer, head) and per token.
#[derive(Debug, Clone)]
pub struct Tally {
    pub layers: usize,
    pub heads: usize,
    pub chunk: i64,
    pub kappa: i64,
    /// Tokens per class.
    pub count: [u64; 8],
    /// `[class][layer][head]` selections.
    pub selected: Vec<Vec<Vec<u64>>>,
    /// Per class: Σ f and Σ f² of each token's share f of the (layer, head) pairs that selected it.
    share_sum: [f64; 8],
    share_sq: [f64; 8],
    /// Per token id: (occurrences, selections over layers × heads).
    pub by_token: HashMap<u32, (u64, u64)>,
    /// Complete chunks scored.
    pub chunks: u64,
}

impl Tally {
    pub fn new(layers: usize, heads: usize, chunk: i64, kappa: i64) -> Tally {
        Tally { layers, heads, chunk, kappa, count: [0; 8], selected: vec![vec![vec![0; heads]; layers]; 8], share_sum: [0.0; 8], share_sq: [0.0; 8], by_token: HashMap::new(), chunks: 0 }
    }

    /// Add R chunks: `ids` `[R·C]`, their classes, and per layer the selection `[H, R, C]`.
    pub fn add(&mut self, ids: &[u32], classes: &[Class], selections: &[Tensor]) {
        assert_eq!(selections.len(), self.layers, "one selection per layer");
        let n = ids.len();
        let mut hits = vec![0u64; n];
        for (l, sel) in selections.iter().enumerate() {
            let flat: Vec<bool> = Vec::try_from(sel.to_kind(Kind::Bool).flatten(0, -1)).expect("bool selection");
            assert_eq!(flat.len(), self.heads * n, "selection [H, R, C] of these tokens");
            for h in 0..self.heads {
                for (j, &s) in flat[h * n..(h + 1) * n].iter().enumerate() {
                    if s {
                        self.selected[classes[j].index()][l][h] += 1;
                        hits[j] += 1;
                    }
                }
            }
        }
        let pairs = (self.layers * self.heads) as f64;
        for j in 0..n {
            let c = classes[j].index();
            self.count[c] += 1;
            let f = hits[j] as f64 / pairs;
            self.share_sum[c] += f;
            self.share_sq[c] += f * f;
            let e = self.by_token.entry(ids[j]).or_insert((0, 0));
            e.0 += 1;
            e.1 += hits[j];
        }
        self.chunks += (n as i64 / self.chunk) as u64;
    }

    pub fn chance(&self) -> f64 {
        self.kappa as f64 / self.chunk as f64
    }

    /// Scored tokens.
    pub fn tokens(&self) -> u64 {
        self.count.iter().sum()
    }

    /// The row of class `c`.
    pub fn row(&self, c: Class) -> ClassRow {
        let i = c.index();
        let (n, pairs) = (self.count[i], (self.layers * self.heads) as u64);
        let selected: u64 = self.selected[i].iter().flatten().sum();
        let rate = if n == 0 { f64::NAN } else { selected as f64 / (n * pairs) as f64 };
        // Normal interval over tokens of the per-token share (its mean is the rate).
        let ci = if n < 2 {
            (f64::NAN, f64::NAN)
        } else {
            let nf = n as f64;
            let var = ((self.share_sq[i] - self.share_sum[i] * self.share_sum[i] / nf) / (nf - 1.0)).max(0.0);
            let half = 1.96 * (var / nf).sqrt();
            ((rate - half).max(0.0), (rate + half).min(1.0))
        };
        let per_head: Vec<Vec<f64>> = self.selected[i].iter().map(|row| row.iter().map(|&s| if n == 0 { f64::NAN } else { s as f64 / n as f64 }).collect()).collect();
        let per_head_ci: Vec<Vec<(f64, f64)>> = self.selected[i].iter().map(|row| row.iter().map(|&s| wilson(s, n)).collect()).collect();
        let chance = self.chance();
        ClassRow {
            class: c,
            count: n,
            selected,
            slots: n * pairs,
            rate,
            rate_over_chance: rate / chance,
            ci95: ci,
            ci95_over_chance: (ci.0 / chance, ci.1 / chance),
            per_head_rate: per_head,
            per_head_selected: self.selected[i].clone(),
            per_head_ci95: per_head_ci,
        }
    }
}

/// The Wilson 95% interval of s successes in n trials ((NaN, NaN) for n = 0).
pub fn wilson(s: u64, n: u64) -> (f64, f64) {
    if n == 0 {
        return (f64::NAN, f64::NAN);
    }
    let (z, nf) = (1.96f64, n as f64);
    let p = s as f64 / nf;
    let den = 1.0 + z * z / nf;
    let centre = (p + z * z / (2.0 * nf)) / den;
    let half = z * (p * (1.0 - p) / nf + z * z / (4.0 * nf * nf)).sqrt() / den;
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// One class of the results.
#[derive(Debug, Clone, Serialize)]
pub struct ClassRow {
    pub class: Class,
    /// Tokens of this class.
    pub count: u64,
    /// Selections summed over layers and heads.
    pub selected: u64,
    /// count × layers × heads.
    pub slots: u64,
    pub rate: f64,
    pub rate_over_chance: f64,
    pub ci95: (f64, f64),
    pub ci95_over_chance: (f64, f64),
    /// `[layer][head]`.
    pub per_head_rate: Vec<Vec<f64>>,
    pub per_head_selected: Vec<Vec<u64>>,
    pub per_head_ci95: Vec<Vec<(f64, f64)>>,
}

/// A frequent token and its rate.
#[derive(Debug, Clone, Serialize)]
pub struct TokenRow {
    pub id: u32,
    pub text: String,
    pub class: Class,
    pub count: u64,
    pub rate: f64,
    pub rate_over_chance: f64,
}

/// The results file (saliency_words.json).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub model: String,
    pub text: String,
    pub routing: String,
    pub chunk: i64,
    pub kappa: i64,
    pub chance: f64,
    pub seq_len: usize,
    pub sequences: usize,
    pub chunks: u64,
    pub tokens: u64,
    pub layers: usize,
    pub heads: usize,
    pub note: String,
    pub class_words: HashMap<String, Vec<String>>,
    pub classes: Vec<ClassRow>,
    /// Tokens seen at least `min_count` times, by rate, highest first (all of them).
    pub tokens_by_rate: Vec<TokenRow>,
    pub min_count: u64,
    pub seconds: f64,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Tokens to score (chunk 0 of each sequence not counted); the run stops after the sequence that reaches it.
    pub max_tokens: usize,
    pub seq_len: usize,
    /// Tokens listed in `tokens_by_rate` occur at least this often.
    pub min_count: u64,
    pub quiet: bool,
}

/// The STILL options a model is scored with: a STILL student's own; a softmax model's
/// `StillConfig` defaults with `sets` (`attention.KEY=VALUE`) applied.
pub fn still_config(m: &Llama, sets: &[String]) -> Result<StillConfig> {
    match m.variant() {
        Some(Variant::Still(c)) => Ok(c.clone()),
        Some(v) => Err(Error::Other(format!("saliency-words scores STILL's routing; this model's operator is {} (no per-token routing scores)", v.name()))),
        None => match crate::student_export::variant_with_overrides("kind: still\n", sets, Path::new("--set"))? {
            Variant::Still(c) => Ok(c),
            _ => unreachable!("kind: still"),
        },
    }
}

/// Score `docs` with `m` (see the module doc) and tally the selections by class.
pub fn analyze(m: &Llama, tok: &Tok, cfg: &StillConfig, docs: &[String], o: &Options) -> Result<(Tally, usize)> {
    let c = cfg.chunk;
    let kappa = cfg.selection()?.kappa.min(c);
    if kappa <= 0 {
        return Err(Error::Other(format!("κ = {kappa}: nothing is selected (set attention.tokens_per_chunk)")));
    }
    let seq = (o.seq_len as i64 / c) * c;
    if seq < 2 * c {
        return Err(Error::Other(format!("--seq-len {}: at least 2C = {} tokens (chunk 0 is not scored)", o.seq_len, 2 * c)));
    }
    // Sequences: each document cut into seq_len pieces, each truncated to whole chunks, ≥ 2 chunks.
    let mut seqs: Vec<Vec<u32>> = Vec::new();
    let mut planned = 0usize;
    'docs: for d in docs {
        let ids = tok.encode(d)?;
        for piece in ids.chunks(seq as usize) {
            let whole = (piece.len() as i64 / c) * c;
            if whole < 2 * c {
                continue;
            }
            seqs.push(piece[..whole as usize].to_vec());
            planned += (whole - c) as usize;
            if planned >= o.max_tokens {
                break 'docs;
            }
        }
    }
    if seqs.is_empty() {
        return Err(Error::Data(format!("no document has {} tokens (2 chunks of C = {c}): nothing to score", 2 * c)));
    }
    let (layers, heads) = (m.cfg.num_hidden_layers, m.cfg.num_attention_heads);
    let mut tally = Tally::new(layers, heads, c, kappa);
    let mut words: HashMap<u32, Class> = HashMap::new();
    let dev = m.head_weight().device();
    let bar = crate::progress::bar(seqs.len() as u64, "saliency-words", o.quiet);
    for ids in &seqs {
        let t = ids.len() as i64;
        let r = t / c - 1;
        let scored = &ids[c as usize..];
        let mut classes = Vec::with_capacity(scored.len());
        for (j, &id) in scored.iter().enumerate() {
            let w = match words.get(&id) {
                Some(&w) => w,
                None => {
                    let w = word_class(&tok.decode(&[id])?);
                    words.insert(id, w);
                    w
                }
            };
            classes.push(class_at(w, j as i64 % c, c));
        }
        let selections = tch::no_grad(|| -> Result<Vec<Tensor>> {
            let x_ids = Tensor::from_slice(&ids.iter().map(|&i| i as i64).collect::<Vec<_>>()).view([1, t]).to_device(dev);
            let (cos, sin) = m.rope_tables(t, dev);
            let mut x = m.embed(&x_ids);
            let mut out = Vec::with_capacity(layers);
            for (i, b) in m.layers.iter().enumerate() {
                let a = m.kv_input(i, &x);
                let (q, k, v) = m.layer_qkv(i, &a, &cos, &sin, Pass::Eval);
                let s = routing_scores(cfg, i as i64, &q, &repeat_kv(&k, &q))?; // [1, H, T]
                out.push(select(&s.select(0, 0).narrow(1, c, r * c).reshape([heads as i64, r, c]), kappa).to_device(tch::Device::Cpu));
                let o = m.layer_attention(i, &b.attn, &a, (q, k, v), &cos, &sin, false);
                x = m.layer_finish(i, &x, &o, Pass::Eval);
            }
            Ok(out)
        })?;
        tally.add(scored, &classes, &selections);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok((tally, seqs.len()))
}

/// The report of a tally.
pub fn report(tally: &Tally, tok: &Tok, head: ReportHead) -> Result<Report> {
    let mut class_words = HashMap::new();
    for (name, list) in [("negation", NEGATIONS), ("modal", MODALS), ("quantifier", QUANTIFIERS)] {
        class_words.insert(name.to_string(), list.iter().map(|s| s.to_string()).collect());
    }
    let pairs = (tally.layers * tally.heads) as f64;
    let mut tokens_by_rate = Vec::new();
    for (&id, &(n, s)) in &tally.by_token {
        if n >= head.min_count {
            let text = tok.decode(&[id])?;
            let rate = s as f64 / (n as f64 * pairs);
            tokens_by_rate.push(TokenRow { id, class: word_class(&text), text, count: n, rate, rate_over_chance: rate / tally.chance() });
        }
    }
    tokens_by_rate.sort_by(|a, b| b.rate.total_cmp(&a.rate).then(a.id.cmp(&b.id)));
    Ok(Report {
        model: head.model,
        text: head.text,
        routing: head.routing,
        chunk: tally.chunk,
        kappa: tally.kappa,
        chance: tally.chance(),
        seq_len: head.seq_len,
        sequences: head.sequences,
        chunks: tally.chunks,
        tokens: tally.tokens(),
        layers: tally.layers,
        heads: tally.heads,
        note: "Each scored token is in one class: chunk_first / chunk_last by its index in the chunk, else its word class. Chunk 0 of each sequence is not scored. rate = selected / (count × layers × heads); chance = κ/C. ci95: normal interval over tokens of each token's share of selecting (layer, head) pairs; per_head_ci95: Wilson over the class's tokens.".into(),
        class_words,
        classes: Class::ALL.iter().map(|&c| tally.row(c)).collect(),
        tokens_by_rate,
        min_count: head.min_count,
        seconds: head.seconds,
    })
}

/// What a report says besides the tally.
pub struct ReportHead {
    pub model: String,
    pub text: String,
    pub routing: String,
    pub seq_len: usize,
    pub sequences: usize,
    pub min_count: u64,
    pub seconds: f64,
}

fn f3(x: f64) -> String {
    if x.is_nan() {
        "–".into()
    } else {
        format!("{x:.3}")
    }
}

/// The markdown tables: classes overall, rate / chance by layer (mean over heads), the tokens
/// selected most and least often.
pub fn markdown(r: &Report) -> String {
    let mut s = format!(
        "# Which tokens STILL's routing selects\n\nModel `{}`, text `{}`; routing `{}`, C {}, κ {} (chance κ/C = {:.4}); {} sequences of ≤ {} tokens, {} chunks, {} scored tokens, {} layers × {} heads.\n\n{}\n\n",
        r.model, r.text, r.routing, r.chunk, r.kappa, r.chance, r.sequences, r.seq_len, r.chunks, r.tokens, r.layers, r.heads, r.note
    );
    s += "| class | tokens | selected (layer × head) | rate | rate / chance | 95% interval (rate / chance) |\n|---|---:|---:|---:|---:|---|\n";
    for c in &r.classes {
        s += &format!("| {} | {} | {} | {} | {} | [{}, {}] |\n", c.class.name(), c.count, c.selected, f3(c.rate), f3(c.rate_over_chance), f3(c.ci95_over_chance.0), f3(c.ci95_over_chance.1));
    }
    s += "\n## Rate / chance by layer (mean over heads)\n\n| layer |";
    for c in &r.classes {
        s += &format!(" {} |", c.class.name());
    }
    s += "\n|---:|";
    s += &"---:|".repeat(r.classes.len());
    s += "\n";
    for l in 0..r.layers {
        s += &format!("| {l} |");
        for c in &r.classes {
            let v = c.per_head_rate[l].iter().sum::<f64>() / r.heads as f64 / r.chance;
            s += &format!(" {} |", f3(v));
        }
        s += "\n";
    }
    let row = |t: &TokenRow| format!("| {:?} | {} | {} | {} | {} |\n", t.text, t.class.name(), t.count, f3(t.rate), f3(t.rate_over_chance));
    s += &format!("\n## Tokens seen ≥ {} times, selected most often\n\n| token | word class | count | rate | rate / chance |\n|---|---|---:|---:|---:|\n", r.min_count);
    r.tokens_by_rate.iter().take(30).for_each(|t| s += &row(t));
    s += &format!("\n## … and least often\n\n| token | word class | count | rate | rate / chance |\n|---|---|---:|---:|---:|\n");
    let n = r.tokens_by_rate.len();
    r.tokens_by_rate.iter().skip(n.saturating_sub(15)).for_each(|t| s += &row(t));
    s
}

/// Write `saliency_words.json`, `saliency_words.md` and (with plots) `saliency_words_heatmap.png`
/// into `out`; returns the paths.
pub fn write(r: &Report, out: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let json = out.join("saliency_words.json");
    let text = serde_json::to_string_pretty(r).map_err(|e| Error::Other(format!("{}: {e}", json.display())))?;
    std::fs::write(&json, text).map_err(|e| Error::io(&json, e))?;
    let md = out.join("saliency_words.md");
    std::fs::write(&md, markdown(r)).map_err(|e| Error::io(&md, e))?;
    #[allow(unused_mut)]
    let mut files = vec![json, md];
    #[cfg(feature = "analysis")]
    {
        let shown = [Class::Negation, Class::Modal, Class::Quantifier, Class::Punctuation, Class::ChunkFirst, Class::ChunkLast];
        let panels: Vec<crate::plots::HeatPanel> = shown
            .iter()
            .map(|&c| {
                let row = &r.classes[c.index()];
                crate::plots::HeatPanel { title: format!("{} ({} tokens)", c.name(), row.count), values: row.per_head_rate.iter().map(|l| l.iter().map(|v| v / r.chance).collect()).collect() }
            })
            .collect();
        let title = format!("{}: selection rate / chance (κ/C = {}/{}), {} routing, {} tokens", r.model, r.kappa, r.chunk, r.routing, r.tokens);
        files.push(crate::plots::heatmaps(&title, "head", "layer", &panels, &out.join("saliency_words_heatmap"))?);
    }
    Ok(files)
}

/// `attnlab saliency-words`: load `model` (a llama GGUF / `gguf:NAME`, an HF folder's run, or a
/// STILL student's export / linearize run), read the documents of `text` (`field` of JSON lines),
/// score them and write the results into `out`.
pub fn command(model: &Path, text: &Path, field: &str, sets: &[String], device: Option<&str>, out: &Path, o: &Options) -> Result<(Report, Vec<PathBuf>)> {
    use crate::student_export::{EXPORT_DIR, EXPORT_VARIANT};
    let linearized = model.join(EXPORT_VARIANT).is_file() || model.join(EXPORT_DIR).join(EXPORT_VARIANT).is_file();
    let src = crate::spec::SourceSpec::Local(crate::spec::LocalSource { path: text.to_path_buf(), field: field.to_string(), format: crate::spec::TextFormat::Text });
    if !text.exists() {
        return Err(Error::Data(format!("--text {}: no such file or folder", text.display())));
    }
    let docs: Vec<String> = crate::data::sources::read_documents(&src)?.into_iter().map(|d| d.text).collect();
    let loaded = super::generate::load_with(model, None, device, if linearized { sets } else { &[] })?;
    let crate::model::Model::Llama(m) = &loaded.model else {
        return Err(Error::Other(format!("{}: saliency-words reads Llama-family models (STILL's teachers and students)", model.display())));
    };
    let cfg = still_config(m, if linearized { &[] } else { sets })?;
    let t0 = std::time::Instant::now();
    let (tally, sequences) = analyze(m, &loaded.tok, &cfg, &docs, o)?;
    let head = ReportHead {
        model: model.display().to_string(),
        text: text.display().to_string(),
        routing: serde_yaml::to_string(&cfg.routing).unwrap_or_default().trim().to_string(),
        seq_len: o.seq_len,
        sequences,
        min_count: o.min_count,
        seconds: t0.elapsed().as_secs_f64(),
    };
    let r = report(&tally, &loaded.tok, head)?;
    let files = write(&r, out)?;
    Ok((r, files))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-written tokens, as decoded (leading space) and raw (`Ġ`).
    #[test]
    fn tagger_classes() {
        let cases = [
            (" not", Class::Negation),
            ("Never", Class::Negation),
            ("'t", Class::Negation),
            (" n't", Class::Negation),
            ("Ġno", Class::Negation),
            (" would", Class::Modal),
            (" Can", Class::Modal),
            ("'ll", Class::Modal),
            (" all", Class::Quantifier),
            (" none", Class::Quantifier),
            ("every", Class::Quantifier),
            (" 1984", Class::Digit),
            ("7", Class::Digit),
            (".", Class::Punctuation),
            (" —", Class::Punctuation),
            (",\"", Class::Punctuation),
            ("\n", Class::Other),
            (" ", Class::Other),
            (" note", Class::Other),
            (" nothingness", Class::Other),
            (" 3rd", Class::Other),
            ("\u{FFFD}", Class::Other),
            (" cans", Class::Other),
            ("1.5", Class::Other),
        ];
        for (t, want) in cases {
            assert_eq!(word_class(t), want, "{t:?}");
        }
        assert_eq!(class_at(Class::Negation, 0, 8), Class::ChunkFirst);
        assert_eq!(class_at(Class::Digit, 7, 8), Class::ChunkLast);
        assert_eq!(class_at(Class::Negation, 3, 8), Class::Negation);
    }

    /// Top-κ and the rates on a hand-made score tensor: 2 layers, 2 heads, 2 chunks of C = 4, κ = 1.
    #[test]
    fn selection_rates_by_hand() {
        // Tokens j = 0..8: classes by index (first, ·, ·, last); the middle ones are negation at j = 1,
        // 5 and modal at j = 2, 6.
        let ids: Vec<u32> = vec![10, 11, 12, 13, 10, 11, 12, 13];
        let words = [Class::Other, Class::Negation, Class::Modal, Class::Other];
        let classes: Vec<Class> = (0..8).map(|j| class_at(words[j % 4], j as i64 % 4, 4)).collect();
        assert_eq!(classes[1], Class::Negation);
        let sc = |v: [f64; 16]| select(&Tensor::from_slice(&v).view([2, 2, 4]), 1);
        // Layer 0: head 0 picks j 1 and 5 (negations), head 1 picks j 2 (modal) and j 4 (first; a tie
        // with j 6 goes to the lower index).
        let l0 = sc([0., 9., 1., 2., 0., 5., 1., 1., 0., 1., 7., 0., 3., 0., 3., 1.]);
        // Layer 1: head 0 picks j 3 (last) and j 5 (negation), head 1 picks j 1 (negation) and j 7 (last).
        let l1 = sc([0., 1., 1., 4., 0., 2., 1., 1., 0., 5., 1., 0., 0., 0., 0., 6.]);
        let want0: Vec<bool> = [false, true, false, false, false, true, false, false, false, false, true, false, true, false, false, false].to_vec();
        assert_eq!(Vec::<bool>::try_from(l0.flatten(0, -1)).unwrap(), want0);
        let mut t = Tally::new(2, 2, 4, 1);
        t.add(&ids, &classes, &[l0, l1]);
        assert_eq!(t.chunks, 2);
        assert_eq!(t.tokens(), 8);
        // Negation: 2 tokens × 4 (layer, head) pairs = 8 slots; selected: l0h0 ×2, l1h0 ×1, l1h1 ×1 = 4.
        let neg = t.row(Class::Negation);
        assert_eq!((neg.count, neg.selected, neg.slots), (2, 4, 8));
        assert!((neg.rate - 0.5).abs() < 1e-12 && (neg.rate_over_chance - 2.0).abs() < 1e-12);
        assert_eq!(neg.per_head_selected, vec![vec![2, 0], vec![1, 1]]);
        assert_eq!(neg.per_head_rate, vec![vec![1.0, 0.0], vec![0.5, 0.5]]);
        // Per-token shares: j 1 selected by l0h0 and l1h1 (2/4), j 5 by l0h0 and l1h0 (2/4): no spread.
        assert!((neg.ci95.0 - 0.5).abs() < 1e-12 && (neg.ci95.1 - 0.5).abs() < 1e-12);
        let modal = t.row(Class::Modal);
        assert_eq!((modal.count, modal.selected), (2, 1));
        assert!((modal.rate - 0.125).abs() < 1e-12);
        let first = t.row(Class::ChunkFirst);
        assert_eq!((first.count, first.selected), (2, 1));
        let last = t.row(Class::ChunkLast);
        assert_eq!((last.count, last.selected), (2, 2));
        assert!((last.rate_over_chance - 1.0).abs() < 1e-12);
        assert_eq!(t.row(Class::Other).count, 0);
        // Every (layer, head) selects κ per chunk: 2 per pair, 8 in all.
        let all: u64 = Class::ALL.iter().map(|&c| t.row(c).selected).sum();
        assert_eq!(all, 8);
        // Per token id: 11 (negation) twice, selected 4 times.
        assert_eq!(t.by_token[&11], (2, 4));
        // Wilson: 2 of 2.
        let (lo, hi) = wilson(2, 2);
        assert!((hi - 1.0).abs() < 1e-12 && (lo - 0.3424).abs() < 1e-3, "{lo}");
    }

    /// End to end on a tiny random Llama and the built-in tokenizer: the files are written and the
    /// JSON's counts add up (classes partition the scored tokens; every (layer, head) selects κ per chunk).
    #[test]
    fn tiny_model_counts_add_up() {
        let _rng = crate::testutil::seeded(7);
        let tok = Tok::load(&crate::spec::TokenizerSpec::Path("builtin".into())).unwrap();
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let m = Llama::build(&vs.root(), crate::testutil::tiny_llama(tok.padded_vocab(), crate::model::Family::Llama)).unwrap();
        let cfg = still_config(&m, &["attention.chunk=8".into(), "attention.tokens_per_chunk=2".into()]).unwrap();
        assert_eq!((cfg.chunk, cfg.selection().unwrap().kappa), (8, 2));
        // Words of the built-in (word-level) vocabulary, with digits and punctuation among them.
        let text = "the old answer is 7 . what does the quiet code live near ? 1 2 3 : the dark question and then a count . ".repeat(8);
        let docs = vec![text.clone(), "too short".into(), text];
        let o = Options { max_tokens: 100_000, seq_len: 64, min_count: 2, quiet: true };
        let (tally, seqs) = analyze(&m, &tok, &cfg, &docs, &o).unwrap();
        let head = ReportHead { model: "tiny".into(), text: "inline".into(), routing: "self_saliency".into(), seq_len: 64, sequences: seqs, min_count: 2, seconds: 0.0 };
        let r = report(&tally, &tok, head).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let files = write(&r, dir.path()).unwrap();
        assert!(files.iter().all(|f| f.is_file()), "{files:?}");
        let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("saliency_words.json")).unwrap()).unwrap();
        let (chunks, tokens) = (j["chunks"].as_u64().unwrap(), j["tokens"].as_u64().unwrap());
        assert!(chunks > 0 && tokens == chunks * 8, "{chunks} chunks, {tokens} tokens");
        let classes = j["classes"].as_array().unwrap();
        assert_eq!(classes.len(), 8);
        let count: u64 = classes.iter().map(|c| c["count"].as_u64().unwrap()).sum();
        assert_eq!(count, tokens, "classes partition the tokens");
        assert_eq!(classes[5]["count"].as_u64().unwrap(), chunks, "one first token per chunk");
        assert_eq!(classes[6]["count"].as_u64().unwrap(), chunks, "one last token per chunk");
        assert!(classes[3]["count"].as_u64().unwrap() > 0 && classes[4]["count"].as_u64().unwrap() > 0, "digits and punctuation tagged");
        for l in 0..2 {
            for h in 0..4 {
                let sel: u64 = classes.iter().map(|c| c["per_head_selected"][l][h].as_u64().unwrap()).sum();
                assert_eq!(sel, 2 * chunks, "layer {l} head {h}: κ per chunk");
            }
        }
        let total: u64 = classes.iter().map(|c| c["selected"].as_u64().unwrap()).sum();
        assert_eq!(total, 2 * chunks * 2 * 4);
        let md = std::fs::read_to_string(dir.path().join("saliency_words.md")).unwrap();
        assert!(md.contains("| negation |") && md.contains("rate / chance"), "{md}");
        // Bad input: a routing without scores, an unknown key.
        assert!(still_config(&m, &["attention.routing=oracle".into()]).and_then(|c| analyze(&m, &tok, &c, &docs, &o)).is_err());
        let e = still_config(&m, &["attention.colour=red".into()]).unwrap_err().to_string();
        assert!(e.contains("colour"), "{e}");
        // Nothing long enough.
        let e = analyze(&m, &tok, &cfg, &["short".to_string()], &o).unwrap_err().to_string();
        assert!(e.contains("nothing to score"), "{e}");
    }
}
