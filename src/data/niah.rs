//! RULER's needle-in-a-haystack samples (evaluation.md §3.1–3.2): seeded generators sized to a target
//! length by a caller's token count (the evaluated model's tokenizer; `eval::ruler` scores them).
//!
//! Tasks: niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery. Haystacks: `noise`
//! (the fixed five-sentence line), `needle` (every filler line a distractor needle), `essay` (RULER's
//! Paul Graham essays, whitespace-split words, sentence-split, needles inserted at depths from the 40
//! RULER depths). Keys are `adjective-noun` pairs of wonderwords' lists (sampled as a uniform pair,
//! not from the de-duplicated sorted set: 0.2% of pairs collide, which only changes which distractor
//! strings can occur), 7-digit numbers, or UUID4 strings.
use rand::{seq::SliceRandom, Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const ADJECTIVES: &str = include_str!("../../assets/ruler/adjectivelist.txt");
const NOUNS: &str = include_str!("../../assets/ruler/nounlist.txt");
const NOISE: &str = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
const NEEDLE: &str = "One of the special magic {type_needle_v} for {key} is: {value}.";
const TEMPLATE: &str = "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?";
const ANSWER_PREFIX: &str = " The special magic {type_needle_v} for {query} mentioned in the provided text are";
pub use crate::spec::ruler_tasks::{task, Haystack, Kind, NiahTask, TASKS};

/// One generated sample: the model is fed `input + answer_prefix`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub input: String,
    pub answer_prefix: String,
    pub outputs: Vec<String>,
    /// Haystack units (noise lines or essay words) it was built with.
    pub units: usize,
    /// Where each needle went, as a fraction of the haystack (0 = start).
    pub depths: Vec<f64>,
    /// The (key, value) of every needle the question asks for.
    pub queried: Vec<(String, String)>,
}

pub struct Generator {
    adjectives: Vec<&'static str>,
    nouns: Vec<&'static str>,
    /// Essay words (`re.sub(r"\s+", " ", text).split(" ")`), for essay haystacks.
    essay: Option<Vec<String>>,
}

impl Generator {
    pub fn new(essay_text: Option<&str>) -> Generator {
        let lines = |s: &'static str| s.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>();
        let essay = essay_text.map(|t| t.split_whitespace().map(str::to_string).collect());
        Generator { adjectives: lines(ADJECTIVES), nouns: lines(NOUNS), essay }
    }

    fn draw(&self, kind: Kind, r: &mut ChaCha8Rng) -> String {
        match kind {
            Kind::Words => format!("{}-{}", self.adjectives[r.random_range(0..self.adjectives.len())], self.nouns[r.random_range(0..self.nouns.len())]),
            Kind::Numbers => r.random_range(1_000_000..=9_999_999u32).to_string(),
            Kind::Uuids => {
                let mut b: [u8; 16] = r.random();
                b[6] = (b[6] & 0x0f) | 0x40; // version 4
                b[8] = (b[8] & 0x3f) | 0x80; // RFC 4122 variant
                let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
                format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
            }
        }
    }

