//! The built-in corpus: seeded, text-like documents with strong local structure and long-range
//! dependencies, so that vanilla, DAR and uniform attention differ even on a tiny model.
//!
//! Each document introduces 3–5 people and states three facts about each near its start:
//! `mira lives in oslo . mira likes red . the code of mira is 4 1 7 .`
//! The body then mixes
//! - filler sentences from a fixed random grammar (adjective → noun → verb → object are each drawn
//!   from a small per-word successor set, so the next word is locally predictable),
//! - counting runs (`count : 3 4 5 6 7 .`), predictable from the previous token alone, and
//! - questions whose answers are facts stated tens to hundreds of tokens earlier:
//!   `question : where does mira live ? answer : oslo .` — the answer token can only be predicted
//!   by attending far back, beyond any small window, to the exact identity of a distant token.
//!
//! Documents are 100–250 words. Words are single tokens of the built-in word-level tokenizer
//! (`vocabulary()`), whose id 0 is `<|endoftext|>`. Document i depends only on (seed, i).
//!
//! Those answers are often predictable from nearby tokens (a question repeats an earlier answer), so
//! window-only attention does well on them. The **recall** corpus (`synthetic: {recall_gap: G}`,
//! `recall_document`) is built so that it cannot: 2–4 codes stated once at the start
//! (`the code of mira is 4 1 7 .`), at least G words of filler that never name a person, then every
//! code asked for once (`question : what is the code of mira ? answer : 4 1 7 .`). The three answer
//! digits are uniform and independent of everything else in the document, so a model that cannot see
//! back G tokens scores chance at them: loss ln 10 per digit, 10% of digits right (src/recall.rs).
//! Two options widen it (issue 36): `recall_gap: [LO, HI]` draws each document's gap uniformly from
//! LO..=HI (from a stream of its own, so a document with drawn gap g is exactly the one-gap
//! document with gap g), so every gap an evaluation asks about is in the training distribution; and
//! `recall_facts: K` states exactly K codes per document (Zoology's multi-query associative recall:
//! K key–value pairs, all asked at least the gap later) instead of 2–4.
use rand::{seq::IndexedRandom, seq::SliceRandom, Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const SYLLABLES: [&str; 12] = ["ka", "to", "mi", "re", "su", "no", "la", "vi", "do", "ne", "ri", "po"];
const CITIES: [&str; 20] = [
    "oslo", "lima", "cairo", "delhi", "paris", "quito", "rome", "seoul", "tokyo", "kyiv", "accra", "baku", "bern", "dakar", "hanoi", "lagos", "minsk", "nairobi", "riga", "sofia",
];
const COLORS: [&str; 12] = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "brown", "gray", "gold"];
const DIGITS: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
const FUNCTION: [&str; 24] = [
    ".", "?", ":", "the", "of", "is", "in", "lives", "likes", "code", "question", "answer", "where", "does", "live", "what", "color", "like", "count", "a", "and", "then", "saw", "near",
];
const ADJ: [&str; 16] = ["old", "tall", "quiet", "bright", "small", "warm", "dark", "quick", "soft", "loud", "cold", "deep", "wild", "calm", "thin", "wide"];
const NOUN: [&str; 16] = ["tree", "river", "house", "stone", "bird", "road", "cloud", "field", "boat", "wall", "lamp", "door", "hill", "ship", "bell", "cart"];
const VERB: [&str; 12] = ["moves", "stands", "falls", "sings", "waits", "turns", "rests", "shines", "breaks", "grows", "burns", "opens"];

/// Person names: all two-syllable combinations (144).
fn names() -> Vec<String> {
    SYLLABLES.iter().flat_map(|a| SYLLABLES.iter().map(move |b| format!("{a}{b}"))).collect()
}

/// The word-level vocabulary in id order; id 0 = `<|endoftext|>`, 1 = `<|padding|>`, 2 = `<unk>`.
pub fn vocabulary() -> Vec<String> {
    let mut v: Vec<String> = ["<|endoftext|>", "<|padding|>", "<unk>"].iter().map(|s| s.to_string()).collect();
    for group in [&CITIES[..], &COLORS, &DIGITS, &FUNCTION, &ADJ, &NOUN, &VERB] {
        v.extend(group.iter().map(|s| s.to_string()));
    }
    v.extend(names());
    v
}

