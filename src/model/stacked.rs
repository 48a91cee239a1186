//! Projections of one input that share one matrix multiply at inference: Llama's q / k / v and
//! gate / up, GPT-NeoX's query_key_value with DAR's W_down (biases stacked too, zeros where a part
//! has none). A decode step is launch-bound (one token, a few microseconds a GEMM), so three
//! GEMMs of one input cost about three times one.
//!
//! The parameters stay what they are (names, shapes, gradients, optimizer slots, checkpoints);
//! their data become row blocks of one stacked matrix, so that in-place updates (an optimizer
//! step, a checkpoint load) land in the stack too. Anything that gives a parameter new data
//! (a dtype or device change) ends the sharing; [`Stacked::get`] sees that and says no, and the
//! next [`Stacked::stack`] (an eager inference pass: prefill, before a CUDA graph is captured)
//! stacks again. `ATTNLAB_STACKED=0` stacks nothing (to time or check the separate multiplies). On
//! one H100, STILL (budget) and LoLCATs (Llama hybrids) decode 1.07–1.12× faster stacked, with the
//! same greedy tokens (results/bench/2026-12-07-h100, `scripts/gpu_bench.sh stacked`).
use crate::util::grad_enabled;
use std::sync::Mutex;
use tch::Tensor;

/// One stack of weights `[Σ rows_i, in]` whose row blocks are the parts' data, and where the parts
/// have biases, their stack `[Σ rows_i]`.
#[derive(Default)]
pub struct Stacked {
    stack: Mutex<Option<(Tensor, Option<Tensor>)>>,
}

impl Stacked {
    /// Make `parts` (weights `[rows_i, in]` of one dtype and device) row blocks of one stack, unless
    /// they already are. Not during a CUDA graph capture (it allocates).
    pub fn stack(&self, parts: &[&Tensor]) {
        self.stack_biased(parts, &[]);
    }

    /// [`Stacked::stack`] with the parts' biases (`biases`: one per part, `None` for a part without
    /// one, whose rows then add zeros; empty: no part has a bias).
    pub fn stack_biased(&self, parts: &[&Tensor], biases: &[Option<&Tensor>]) {
        let mut stack = self.stack.lock().unwrap_or_else(|e| e.into_inner());
        let fits = biases.is_empty() || (biases.len() == parts.len() && biases.iter().flatten().all(|b| b.size() == [b.size()[0]] && b.kind() == parts[0].kind() && b.device() == parts[0].device()));
        if stack.as_ref().is_some_and(|s| holds(s, parts, biases)) || !stackable(parts) || !fits || std::env::var("ATTNLAB_STACKED").as_deref() == Ok("0") {
            return;
        }
        let _guard = tch::no_grad_guard();
        let s = Tensor::cat(parts, 0);
        let sb = (!biases.is_empty()).then(|| {
            let rows: Vec<Tensor> = parts.iter().zip(biases).map(|(p, b)| b.map_or_else(|| Tensor::zeros([p.size()[0]], (p.kind(), p.device())), |b| b.detach())).collect();
            Tensor::cat(&rows, 0)
        });
        let mut row = 0;
        for (i, p) in parts.iter().enumerate() {
            let rows = p.size()[0];
            // A handle shares the parameter's TensorImpl: every other handle (the VarStore's, the
            // optimizer's) sees the new data.
            p.shallow_clone().set_data(&s.narrow(0, row, rows));
            if let (Some(sb), Some(Some(b))) = (&sb, biases.get(i)) {
                b.shallow_clone().set_data(&sb.narrow(0, row, rows));
            }
            row += rows;
        }
        *stack = Some((s, sb));
    }

    /// The stack, where `parts` still are its row blocks. A stack they have left is dropped (its
    /// memory is no parameter's any more).
    pub fn get(&self, parts: &[&Tensor]) -> Option<Tensor> {
        self.get_biased(parts, &[]).map(|(w, _)| w)
    }

