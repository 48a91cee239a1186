//! Decode caches for every model family. A model computes the new tokens' rotated queries
//! `[B, H, n, hd]` and rotated keys / values `[B, H_kv, n, hd]` (per KV head, so grouped-query
//! attention keeps its saving) and hands them to its layer's cache, which keeps what later tokens need.
//! Each variant's cache is a [`KindCache`] (made by its layer's `new_cache`), for instance:
//! - vanilla: `Recent` holding every token; window: `Recent` holding the last w (`super::window`);
//! - DAR / uniform: `super::dar::DarCache` (last w tokens full width, a d_down latent for every token);
//! - STILL / LoLCATs: `super::still::HybridCache` (selected K/V, the window of chunks, S and z).
//!
//! The softmax caches never copy what they hold: their buffers ([`Slots`]) are preallocated (sized
//! from the request by [`DecodeCache::reserve`], else grown by doubling) and written in place; a
//! window is a ring buffer (position p in slot p mod w). An empty cache is filled from the prefill's
//! own tensors after the training forward's fast kernels (`Layer::decode`). One new token attends all
//! the cache holds by an explicit softmax over views of its buffers ([`attend_newest`]); several new
//! tokens after cached ones (a prompt fed in pieces) take the explicit masked softmax.
use super::layer::Heads;
use super::masked_softmax_attention;
use std::any::Any;
use tch::{Device, Kind, Tensor};

/// What a layer's cache is made of (the same in every family): batch, KV heads, head dim, dtype, device.
#[derive(Debug, Clone, Copy)]
pub struct CacheShape {
    pub batch: i64,
    pub kv_heads: i64,
    pub head_dim: i64,
    pub kind: Kind,
    pub device: Device,
}

pub(crate) fn tensor_bytes(t: &Tensor) -> i64 {
    t.numel() as i64 * t.kind().elt_size_in_bytes() as i64
}

/// A buffer whose axis `dim` holds one slot per token, written in place. Capacity grows by doubling
/// (or to what [`Slots::reserve`] asks) up to `limit` slots (a window's ring) and never shrinks.
pub struct Slots {
    buf: Tensor,
    dim: i64,
    limit: Option<i64>,
}

impl Slots {
    /// Empty slots of `shape` (its entry at `dim` is ignored).
    pub fn new(shape: &[i64], dim: usize, limit: Option<i64>, kind: Kind, device: Device) -> Self {
        let mut s = shape.to_vec();
        s[dim] = 0;
        Slots { buf: Tensor::zeros(s.as_slice(), (kind, device)), dim: dim as i64, limit }
    }

    pub fn capacity(&self) -> i64 {
        self.buf.size()[self.dim as usize]
    }

    /// The storage (tests: nothing is copied while the capacity suffices).
    pub fn storage(&self) -> &Tensor {
        &self.buf
    }

    /// Room for `slots` slots (at most `limit`): one copy of the filled part when the buffer grows,
    /// to at least twice its size.
    pub fn reserve(&mut self, slots: i64) {
        let want = self.limit.map_or(slots, |w| slots.min(w));
        let cap = self.capacity();
        if want <= cap {
            return;
        }
        let new_cap = self.limit.map_or(want.max(2 * cap), |w| want.max(2 * cap).min(w));
        let mut shape = self.buf.size();
        shape[self.dim as usize] = new_cap;
        let grown = Tensor::zeros(shape.as_slice(), (self.buf.kind(), self.buf.device()));
        if cap > 0 {
            grown.narrow(self.dim, 0, cap).copy_(&self.buf);
        }
        self.buf = grown;
    }

    /// Write `x` (its axis `dim` holding `n` ≤ capacity − slot tokens) from slot `slot` on.
    pub fn write(&mut self, slot: i64, x: &Tensor) {
        let n = x.size()[self.dim as usize];
        self.buf.narrow(self.dim, slot, n).copy_(x);
    }

    /// Write `x` (one token on axis `dim`) into the slot named by the device tensor `slot` (`[1]`
    /// i64): no host value, so a CUDA graph replays it at each new position.
    pub fn write_at(&mut self, slot: &Tensor, x: &Tensor) {
        let _ = self.buf.index_copy_(self.dim, slot, x);
    }

