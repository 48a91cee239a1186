//! Per-document metrics as lm-evaluation-harness computes them: multiple-choice acc / acc_norm,
//! regex answer extraction + exact_match (GSM8K's strict and flexible filters), and ROUGE-L.
use regex::Regex;

/// Index of the largest value (the first one on ties, as numpy's argmax).
pub fn argmax(xs: &[f64]) -> usize {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best
}

/// (acc, acc_norm) of one document. `lls`: summed log-probabilities of each continuation; `choices`:
/// the choice strings (without the target delimiter). acc_norm divides by the choice's length in
/// characters — lm-eval's `completion_len = len(choice)` (Python `len`, code points; equal to the
/// UTF-8 byte length for ASCII text, which is why lm-eval's docs call it byte-length normalisation).
pub fn mc_scores(lls: &[f64], choices: &[String], gold: usize) -> (f64, f64) {
    let norm: Vec<f64> = lls.iter().zip(choices).map(|(l, c)| l / c.chars().count().max(1) as f64).collect();
    (f64::from(u8::from(argmax(lls) == gold)), f64::from(u8::from(argmax(&norm) == gold)))
}

/// A regex answer filter (lm-eval `RegexFilter` + `take_first`): the match's first group, or the
/// group_select-th match (negative counts from the end); a match with several groups yields its
/// first non-empty group. No match gives `[invalid]`, lm-eval's fallback.
pub fn regex_extract(re: &Regex, group_select: i64, text: &str) -> String {
    let matches: Vec<regex::Captures> = re.captures_iter(text).collect();
    if matches.is_empty() {
        return "[invalid]".into();
    }
    let i = if group_select < 0 { matches.len() as i64 + group_select } else { group_select };
    let Some(m) = usize::try_from(i).ok().and_then(|i| matches.get(i)) else { return "[invalid]".into() };
    if m.len() == 1 {
        return m[0].to_string();
    }
    (1..m.len()).find_map(|g| m.get(g).map(|x| x.as_str()).filter(|s| !s.is_empty())).unwrap_or("").to_string()
}

/// lm-eval's exact_match: apply `regexes_to_ignore` (each replaced by "") to both strings, optionally
/// lower-case, then compare.
pub fn exact_match(prediction: &str, reference: &str, ignore: &[Regex], ignore_case: bool) -> f64 {
    let clean = |s: &str| {
        let mut s = s.to_string();
        for re in ignore {
            s = re.replace_all(&s, "").into_owned();
        }
        if ignore_case {
            s.to_lowercase()
        } else {
            s
        }
    };
    f64::from(u8::from(clean(prediction) == clean(reference)))
}

/// Tokens for ROUGE as Google's `rouge_score` makes them (no stemmer): lower-case, every run of
/// characters other than [a-z0-9] becomes a space, split on whitespace.
pub fn rouge_tokens(s: &str) -> Vec<String> {
    let lower = s.to_lowercase();
    let mapped: String = lower.chars().map(|c| if c.is_ascii_lowercase() || c.is_ascii_digit() { c } else { ' ' }).collect();
    mapped.split_whitespace().map(str::to_string).collect()
}