    /// [`Stacked::get`] with the biases' stack (`None` where the parts have none), `biases` as
    /// [`Stacked::stack_biased`] took them.
    pub fn get_biased(&self, parts: &[&Tensor], biases: &[Option<&Tensor>]) -> Option<(Tensor, Option<Tensor>)> {
        let mut stack = self.stack.lock().unwrap_or_else(|e| e.into_inner());
        if stack.as_ref().is_some_and(|s| !holds(s, parts, biases)) {
            *stack = None;
        }
        stack.as_ref().map(|(w, b)| (w.shallow_clone(), b.as_ref().map(Tensor::shallow_clone)))
    }

    /// `x·[W₁; W₂; …]ᵀ`, the parts' outputs side by side along the last dim, under
    /// [`Stacked::forward`]'s conditions.
    pub fn product(&self, x: &Tensor, parts: &[&Tensor]) -> Option<Tensor> {
        self.product_biased(x, parts, &[])
    }

    /// [`Stacked::product`] plus the parts' biases (as [`Stacked::stack_biased`] took them).
    pub fn product_biased(&self, x: &Tensor, parts: &[&Tensor], biases: &[Option<&Tensor>]) -> Option<Tensor> {
        if parts.iter().chain(biases.iter().flatten()).any(|p| p.requires_grad()) && grad_enabled() {
            return None;
        }
        let (w, b) = self.get_biased(parts, biases)?;
        Some(x.linear(&w, b.as_ref()))
    }

    /// `x·Wᵢᵀ` for every part, by one matrix multiply (views of its output, split along the last
    /// dim); `None` where the parts are not stacked or a weight needs its gradient (autograd on and
    /// a part requiring grad: the stack is outside the graph).
    pub fn forward(&self, x: &Tensor, parts: &[&Tensor]) -> Option<Vec<Tensor>> {
        let y = self.product(x, parts)?;
        let mut col = 0;
        Some(
            parts
                .iter()
                .map(|p| {
                    let rows = p.size()[0];
                    col += rows;
                    y.narrow(-1, col - rows, rows)
                })
                .collect(),
        )
    }
}

/// Parts that can share a stack: 2-D, contiguous, one input width, dtype and device.
pub fn stackable(parts: &[&Tensor]) -> bool {
    let Some(first) = parts.first() else { return false };
    parts.iter().all(|p| p.dim() == 2 && p.is_contiguous() && p.size()[1] == first.size()[1] && p.kind() == first.kind() && p.device() == first.device())
}

