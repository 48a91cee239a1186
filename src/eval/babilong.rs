//! BABILong-style QA (evaluation.md §4.2, our variant of booydar/babilong): the facts of a bAbI
//! sample scattered in order through an essay background, the question after the context, greedy
//! decoding of 20 tokens and BABILong's label-set accuracy.
//!
//! Construction, for a target length L (tokens of the evaluated model's tokenizer):
//! - context budget L − 300 (300 reserved for the prompt, as BABILong); samples with more than
//!   budget/8 facts are skipped (BABILong drops those stories);
//! - background: essay sentences (whitespace-normalised, split as RULER's essays) from a seeded
//!   random start, wrapping at the end, keeping sentences of ≥ 10 tokens (each counted as
//!   `" " + sentence`); the last one is cut at a word boundary so that facts + background is the
//!   largest context within the budget (binary search over background words, `ruler::largest_fitting`);
//! - facts: each goes into one of the `sentences + 1` gaps, drawn uniformly with replacement and
//!   sorted (seeded fractions of the background, so the facts keep their order and may share a gap);
//! - prompt: BABILong's template with the task's instruction, two examples and post-prompt
//!   (`babilong/prompts.py`), no chat template, no "Answer:" suffix: the prompt ends with
//!   `Question: …` as BABILong feeds base models (evaluation.md §4.1 step 6).
use super::ruler::{self, largest_fitting, split_sentences, Cell, Greedy};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Tokens of L kept for the prompt around the context (BABILong).
pub const PROMPT_RESERVE: usize = 300;
/// Greedy tokens per answer (evaluation.md §4.1 step 7).
pub const TOKENS_TO_GENERATE: usize = 20;
/// Background sentences shorter than this many tokens are skipped.
const MIN_SENTENCE_TOKENS: usize = 10;
/// qa1 and qa2 answers (babilong/metrics.py TASK_LABELS).
pub const LABELS: [&str; 6] = ["bathroom", "bedroom", "garden", "hallway", "kitchen", "office"];
pub const TASKS: [&str; 2] = ["qa1", "qa2"];

const TEMPLATE: &str = "{instruction}\n{examples}\n{post_prompt}\n<context>\n{context}\n</context>\nQuestion: {question}";

/// The task's instruction, in-context examples and post-prompt, verbatim from BABILong's
/// `DEFAULT_PROMPTS` (booydar/babilong `babilong/prompts.py`; the ’ quotes and trailing spaces are theirs).
pub fn prompts(task: &str) -> Option<[&'static str; 3]> {
    Some(match task {
        "qa1" => [
            "I will give you context with the facts about positions of different persons hidden in some random text and a question. You need to answer the question based only on the information from the facts. If a person was in different locations, use the latest location to answer the question.",
            "<example>\nCharlie went to the hallway. Judith come back to the kitchen. Charlie travelled to balcony. Where is Charlie?\nAnswer: The most recent location of Charlie is balcony.\n</example>\n\n<example>\nAlan moved to the garage. Charlie went to the beach. Alan went to the shop. Rouse travelled to balcony. Where is Alan?\nAnswer: The most recent location of Alan is shop.\n</example>",
            "Always return your answer in the following format: The most recent location of ’person’ is ’location’. Do not write anything else after that. ",
        ],
        "qa2" => [
            "I give you context with the facts about locations and actions of different persons hidden in some random text and a question.You need to answer the question based only on the information from the facts.\nIf a person got an item in the first location and travelled to the second location the item is also in the second location. If a person dropped an item in the first location and moved to the second location the item remains in the first location.",
            "<example>\nCharlie went to the kitchen. Charlie got a bottle. Charlie moved to the balcony. Where is the bottle?\nAnswer: The bottle is in the balcony.\n</example>\n<example>\nAlan moved to the garage. Alan got a screw driver. Alan moved to the kitchen. Where is the screw driver?\nAnswer: The screw driver is in the kitchen.\n</example>",
            "Always return your answer in the following format: The ’item’ is in ’location’. Do not write anything else after that.",
        ],
        _ => return None,
    })
}