/// Length of the longest common subsequence (O(n·m) time, O(m) memory).
pub fn lcs(a: &[String], b: &[String]) -> usize {
    let mut prev = vec![0usize; b.len() + 1];
    let mut cur = vec![0usize; b.len() + 1];
    for x in a {
        for (j, y) in b.iter().enumerate() {
            cur[j + 1] = if x == y { prev[j] + 1 } else { cur[j].max(prev[j + 1]) };
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

/// ROUGE-L F-measure (rouge_score's `rougeL`): P = LCS/|prediction|, R = LCS/|reference|, F = 2PR/(P+R).
pub fn rouge_l(prediction: &str, reference: &str) -> f64 {
    let (p, r) = (rouge_tokens(prediction), rouge_tokens(reference));
    if p.is_empty() || r.is_empty() {
        return 0.0;
    }
    let l = lcs(&p, &r) as f64;
    if l == 0.0 {
        return 0.0;
    }
    let (prec, rec) = (l / p.len() as f64, l / r.len() as f64);
    2.0 * prec * rec / (prec + rec)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// acc picks the larger summed log-prob; acc_norm divides by characters and can pick another choice.
    #[test]
    fn acc_and_acc_norm_choose_differently() {
        let choices = vec!["a cat".to_string(), "a much longer answer".to_string()];
        // Choice 0: -6 over 5 chars = -1.2/char; choice 1: -8 over 20 chars = -0.4/char.
        let lls = [-6.0, -8.0];
        assert_eq!(mc_scores(&lls, &choices, 0), (1.0, 0.0));
        assert_eq!(mc_scores(&lls, &choices, 1), (0.0, 1.0));
        // Non-ASCII: "é" is one character (lm-eval's len), two bytes.
        let c2 = vec!["éé".to_string(), "abc".to_string()];
        // Per character: -2/2 = -1.0 < -2.9/3 = -0.967 → choice 1; per byte it would be -2/4 = -0.5 → choice 0.
        assert_eq!(mc_scores(&[-2.0, -2.9], &c2, 1), (0.0, 1.0));
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1, "first maximum, as numpy");
    }

    fn gsm_filters() -> (Regex, Regex, Vec<Regex>) {
        let strict = Regex::new(r"#### (\-?[0-9\.\,]+)").unwrap();
        let flex = Regex::new(r"(-?[$0-9.,]{2,})|(-?[0-9]+)").unwrap();
        let ignore = [",", r"\$", r"(?s).*#### ", r"\.$"].iter().map(|r| Regex::new(r).unwrap()).collect();
        (strict, flex, ignore)
    }

    /// GSM8K: strict wants `#### N`; flexible takes the last number-like run; both compared with the
    /// reference after lm-eval's regexes_to_ignore (",", "$", everything up to "#### ", a final ".").
    #[test]
    fn gsm8k_extraction_and_exact_match() {
        let (strict, flex, ignore) = gsm_filters();
        let reference = "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 1,072";
        let out = " She sold 48 + 24 = 72 clips, so $1,072 in total.\n#### 1,072\n\n";
        assert_eq!(regex_extract(&strict, 0, out), "1,072");
        assert_eq!(exact_match(&regex_extract(&strict, 0, out), reference, &ignore, true), 1.0);
        // No "####": strict is invalid, flexible takes the last number ("$1,072." → "1072").
        let loose = "So the answer is $1,072.";
        assert_eq!(regex_extract(&strict, 0, loose), "[invalid]");
        assert_eq!(regex_extract(&flex, -1, loose), "$1,072.");
        assert_eq!(exact_match(&regex_extract(&flex, -1, loose), reference, &ignore, true), 1.0);
        assert_eq!(exact_match(&regex_extract(&strict, 0, loose), reference, &ignore, true), 0.0);
        // A single digit matches the second alternative (group 2); the last match wins.
        assert_eq!(regex_extract(&flex, -1, "between 12 and 7"), "7");
        assert_eq!(exact_match("-3", "#### -3", &ignore, true), 1.0);
        assert_eq!(exact_match("72", "#### 73", &ignore, true), 0.0);
    }

    /// ROUGE-L on hand-computed cases.
    #[test]
    fn rouge_l_hand_computed() {
        // Tokens: [the cat sat on the mat] vs [the cat is on the mat]: LCS = the cat on the mat = 5.
        // P = R = 5/6 → F = 5/6.
        assert!((rouge_l("The cat sat on the mat.", "the cat is on the mat") - 5.0 / 6.0).abs() < 1e-12);
        // [a b c d] vs [a c]: LCS 2, P = 2/4, R = 2/2 → F = 2·0.5·1/1.5 = 2/3.
        assert!((rouge_l("a b c d", "a-c") - 2.0 / 3.0).abs() < 1e-12);
        // Order matters: [x y z] vs [z y x]: LCS 1 → P = R = 1/3.
        assert!((rouge_l("x y z", "z y x") - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(rouge_l("", "a"), 0.0);
        assert_eq!(rouge_l("q", "a"), 0.0);
        assert_eq!(rouge_tokens("Don't STOP—now!"), ["don", "t", "stop", "now"]);
    }
}