    /// The first `n` slots (a view).
    pub fn view(&self, n: i64) -> Tensor {
        self.buf.narrow(self.dim, 0, n)
    }
}

/// The position each of a ring's `slots` (of `w` in all; position p goes in slot p mod w) holds once
/// position `newest` (an i64 tensor of one element, on the host or the device) is written: the
/// latest position ≤ newest congruent to the slot, newest − ((newest − slot) mod w); negative: none yet.
pub(crate) fn ring_positions(newest: &Tensor, slots: &Tensor, w: i64) -> Tensor {
    newest - (newest - slots).remainder(w)
}

/// Where a one-token decode step runs when its position lives on the device (`LayerOp::decode_at`):
/// every shape depends on `span` alone and nothing is read back to the host, so one CUDA graph
/// captures the step and replays it at every position up to `span` (`eval::stepper`).
pub struct StepAt {
    /// The new token's position `[1]` i64, on the model's device.
    pub pos: Tensor,
    /// Slots of a full-length buffer the step reads (≥ pos + 1, ≤ the reserved capacity): keys
    /// beyond the newest are masked, so one span serves many positions.
    pub span: i64,
}

/// A device-side step's RoPE tables for key positions 0..span (DAR's distant keys, rebuilt or read
/// through the absorbed map): the prepared ones' first rows ([`StepTables`]), else made by the first
/// layer that asks, shared by the others.
pub struct SpanTables {
    span: i64,
    tables: std::cell::OnceCell<(Tensor, Tensor)>,
}

impl SpanTables {
    /// `prepared`: tables of at least `span` positions made before the step ([`StepTables::covering`]).
    pub fn new(span: i64, prepared: Option<&(Tensor, Tensor)>) -> Self {
        let tables = std::cell::OnceCell::new();
        if let Some((c, s)) = prepared {
            let _ = tables.set((c.narrow(0, 0, span), s.narrow(0, 0, span)));
        }
        SpanTables { span, tables }
    }

    /// The tables of positions 0..n: the step's own when n is its span, else `make`'s.
    pub fn get(&self, n: i64, make: impl Fn() -> (Tensor, Tensor)) -> (Tensor, Tensor) {
        if n != self.span {
            return make();
        }
        let (c, s) = self.tables.get_or_init(make);
        (c.shallow_clone(), s.shallow_clone())
    }
}

/// A model's RoPE tables (cos, sin) of positions 0..n, made before a decode's device-side steps and
/// outside any CUDA graph (`Model::prepare_step_at`), then read by every step: its query's rows by
/// one index_select each, its key positions 0..span ([`SpanTables`]) as a view. Made inside the
/// step, each set was about seven kernels (aranges, the frequencies' exp, products, cos, sin) in
/// every replay; the numbers are the same bit for bit (the same fp32 ops on the same positions).
/// Tables made for a shorter reservation stay alive beside longer ones: a graph captured over them
/// reads their memory for as long as it lives.
#[derive(Debug, Default)]
pub struct StepTables(std::sync::Mutex<Vec<(Device, Tensor, Tensor)>>);

impl StepTables {
    /// Make sure tables of at least `n` positions exist on `device`, by `make(len)` for positions
    /// 0..len (len a power of two ≥ n, so that longer generations seldom make new ones). Eager: call
    /// it outside graph capture.
    pub fn prepare(&self, n: i64, device: Device, make: impl Fn(i64) -> (Tensor, Tensor)) {
        if self.covering(n, device).is_some() {
            return;
        }
        let len = (n.max(1) as u64).next_power_of_two() as i64;
        let (c, s) = tch::no_grad(|| make(len));
        self.0.lock().expect("step tables lock").push((device, c, s));
    }

    /// Prepared tables of at least `n` positions on `device` (all their rows), if any.
    pub fn covering(&self, n: i64, device: Device) -> Option<(Tensor, Tensor)> {
        let tables = self.0.lock().expect("step tables lock");
        tables.iter().rev().find(|(d, c, _)| *d == device && c.size()[0] >= n).map(|(_, c, s)| (c.shallow_clone(), s.shallow_clone()))
    }