/// One bAbI question (a line of shared/data/babi/*_test_first300.jsonl; other fields ignored).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct Record {
    /// The story's non-question lines before the question, in order.
    pub facts: Vec<String>,
    pub question: String,
    pub answer: String,
}

/// Records of a jsonl file's text; `origin` names it in errors (with the line).
pub fn parse_records(text: &str, origin: &str) -> crate::Result<Vec<Record>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| crate::Error::Data(format!("{origin} line {}: {e}", i + 1))))
        .collect()
}

/// `path` itself, or `path/{task}_test_first300.jsonl` when it is a folder.
pub fn read_records(path: &std::path::Path, task: &str) -> crate::Result<Vec<Record>> {
    let file = if path.is_dir() { path.join(format!("{task}_test_first300.jsonl")) } else { path.to_path_buf() };
    let text = std::fs::read_to_string(&file).map_err(|e| crate::Error::io(&file, e))?;
    parse_records(&text, &file.display().to_string())
}

/// One generated sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The whole prompt fed to the model.
    pub prompt: String,
    /// Facts and background, as placed between `<context>` tags.
    pub context: String,
    /// For each fact, the number of background sentences before it.
    pub gaps: Vec<usize>,
    /// Background sentences used (the last one possibly cut).
    pub background: usize,
}

/// The essay as sentences; samples draw their background from it.
pub struct Background {
    sentences: Vec<String>,
}

impl Background {
    pub fn new(essay: &str) -> Background {
        let text = essay.split_whitespace().collect::<Vec<_>>().join(" ");
        Background { sentences: split_sentences(&text) }
    }

    /// Background sentences from a random start (wrapping), each ≥ 10 tokens, until they hold at
    /// least `budget` tokens: enough for any context of that budget.
    fn take(&self, budget: usize, count: &dyn Fn(&str) -> usize, r: &mut ChaCha8Rng) -> Vec<&str> {
        let n = self.sentences.len();
        let mut out = Vec::new();
        if n == 0 {
            return out;
        }
        let start = r.random_range(0..n);
        let mut total = 0;
        for i in 0.. {
            // A full pass without a usable sentence: the essay cannot fill the budget.
            if total >= budget || (i >= n && out.is_empty()) {
                break;
            }
            let s = self.sentences[(start + i) % n].as_str();
            let c = count(&format!(" {s}"));
            if c >= MIN_SENTENCE_TOKENS {
                out.push(s);
                total += c;
            }
        }
        out
    }

    /// The sample of `rec` for target length `length`: the largest context within the budget.
    pub fn sample(&self, task: &str, rec: &Record, length: usize, count: &dyn Fn(&str) -> usize, r: &mut ChaCha8Rng) -> crate::Result<Sample> {
        let [instruction, examples, post_prompt] = prompts(task).ok_or_else(|| unknown(task))?;
        let budget = length.saturating_sub(PROMPT_RESERVE);
        let sentences = self.take(budget, count, r);
        let mut fractions: Vec<f64> = rec.facts.iter().map(|_| r.random::<f64>()).collect();
        fractions.sort_by(|a, b| a.total_cmp(b));
        let words: Vec<Vec<&str>> = sentences.iter().map(|s| s.split(' ').collect()).collect();
        let total_words: usize = words.iter().map(Vec::len).sum();
        // Context with the first `n` background words: facts at gap ⌊u·(sentences + 1)⌋.
        let build = |n: usize| -> (String, Vec<usize>, usize) {
            let mut bg: Vec<String> = Vec::new();
            let mut left = n;
            for w in &words {
                if left == 0 {
                    break;
                }
                let k = left.min(w.len());
                bg.push(w[..k].join(" "));
                left -= k;
            }
            let gaps: Vec<usize> = fractions.iter().map(|u| ((u * (bg.len() + 1) as f64) as usize).min(bg.len())).collect();
            let mut parts: Vec<&str> = Vec::new();
            let mut f = 0;
            for g in 0..=bg.len() {
                while f < gaps.len() && gaps[f] == g {
                    parts.push(&rec.facts[f]);
                    f += 1;
                }
                if g < bg.len() {
                    parts.push(&bg[g]);
                }
            }
            (parts.join(" "), gaps, bg.len())
        };
        let n = largest_fitting(0, total_words, |n| count(&build(n).0) <= budget).unwrap_or(0);
        let (context, gaps, background) = build(n);
        let prompt = TEMPLATE
            .replace("{instruction}", instruction)
            .replace("{examples}", examples)
            .replace("{post_prompt}", post_prompt)
            .replace("{question}", &rec.question)
            .replace("{context}", &context)
            .trim()
            .to_string();
        Ok(Sample { prompt, context, gaps, background })
    }
}

