//! The softmax attention kinds, registered once. A kind is a type in its own file that implements
//! [`SoftmaxKind`]: its options as a spec writes them (serde, `deny_unknown_fields`, so a key belongs
//! to one kind and every other kind refuses it), how they resolve, its names, label, line style,
//! bench op and layer. The registration (`softmax_kinds!`, invoked once in `attention/mod.rs`)
//! generates [`AttentionKind`] (a kind's name alone: tables, `compare`, `bench`) and [`AttentionSpec`]
//! (a kind with its options: a spec's `attention:`, config.yaml, a model's config.json) and every
//! dispatch between them; adding a kind is its file plus one line in that list, and the compiler
//! names each thing the kind must answer.
use super::layer::{LayerDims, LayerOp};
pub use super::{AttentionKind, AttentionSpec};
use crate::error::Invalid;
use crate::Result;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_yaml::{Mapping, Value};
use tch::{nn, Tensor};

/// How a plot strokes a line: one style per attention kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LineStyle {
    Solid,
    Dashed,
    Dotted,
}

/// Which implementation computes a softmax kind's attention (all compute the same function).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum AttentionImpl {
    /// Fastest available: on CUDA (bf16/fp16, head dim a multiple of 8, ≤ 256) split-merge-band when
    /// training where it takes the inputs, else split-merge-fused; split-merge (flash) at inference,
    /// split-merge-cudnn from 32K keys on; on the CPU (fp32 / fp64) band-split where T ≥ 256
    /// and w ≤ T/16 (measured faster there); masked SDPA otherwise.
    #[default]
    Auto,
    /// Explicit masked scores (slow, O(T²) memory): the oracle.
    Reference,
    /// SDPA over concatenated local + global keys with a boolean mask (dar-kernels.md §2).
    Sdpa,
    /// Sliding-window flash call (local) + causal flash call over the bottleneck keys (global),
    /// merged by log-sum-exp, exact custom backward (dar-kernels.md §3; CUDA only).
    SplitMerge,
    /// As split-merge, with cuDNN attention for the global part.
    SplitMergeCudnn,
    /// Split-merge with cuDNN, the merge in one pass in place (bf16 out, log-sum-exp kept) and
    /// dK_g / dV_g by one padded write (issue 28); `auto`'s choice for training where
    /// split-merge-band does not take the inputs.
    SplitMergeFused,
    /// Split-merge with cuDNN for the distant part and our band kernels for the local part, the merge
    /// in the band's epilogue and dQ's scatter-add in its backward (csrc/cuda/dar_band.cu; issue 35;
    /// CUDA, bf16, head dim 64 / 128, with the kernel library; else split-merge-fused). `auto`'s
    /// choice for training: it passes `bench --check` on a GPU and is the fastest op (issue 35).
    SplitMergeBand,
    /// CPU (fp32 / fp64): the local band by blocks of queries against the keys their band touches,
    /// the distant keys by the CPU flash kernel (causal over the shifted sequences), merged by
    /// log-sum-exp, exact custom backward (csrc/dar_band.cpp; issue 35). Elsewhere: masked SDPA.
    BandSplit,
}

/// What commands and the report read of any kind's options (None: the kind has no such option, or
/// it is unset in an unresolved spec).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Settings {
    /// Bottleneck width of distant keys (DAR, uniform).
    pub d_down: Option<usize>,
    /// Keys at distance < window are read at full width (uniform: 0).
    pub window: Option<usize>,
    /// How pretraining starts a bottleneck.
    pub init: Option<super::dar::AttentionInit>,
    /// DAR's latent activation (linear for kinds without one).
    pub dar_act: super::dar::DarAct,
    pub implementation: AttentionImpl,
}

/// The bottleneck keys / values a bench op may read besides the full-width ones.
pub struct BenchInputs<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    /// Distant (bottleneck) keys / values, the shape of k / v.
    pub kg: &'a Tensor,
    pub vg: &'a Tensor,
    pub window: i64,
    pub imp: AttentionImpl,
}