    /// The rows of positions `pos` `[1]` (i64, on the tables' device) of tables from [`StepTables::covering`].
    pub fn rows((c, s): &(Tensor, Tensor), pos: &Tensor) -> (Tensor, Tensor) {
        let rows = pos.view([-1]);
        (c.index_select(0, &rows), s.index_select(0, &rows))
    }
}

impl StepAt {
    /// `[1, 1, 1, len]` → the mask shape of `attend_newest`, with the padding of the rows.
    pub(crate) fn mask(pad: &Option<Padding>, visible: Tensor, pos: &Tensor) -> Tensor {
        Padding::and(pad, visible.view([1, 1, 1, -1]), pos)
    }
}

/// Rotated keys and values `[B, H_kv, S, hd]` of the most recent tokens: all of them (`keep: None`,
/// position p in slot p) or the last `keep` (a ring: position p in slot p mod keep).
pub struct Recent {
    k: Slots,
    v: Slots,
    keep: Option<i64>,
    /// Tokens written so far.
    seen: i64,
    /// Left padding of a batch of prompts (`DecodeCache::set_padding`).
    pad: Option<Padding>,
}

impl Recent {
    pub fn new(shape: &CacheShape, keep: Option<i64>) -> Self {
        let s = [shape.batch, shape.kv_heads, 0, shape.head_dim];
        Recent { k: Slots::new(&s, 2, keep, shape.kind, shape.device), v: Slots::new(&s, 2, keep, shape.kind, shape.device), keep, seen: 0, pad: None }
    }

    pub fn set_padding(&mut self, pad: &Padding) {
        self.pad = Some(pad.clone());
    }

    /// Slots holding a token.
    pub fn filled(&self) -> i64 {
        self.keep.map_or(self.seen, |w| self.seen.min(w))
    }

    /// Bytes of the keys and values held (the cache's size; spare capacity not counted).
    pub fn bytes(&self) -> i64 {
        let per_slot = tensor_bytes(self.k.storage()) / self.k.capacity().max(1);
        2 * self.filled() * per_slot
    }

    /// Room for `tokens` tokens in all.
    pub fn reserve(&mut self, tokens: i64) {
        self.k.reserve(tokens);
        self.v.reserve(tokens);
    }

    /// The most bytes held after `tokens` tokens: keys and values of all of them, or of the last `keep`.
    pub fn bound(&self, tokens: i64) -> i64 {
        let s = self.k.storage().size();
        let slot = s[0] * s[1] * s[3] * self.k.storage().kind().elt_size_in_bytes() as i64;
        2 * self.keep.map_or(tokens, |w| tokens.min(w)) * slot
    }

    /// The key and value buffers (tests).
    pub fn storage(&self) -> (&Tensor, &Tensor) {
        (self.k.storage(), self.v.storage())
    }

    /// Keys and values of every slot holding a token, in slot order (a view).
    pub fn held(&self) -> (Tensor, Tensor) {
        (self.k.view(self.filled()), self.v.view(self.filled()))
    }

    /// The position of the token in each held slot `[filled]` (a ring's slots are not in order).
    pub fn positions(&self, device: Device) -> Tensor {
        let slots = Tensor::arange(self.filled(), (Kind::Int64, device));
        match self.keep {
            Some(w) if self.seen > w => ring_positions(&Tensor::from(self.seen - 1), &slots, w),
            _ => slots,
        }
    }