    /// A sample with `units` haystack units (noise/needle lines, or essay words), seeded by `r`.
    pub fn render(&self, t: &NiahTask, units: usize, r: &mut ChaCha8Rng) -> Sample {
        let type_v = match t.value {
            Kind::Numbers => "numbers",
            Kind::Uuids => "uuids",
            Kind::Words => "words",
        };
        let mut keys = Vec::new();
        while keys.len() < t.num_keys {
            let k = self.draw(t.key, r);
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
        let values: Vec<Vec<String>> = keys.iter().map(|_| (0..t.num_values).map(|_| self.draw(t.value, r)).collect()).collect();
        let mut needles: Vec<String> = keys
            .iter()
            .zip(&values)
            .flat_map(|(k, vs)| vs.iter().map(move |v| NEEDLE.replace("{type_needle_v}", type_v).replace("{key}", k).replace("{value}", v)))
            .collect();
        needles.shuffle(r);
        let (context, depths) = match t.haystack {
            Haystack::Noise | Haystack::Needle => {
                let mut lines: Vec<String> = (0..units)
                    .map(|_| match t.haystack {
                        Haystack::Noise => NOISE.to_string(),
                        _ => NEEDLE.replace("{type_needle_v}", type_v).replace("{key}", &self.draw(t.key, r)).replace("{value}", &self.draw(t.value, r)),
                    })
                    .collect();
                // Positions sampled without replacement, inserted from the highest down (RULER).
                let mut pos: Vec<usize> = rand::seq::index::sample(r, units + 1, needles.len().min(units + 1)).into_vec();
                pos.sort_unstable_by(|a, b| b.cmp(a));
                let depths = pos.iter().map(|&p| p as f64 / (units.max(1)) as f64).collect();
                for (p, n) in pos.iter().zip(&needles) {
                    lines.insert(*p, n.clone());
                }
                (lines.join("\n"), depths)
            }
            Haystack::Essay => {
                let words = self.essay.as_ref().expect("essay haystack needs the essay text (Generator::new(Some(..)))");
                let text: Vec<&str> = (0..units).map(|i| words[i % words.len()].as_str()).collect();
                let mut sents = split_sentences(&text.join(" "));
                // n distinct depths from RULER's 40, positions int(n_sents · depth/100), inserted in order.
                let grid: Vec<f64> = (0..40).map(|i| (i as f64 * 100.0 / 39.0).round()).collect();
                let mut chosen: Vec<f64> = rand::seq::index::sample(r, 40, needles.len()).into_iter().map(|i| grid[i]).collect();
                chosen.sort_by(|a, b| a.total_cmp(b));
                let n_sents = sents.len();
                for (k, (d, n)) in chosen.iter().zip(&needles).enumerate() {
                    let at = (n_sents as f64 * d / 100.0) as usize + k;
                    sents.insert(at.min(sents.len()), n.clone());
                }
                (sents.join(" "), chosen.iter().map(|d| d / 100.0).collect())
            }
        };
        let queried: Vec<usize> = rand::seq::index::sample(r, keys.len(), t.num_queries).into_vec();
        let query_keys: Vec<&str> = queried.iter().map(|&i| keys[i].as_str()).collect();
        let query = match query_keys.len() {
            1 => query_keys[0].to_string(),
            n => format!("{}, and {}", query_keys[..n - 1].join(", "), query_keys[n - 1]),
        };
        let outputs: Vec<String> = queried.iter().flat_map(|&i| values[i].clone()).collect();
        let queried_pairs: Vec<(String, String)> = queried.iter().flat_map(|&i| values[i].iter().map(|v| (keys[i].clone(), v.clone())).collect::<Vec<_>>()).collect();
        let mut full = format!("{TEMPLATE}{ANSWER_PREFIX}");
        if t.num_queries * t.num_values == 1 {
            full = full.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer");
            full = full.replace("{type_needle_v}", type_v.trim_end_matches('s'));
        } else {
            full = full.replace("{type_needle_v}", type_v);
        }
        let full = full.replace("{context}", &context).replace("{query}", &query);
        // Cut at the last occurrence of the answer prefix's first 10 characters (evaluation.md §3.1).
        let prefix_start = ANSWER_PREFIX.chars().take(10).collect::<String>();
        let cut = full.rfind(&prefix_start).expect("answer prefix present");
        Sample { input: full[..cut].to_string(), answer_prefix: full[cut..].to_string(), outputs, units, depths, queried: queried_pairs }
    }

    /// The largest haystack whose prompt (input + answer prefix, counted by `count`) plus the
    /// generation budget fits `max_len`: RULER's binary search (each probe a fresh sample), then
    /// the final sample, stepping back by `incremental` units while it does not fit.
    pub fn sized(&self, t: &NiahTask, max_len: usize, budget: usize, count: &dyn Fn(&str) -> usize, r: &mut ChaCha8Rng) -> Sample {
        let incremental = match t.haystack {
            Haystack::Essay => 500,
            _ if max_len < 4096 => 5,
            _ => 25,
        };
        let fits = |s: &Sample| count(&format!("{}{}", s.input, s.answer_prefix)) + budget <= max_len;
        let probe = self.render(t, incremental, r);
        let per_unit = count(&probe.input).max(1) as f64 / incremental as f64;
        let hi = ((3 * max_len) as f64 / per_unit).max(2.0 * incremental as f64) as usize;
        let best = largest_fitting(incremental, hi, |mid| fits(&self.render(t, mid, r))).unwrap_or(incremental);
        let mut units = best;
        loop {
            let s = self.render(t, units, r);
            if fits(&s) || units <= incremental {
                return s;
            }
            units -= incremental;
        }
    }
}

/// The largest `n` in `lo..=hi` with `fits(n)`, by binary search (assumes `fits` holds up to some
/// point and fails after it); None when not even `lo` fits. Shared by the RULER and BABILong sizing.
pub fn largest_fitting(lo: usize, hi: usize, mut fits: impl FnMut(usize) -> bool) -> Option<usize> {
    let (mut lo, mut hi, mut best) = (lo, hi, None);
    while lo <= hi {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            best = Some(mid);
            lo = mid + 1;
        } else if mid == 0 {
            break;
        } else {
            hi = mid - 1;
        }
    }
    best
}

/// A Punkt-like sentence split: break after `.`, `!` or `?` followed by whitespace.
pub fn split_sentences(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut start = 0;
    let b = text.as_bytes();
    for i in 0..b.len() {
        if matches!(b[i], b'.' | b'!' | b'?') && i + 1 < b.len() && b[i + 1] == b' ' {
            out.push(text[start..=i].trim().to_string());
            start = i + 1;
        }
    }
    if start < text.len() && !text[start..].trim().is_empty() {
        out.push(text[start..].trim().to_string());
    }
    out
}

/// Seeded RNG for sample `i` of a (task, length) cell, RULER's default seed 42.
pub fn rng(seed: u64, length: usize, i: usize) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed ^ ((length as u64) << 20) ^ i as u64)
}