/// What a softmax attention kind answers: one implementation per kind, in the kind's own file.
pub trait SoftmaxKind: Sized + Clone + std::fmt::Debug + PartialEq + Default + Serialize + DeserializeOwned {
    /// The spec's spelling (`attention.kind: NAME`); `compare`, `bench`, bench-decode and the
    /// report's `kind` column write it.
    const NAME: &'static str;
    /// Other names a spec or `--kinds` may use for the kind (read, never written).
    const ALIASES: &'static [&'static str] = &[];
    /// The report tables' Model column.
    const TABLE_NAME: &'static str;
    /// How plots stroke the kind's lines.
    const LINE_STYLE: LineStyle;
    /// What `bench-decode --attention NAME` builds (its `--help` and errors list these).
    const DECODE_BENCH: &'static str;
    /// The kind adds a bottleneck's parameters to each layer (a model cannot switch to it in place).
    const HAS_BOTTLENECK: bool;
    /// Keys within a local window only, nothing farther (the window-only control).
    const LOCAL_ONLY: bool;

    /// The kind's options for the same experiment as `other` (`compare`, `Spec::with_attention`):
    /// keep what still applies, leave the rest to `resolve`'s defaults.
    fn adopt(other: &AttentionSpec) -> Self;
    /// Fill every default for a model of width `d_model` and check every value; an error names the
    /// key under `attention.`.
    fn resolve(&mut self, d_model: usize) -> std::result::Result<(), Invalid>;
    /// The options as `attnlab finetune` gives them to a pretrained model, resolved, or the refusal.
    fn resolve_finetune(&mut self) -> std::result::Result<(), Invalid>;
    /// The form in which the report compares runs: what tells configurations apart, nothing else
    /// (the implementation and the note are dropped; implementations compute the same function).
    fn comparable(&self) -> AttentionSpec;
    /// Plot legends and run lists ("DAR (d_down 128, w 128)"), of the comparable form.
    fn label(&self) -> String;
    fn settings(&self) -> Settings;
    fn set_implementation(&mut self, imp: AttentionImpl);
    /// The run's seed, for a kind whose parameters start from their own seeded stream (DAR's
    /// bottleneck); kinds without parameters have nothing to seed.
    fn set_init_seed(&mut self, _seed: u64) {}
    /// How a resolved spec's kind was interpreted (`compare` prints it).
    fn note(&self) -> Option<&str>;
    /// One layer's attention under the module path `p`.
    fn layer(&self, p: &nn::Path, dims: LayerDims) -> Result<Box<dyn LayerOp>>;
    /// The attention op alone, as `attnlab bench` times it (at `op_window`).
    fn bench_op(x: &BenchInputs) -> Tensor;
    /// The local window the op uses when the bench asks for `window` (uniform: 0).
    fn op_window(window: i64) -> i64 {
        window
    }
    /// Keys that older versions recorded for this kind although it ignores them (DarConfig wrote
    /// `d_down: 0, window: 0` for every kind): removed before the kind's own fields are read.
    fn upgrade_legacy(_map: &mut Mapping) {}
}

/// The local window a kind with one starts with (`window: 128`, dar.md §4.1).
pub const DEFAULT_WINDOW: i64 = 128;

/// A local window that holds at least the current token, default [`DEFAULT_WINDOW`], resolved
/// (window-only and sinks; `kind` names the kind in the refusal).
pub(crate) fn resolve_local_window(window: &mut Option<i64>, kind: &str) -> std::result::Result<i64, Invalid> {
    let w = *window.get_or_insert(DEFAULT_WINDOW);
    if w < 1 {
        return Err(("window".into(), format!("{w}: kind: {kind} needs window ≥ 1 (the current token)")));
    }
    Ok(w)
}

/// Remove `key` from an old config where it holds a value the kind ignores (any value when `neutral`
/// is None).
pub(crate) fn drop_legacy(map: &mut Mapping, key: &str, neutral: Option<Value>) {
    let k = Value::String(key.into());
    if map.get(&k).is_some_and(|v| neutral.as_ref().is_none_or(|n| n == v || v.as_i64().zip(n.as_i64()).is_some_and(|(a, b)| a == b))) {
        map.shift_remove(&k);
    }
}