    /// Store the keys / values of the next `n` tokens (only the last `keep` of them in a ring).
    pub fn push(&mut self, k: &Tensor, v: &Tensor) {
        let n = k.size()[2];
        let from = self.keep.map_or(0, |w| (n - w).max(0));
        let (start, count) = (self.seen + from, n - from);
        if count == 0 {
            // A ring of no slots (DAR with window 0) holds nothing.
            self.seen += n;
            return;
        }
        self.reserve(self.seen + n);
        match self.keep {
            None => {
                self.k.write(start, k);
                self.v.write(start, v);
            }
            Some(w) => {
                // At most two runs of slots: up to the ring's end, then from its start.
                let slot = start % w;
                let first = count.min(w - slot);
                self.k.write(slot, &k.narrow(2, from, first));
                self.v.write(slot, &v.narrow(2, from, first));
                if count > first {
                    self.k.write(0, &k.narrow(2, from + first, count - first));
                    self.v.write(0, &v.narrow(2, from + first, count - first));
                }
            }
        }
        self.seen += n;
    }

    /// Count `n` tokens written by [`Recent::write_at`] (the host's side of a device-side step).
    pub fn advance(&mut self, n: i64) {
        self.seen += n;
    }

    /// Write the key / value of the token at `at.pos` (`[B, H_kv, 1, hd]`) into its slot (a ring:
    /// pos mod keep) and return the key set that token attends with its mask: the first `at.span`
    /// slots (a ring: all of its slots), positions ≤ pos (and at distance < keep) that hold a real
    /// token. None for a ring of no slots. The buffer must hold `at.span` slots (`reserve`).
    pub(crate) fn write_at(&mut self, k: &Tensor, v: &Tensor, at: &StepAt) -> Option<(Tensor, Tensor, Tensor)> {
        let (k, v, _) = self.write_slot_at(k, v, at)?;
        let span = k.size()[2];
        let slots = Tensor::arange(span, (Kind::Int64, k.device()));
        let pos = match self.keep {
            Some(w) => ring_positions(&at.pos, &slots, w),
            None => slots,
        };
        let visible = pos.ge(0).logical_and(&pos.le_tensor(&at.pos));
        let mask = StepAt::mask(&self.pad, visible, &pos);
        Some((k, v, mask))
    }

    /// [`Recent::write_at`] without the mask: the key set's views and the ring's slot count (0: slot j
    /// holds position j), for a step that works out what each slot holds itself (the fused step).
    pub(crate) fn write_slot_at(&mut self, k: &Tensor, v: &Tensor, at: &StepAt) -> Option<(Tensor, Tensor, i64)> {
        let views = self.slot_views_at(at)?;
        let slot = match self.keep {
            Some(w) => at.pos.remainder(w),
            None => at.pos.shallow_clone(),
        };
        self.k.write_at(&slot, k);
        self.v.write_at(&slot, v);
        Some(views)
    }

    /// [`Recent::write_slot_at`]'s views without the write, for a fused step that reads the new
    /// token's own rows for its slot and writes them itself (`kernels::cuda::Fresh`).
    pub(crate) fn slot_views_at(&self, at: &StepAt) -> Option<(Tensor, Tensor, i64)> {
        let (span, keep) = match self.keep {
            Some(0) => return None,
            Some(w) => (self.k.capacity(), w),
            None => (at.span, 0),
        };
        assert!(span <= self.k.capacity() && span > 0, "decode step: span {span} beyond the cache's {} slots (reserve first)", self.k.capacity());
        Some((self.k.view(span), self.v.view(span), keep))
    }

    /// The held keys (slots, positions, mask of the ones the new queries at p0.. see) and the new
    /// ones (band mask), for the explicit masked softmax of several new tokens. Call before `push`.
    pub(crate) fn parts_before_push(&self, k: &Tensor, v: &Tensor, p0: i64) -> Vec<(Tensor, Tensor, Tensor)> {
        let (n, device) = (k.size()[2], k.device());
        let visible = |d: Tensor| match self.keep {
            None => d.ge(0),
            Some(w) => d.ge(0).logical_and(&d.lt(w)),
        };
        let mut parts = Vec::new();
        if self.filled() > 0 {
            let (hk, hv) = self.held();
            let pos = self.positions(device);
            let qpos = Tensor::arange_start(p0, p0 + n, (Kind::Int64, device)).unsqueeze(1);
            parts.push((hk, hv, Padding::and(&self.pad, visible(qpos - pos.unsqueeze(0)), &pos)));
        }
        let pos = Tensor::arange_start(p0, p0 + n, (Kind::Int64, device));
        parts.push((k.shallow_clone(), v.shallow_clone(), Padding::and(&self.pad, visible(distances(p0, n, p0, n, device)), &pos)));
        parts
    }

