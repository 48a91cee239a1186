//! The probe: what the last query of a sequence reads (its Sel and Win sets and the normalizer's
//! shares), computed directly from the sets beside the chunked path.
use super::{compute_kind, dims4, Normalizer, Still, OUT_EPS};
use tch::{Kind, Tensor};

/// [`Still::probe`]: what the last query of a sequence reads.
#[derive(Debug)]
pub struct Probe {
    /// `[B, H, T]` bool: its selected tokens (Sel).
    pub selected: Tensor,
    /// `[B, H, T]` bool: its window (chunk c−1 and its own chunk).
    pub window: Tensor,
    /// `[B, H, 3]` fp64: the shares of its normalizer held by the Win, Sel and Lin terms (they sum to
    /// 1 up to the denominator's ε).
    pub shares: Tensor,
}

impl Still {
    /// What the last query of the sequence reads: its Sel and Win sets and the shares of its output's
    /// normalizer held by the Win, Sel and Lin terms (with this layer's normalizer and linear switch).
    /// Computed directly from the sets, beside the chunked path (chunk-0 phantom keys are left out).
    pub fn probe(&self, q: &Tensor, k: &Tensor) -> Probe {
        let (b, h, t, d) = dims4(q);
        let c = self.cfg.chunk;
        let selected = self.selected(q, k);
        tch::no_grad(|| {
            let kind = compute_kind(q);
            let last_chunk = (t - 1) / c;
            let window = Tensor::arange(t, (Kind::Int64, q.device())).ge((last_chunk - 1).max(0) * c).view([1, 1, t]).expand([b, h, t], false);
            let (qt, kf) = (q.narrow(2, t - 1, 1).to_kind(kind), k.to_kind(kind));
            let s = qt.matmul(&kf.transpose(-2, -1)).squeeze_dim(2) / (d as f64).sqrt(); // [B, H, T]
            let soft = window.logical_or(&selected);
            let s_m = s.masked_fill(&soft.logical_not(), f64::NEG_INFINITY);
            let m = s_m.amax(-1, true);
            let e = (&s_m - &m).exp();
            let part = |mask: &Tensor| e.masked_fill(&mask.logical_not(), 0.0).sum_dim_intlist(-1, false, kind);
            let a_lin = self.feature_map_q.forward(&qt).matmul(&self.feature_map_k.forward(&kf).transpose(-2, -1)).squeeze_dim(2);
            let mut z_lin = a_lin.masked_fill(&soft, 0.0).sum_dim_intlist(-1, false, kind);
            if !self.cfg.linear_branch {
                z_lin = z_lin.zeros_like();
            } else if self.cfg.normalizer == Normalizer::MaxCompensated {
                z_lin = z_lin * (-m.squeeze_dim(-1)).exp();
            }
            let z = Tensor::stack(&[part(&window), part(&selected), z_lin], -1);
            let total = z.sum_dim_intlist(-1, true, kind) + OUT_EPS;
            Probe { selected: selected.shallow_clone(), window: window.contiguous(), shares: (z / total).to_kind(Kind::Double) }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use crate::attention::causal;
    use crate::spec::AttentionImpl;
    use tch::{Device, Kind, Tensor};

    /// A planted (key, value) pair in an early chunk, matched strongly by the last query (logit 12
    /// against N(0, 1) elsewhere), at T = 1024, C = 64, D = 64, with the layer's initial feature maps.
    /// Selected by the oracle, it carries its value with the linear branch off and with the
    /// max-compensated normalizer; with the reference normalizer the linear terms take most of the
    /// denominator: the output still points at the value (the linear numerator of random values
    /// nearly cancels) but its size shrinks to the Sel share, and a pair in the window shrinks alike.
    /// `probe` measures the same shares as the output shows.
    #[test]
    fn planted_pair_when_selected() {
        let _rng = crate::testutil::rng();
        let (t, d, p) = (1024i64, 64i64, 300i64);
        let x: Vec<Tensor> = inputs(1, 2, t, d, 21).iter().map(|t| t.detach()).collect();
        let (q, k, v) = (x[0].shallow_clone(), x[1].copy(), x[2].copy());
        let q_last = q.narrow(2, t - 1, 1);
        let norm2 = q_last.square().sum_dim_intlist(-1, true, Kind::Double);
        k.narrow(2, p, 1).copy_(&(&q_last * (12.0 * (d as f64).sqrt()) / norm2)); // logit q·k/√D = 12
        let value = Tensor::randn([1, 2, 1, d], (Kind::Double, Device::Cpu)) * 3.0;
        v.narrow(2, p, 1).copy_(&value);
        // |y_last| / |value|, the smaller over the heads.
        let gain = |y: &Tensor| (y.narrow(2, t - 1, 1).norm_scalaropt_dim(2, [-1], false) / value.norm_scalaropt_dim(2, [-1], false)).min().double_value(&[]);
        let cosine = |y: &Tensor| {
            let y = y.narrow(2, t - 1, 1);
            ((&y * &value).sum_dim_intlist(-1, false, Kind::Double) / (y.norm_scalaropt_dim(2, [-1], false) * value.norm_scalaropt_dim(2, [-1], false))).min().double_value(&[])
        };
        let teacher = causal(&q, &k, &v, AttentionImpl::Reference);
        assert!(cosine(&teacher) > 0.99, "the teacher retrieves: {}", cosine(&teacher));
        let mut measured = vec![];
        for y in ["{routing: oracle, linear_branch: false}", "{routing: oracle, normalizer: max_compensated}", "{routing: oracle}", "{routing: none}"] {
            let (_, st) = layer(&cfg(y), 2, d, 22);
            st.set_oracle(Some(vec![p]));
            let g = st.gate(&x[3]);
            let out = tch::no_grad(|| st.forward(&q, &k, &v, g.as_ref()));
            let probe = st.probe(&q, &k);
            let sh: Vec<f64> = Vec::try_from(probe.shares.select(0, 0).select(0, 0)).unwrap();
            // Only the planted value, everything else zero: the output is share(Sel) · value.
            let only = v.zeros_like();
            only.narrow(2, p, 1).copy_(&value);
            let y_only = tch::no_grad(|| st.forward(&q, &k, &only, None)).narrow(2, t - 1, 1);
            // Per head: the planted value's coefficient in the output against the probe's Sel share.
            let coef: Vec<f64> = Vec::try_from((&y_only * &value).sum_dim_intlist(-1, false, Kind::Double).flatten(0, -1) / (&value * &value).sum_dim_intlist(-1, false, Kind::Double).flatten(0, -1)).unwrap();
            let head_shares: Vec<f64> = Vec::try_from(probe.shares.select(-1, 1).flatten(0, -1)).unwrap();
            let sel_share = head_shares.iter().sum::<f64>() / 2.0;
            if y.contains("oracle") {
                for (c, s) in coef.iter().zip(&head_shares) {
                    assert!((c - s).abs() < 1e-9, "{y}: probe share {s} vs output coefficient {c}");
                }
            }
            eprintln!("{y:48} cos(y, v) {:.3}  |y|/|v| {:.3}  shares of head 0: window {:.4} selected {:.4} linear {:.4}", cosine(&out), gain(&out), sh[0], sh[1], sh[2]);
            measured.push((cosine(&out), sel_share, gain(&out)));
        }
        // The same pair planted inside the window (50 tokens back) meets the same denominator: the
        // reference normalizer dilutes window and selected tokens alike.
        let (_, st) = layer(&cfg("{routing: oracle}"), 2, d, 22);
        let (kw, vw) = (x[1].copy(), x[2].copy());
        kw.narrow(2, t - 50, 1).copy_(&k.narrow(2, p, 1));
        vw.narrow(2, t - 50, 1).copy_(&value);
        let win_share: f64 = Vec::<f64>::try_from(st.probe(&q, &kw).shares.select(-1, 0).flatten(0, -1)).unwrap().iter().sum::<f64>() / 2.0;
        let y_win = tch::no_grad(|| st.forward(&q, &kw, &vw, st.gate(&x[3]).as_ref()));
        eprintln!("{:48} cos(y, v) {:.3}  |y|/|v| {:.3}  window share (mean of heads) {win_share:.4}", "{routing: oracle}, pair in the window", cosine(&y_win), gain(&y_win));
        assert!((win_share - measured[2].1).abs() < 0.05 * measured[2].1.max(1e-3), "window {win_share} vs selected {}", measured[2].1);
        assert!(measured[0].0 > 0.99 && measured[0].1 > 0.99, "linear off: {:?}", measured[0]);
        assert!(measured[1].0 > 0.99 && measured[1].1 > 0.99, "compensated: {:?}", measured[1]);
        assert!(measured[0].2 > 0.95 && measured[1].2 > 0.95, "full size: {measured:?}");
        assert!(measured[2].1 < 0.5 && measured[2].2 < 0.25, "reference normalizer: the linear terms outweigh the planted key, the value shrinks: {:?}", measured[2]);
        assert!(measured[3].1 == 0.0 && measured[3].0 < 0.5, "not selected, not retrieved: {:?}", measured[3]);
    }
}