/// The registration (invoked once, in `attention/mod.rs`): `module: Kind, …;` per line declares the
/// module (its file) and the kinds it defines, each the type `module::Kind` implementing
/// [`SoftmaxKind`]. It generates [`AttentionKind`], [`AttentionSpec`] and every dispatch between them.
macro_rules! softmax_kinds {
    ($($module:ident: $($kind:ident),+;)*) => {
        $(pub mod $module;)*

        /// A softmax attention kind by name (`AttentionSpec` holds its options).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum AttentionKind {
            $($($kind,)+)*
        }

        /// A softmax attention kind with its options: a spec's `attention:` (`kind:` tags it; no
        /// `kind:` is vanilla), config.yaml, and a model config (config.json `attnlab_attention`).
        #[derive(Debug, Clone, PartialEq)]
        pub enum AttentionSpec {
            $($($kind($module::$kind),)+)*
        }

        impl AttentionKind {
            /// Every kind, in the order tables, plots and `bench` list them.
            pub const ALL: [AttentionKind; 0 $($(+ { let _ = stringify!($kind); 1 })+)*] = [$($(AttentionKind::$kind,)+)*];

            /// Other names the kind is read by.
            pub fn aliases(self) -> &'static [&'static str] {
                match self { $($(AttentionKind::$kind => <$module::$kind as $crate::attention::kinds::SoftmaxKind>::ALIASES,)+)* }
            }
            pub fn name(self) -> &'static str {
                match self { $($(AttentionKind::$kind => <$module::$kind as $crate::attention::kinds::SoftmaxKind>::NAME,)+)* }
            }
            /// The report tables' Model column.
            pub fn table_name(self) -> &'static str {
                match self { $($(AttentionKind::$kind => <$module::$kind as $crate::attention::kinds::SoftmaxKind>::TABLE_NAME,)+)* }
            }
            /// How plots stroke the kind's lines.
            pub fn line_style(self) -> $crate::attention::kinds::LineStyle {
                match self { $($(AttentionKind::$kind => <$module::$kind as $crate::attention::kinds::SoftmaxKind>::LINE_STYLE,)+)* }
            }
            /// What `bench-decode --attention NAME` builds for the kind.
            pub fn decode_bench_model(self) -> &'static str {
                match self { $($(AttentionKind::$kind => <$module::$kind as $crate::attention::kinds::SoftmaxKind>::DECODE_BENCH,)+)* }
            }
            /// DAR and uniform add a d_down bottleneck per layer.
            pub fn has_bottleneck(self) -> bool {
                match self { $($(AttentionKind::$kind => <$module::$kind as $crate::attention::kinds::SoftmaxKind>::HAS_BOTTLENECK,)+)* }
            }
            /// Keys within the window only, nothing farther.
            pub fn is_local_only(self) -> bool {
                match self { $($(AttentionKind::$kind => <$module::$kind as $crate::attention::kinds::SoftmaxKind>::LOCAL_ONLY,)+)* }
            }
            /// The kind's options for the experiment `other` describes (`AttentionSpec::adopt`).
            pub fn adopt(self, other: &AttentionSpec) -> AttentionSpec {
                match self { $($(AttentionKind::$kind => AttentionSpec::$kind(<$module::$kind as $crate::attention::kinds::SoftmaxKind>::adopt(other)),)+)* }
            }
            /// The local window the kind's op uses when `window` is asked for (uniform: 0).
            pub fn op_window(self, window: i64) -> i64 {
                match self { $($(AttentionKind::$kind => <$module::$kind as $crate::attention::kinds::SoftmaxKind>::op_window(window),)+)* }
            }
            /// The kind's attention op alone (`attnlab bench`).
            pub fn bench_op(self, x: &$crate::attention::kinds::BenchInputs) -> tch::Tensor {
                match self { $($(AttentionKind::$kind => <$module::$kind as $crate::attention::kinds::SoftmaxKind>::bench_op(x),)+)* }
            }
            /// The kind's options from a mapping without `kind:` (old keys upgraded first).
            fn read(self, mut map: serde_yaml::Mapping) -> std::result::Result<AttentionSpec, serde_yaml::Error> {
                match self {
                    $($(AttentionKind::$kind => {
                        <$module::$kind as $crate::attention::kinds::SoftmaxKind>::upgrade_legacy(&mut map);
                        serde_yaml::from_value(serde_yaml::Value::Mapping(map)).map(AttentionSpec::$kind)
                    })+)*
                }
            }
        }

        impl AttentionSpec {
            pub fn kind(&self) -> AttentionKind {
                match self { $($(AttentionSpec::$kind(_) => AttentionKind::$kind,)+)* }
            }
            /// Fill every default for a model of width `d_model` and check every value.
            pub fn resolve(&mut self, d_model: usize) -> std::result::Result<(), $crate::error::Invalid> {
                match self { $($(AttentionSpec::$kind(o) => $crate::attention::kinds::SoftmaxKind::resolve(o, d_model),)+)* }
                    .map_err(|(k, m)| (format!("attention.{k}"), m))
            }
            /// The attention of a fine-tuned pretrained model (`attnlab finetune`, dar.md §4.2), resolved.
            pub fn resolve_finetune(mut self) -> std::result::Result<AttentionSpec, $crate::error::Invalid> {
                match &mut self { $($(AttentionSpec::$kind(o) => $crate::attention::kinds::SoftmaxKind::resolve_finetune(o),)+)* }
                    .map_err(|(k, m)| (format!("attention.{k}"), m))?;
                Ok(self)
            }
            /// The form in which the report compares runs (of a resolved spec).
            pub fn comparable(&self) -> AttentionSpec {
                match self { $($(AttentionSpec::$kind(o) => $crate::attention::kinds::SoftmaxKind::comparable(o),)+)* }
            }
            /// "DAR (d_down 128, w 128)", "uniform (d_down 128, orthogonal)", "vanilla",
            /// "window-only (w 128)": plot legends and the report's run lists.
            pub fn label(&self) -> String {
                match self { $($(AttentionSpec::$kind(o) => $crate::attention::kinds::SoftmaxKind::label(o),)+)* }
            }
            pub fn settings(&self) -> $crate::attention::kinds::Settings {
                match self { $($(AttentionSpec::$kind(o) => $crate::attention::kinds::SoftmaxKind::settings(o),)+)* }
            }
            /// How the kind was interpreted (resolved specs).
            pub fn note(&self) -> Option<&str> {
                match self { $($(AttentionSpec::$kind(o) => $crate::attention::kinds::SoftmaxKind::note(o),)+)* }
            }
            /// The same options computed by another implementation.
            pub fn with_implementation(mut self, imp: $crate::attention::kinds::AttentionImpl) -> AttentionSpec {
                match &mut self { $($(AttentionSpec::$kind(o) => $crate::attention::kinds::SoftmaxKind::set_implementation(o, imp),)+)* }
                self
            }
            /// The run's seed for the kind's own parameter stream (`SoftmaxKind::set_init_seed`).
            pub fn with_init_seed(mut self, seed: u64) -> AttentionSpec {
                match &mut self { $($(AttentionSpec::$kind(o) => $crate::attention::kinds::SoftmaxKind::set_init_seed(o, seed),)+)* }
                self
            }
            /// One layer's attention under the module path `p`.
            pub fn layer(&self, p: &tch::nn::Path, dims: $crate::attention::layer::LayerDims) -> $crate::Result<Box<dyn $crate::attention::layer::LayerOp>> {
                match self { $($(AttentionSpec::$kind(o) => $crate::attention::kinds::SoftmaxKind::layer(o, p, dims),)+)* }
            }
            fn options_value(&self) -> std::result::Result<serde_yaml::Value, serde_yaml::Error> {
                match self { $($(AttentionSpec::$kind(o) => serde_yaml::to_value(o),)+)* }
            }
        }
    };
}