    /// Attention of the new queries at positions p0.. over every held + new key at distance <
    /// `keep` (None: all); stores the new keys / values.
    pub(crate) fn attend(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, p0: i64) -> Tensor {
        if q.size()[2] == 1 {
            self.push(k, v);
            let (hk, hv) = self.held();
            let mask = self.pad.as_ref().map(|p| p.keys(&self.positions(q.device())));
            return attend_newest(q, &[(&hk, &hv, mask)]);
        }
        let parts = self.parts_before_push(k, v, p0);
        let out = masked_parts(q, &parts);
        self.push(k, v);
        out
    }
}

/// The explicit masked softmax over parts whose keys are per KV head.
pub(crate) fn masked_parts(q: &Tensor, parts: &[(Tensor, Tensor, Tensor)]) -> Tensor {
    let expanded: Vec<(Tensor, Tensor)> = parts.iter().map(|(k, v, _)| (repeat_kv(k, q), repeat_kv(v, q))).collect();
    let refs: Vec<(&Tensor, &Tensor, &Tensor)> = expanded.iter().zip(parts).map(|((k, v), (_, _, m))| (k, v, m)).collect();
    masked_softmax_attention(q, &refs)
}

/// Left padding of a batch of prompts: row b's first `pad[b]` tokens are filler that no real token
/// reads (RoPE scores depend on relative positions only, so a row shifted right by its padding
/// computes what it computes alone).
pub struct Padding {
    /// `[B, 1, 1, 1]` i64.
    pad: Tensor,
}

impl Clone for Padding {
    fn clone(&self) -> Self {
        Padding { pad: self.pad.shallow_clone() }
    }
}

impl Padding {
    /// Pads per row `[B]`.
    pub fn new(pad: &Tensor) -> Self {
        Padding { pad: pad.to_kind(Kind::Int64).view([-1, 1, 1, 1]) }
    }

    /// The padding of each row `[B, 1, 1, 1]` i64 (a key at position p is real iff p ≥ it).
    pub fn rows(&self) -> &Tensor {
        &self.pad
    }

    /// The largest padding of any row: every row's real tokens have begun by this position.
    pub fn largest(&self) -> i64 {
        self.pad.max().int64_value(&[])
    }

    /// `[B, 1, 1, len]`: whether each key (at positions `pos` `[len]`) is a real token.
    pub fn keys(&self, pos: &Tensor) -> Tensor {
        pos.view([1, 1, 1, -1]).ge_tensor(&self.pad)
    }

    /// `mask` (`[n, len]`, by positions) without the filler keys: `[B, 1, n, len]` when padded.
    pub(crate) fn and(pad: &Option<Padding>, mask: Tensor, pos: &Tensor) -> Tensor {
        match pad {
            Some(p) => mask.logical_and(&p.keys(pos)),
            None => mask,
        }
    }

    /// Document segments `[B, n]` of a padded prompt (0: filler, 1: the prompt), for the prefill's
    /// masks (`super::doc_segments`' layout).
    pub fn segments(&self, n: i64) -> Tensor {
        Tensor::arange(n, (Kind::Int64, self.pad.device())).unsqueeze(0).ge_tensor(&self.pad.view([-1, 1])).to_kind(Kind::Int64)
    }
}