/// Whether `parts` are, in order, the row blocks of the stack's weights (same storage, offsets,
/// shapes, dtype), and `biases` (empty: none) the blocks of its biases.
fn holds(stack: &(Tensor, Option<Tensor>), parts: &[&Tensor], biases: &[Option<&Tensor>]) -> bool {
    let (s, sb) = stack;
    if biases.is_empty() != sb.is_none() || (!biases.is_empty() && biases.len() != parts.len()) {
        return false;
    }
    let (width, elt) = (s.size()[1], s.kind().elt_size_in_bytes());
    let mut row = 0;
    for (i, p) in parts.iter().enumerate() {
        let offset = (row * width) as usize * elt;
        if p.kind() != s.kind() || p.device() != s.device() || p.size() != [p.size()[0], width] || !p.is_contiguous() || p.data_ptr() as usize != s.data_ptr() as usize + offset {
            return false;
        }
        if let (Some(sb), Some(Some(b))) = (sb, biases.get(i)) {
            if b.kind() != sb.kind() || b.size() != [p.size()[0]] || b.data_ptr() as usize != sb.data_ptr() as usize + row as usize * elt {
                return false;
            }
        }
        row += p.size()[0];
    }
    row == s.size()[0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn weights() -> Vec<Tensor> {
        let _g = crate::testutil::seeded(3);
        [4, 2, 2].iter().map(|&r| Tensor::randn([r, 5], (Kind::Double, Device::Cpu)).set_requires_grad(true)).collect()
    }

    #[test]
    fn one_multiply_equals_each_projection_and_follows_in_place_updates() {
        let w = weights();
        let parts: Vec<&Tensor> = w.iter().collect();
        let x = Tensor::randn([3, 7, 5], (Kind::Double, Device::Cpu));
        let st = Stacked::default();
        st.stack(&parts);
        let _g = tch::no_grad_guard();
        let check = |st: &Stacked| {
            let ys = st.forward(&x, &parts).expect("stacked");
            for (y, p) in ys.iter().zip(&parts) {
                let want = x.linear::<Tensor>(*p, None);
                assert!(y.allclose(&want, 1e-12, 1e-12, false), "{:?}", (y - want).abs().max());
            }
        };
        check(&st);
        // An optimizer's in-place update of one parameter is the stack's too.
        let _ = w[1].shallow_clone().g_add_scalar_(0.5);
        check(&st);
        assert!(st.get(&parts).unwrap().narrow(0, 4, 2).allclose(&w[1], 0.0, 0.0, false));
    }

    #[test]
    fn biases_stack_with_their_weights_and_a_part_without_one_adds_zeros() {
        let w = weights();
        let parts: Vec<&Tensor> = w.iter().collect();
        let _g = crate::testutil::seeded(4);
        let b: Vec<Tensor> = [4, 2].iter().map(|&r| Tensor::randn([r], (Kind::Double, Device::Cpu))).collect();
        let biases = [Some(&b[0]), None, Some(&b[1])];
        let x = Tensor::randn([3, 7, 5], (Kind::Double, Device::Cpu));
        let st = Stacked::default();
        st.stack_biased(&parts, &biases);
        let _ng = tch::no_grad_guard();
        let check = |st: &Stacked| {
            let y = st.product_biased(&x, &parts, &biases).expect("stacked");
            let want = Tensor::cat(&[x.linear(parts[0], Some(&b[0])), x.linear::<Tensor>(parts[1], None), x.linear(parts[2], Some(&b[1]))], -1);
            assert!(y.allclose(&want, 1e-12, 1e-12, false), "{:?}", (&y - &want).abs().max());
        };
        check(&st);
        // An in-place update of a bias is the stack's too.
        let _ = b[1].shallow_clone().g_add_scalar_(0.25);
        check(&st);
        // Asked without its biases, the stack is not the one that was made.
        assert!(st.get_biased(&parts, &[]).is_none());
        st.stack_biased(&parts, &biases);
        // New data for a bias ends the sharing.
        b[0].shallow_clone().set_data(&b[0].detach().copy());
        assert!(st.get_biased(&parts, &biases).is_none());
    }

    #[test]
    fn new_data_for_a_part_ends_the_sharing_until_stacked_again() {
        let w = weights();
        let parts: Vec<&Tensor> = w.iter().collect();
        let st = Stacked::default();
        st.stack(&parts);
        assert!(st.get(&parts).is_some());
        // As a dtype change does: the parameter gets a tensor of its own.
        w[2].shallow_clone().set_data(&w[2].detach().copy());
        assert!(st.get(&parts).is_none(), "a replaced part must not be read from the old stack");
        let _g = tch::no_grad_guard();
        assert!(st.forward(&w[0], &parts).is_none());
        st.stack(&parts);
        assert!(st.get(&parts).is_some());
        // In another order they are not the stack's row blocks.
        assert!(st.get(&[parts[1], parts[0], parts[2]]).is_none());
    }

    #[test]
    fn no_stacked_multiply_where_a_weight_gradient_is_wanted() {
        assert!(grad_enabled());
        assert!(!tch::no_grad(grad_enabled));
        let w = weights();
        let parts: Vec<&Tensor> = w.iter().collect();
        let st = Stacked::default();
        st.stack(&parts);
        let x = Tensor::ones([1, 5], (Kind::Double, Device::Cpu));
        assert!(st.forward(&x, &parts).is_none(), "autograd on: the parameters need their own graph");
        let _g = tch::no_grad_guard();
        assert!(st.forward(&x, &parts).is_some());
    }

    #[test]
    fn stacked_parameters_save_and_load_as_themselves() {
        let w = weights();
        let parts: Vec<&Tensor> = w.iter().collect();
        Stacked::default().stack(&parts);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let named: Vec<(String, &Tensor)> = w.iter().enumerate().map(|(i, t)| (format!("w{i}"), t)).collect();
        Tensor::write_safetensors(&named, &path).unwrap();
        let back = Tensor::read_safetensors(&path).unwrap();
        for (name, t) in back {
            let i: usize = name[1..].parse().unwrap();
            assert!(t.allclose(&w[i], 0.0, 0.0, false), "{name}");
        }
    }
}