fn unknown(task: &str) -> crate::Error {
    crate::Error::Other(format!("unknown BABILong task `{task}` (known: {})", TASKS.join(", ")))
}

/// BABILong's `compare_answers` for the qa1/qa2 labels: lower-case the output, keep the text before
/// the first `.`, `<context>` or `<example>` (the reference's cut at `Question` comes after
/// lower-casing and so never applies), collect the labels in it minus those in the question;
/// correct iff that set is exactly {target}.
pub fn correct(output: &str, target: &str, question: &str) -> bool {
    let lower = output.to_lowercase();
    let mut out = lower.split('.').next().unwrap_or("");
    for stop in ["<context>", "<example>"] {
        out = out.split(stop).next().unwrap_or("");
    }
    let q = question.to_lowercase();
    let found: Vec<&str> = LABELS.iter().copied().filter(|l| out.contains(l) && !q.contains(l)).collect();
    found.len() == 1 && found[0] == target.to_lowercase()
}

/// Samples used at `length`: the first `samples` records with at most budget/8 facts (BABILong).
pub fn usable(records: &[Record], length: usize, samples: usize) -> Vec<&Record> {
    let max_facts = length.saturating_sub(PROMPT_RESERVE) / 8;
    records.iter().filter(|r| r.facts.len() <= max_facts).take(samples).collect()
}