/// One new query per sequence `[B, H, 1, hd]` over key sets `[B, H_kv, S_p, hd]` (views of the cache's
/// buffers, not copied into one), each with the mask of the keys it may read (`[B, 1, 1, S_p]`, None:
/// all), as one softmax over every set (a key's slot order does not matter to a softmax). Grouped-query
/// heads are not expanded: the H / H_kv query heads of one KV head become that head's rows (HF
/// repeat_kv order). Explicit matmul → softmax (fp32) → matmul, as before the in-place caches, rather
/// than SDPA: with SDPA here the H200 decoded vanilla / DAR at 19–25 tok/s at every length (1K–64K)
/// while the window, whose key length stops changing, ran at 445 tok/s: a fixed cost per new key
/// length, i.e. SDPA's per-shape setup (BENCHMARKS.md, issue 29).
pub(crate) fn attend_newest(q: &Tensor, parts: &[(&Tensor, &Tensor, Option<Tensor>)]) -> Tensor {
    let (b, h, n, hd) = q.size4().expect("q is [B, H, n, hd]");
    assert_eq!(n, 1, "attend_newest takes one new token");
    let hkv = parts[0].0.size()[1];
    // Only made when a part has no mask: a host → device copy, which a CUDA graph cannot capture.
    let all = parts.iter().any(|p| p.2.is_none()).then(|| Tensor::from(true).to_device(q.device()));
    let masked: Vec<(&Tensor, &Tensor, &Tensor)> = parts.iter().map(|(k, v, m)| (*k, *v, m.as_ref().or(all.as_ref()).expect("a mask"))).collect();
    let q = q.reshape([b, hkv, h / hkv, hd]);
    let out = if matches!(q.kind(), Kind::BFloat16 | Kind::Half) { newest_in_half(&q, &masked) } else { masked_softmax_attention(&q, &masked) };
    out.reshape([b, h, 1, hd])
}

/// [`attend_newest`]'s softmax for 16-bit caches with Hugging Face eager attention's numerics
/// (products in the cache's dtype, fp32 accumulation inside the matmul, the softmax in fp32): the
/// fp32 path would copy every key and value it reads into fp32, per layer and token, which at 16K
/// tokens is most of a decode step's memory traffic.
fn newest_in_half(q: &Tensor, parts: &[(&Tensor, &Tensor, &Tensor)]) -> Tensor {
    let scale = 1.0 / (q.size()[3] as f64).sqrt();
    let scores: Vec<Tensor> = parts.iter().map(|(k, _, m)| (q.matmul(&k.transpose(-2, -1)) * scale).masked_fill(&m.logical_not(), f64::NEG_INFINITY)).collect();
    let p = super::joint_softmax(&scores, Kind::Float, q.kind());
    p.iter().zip(parts).map(|(p, (_, v, _))| p.matmul(v)).reduce(|a, b| a + b).expect("at least one part")
}

/// `[n, len]`: query position (p0 ..) − key position (start ..).
pub(crate) fn distances(p0: i64, n: i64, start: i64, len: i64, device: Device) -> Tensor {
    let qpos = Tensor::arange_start(p0, p0 + n, (Kind::Int64, device)).unsqueeze(1);
    qpos - Tensor::arange_start(start, start + len, (Kind::Int64, device)).unsqueeze(0)
}

/// Grouped-query attention: each KV head serves H / H_kv consecutive query heads (HF repeat_kv).
pub(crate) fn repeat_kv(x: &Tensor, q: &Tensor) -> Tensor {
    let rep = q.size()[1] / x.size()[1];
    if rep == 1 { x.shallow_clone() } else { x.repeat_interleave_self_int(rep, 1, None) }
}

/// What a layer's decode state answers, whatever its variant keeps.
pub trait KindCache: Any + Send {
    /// Bytes held (the cache's size; spare capacity not counted).
    fn bytes(&self) -> i64;
    /// The most bytes the cache may hold after `tokens` tokens: the variant's declared memory (the
    /// conformance suite holds `bytes` to it); None when bounded by rules of its own (STILL's budget).
    fn bound(&self, tokens: i64) -> Option<i64>;
    /// Room for `tokens` tokens in all, so that decoding up to there copies nothing (a cache
    /// bounded by its own rules has nothing to do).
    fn reserve(&mut self, _tokens: i64) {}
    /// Left-padded prompts: row b's first `pad[b]` tokens are filler no real token reads.
    fn set_padding(&mut self, pad: &Padding);
    /// Count `n` tokens written on the device by `LayerOp::decode_at` (nothing for a cache that
    /// has no such step).
    fn advance(&mut self, _n: i64) {}
}