struct Person {
    name: String,
    city: &'static str,
    color: &'static str,
    code: [usize; 3],
}

/// Successor sets of the filler grammar: fixed per corpus (seed-independent) so the local
/// structure is learnable across documents.
fn successors<const N: usize>(from: usize, to: &[&'static str; N], salt: u64) -> [&'static str; 3] {
    let mut r = ChaCha8Rng::seed_from_u64(0x5eed ^ salt ^ (from as u64) << 8);
    [to[r.random_range(0..N)], to[r.random_range(0..N)], to[r.random_range(0..N)]]
}

/// Document `index` of the corpus with `seed`.
pub fn document(seed: u64, index: u64) -> String {
    let mut r = ChaCha8Rng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index);
    let all_names = names();
    let n_people = r.random_range(3..=5);
    let people: Vec<Person> = all_names
        .choose_multiple(&mut r, n_people)
        .map(|n| Person {
            name: n.clone(),
            city: CITIES[r.random_range(0..CITIES.len())],
            color: COLORS[r.random_range(0..COLORS.len())],
            code: [r.random_range(0..10), r.random_range(0..10), r.random_range(0..10)],
        })
        .collect();
    let mut w: Vec<String> = Vec::new();
    let say = |w: &mut Vec<String>, s: &str| w.extend(s.split(' ').map(str::to_string));
    for p in &people {
        say(&mut w, &format!("{} lives in {} .", p.name, p.city));
        say(&mut w, &format!("{} likes {} .", p.name, p.color));
        let [a, b, c] = p.code;
        say(&mut w, &format!("the code of {} is {a} {b} {c} .", p.name));
    }
    let target_len = r.random_range(100..=250);
    while w.len() < target_len {
        match r.random_range(0..10) {
            0..=4 => {
                let a = r.random_range(0..ADJ.len());
                let noun = successors(a, &NOUN, 1)[r.random_range(0..3)];
                let ni = NOUN.iter().position(|x| *x == noun).unwrap();
                let verb = successors(ni, &VERB, 2)[r.random_range(0..3)];
                let vi = VERB.iter().position(|x| *x == verb).unwrap();
                let obj = successors(vi, &NOUN, 3)[r.random_range(0..3)];
                say(&mut w, &format!("the {} {noun} {verb} near the {obj} .", ADJ[a]));
            }
            5 => {
                let start = r.random_range(0..5);
                let len = r.random_range(3..6);
                let digits: Vec<&str> = (start..start + len).map(|d| DIGITS[d]).collect();
                say(&mut w, &format!("count : {} .", digits.join(" ")));
            }
            _ => {
                let p = &people[r.random_range(0..people.len())];
                let q = match r.random_range(0..3) {
                    0 => format!("question : where does {} live ? answer : {} .", p.name, p.city),
                    1 => format!("question : what color does {} like ? answer : {} .", p.name, p.color),
                    _ => {
                        let [a, b, c] = p.code;
                        format!("question : what is the code of {} ? answer : {a} {b} {c} .", p.name)
                    }
                };
                say(&mut w, &q);
            }
        }
    }
    w.join(" ")
}

/// Documents `0..n` of the corpus with `seed`.
pub fn documents(seed: u64, n: usize) -> Vec<String> {
    (0..n as u64).map(|i| document(seed, i)).collect()
}

/// Documents `0..n` of the recall corpus with `seed` and minimum fact-to-question distance `gap`.
pub fn recall_documents(seed: u64, n: usize, gap: usize) -> Vec<String> {
    (0..n as u64).map(|i| recall_document(seed, i, gap)).collect()
}

/// What a recall corpus varies: the gap (one value, or drawn per document from `gap.0..=gap.1`) and
/// the codes per document (None: 2–4, drawn per document).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recall {
    pub gap: (usize, usize),
    pub facts: Option<usize>,
}