/// Text of RULER's essay haystack file (`{"text": …}` JSON, optionally gzip'd) or of a plain text file.
pub fn read_essay(path: &std::path::Path) -> crate::Result<String> {
    use std::io::Read;
    let f = std::fs::File::open(path).map_err(|e| crate::Error::io(path, e))?;
    let mut raw = String::new();
    let mut reader: Box<dyn Read> = if path.to_string_lossy().ends_with(".gz") { Box::new(flate2::read::GzDecoder::new(f)) } else { Box::new(f) };
    reader.read_to_string(&mut raw).map_err(|e| crate::Error::io(path, e))?;
    if raw.trim_start().starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(&raw)?;
        return v["text"].as_str().map(str::to_string).ok_or_else(|| crate::Error::Data(format!("{}: no `text` field", path.display())));
    }
    Ok(raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rendered S-NIAH-1 prompt has the worked example's structure (templates.json).
    #[test]
    fn single_needle_prompt_has_rulers_wording() {
        let g = Generator::new(None);
        let s = g.render(&task("niah_single_1").unwrap(), 3, &mut rng(42, 0, 0));
        assert!(s.input.starts_with("A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about the number afterwards.\n"), "{}", s.input);
        assert_eq!(s.input.matches(NOISE).count(), 3);
        let key = s.input.split("One of the special magic numbers for ").nth(1).unwrap().split(" is: ").next().unwrap().to_string();
        assert!(s.input.ends_with(&format!("\nWhat is the special magic number for {key} mentioned in the provided text?")));
        assert_eq!(s.answer_prefix, format!(" The special magic number for {key} mentioned in the provided text is"));
        assert_eq!(s.outputs.len(), 1);
        assert!(s.outputs[0].len() == 7 && s.input.contains(&format!("for {key} is: {}.", s.outputs[0])));
        let (adj, noun) = key.split_once('-').unwrap();
        assert!(ADJECTIVES.lines().any(|l| l.trim() == adj) && NOUNS.lines().any(|l| l.trim() == noun));
    }

    /// Multi-value and multi-query use the plural wording and four references each.
    #[test]
    fn multi_needle_tasks_use_plural_wording() {
        let essay = "First sentence here. Second one! A third? ".repeat(200);
        let g = Generator::new(Some(&essay));
        for name in ["niah_multivalue", "niah_multiquery"] {
            let s = g.render(&task(name).unwrap(), 600, &mut rng(42, 0, 1));
            assert!(s.input.starts_with("Some special magic numbers are hidden"), "{name}");
            assert!(s.answer_prefix.ends_with("mentioned in the provided text are"), "{name}");
            assert_eq!(s.outputs.len(), 4, "{name}");
            for o in &s.outputs {
                assert!(s.input.contains(o.as_str()), "{name}: {o} not in haystack");
            }
        }
        let s = g.render(&task("niah_multiquery").unwrap(), 600, &mut rng(42, 0, 2));
        assert!(s.input.contains(", and "), "four keys queried as `k1, k2, k3, and k4`");
    }

    /// Essay needles land at the requested depth: a needle at depth d sits after ~d of the sentences.
    #[test]
    fn essay_needle_lands_at_its_depth() {
        let essay: String = (0..400).map(|i| format!("Sentence number {i} ends here.")).collect::<Vec<_>>().join(" ");
        let g = Generator::new(Some(&essay));
        for i in 0..20 {
            let s = g.render(&task("niah_single_2").unwrap(), 2000, &mut rng(7, 0, i));
            let sents = split_sentences(&s.input);
            let at = sents.iter().position(|x| x.contains("One of the special magic")).unwrap();
            let body = sents.len() - 2; // minus the template's opening and question sentences (roughly)
            let want = s.depths[0] * body as f64;
            assert!((at as f64 - want).abs() <= 3.0, "depth {} → sentence {at}, expected ≈ {want}", s.depths[0]);
        }
    }

    /// Sizing keeps prompt + generation budget within the target and is within one increment of full.
    #[test]
    fn sized_prompts_fit_the_target_length() {
        let g = Generator::new(None);
        let count = |s: &str| s.split_whitespace().count();
        for len in [512usize, 1024, 4096] {
            let s = g.sized(&task("niah_single_1").unwrap(), len, 128, &count, &mut rng(42, len, 0));
            let n = count(&format!("{}{}", s.input, s.answer_prefix));
            assert!(n + 128 <= len, "{len}: {n} + 128");
            let incr = if len < 4096 { 5 } else { 25 };
            let bigger = g.render(&task("niah_single_1").unwrap(), s.units + incr, &mut rng(1, 0, 0));
            assert!(count(&format!("{}{}", bigger.input, bigger.answer_prefix)) + 128 > len, "{len}: could have used {} units", s.units + incr);
        }
    }

    #[test]
    fn uuid_keys_are_version_4() {
        let u = Generator::new(None).draw(Kind::Uuids, &mut rng(1, 2, 3));
        assert!(u.len() == 36 && u.as_bytes()[14] == b'4', "{u}");
    }
}