impl Default for AttentionKind {
    /// The first kind registered (vanilla).
    fn default() -> Self {
        AttentionKind::ALL[0]
    }
}

impl AttentionKind {
    /// The kind the spec spells `name` (or one of its aliases).
    pub fn from_name(name: &str) -> Option<AttentionKind> {
        AttentionKind::ALL.into_iter().find(|k| k.name() == name || k.aliases().contains(&name))
    }

    /// The names of every kind, for error messages ("vanilla, dar, uniform, window").
    pub fn names() -> String {
        AttentionKind::ALL.map(AttentionKind::name).join(", ")
    }

    pub fn is_vanilla(self) -> bool {
        self == AttentionKind::Vanilla
    }

    /// Position in `ALL`: the order of table rows and plot legends.
    pub fn order(self) -> usize {
        AttentionKind::ALL.iter().position(|&k| k == self).unwrap_or(AttentionKind::ALL.len())
    }

    /// The kind's options with nothing set (`resolve` fills them).
    pub fn spec(self) -> AttentionSpec {
        self.adopt(&AttentionSpec::default())
    }
}

impl Serialize for AttentionKind {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for AttentionKind {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        AttentionKind::from_name(&name).ok_or_else(|| serde::de::Error::custom(format!("unknown attention kind `{name}` (one of {})", AttentionKind::names())))
    }
}

impl Default for AttentionSpec {
    fn default() -> Self {
        AttentionSpec::Vanilla(Default::default())
    }
}

impl AttentionSpec {
    /// Full-width keys everywhere.
    pub fn vanilla() -> AttentionSpec {
        AttentionSpec::default()
    }

    /// This experiment with another kind (`compare`): what applies kept, the rest unset.
    pub fn to_kind(&self, kind: AttentionKind) -> AttentionSpec {
        kind.adopt(self)
    }

    pub fn is_vanilla(&self) -> bool {
        self.kind().is_vanilla()
    }

    /// DAR or uniform: a d_down bottleneck beyond a window.
    pub fn has_bottleneck(&self) -> bool {
        self.kind().has_bottleneck()
    }