/// The decode state of one layer: the cache type of the layer's variant (made by its `new_cache`).
pub struct LayerCache(Box<dyn KindCache>);

impl LayerCache {
    pub fn new(cache: impl KindCache) -> Self {
        LayerCache(Box::new(cache))
    }

    pub fn bytes(&self) -> i64 {
        self.0.bytes()
    }

    pub fn bound(&self, tokens: i64) -> Option<i64> {
        self.0.bound(tokens)
    }

    pub fn reserve(&mut self, tokens: i64) {
        self.0.reserve(tokens)
    }

    pub fn set_padding(&mut self, pad: &Padding) {
        self.0.set_padding(pad)
    }

    pub fn advance(&mut self, n: i64) {
        self.0.advance(n)
    }

    /// The variant's own state, asked for by the layer that made it.
    pub fn get<T: KindCache>(&self) -> Option<&T> {
        (self.0.as_ref() as &dyn Any).downcast_ref()
    }

    /// As [`LayerCache::get`], mutably; a cache made by another layer is a caller's bug (the model
    /// builds one cache per layer from that layer).
    pub fn state<T: KindCache>(&mut self) -> &mut T {
        (self.0.as_mut() as &mut dyn Any).downcast_mut().unwrap_or_else(|| panic!("decode: the cache was made for another attention variant, not {}", std::any::type_name::<T>()))
    }
}

impl KindCache for Recent {
    fn bytes(&self) -> i64 {
        Recent::bytes(self)
    }
    fn bound(&self, tokens: i64) -> Option<i64> {
        Some(Recent::bound(self, tokens))
    }
    fn reserve(&mut self, tokens: i64) {
        Recent::reserve(self, tokens)
    }
    fn set_padding(&mut self, pad: &Padding) {
        Recent::set_padding(self, pad)
    }
    fn advance(&mut self, n: i64) {
        Recent::advance(self, n)
    }
}

/// `LayerOp::decode_at` of a layer whose cache is a [`Recent`] (vanilla, window).
pub(crate) fn decode_recent_at(cache: &mut LayerCache, h: &Heads, at: &StepAt) -> Tensor {
    let recent = cache.state::<Recent>();
    if crate::kernels::cuda::step_enabled(&h.q, h.k.size()[1], 0) {
        use crate::kernels::cuda;
        // Fresh: the kernels read the new key / value from h and write them into their slot
        // themselves; else they are written first.
        let fresh = cuda::fresh_enabled().then_some(cuda::Fresh { kv: Some((&h.k, &h.v)), latent: None });
        let views = if fresh.is_some() { recent.slot_views_at(at) } else { recent.write_slot_at(&h.k, &h.v, at) };
        let (k, v, keep) = views.expect("a vanilla / window cache holds at least one slot");
        let pad = recent.pad.as_ref().map(|p| p.rows());
        let step = cuda::Step { q: &h.q, pos: &at.pos, pad, full: Some(cuda::FullWidth { k: &k, v: &v, keep }), distant: None, fresh };
        if let Some(out) = cuda::attend_step(&step) {
            return out.unwrap_or_else(|e| panic!("fused decode step failed: {e}"));
        }
    }
    let part = recent.write_at(&h.k, &h.v, at).expect("a vanilla / window cache holds at least one slot");
    attend_newest(&h.q, &[(&part.0, &part.1, Some(part.2))])
}

/// `LayerOp::decode` of a layer whose cache is a [`Recent`] (vanilla, window): the prefill by the
/// layer's own forward, then the explicit softmax over what the cache holds.
pub(crate) fn decode_recent(forward: impl FnOnce() -> Tensor, cache: &mut LayerCache, h: &Heads, p0: i64) -> Tensor {
    let c = cache.state::<Recent>();
    if p0 == 0 {
        let out = forward();
        c.push(&h.k, &h.v);
        return out;
    }
    c.attend(&h.q, &h.k, &h.v, p0)
}