impl Recall {
    /// The recall corpus a synthetic source describes; None for the mixed corpus.
    pub fn of(s: &crate::spec::SyntheticSpec) -> Option<Recall> {
        s.recall_gap.map(|g| Recall { gap: g.bounds(), facts: s.recall_facts })
    }

    /// The one-gap corpus with 2–4 codes per document (`recall_document`).
    pub fn gap(gap: usize) -> Recall {
        Recall { gap: (gap, gap), facts: None }
    }

    /// The gap of document `index` (`seed`): `gap.0` for one gap, else uniform over `gap.0..=gap.1`
    /// from a stream of its own (the document's words do not move the draw, nor it them).
    pub fn gap_of(&self, seed: u64, index: u64) -> usize {
        let (lo, hi) = self.gap;
        if hi <= lo {
            return lo;
        }
        ChaCha8Rng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index ^ 0x6761_7073).random_range(lo..=hi)
    }

    /// Document `index` of this corpus.
    pub fn document(&self, seed: u64, index: u64) -> String {
        recall_document_with(seed, index, self.gap_of(seed, index), self.facts)
    }

    /// Documents `0..n`.
    pub fn documents(&self, seed: u64, n: usize) -> Vec<String> {
        (0..n as u64).map(|i| self.document(seed, i)).collect()
    }

    /// The most words a document can have, without the EOD before it (`spec::recall_max_words`).
    pub fn max_words(&self) -> usize {
        crate::spec::recall_max_words(self.gap.0.max(self.gap.1), self.facts)
    }
}

/// Words of one filler sentence (the grammar of `document`, or a counting run): no names, no codes.
fn filler(r: &mut ChaCha8Rng) -> String {
    if r.random_range(0..6) == 0 {
        let start = r.random_range(0..5);
        let len = r.random_range(3..6);
        let digits: Vec<&str> = (start..start + len).map(|d| DIGITS[d]).collect();
        return format!("count : {} .", digits.join(" "));
    }
    let a = r.random_range(0..ADJ.len());
    let noun = successors(a, &NOUN, 1)[r.random_range(0..3)];
    let ni = NOUN.iter().position(|x| *x == noun).unwrap_or(0);
    let verb = successors(ni, &VERB, 2)[r.random_range(0..3)];
    let vi = VERB.iter().position(|x| *x == verb).unwrap_or(0);
    let obj = successors(vi, &NOUN, 3)[r.random_range(0..3)];
    format!("the {} {noun} {verb} near the {obj} .", ADJ[a])
}

/// Document `index` of the recall corpus (module doc): codes stated once, at least `gap` words of
/// filler after the last one, then one question per person in a random order. Every answer digit is
/// at least `gap` + 10 words after the digit it repeats.
pub fn recall_document(seed: u64, index: u64, gap: usize) -> String {
    recall_document_with(seed, index, gap, None)
}

