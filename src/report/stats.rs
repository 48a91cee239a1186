//! Summaries over seeds: mean, sample standard deviation, n and the 95% Student-t interval of the
//! mean. The interval captures seed-to-seed variance (initialisation and data order), not the
//! sampling error of one evaluation: every run is evaluated on the same documents.
use statrs::distribution::{ContinuousCDF, StudentsT};

/// The one sentence report.md and the tables' notes use.
pub const WHAT_INTERVALS_MEAN: &str = "Values are mean ± s.d. (n seeds) [95% t-interval of the mean]: the spread is seed-to-seed variance (initialisation and data order), not evaluation sampling error — every seed is scored on the same documents.";

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stat {
    pub mean: f64,
    /// Sample standard deviation (n − 1 in the denominator); 0 for n = 1.
    pub sd: f64,
    pub n: usize,
    /// 95% t-interval of the mean; None for n = 1.
    pub ci: Option<(f64, f64)>,
}

/// The two-sided 95% Student-t quantile with `df` degrees of freedom (12.706 for df 1).
pub fn t975(df: usize) -> f64 {
    StudentsT::new(0.0, 1.0, df as f64).map(|t| t.inverse_cdf(0.975)).unwrap_or(f64::NAN)
}

impl Stat {
    /// Summary of the finite values of `xs`; None when there are none.
    pub fn of(xs: &[f64]) -> Option<Stat> {
        let v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
        let n = v.len();
        if n == 0 {
            return None;
        }
        let mean = v.iter().sum::<f64>() / n as f64;
        if n == 1 {
            return Some(Stat { mean, sd: 0.0, n, ci: None });
        }
        let sd = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt();
        let half = t975(n - 1) * sd / (n as f64).sqrt();
        Some(Stat { mean, sd, n, ci: Some((mean - half, mean + half)) })
    }

    /// The same summary with its interval cut to `[lo, hi]`, the range the quantity can take (a
    /// percentage's t-interval over two or three seeds can run past 0 or 100).
    pub fn clipped(self, lo: f64, hi: f64) -> Stat {
        Stat { ci: self.ci.map(|(a, b)| (a.max(lo), b.min(hi))), ..self }
    }

    /// The two-sided p-value of a one-sample t-test of mean 0 (the paired t-test when the values
    /// are differences); None for one value or no spread.
    pub fn t_test_p(&self) -> Option<f64> {
        if self.n < 2 || self.sd <= 0.0 {
            return None;
        }
        let t = self.mean / (self.sd / (self.n as f64).sqrt());
        let dist = StudentsT::new(0.0, 1.0, (self.n - 1) as f64).ok()?;
        Some(2.0 * (1.0 - dist.cdf(t.abs())))
    }

    /// The p-value as tables print it: three decimals, "< 0.001" below that.
    pub fn p_text(p: f64) -> String {
        if p < 0.001 { "< 0.001".into() } else { format!("{p:.3}") }
    }

    /// "12.34" for one seed, "12.34 ± 0.56 (3) [10.95, 13.73]" for several (two decimals).
    pub fn text(&self) -> String {
        match self.ci {
            None => format!("{:.2}", self.mean),
            Some((lo, hi)) => format!("{:.2} ± {:.2} ({}) [{lo:.2}, {hi:.2}]", self.mean, self.sd, self.n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn t_quantiles_match_the_printed_table() {
        // Any statistics textbook's t table, two-sided 95%.
        for (df, want) in [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042)] {
            assert!((t975(df) - want).abs() < 1e-3, "df {df}: {}", t975(df));
        }
    }

    #[test]
    fn mean_sd_and_interval_by_hand() {
        // 1, 2, 3: mean 2, s.d. 1, half-width 4.303 / √3.
        let s = Stat::of(&[1.0, 2.0, 3.0]).unwrap();
        assert_eq!((s.mean, s.sd, s.n), (2.0, 1.0, 3));
        let (lo, hi) = s.ci.unwrap();
        assert!((hi - 2.0 - 4.302_652_7 / 3f64.sqrt()).abs() < 1e-6 && (2.0 - lo - (hi - 2.0)).abs() < 1e-12);
        assert_eq!(s.text(), "2.00 ± 1.00 (3) [-0.48, 4.48]");
        let one = Stat::of(&[5.0, f64::NAN]).unwrap();
        assert_eq!((one.n, one.ci, one.text()), (1, None, "5.00".to_string()));
        assert!(Stat::of(&[]).is_none());
        // Clipping cuts the interval to the range, not the mean or the spread.
        let wide = Stat::of(&[0.0, 100.0]).unwrap();
        let cut = wide.clipped(0.0, 100.0);
        assert_eq!((cut.mean, cut.sd, cut.ci), (wide.mean, wide.sd, Some((0.0, 100.0))));
        assert!(wide.ci.unwrap().0 < -500.0);
    }

    /// The paired t-test's p against the closed form for 2 degrees of freedom,
    /// p = 1 − |t| / √(2 + t²): 1, 2, 3 → t = 2√3, p = 1 − √12 / √14 = 0.0741799.
    #[test]
    fn t_test_p_by_hand() {
        let p = Stat::of(&[1.0, 2.0, 3.0]).unwrap().t_test_p().unwrap();
        assert!((p - (1.0 - 12f64.sqrt() / 14f64.sqrt())).abs() < 1e-9, "{p}");
        // Sign does not matter (two-sided); no spread or one value: no test.
        assert!((Stat::of(&[-1.0, -2.0, -3.0]).unwrap().t_test_p().unwrap() - p).abs() < 1e-12);
        assert_eq!(Stat::of(&[2.0, 2.0]).unwrap().t_test_p(), None);
        assert_eq!(Stat::of(&[2.0]).unwrap().t_test_p(), None);
        assert_eq!((Stat::p_text(0.0802), Stat::p_text(0.00009)), ("0.080".to_string(), "< 0.001".to_string()));
    }
}