/// The decode cache of a whole model: one `LayerCache` per layer and the number of tokens seen.
pub struct DecodeCache {
    pub layers: Vec<LayerCache>,
    pub len: i64,
    /// Left padding of the rows (set before the prefill).
    pub pad: Option<Padding>,
}

impl DecodeCache {
    pub fn new(layers: Vec<LayerCache>) -> Self {
        DecodeCache { layers, len: 0, pad: None }
    }

    /// Rows whose first `pad[b]` tokens are filler (prompts of several lengths, left-padded to one):
    /// the prefill masks them as a document of their own, and no later token reads them.
    pub fn set_padding(&mut self, pad: &Tensor) {
        assert_eq!(self.len, 0, "padding is set before the prefill");
        let p = Padding::new(pad);
        self.layers.iter_mut().for_each(|l| l.set_padding(&p));
        self.pad = Some(p);
    }

    /// The document segments of the prefill of `n` tokens when padded (`Heads::seg`).
    pub fn prefill_segments(&self, n: i64) -> Option<Tensor> {
        (self.len == 0).then(|| self.pad.as_ref().map(|p| p.segments(n))).flatten()
    }

    /// Bytes held by the cache (all layers).
    pub fn bytes(&self) -> i64 {
        self.layers.iter().map(LayerCache::bytes).sum()
    }

    /// The most bytes the layers declare they hold after `tokens` tokens (None if one does not say).
    pub fn bound(&self, tokens: i64) -> Option<i64> {
        self.layers.iter().map(|l| l.bound(tokens)).sum()
    }

    /// Count `n` tokens the layers wrote on the device (`LayerOp::decode_at`).
    pub fn advance(&mut self, n: i64) {
        self.layers.iter_mut().for_each(|l| l.advance(n));
        self.len += n;
    }

    /// Preallocate every layer for `tokens` tokens in all (prompt + new tokens).
    pub fn reserve(&mut self, tokens: i64) {
        self.layers.iter_mut().for_each(|l| l.reserve(tokens));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 16-bit one-token step (`newest_in_half`: products in bf16, the joint softmax in fp32) over
    /// two key sets of different lengths, grouped-query heads and per-row masks equals the fp32
    /// masked softmax on the same bf16 numbers, to bf16 rounding; with the parts' masks swapped it
    /// must not.
    #[test]
    fn half_precision_step_equals_the_fp32_softmax_over_its_parts() {
        let _rng = crate::testutil::seeded(8);
        let f = (Kind::Float, Device::Cpu);
        let bf = |shape: &[i64]| Tensor::randn(shape, f).to_kind(Kind::BFloat16);
        let (b, h, hkv, hd) = (2i64, 4i64, 2i64, 16i64);
        let q = bf(&[b, h, 1, hd]);
        let (k1, v1, k2, v2) = (bf(&[b, hkv, 5, hd]), bf(&[b, hkv, 5, hd]), bf(&[b, hkv, 7, hd]), bf(&[b, hkv, 7, hd]));
        let m1 = Tensor::from_slice(&[true, false, true, true, false, true, true, true, false, true]).view([b, 1, 1, 5]);
        let m2 = Tensor::rand([b, 1, 1, 7], f).gt(0.3);
        let got = attend_newest(&q, &[(&k1, &v1, Some(m1.shallow_clone())), (&k2, &v2, Some(m2.shallow_clone()))]).to_kind(Kind::Float);
        let want = |m1: &Tensor, m2: &Tensor| {
            let r = |x: &Tensor| repeat_kv(&x.to_kind(Kind::Float), &q);
            let qf = q.to_kind(Kind::Float);
            masked_softmax_attention(&qf, &[(&r(&k1), &r(&v1), m1), (&r(&k2), &r(&v2), m2)])
        };
        let err = (&got - want(&m1, &m2)).abs().max().double_value(&[]);
        assert!(err < 3e-2, "bf16 step vs fp32: {err}");
        let swapped = (&got - want(&m1.logical_not(), &m2.logical_not().logical_or(&m1.narrow(3, 0, 1)))).abs().max().double_value(&[]);
        assert!(swapped > 0.1, "other masks give the same output: {swapped}");
    }
}