/// `recall_document` with `facts` codes (None: 2–4, drawn as `recall_document` draws them, so that
/// None gives exactly its documents).
pub fn recall_document_with(seed: u64, index: u64, gap: usize, facts: Option<usize>) -> String {
    let mut r = ChaCha8Rng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index ^ 0x7265_6361_6c6c);
    let all_names = names();
    let n_people = facts.map_or_else(|| r.random_range(2..=4), |k| k.min(all_names.len()));
    let people: Vec<(String, [usize; 3])> =
        all_names.choose_multiple(&mut r, n_people).map(|n| (n.clone(), [r.random_range(0..10), r.random_range(0..10), r.random_range(0..10)])).collect();
    let mut w: Vec<String> = Vec::new();
    let say = |w: &mut Vec<String>, s: &str| w.extend(s.split(' ').map(str::to_string));
    for (name, [a, b, c]) in &people {
        say(&mut w, &format!("the code of {name} is {a} {b} {c} ."));
    }
    let facts_end = w.len();
    while w.len() < facts_end + gap {
        let f = filler(&mut r);
        say(&mut w, &f);
    }
    let mut order: Vec<usize> = (0..people.len()).collect();
    order.shuffle(&mut r);
    for i in order {
        let (name, [a, b, c]) = &people[i];
        say(&mut w, &format!("question : what is the code of {name} ? answer : {a} {b} {c} ."));
    }
    w.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn documents_are_deterministic_and_in_vocabulary() {
        let vocab: HashSet<String> = vocabulary().into_iter().collect();
        assert_eq!(vocab.len(), vocabulary().len(), "vocabulary has duplicates");
        for i in 0..50 {
            let d = document(7, i);
            assert_eq!(d, document(7, i));
            for word in d.split(' ') {
                assert!(vocab.contains(word), "`{word}` not in vocabulary");
            }
        }
        assert_ne!(document(7, 0), document(8, 0));
    }

    /// Recall documents: every code is stated exactly once, every person is asked for once, and each
    /// answer digit lies at least `gap` words after the stated digit it repeats; nothing in between
    /// names the person (so no nearer token carries the code).
    #[test]
    fn recall_facts_are_stated_once_and_asked_far_later() {
        let vocab: HashSet<String> = vocabulary().into_iter().collect();
        for gap in [8usize, 64, 300] {
            for i in 0..40 {
                let text = recall_document(5, i, gap);
                assert_eq!(text, recall_document(5, i, gap));
                let words: Vec<&str> = text.split(' ').collect();
                assert!(words.iter().all(|w| vocab.contains(*w)));
                let asked: Vec<usize> = (0..words.len()).filter(|&p| words[p] == "answer").collect();
                assert!((2..=4).contains(&asked.len()), "{text}");
                for a in asked {
                    // question : what is the code of NAME ? answer : d d d .
                    let name = words[a - 2];
                    let stated: Vec<usize> = (0..words.len()).filter(|&p| words[p] == name).collect();
                    assert_eq!(stated.len(), 2, "{name} named once as fact, once as question: {text}");
                    let fact = stated[0];
                    assert_eq!((words[fact - 3], words[fact - 1], words[fact + 1]), ("the", "of", "is"));
                    for k in 0..3 {
                        assert_eq!(words[fact + 2 + k], words[a + 2 + k], "digit {k} of {name}");
                        assert!(a + 2 + k - (fact + 2 + k) >= gap + 10);
                    }
                }
            }
        }
    }

    /// (stated names in order, first word of the questions, asked names in order) of a recall
    /// document, read off its words by the format alone: statements are 9 words each from word 0
    /// (`the code of NAME is d d d .`), questions 15 words each (`question : what is the code of
    /// NAME ? answer : d d d .`) to the end.
    fn layout<'a>(words: &[&'a str]) -> (Vec<&'a str>, usize, Vec<&'a str>) {
        let k = words.iter().filter(|w| **w == "answer").count();
        let q = words.len() - 15 * k;
        for j in 0..k {
            assert_eq!(&words[9 * j..9 * j + 4], &["the", "code", "of", words[9 * j + 3]][..]);
            assert_eq!((words[9 * j + 4], words[9 * j + 8]), ("is", "."));
            assert_eq!(&words[q + 15 * j..q + 15 * j + 7], &["question", ":", "what", "is", "the", "code", "of"][..]);
            assert_eq!((words[q + 15 * j + 8], words[q + 15 * j + 9], words[q + 15 * j + 10], words[q + 15 * j + 14]), ("?", "answer", ":", "."));
        }
        let stated = (0..k).map(|j| words[9 * j + 3]).collect();
        let asked = (0..k).map(|j| words[q + 15 * j + 7]).collect();
        (stated, q, asked)
    }

    /// A mixed-gap corpus: each document's gap is drawn from LO..=HI, the document is exactly the
    /// one-gap document with that gap, and the filler between the last statement (word 9k) and the
    /// first question is the gap plus at most the 7 words of the sentence that crosses it; the draws
    /// cover LO..=HI evenly (eight equal bins of 4,000 draws, each within 20% of 500).
    #[test]
    fn mixed_gap_documents_have_the_gap_drawn_for_them() {
        let r = Recall { gap: (16, 512), facts: None };
        for i in 0..200 {
            let g = r.gap_of(5, i);
            assert!((16..=512).contains(&g), "{g}");
            let text = r.document(5, i);
            assert_eq!(text, recall_document(5, i, g));
            let words: Vec<&str> = text.split(' ').collect();
            let (stated, q, asked) = layout(&words);
            let filler = q - 9 * stated.len();
            assert!(filler >= g && filler <= g + 7, "doc {i}: gap {g}, filler {filler}");
            assert!(words[9 * stated.len()..q].iter().all(|w| !stated.contains(w)));
            assert!(words.len() <= r.max_words(), "{} > {}", words.len(), r.max_words());
            let mut sorted = asked.clone();
            sorted.sort();
            let mut want = stated.clone();
            want.sort();
            assert_eq!(sorted, want);
        }
        // One document by hand: gap 20, 2 facts → statements at words 0–17, filler from word 18 to
        // the first question at 18 + 20 ..= 18 + 27, questions 15 words each to the end.
        let text = Recall { gap: (20, 20), facts: Some(2) }.document(1, 0);
        let words: Vec<&str> = text.split(' ').collect();
        let q = words.iter().position(|w| *w == "question").unwrap();
        assert!((38..=45).contains(&q), "{q}: {text}");
        assert_eq!(words.len(), q + 30);
        for (j, name) in [words[3], words[12]].iter().enumerate() {
            let at = (0..2).map(|a| q + 15 * a).find(|&p| words[p + 7] == *name).unwrap();
            for d in 0..3 {
                assert_eq!(words[9 * j + 5 + d], words[at + 11 + d], "{text}");
                assert!(at + 11 + d - (9 * j + 5 + d) >= 20 + 10);
            }
        }
        let mut bins = [0usize; 8];
        for i in 0..4000 {
            bins[(r.gap_of(9, i) - 16) * 8 / 497] += 1;
        }
        assert!(bins.iter().all(|&b| (400..=600).contains(&b)), "{bins:?}");
        let drawn: Vec<usize> = (0..4000).map(|i| r.gap_of(9, i)).collect();
        assert_eq!((drawn.iter().min(), drawn.iter().max()), (Some(&16), Some(&512)));
        assert_eq!(Recall::gap(64).gap_of(9, 3), 64);
    }

    /// The multi-fact corpus (Zoology's MQAR): exactly k codes stated, each for another person, every
    /// one asked once, each answer digit the stated digit and at least gap + 10 words after it.
    #[test]
    fn multi_fact_documents_ask_every_stated_code_far_later() {
        assert_eq!(names().len(), crate::spec::MAX_RECALL_FACTS);
        for k in [1usize, 2, 8, 32] {
            let r = Recall { gap: (256, 256), facts: Some(k) };
            for i in 0..20 {
                let text = r.document(3, i);
                let words: Vec<&str> = text.split(' ').collect();
                let (stated, q, asked) = layout(&words);
                assert_eq!((stated.len(), asked.len()), (k, k), "{text}");
                assert_eq!(stated.iter().collect::<HashSet<_>>().len(), k, "names repeat: {text}");
                assert!(q - 9 * k >= 256 && words.len() <= r.max_words());
                for (a, name) in asked.iter().enumerate() {
                    let j = stated.iter().position(|s| s == name).unwrap();
                    for d in 0..3 {
                        let (fact, answer) = (9 * j + 5 + d, q + 15 * a + 11 + d);
                        assert_eq!(words[fact], words[answer]);
                        assert!(answer - fact >= 256 + 10);
                    }
                }
            }
        }
    }

    /// Every answer in a document is the fact stated for that person at the start.
    #[test]
    fn answers_restate_earlier_facts_far_back() {
        let mut far = 0;
        for i in 0..100 {
            let words: Vec<&str> = document(3, i).leak().split(' ').collect();
            for (pos, _) in words.iter().enumerate().filter(|(_, w)| **w == "where") {
                let name = words[pos + 2];
                let answer = words[pos + 7]; // where does NAME live ? answer : CITY
                let fact = words.windows(4).position(|f| f[0] == name && f[1] == "lives" && f[2] == "in").unwrap();
                assert_eq!(words[fact + 3], answer);
                far += usize::from(pos - fact > 32);
            }
        }
        assert!(far > 50, "too few long-range questions: {far}");
    }
}
