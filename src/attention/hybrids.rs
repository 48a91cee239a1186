//! The linearized hybrid operators (`attnlab linearize`: softmax over a local part, linear attention
//! over the rest), registered once, as the softmax kinds are (`kinds.rs`). A hybrid is a type in its
//! own file that implements [`HybridKind`]: its options as a spec writes them (serde,
//! `deny_unknown_fields`, so that a key of another kind is refused naming it), its names, label, line
//! style, bench-decode models, linearize's per-stage defaults and its layer. The registration
//! (`hybrid_kinds!`, invoked once in `attention/mod.rs`) generates [`Variant`] (a hybrid with its
//! options: a linearize spec's `attention:`, an export's `hybrid.yaml`, a model's config.json) and
//! every dispatch; adding a hybrid is its file plus one line in that list.
use super::kinds::LineStyle;
use super::layer::{LayerDims, LayerOp};
use super::Variant;
use crate::Result;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tch::nn;

/// What a linearized hybrid answers: one implementation per hybrid, in the hybrid's own file.
pub trait HybridKind: Sized + Clone + std::fmt::Debug + PartialEq + Default + Serialize + DeserializeOwned {
    /// The spec's spelling (`attention.kind: NAME`), the report's and bench-decode's.
    const NAME: &'static str;
    /// The report tables' Model column ("STILL", "LoLCATs").
    const TABLE_NAME: &'static str;
    /// How plots stroke the hybrid's lines.
    const LINE_STYLE: LineStyle;
    /// The models `bench-decode --attention NAME` knows: (name, its options as YAML with `kind:`,
    /// what it is), the first named as the hybrid.
    const DECODE_BENCH: &'static [(&'static str, &'static str, &'static str)];
    /// linearize's weight decay of both stages when the spec sets none.
    const WEIGHT_DECAY: f64;
    /// linearize's evaluation interval of both stages when the spec sets none.
    const EVAL_EVERY: u64;

    /// One layer's operator under the module path `p` (its parameters there; the layer's
    /// `LayerOp::parameters` are what linearize's stage 1 trains).
    fn layer(&self, p: &nn::Path, dims: LayerDims) -> Result<Box<dyn LayerOp>>;
    /// The report's label of a run ("STILL (routing: …)"), of the options as written.
    fn label(&self) -> String {
        Self::TABLE_NAME.to_string()
    }
    /// The options with the keys an ablation varies reset (the report groups the runs of one recipe).
    fn recipe_form(&self) -> Self {
        self.clone()
    }
}