    /// The bottleneck width as set (resolved specs: d_down of DAR and uniform), None when unset.
    pub fn d_down_width(&self) -> Option<usize> {
        self.settings().d_down
    }

    /// The local window as set (resolved specs: DAR's, window-only's, sink's; uniform's 0), None when unset.
    pub fn window_len(&self) -> Option<usize> {
        self.settings().window
    }

    /// How pretraining starts the bottleneck (DAR / uniform), None when unset or without one.
    pub fn init(&self) -> Option<super::dar::AttentionInit> {
        self.settings().init
    }

    pub fn dar_act(&self) -> super::dar::DarAct {
        self.settings().dar_act
    }

    pub fn implementation(&self) -> AttentionImpl {
        self.settings().implementation
    }

    /// The window of a DAR configuration with one (window > 0 beside a bottleneck); None for uniform,
    /// vanilla and kinds without a bottleneck.
    pub fn dar_window(&self) -> Option<usize> {
        self.window_len().filter(|&w| self.has_bottleneck() && w > 0)
    }

    /// The shortest context worth scoring a downstream task at: the local window (where a DAR or
    /// window-only model starts to differ from full attention), 0 for vanilla.
    pub fn min_context(&self) -> usize {
        if self.is_vanilla() { 0 } else { self.window_len().unwrap_or(0) }
    }

    /// The report tables' Model column: "Vanilla", "DAR", "Uniform (orthogonal)", "Window-only".
    pub fn table_name(&self) -> String {
        let c = self.comparable();
        match c.init().filter(|_| c.has_bottleneck()) {
            Some(super::dar::AttentionInit::SmallInit) | None => c.kind().table_name().to_string(),
            Some(i) => format!("{} ({})", c.kind().table_name(), i.name()),
        }
    }

    /// The spec as a YAML mapping: `kind` first, then the kind's own keys.
    fn to_mapping(&self) -> std::result::Result<Mapping, serde_yaml::Error> {
        let mut out = Mapping::new();
        out.insert("kind".into(), self.kind().name().into());
        if let Value::Mapping(m) = self.options_value()? {
            out.extend(m);
        }
        Ok(out)
    }

    /// The spec without the keys that hold their defaults (`dar_act: linear`, `impl: auto`): the
    /// compact form finetune run directories record.
    pub fn compact(&self) -> Mapping {
        let mut m = self.to_mapping().expect("attention options serialize");
        drop_legacy(&mut m, "dar_act", Some("linear".into()));
        drop_legacy(&mut m, "impl", Some("auto".into()));
        m
    }
}

impl Serialize for AttentionSpec {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.to_mapping().map_err(serde::ser::Error::custom)?.serialize(s)
    }
}

/// `kind:` picks the options type (vanilla when absent); the kind's own serde refuses keys it does
/// not take, naming the keys it does.
impl<'de> Deserialize<'de> for AttentionSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let mut map = match Value::deserialize(d)? {
            Value::Mapping(m) => m,
            Value::Null => Mapping::new(),
            other => return Err(D::Error::custom(format!("attention: expected a mapping such as {{kind: dar, d_down: 64}}, got {other:?}"))),
        };
        // A key set to null is unset (`--set attention.d_down=null` when switching to a kind without one).
        map.retain(|_, v| !v.is_null());
        let kind = match map.shift_remove("kind") {
            None | Some(Value::Null) => AttentionKind::default(),
            Some(Value::String(name)) => AttentionKind::from_name(&name).ok_or_else(|| D::Error::custom(format!("unknown attention kind `{name}` (one of {})", AttentionKind::names())))?,
            Some(other) => return Err(D::Error::custom(format!("attention.kind: expected a name, got {other:?}"))),
        };
        kind.read(map.clone()).map_err(|e| {
            // Name the key as a spec writes it: "`attention.d_down`: unknown field `d_down` …". serde
            // names no key for a value of the wrong type: it is the key whose value alone fails to
            // read (every option has a default, so one key alone reads when its value is right).
            let msg = e.to_string();
            let key = match msg.strip_prefix("unknown field `").and_then(|rest| rest.split('`').next()) {
                Some(key) => Some(key.to_string()),
                None => map.iter().find(|(k, v)| kind.read(Mapping::from_iter([((*k).clone(), (*v).clone())])).is_err()).and_then(|(k, _)| k.as_str().map(str::to_string)),
            };
            match key {
                Some(key) => D::Error::custom(format!("`attention.{key}`: {msg} (kind: {})", kind.name())),
                None => D::Error::custom(format!("attention (kind: {}): {msg}", kind.name())),
            }
        })
    }
}