/// Accuracy (%) per length over the first `b.grid.samples` usable records, greedy with `b.max_new` tokens.
pub fn evaluate(model: &crate::model::Model, tok: &crate::data::Tok, task: &str, records: &[Record], essay: &str, b: &ruler::Budget) -> crate::Result<Vec<Cell>> {
    prompts(task).ok_or_else(|| unknown(task))?;
    let bg = Background::new(essay);
    let greedy = Greedy::new(model, tok, b.device);
    let count = |s: &str| tok.encode(s).map(|v| v.len()).unwrap_or(usize::MAX);
    let overhead = ruler::chat_overhead(b.chat, tok)?;
    let mut cells = Vec::new();
    for &len in &b.grid.lengths {
        let recs = usable(records, len, b.grid.samples);
        if recs.is_empty() {
            return Err(crate::Error::Other(format!("{task} @ {len}: no sample has at most {} facts", len.saturating_sub(PROMPT_RESERVE) / 8)));
        }
        let bar = crate::progress::bar(recs.len() as u64, &format!("babilong:{task} @ {len}"), b.quiet);
        let started = std::time::Instant::now();
        let (mut right, mut prompt_tokens) = (0usize, 0usize);
        let batch = ruler::batch_for(model, b, len);
        for (g, group) in recs.chunks(batch).enumerate() {
            let samples: Vec<Sample> = group.iter().enumerate().map(|(j, rec)| bg.sample(task, rec, len.saturating_sub(overhead), &count, &mut ruler::rng(42, len, g * batch + j))).collect::<crate::Result<_>>()?;
            let prompts: Vec<String> = samples.iter().map(|s| ruler::wrap(b.chat, &s.prompt, "")).collect::<crate::Result<_>>()?;
            let answers = greedy.answers(&prompts.iter().map(String::as_str).collect::<Vec<_>>(), b.max_new)?;
            for (rec, (answer, n)) in group.iter().zip(answers) {
                prompt_tokens += n;
                right += correct(&answer, &rec.answer, &rec.question) as usize;
                bar.inc(1);
            }
        }
        bar.finish_and_clear();
        let k = recs.len();
        cells.push(Cell { task: task.to_string(), length: len, samples: k, score: 100.0 * right as f64 / k as f64, mean_prompt_tokens: prompt_tokens as f64 / k as f64, chat: b.chat.is_some(), seconds: started.elapsed().as_secs_f64(), ..Default::default() });
    }
    Ok(cells)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(task: &str) -> Vec<Record> {
        let rel = format!("data/babi/{task}_test_first300.jsonl");
        parse_records(&crate::testutil::shared_text(&rel), &rel).unwrap()
    }

    /// A synthetic essay whose sentences are numbered, so the background's order can be checked.
    fn essay() -> String {
        (0..300).map(|i| format!("Essay sentence number {i} talks about startups and the people who found them.")).collect::<Vec<_>>().join("\n")
    }

    fn words(s: &str) -> usize {
        s.split_whitespace().count()
    }

    /// The shared bAbI files parse to 300 questions each, the facts of the first ones as in the
    /// original story (hand-checked against qa1_single-supporting-fact_test.txt / qa2).
    #[test]
    fn records_parse() {
        let qa1 = records("qa1");
        assert_eq!(qa1.len(), 300);
        assert_eq!(qa1[0].facts, vec!["John travelled to the hallway.", "Mary journeyed to the bathroom."]);
        assert_eq!((qa1[0].question.as_str(), qa1[0].answer.as_str()), ("Where is John?", "hallway"));
        let qa2 = records("qa2");
        assert_eq!(qa2.len(), 300);
        assert!(qa2.iter().all(|r| r.question.starts_with("Where is the ") && LABELS.contains(&r.answer.as_str())));
        assert!(parse_records("{\"facts\": []}\n", "x.jsonl").unwrap_err().to_string().contains("x.jsonl line 1"));
    }

    /// Every fact appears once, in the story's order, and what is left between them is consecutive
    /// essay sentences (wrapping at the end) from one start: the background is not shuffled.
    #[test]
    fn facts_inserted_in_order_and_all_present() {
        let bg = Background::new(&essay());
        for (task, i) in [("qa1", 4usize), ("qa2", 2), ("qa2", 7)] {
            let rec = &records(task)[i];
            for seed in 0..5 {
                let s = bg.sample(task, rec, 1024, &words, &mut ruler::rng(seed, 1024, i)).unwrap();
                let mut rest = s.context.as_str();
                let mut between = String::new();
                for f in &rec.facts {
                    let at = rest.find(f.as_str()).unwrap_or_else(|| panic!("{task}: fact `{f}` missing or out of order"));
                    between.push_str(&rest[..at]);
                    rest = &rest[at + f.len()..];
                }
                between.push_str(rest);
                assert!(s.gaps.windows(2).all(|w| w[0] <= w[1]) && s.gaps.iter().all(|&g| g <= s.background));
                let nums: Vec<usize> = between.split("number ").skip(1).map(|x| x.split(' ').next().unwrap().parse().unwrap()).collect();
                // One number per background sentence (the cut last one may have lost its number).
                assert!(nums.len() == s.background || nums.len() + 1 == s.background, "{task}: {} numbers, {} sentences", nums.len(), s.background);
                assert!(nums.windows(2).all(|w| w[1] == (w[0] + 1) % 300), "{task}: background not consecutive: {nums:?}");
                assert!(rec.facts.iter().all(|f| s.context.matches(f.as_str()).count() == rec.facts.iter().filter(|g| *g == f).count()));
            }
        }
    }

    /// The context is the largest one within L − 300 tokens (one more background word would not fit),
    /// counted with the real GPT-NeoX tokenizer, and prompt + 20 generated tokens stay within L.
    #[test]
    fn prompt_length_within_the_target() {
        let tok = crate::data::Tok::from_json(&crate::testutil::shared_text("data/tokenizers/gpt-neox-20b.json"), "neox").unwrap();
        let count = |s: &str| tok.encode(s).unwrap().len();
        let bg = Background::new(&essay());
        for (task, i, len) in [("qa1", 0usize, 512usize), ("qa2", 5, 1024), ("qa1", 9, 2048)] {
            let rec = &records(task)[i];
            let s = bg.sample(task, rec, len, &count, &mut ruler::rng(42, len, i)).unwrap();
            let c = count(&s.context);
            assert!(c <= len - PROMPT_RESERVE, "{task} @ {len}: context {c} tokens");
            assert!(c + 8 > len - PROMPT_RESERVE, "{task} @ {len}: context {c} tokens leaves the budget unused");
            assert!(count(&s.prompt) + TOKENS_TO_GENERATE <= len, "{task} @ {len}: prompt {} tokens", count(&s.prompt));
        }
    }

    /// Seeded: the same RNG gives the same sample, another seed moves the facts and the background.
    #[test]
    fn samples_are_seeded() {
        let bg = Background::new(&essay());
        let rec = &records("qa2")[3];
        let a = bg.sample("qa2", rec, 1024, &words, &mut ruler::rng(42, 1024, 0)).unwrap();
        assert_eq!(a, bg.sample("qa2", rec, 1024, &words, &mut ruler::rng(42, 1024, 0)).unwrap());
        let b = bg.sample("qa2", rec, 1024, &words, &mut ruler::rng(42, 1024, 1)).unwrap();
        assert_ne!(a.gaps, b.gaps);
        assert_ne!(a.context, b.context);
    }

    /// The prompt is BABILong's template around the context, ending with the question.
    #[test]
    fn prompt_has_babilongs_template() {
        let bg = Background::new(&essay());
        let rec = Record { facts: vec!["Mary moved to the bathroom.".into()], question: "Where is Mary?".into(), answer: "bathroom".into() };
        let s = bg.sample("qa1", &rec, 512, &words, &mut ruler::rng(1, 2, 3)).unwrap();
        let [ins, ex, post] = prompts("qa1").unwrap();
        assert_eq!(s.prompt, format!("{ins}\n{ex}\n{post}\n<context>\n{}\n</context>\nQuestion: Where is Mary?", s.context));
        assert!(s.prompt.contains("Do not write anything else after that. \n<context>\n"));
        assert!(bg.sample("qa9", &rec, 512, &words, &mut ruler::rng(1, 2, 3)).is_err());
    }

    /// babilong/metrics.py on hand-made outputs.
    #[test]
    fn scoring_on_hand_made_cases() {
        let q = "Where is Mary?";
        assert!(correct("The most recent location of Mary is bathroom.", "bathroom", q));
        assert!(correct(" KITCHEN", "kitchen", q));
        assert!(!correct("The most recent location of Mary is garden.", "bathroom", q));
        // Only the first sentence counts.
        assert!(correct("Mary is in the office. Then the kitchen.", "office", q));
        assert!(!correct("Mary went. She is in the office.", "office", q));
        // Two labels: wrong even if one is the target.
        assert!(!correct("bathroom or kitchen", "bathroom", q));
        // A label named in the question is ignored.
        assert!(correct("The football is in the hallway, not the garden", "hallway", "Where was the football before the garden?"));
        // Cut before an example the model starts to write.
        assert!(!correct("<example>\nCharlie is in the hallway", "hallway", q));
        assert!(!correct("", "hallway", q));
    }

    /// Samples with more than (L − 300)/8 facts are skipped (BABILong's story filter).
    #[test]
    fn long_stories_are_skipped() {
        let recs = records("qa2");
        let u = usable(&recs, 512, 300);
        assert!(u.iter().all(|r| r.facts.len() <= 26));
        let expected = recs.iter().filter(|r| r.facts.len() <= 26).count();
        assert!(expected < 300, "qa2 has samples with more than 26 facts");
        assert_eq!(u.len(), expected);
        assert_eq!(usable(&recs, 512, 3).len(), 3);
    }
}