/// The registration (invoked once, in `attention/mod.rs`): `module: Variant(Options);` per line
/// declares the module (its file) and the hybrid it defines, `module::Options` implementing
/// [`HybridKind`], held by `Variant::Variant`. Generates [`Variant`] and every dispatch.
macro_rules! hybrid_kinds {
    ($($module:ident: $variant:ident($opts:ident);)*) => {
        $(pub mod $module;)*

        /// A linearized operator that replaces softmax attention (`attnlab linearize`), with its options.
        #[derive(Debug, Clone, PartialEq)]
        pub enum Variant {
            $($variant($module::$opts),)*
        }

        impl Variant {
            /// Every hybrid's name, in registration order.
            pub const NAMES: &'static [&'static str] = &[$(<$module::$opts as $crate::attention::hybrids::HybridKind>::NAME,)*];

            pub fn name(&self) -> &'static str {
                match self { $(Variant::$variant(_) => <$module::$opts as $crate::attention::hybrids::HybridKind>::NAME,)* }
            }
            /// The report tables' Model column.
            pub fn table_name(&self) -> &'static str {
                match self { $(Variant::$variant(_) => <$module::$opts as $crate::attention::hybrids::HybridKind>::TABLE_NAME,)* }
            }
            pub fn line_style(&self) -> $crate::attention::kinds::LineStyle {
                match self { $(Variant::$variant(_) => <$module::$opts as $crate::attention::hybrids::HybridKind>::LINE_STYLE,)* }
            }
            /// linearize's weight decay when the spec sets none.
            pub fn weight_decay(&self) -> f64 {
                match self { $(Variant::$variant(_) => <$module::$opts as $crate::attention::hybrids::HybridKind>::WEIGHT_DECAY,)* }
            }
            /// linearize's evaluation interval when the spec sets none.
            pub fn eval_every(&self) -> u64 {
                match self { $(Variant::$variant(_) => <$module::$opts as $crate::attention::hybrids::HybridKind>::EVAL_EVERY,)* }
            }
            /// One layer's operator under the module path `p`.
            pub fn layer(&self, p: &tch::nn::Path, dims: $crate::attention::layer::LayerDims) -> $crate::Result<Box<dyn $crate::attention::layer::LayerOp>> {
                match self { $(Variant::$variant(o) => $crate::attention::hybrids::HybridKind::layer(o, p, dims),)* }
            }
            /// The report's label of the run.
            pub fn label(&self) -> String {
                match self { $(Variant::$variant(o) => $crate::attention::hybrids::HybridKind::label(o),)* }
            }
            /// The options with the ablated keys reset (the report's recipe of a run).
            pub fn recipe_form(&self) -> Variant {
                match self { $(Variant::$variant(o) => Variant::$variant($crate::attention::hybrids::HybridKind::recipe_form(o)),)* }
            }
            /// Every bench-decode model of every hybrid: (name, options YAML, what it is).
            pub fn decode_bench_models() -> Vec<(&'static str, &'static str, &'static str)> {
                let mut out = Vec::new();
                $(out.extend_from_slice(<$module::$opts as $crate::attention::hybrids::HybridKind>::DECODE_BENCH);)*
                out
            }
            /// The options of hybrid `name` from a mapping without `kind:` (None: not a hybrid's name).
            fn read(name: &str, map: serde_yaml::Mapping) -> Option<std::result::Result<Variant, serde_yaml::Error>> {
                $(if name == <$module::$opts as $crate::attention::hybrids::HybridKind>::NAME {
                    return Some(serde_yaml::from_value(serde_yaml::Value::Mapping(map)).map(Variant::$variant));
                })*
                None
            }
            fn options_any(&self) -> &dyn std::any::Any {
                match self { $(Variant::$variant(o) => o,)* }
            }
            fn options_value(&self) -> std::result::Result<serde_yaml::Value, serde_yaml::Error> {
                match self { $(Variant::$variant(o) => serde_yaml::to_value(o),)* }
            }
        }
    };
}

impl Variant {
    /// Whether `kind:` names a hybrid (else a softmax kind reads it).
    pub fn is_name(name: &str) -> bool {
        Variant::NAMES.contains(&name)
    }

    /// The options of `T` if this is that hybrid (a hybrid's own readers: the report's ablations).
    pub fn options<T: HybridKind + 'static>(&self) -> Option<&T> {
        self.options_any().downcast_ref()
    }

}

/// The hybrid's options, `kind:` first.
impl Serialize for Variant {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut out = serde_yaml::Mapping::new();
        out.insert("kind".into(), self.name().into());
        match self.options_value().map_err(serde::ser::Error::custom)? {
            serde_yaml::Value::Mapping(m) => out.extend(m),
            serde_yaml::Value::Null => {}
            other => return Err(serde::ser::Error::custom(format!("hybrid options serialize as a mapping, not {other:?}"))),
        }
        out.serialize(s)
    }
}

/// `kind:` picks the hybrid's options type; its own serde refuses keys it does not take, naming
/// them and how a spec that changed the kind drops what it inherited. A key set to null is unset.
impl<'de> serde::Deserialize<'de> for Variant {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        use serde_yaml::Value;
        let mut map = match Value::deserialize(d)? {
            Value::Mapping(m) => m,
            other => return Err(D::Error::custom(format!("attention: expected a mapping such as {{kind: {}}}, got {other:?}", Variant::NAMES[0]))),
        };
        map.retain(|_, v| !v.is_null());
        let name = match map.shift_remove("kind") {
            Some(Value::String(n)) => n,
            Some(other) => return Err(D::Error::custom(format!("attention.kind: expected a name, got {other:?}"))),
            None => return Err(D::Error::custom(format!("attention.kind: missing (a linearized operator: one of {})", Variant::NAMES.join(", ")))),
        };
        let read = Variant::read(&name, map).ok_or_else(|| D::Error::custom(format!("unknown linearized operator `{name}` (one of {})", Variant::NAMES.join(", "))))?;
        read.map_err(|e| {
            let msg = e.to_string();
            match msg.strip_prefix("unknown field `").and_then(|rest| rest.split('`').next()) {
                Some(key) => D::Error::custom(format!(
                    "`attention.{key}`: {msg} (kind: {name}; a key of another kind, e.g. inherited through `base:`, is dropped with `{key}: null`)"
                )),
                None => D::Error::custom(format!("attention (kind: {name}): {msg}")),
            }
        })
    }
}
