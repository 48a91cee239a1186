//! Training documents in RULER's needle format (evaluation.md §3): the haystack with its needles,
//! the question, the answer prefix and the answer. A teacher that sees these mixed into real text
//! learns to copy a value from far back in its context, which is what STILL's selection must keep
//! (still-linearized students are then judged on the same format, with fresh keys and values).
use super::niah::{self, Generator, Haystack};
use crate::spec::NeedleSpec;
use crate::{Error, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Words per haystack unit: a noise line has 18, a needle line 10, an essay unit is one word.
fn words_per_unit(h: Haystack) -> usize {
    match h {
        Haystack::Noise => 18,
        Haystack::Needle => 10,
        Haystack::Essay => 1,
    }
}

/// `spec.docs` documents, task i % tasks, document i from its own seeded stream (so the set is a
/// pure function of the spec).
pub fn documents(spec: &NeedleSpec) -> Result<Vec<String>> {
    let essay = spec.essay.as_deref().map(niah::read_essay).transpose()?;
    let gen = Generator::new(essay.as_deref());
    let tasks = spec
        .tasks
        .iter()
        .map(|t| niah::task(t).ok_or_else(|| Error::Data(format!("unknown RULER task `{t}`"))))
        .collect::<Result<Vec<_>>>()?;
    Ok((0..spec.docs)
        .map(|i| {
            let task = &tasks[i % tasks.len()];
            let mut r = ChaCha8Rng::seed_from_u64(spec.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i as u64);
            let words = r.random_range(spec.min_words..=spec.max_words);
            let s = gen.render(task, (words / words_per_unit(task.haystack)).max(1), &mut r);
            format!("{}{} {}.", s.input, s.answer_prefix, s.outputs.join(", "))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(tasks: &[&str], docs: usize) -> NeedleSpec {
        NeedleSpec { tasks: tasks.iter().map(|t| t.to_string()).collect(), docs, seed: 3, min_words: 40, max_words: 400, essay: None }
    }

    /// Each document states its needle once in the haystack and ends by answering with that value.
    #[test]
    fn documents_answer_their_own_needle() {
        let docs = documents(&spec(&["niah_single_1", "niah_multikey_2"], 6)).unwrap();
        assert_eq!(docs.len(), 6);
        for d in &docs {
            let question = d.rfind("What is the special magic number for ").expect("question");
            let key = d[question..].split(" for ").nth(1).unwrap().split(" mentioned").next().unwrap();
            let answer = d.trim_end_matches('.').rsplit(' ').next().unwrap();
            let needle = format!("One of the special magic numbers for {key} is: {answer}.");
            assert_eq!(d[..question].matches(&needle).count(), 1, "{d}");
            assert!(answer.len() == 7 && answer.chars().all(|c| c.is_ascii_digit()), "{answer}");
        }
        // Deterministic, and the seed matters.
        assert_eq!(docs, documents(&spec(&["niah_single_1", "niah_multikey_2"], 6)).unwrap());
        let mut other = spec(&["niah_single_1", "niah_multikey_2"], 6);
        other.seed = 4;
        assert_ne!(docs, documents(&other).unwrap());
    }

    /// Haystack lengths follow [min_words, max_words] (noise lines are 18 words).
    #[test]
    fn haystack_length_follows_the_word_range() {
        let mut s = spec(&["niah_single_1"], 40);
        s.min_words = 180;
        s.max_words = 360;
        for d in documents(&s).unwrap() {
            let lines = d.matches("The grass is green.").count();
            assert!((10..=20).contains(&lines), "{lines} noise lines");
        }
    }
}
