//! What commands and the report ask of an attention spec: its names and labels, its resolved sizes,
//! and the form in which runs are compared. Matching on `AttentionKind` happens here (and in
//! `Spec::resolve`, src/attention, src/model), so that a new kind is named and labelled in one file
//! and bench, compare, export, eval and the report follow.
use super::schema::{AttentionImpl, AttentionInit, AttentionKind, AttentionSpec, DarAct, Invalid};

/// How a plot strokes a line: one style per attention kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LineStyle {
    Solid,
    Dashed,
    Dotted,
}

impl AttentionKind {
    /// The spec's spelling (`attention.kind: dar`): `compare`, `bench`, bench-decode and the report's
    /// `kind` column write it (the serde name; a test holds them together).
    pub fn name(self) -> &'static str {
        match self {
            AttentionKind::Vanilla => "vanilla",
            AttentionKind::Dar => "dar",
            AttentionKind::Uniform => "uniform",
            AttentionKind::Window => "window",
        }
    }

    /// The kind the spec spells `name`.
    pub fn from_name(name: &str) -> Option<AttentionKind> {
        AttentionKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The names of every kind, for error messages ("vanilla, dar, uniform, window").
    pub fn names() -> String {
        AttentionKind::ALL.map(AttentionKind::name).join(", ")
    }

    pub fn is_vanilla(self) -> bool {
        self == AttentionKind::Vanilla
    }

    /// Keys within the window only, nothing farther (window-only attention).
    pub fn is_local_only(self) -> bool {
        match self {
            AttentionKind::Window => true,
            AttentionKind::Vanilla | AttentionKind::Dar | AttentionKind::Uniform => false,
        }
    }

    /// Position in `ALL`: the order of table rows and plot legends.
    pub fn order(self) -> usize {
        AttentionKind::ALL.iter().position(|&k| k == self).unwrap_or(AttentionKind::ALL.len())
    }

    /// The report tables' Model column.
    pub fn table_name(self) -> &'static str {
        match self {
            AttentionKind::Vanilla => "Vanilla",
            AttentionKind::Dar => "DAR",
            AttentionKind::Uniform => "Uniform",
            AttentionKind::Window => "Window-only",
        }
    }

    /// How plots stroke the kind's lines (`report::plots::Dash`).
    pub fn line_style(self) -> LineStyle {
        match self {
            AttentionKind::Vanilla | AttentionKind::Dar => LineStyle::Solid,
            AttentionKind::Uniform => LineStyle::Dashed,
            AttentionKind::Window => LineStyle::Dotted,
        }
    }

    /// What `bench-decode --attention NAME` builds for the kind (its `--help` and errors list these).
    pub fn decode_bench_model(self) -> &'static str {
        match self {
            AttentionKind::Vanilla => "GPT-NeoX, softmax attention: K/V of every token",
            AttentionKind::Dar => "GPT-NeoX, the spec's DAR: full K/V for the last w tokens, d_down-wide latents before",
            AttentionKind::Uniform => "GPT-NeoX, DAR with w = 0",
            AttentionKind::Window => "GPT-NeoX, sliding-window attention only (the spec's window, default 128): K/V of the last w tokens",
        }
    }

    /// The local window the kind's attention op uses when `window` is asked for: uniform is DAR with
    /// window 0; the others keep it (vanilla ignores it).
    pub fn op_window(self, window: i64) -> i64 {
        match self {
            AttentionKind::Uniform => 0,
            AttentionKind::Vanilla | AttentionKind::Dar | AttentionKind::Window => window,
        }
    }
}

impl AttentionInit {
    /// The spec's spelling (`attention.init: small_init`).
    pub fn name(self) -> &'static str {
        match self {
            AttentionInit::SmallInit => "small_init",
            AttentionInit::Orthogonal => "orthogonal",
            AttentionInit::Pca => "pca",
        }
    }
}

impl AttentionSpec {
    /// Full-width keys everywhere.
    pub fn vanilla() -> AttentionSpec {
        AttentionSpec::default()
    }

    /// DAR with a bottleneck of `d_down` beyond `window` (small_init) in comparable form; window 0 is
    /// uniform (dar.md §1.1).
    pub fn bottleneck(d_down: usize, window: usize) -> AttentionSpec {
        let kind = if window == 0 { AttentionKind::Uniform } else { AttentionKind::Dar };
        AttentionSpec { kind, d_down: Some(d_down as i64), window: Some(window as i64), init: Some(AttentionInit::SmallInit), ..AttentionSpec::default() }
    }

    /// The same with another bottleneck start.
    pub fn with_init(self, init: AttentionInit) -> AttentionSpec {
        AttentionSpec { init: Some(init), ..self }
    }

    /// The form in which the report compares runs (of a resolved spec): DAR and uniform with their
    /// d_down, window and bottleneck start (DAR at window 0 is uniform), kinds without a bottleneck with
    /// what they set, vanilla with nothing. The activation, implementation and note are dropped: the
    /// report treats the activation on its own (`groups::tabulated`), and implementations compute
    /// the same function.
    pub fn comparable(&self) -> AttentionSpec {
        let pos = |v: Option<i64>| v.filter(|&x| x >= 0);
        match self.kind {
            AttentionKind::Vanilla => AttentionSpec::vanilla(),
            AttentionKind::Dar | AttentionKind::Uniform => {
                let c = AttentionSpec::bottleneck(self.d_down.unwrap_or(0).max(0) as usize, self.window.unwrap_or(0).max(0) as usize);
                c.with_init(self.init.unwrap_or_default())
            }
            AttentionKind::Window => AttentionSpec { kind: self.kind, d_down: pos(self.d_down), window: pos(self.window), ..AttentionSpec::default() },
        }
    }

    pub fn is_vanilla(&self) -> bool {
        self.kind.is_vanilla()
    }

    /// DAR or uniform: a d_down bottleneck beyond a window.
    pub fn has_bottleneck(&self) -> bool {
        self.kind.has_bottleneck()
    }

    /// The bottleneck width as set (resolved specs: d_down of DAR and uniform), None when unset.
    pub fn d_down_width(&self) -> Option<usize> {
        self.d_down.filter(|&x| x >= 0).map(|x| x as usize)
    }

    /// The local window as set (resolved specs: DAR's and window-only's; uniform's 0), None when unset.
    pub fn window_len(&self) -> Option<usize> {
        self.window.filter(|&x| x >= 0).map(|x| x as usize)
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

    /// "DAR (d_down 128, w 128)", "uniform (d_down 128, orthogonal)", "vanilla", "window-only (w 128)":
    /// plot legends and the report's run lists (of the comparable form).
    pub fn label(&self) -> String {
        let c = self.comparable();
        let init = match c.init {
            Some(AttentionInit::SmallInit) | None => String::new(),
            Some(i) => format!(", {}", i.name()),
        };
        let (d, w) = (c.d_down_width(), c.window_len());
        // A size left unset (an unresolved spec) is left out of the label.
        let sizes = || {
            let parts: Vec<String> = d.map(|d| format!("d_down {d}")).into_iter().chain(w.map(|w| format!("w {w}"))).collect();
            if parts.is_empty() { c.kind.name().to_string() } else { format!("{} ({})", c.kind.name(), parts.join(", ")) }
        };
        match c.kind {
            AttentionKind::Vanilla => "vanilla".into(),
            AttentionKind::Uniform => d.map_or_else(sizes, |d| format!("uniform (d_down {d}{init})")),
            AttentionKind::Dar => match (d, w) {
                (Some(d), Some(w)) => format!("DAR (d_down {d}, w {w}{init})"),
                _ => sizes(),
            },
            AttentionKind::Window => w.map_or_else(sizes, |w| format!("window-only (w {w})")),
        }
    }

    /// The report tables' Model column: "Vanilla", "DAR", "Uniform (orthogonal)", "Window-only".
    pub fn table_name(&self) -> String {
        let c = self.comparable();
        match c.init.filter(|_| c.has_bottleneck()) {
            Some(AttentionInit::SmallInit) | None => c.kind.table_name().to_string(),
            Some(i) => format!("{} ({})", c.kind.table_name(), i.name()),
        }
    }
}

impl AttentionSpec {
    /// The attention of a fine-tuned pretrained model (`attnlab finetune`, dar.md §4.2), resolved:
    /// `vanilla` (the base model's attention, unchanged) or `dar` with its d_down (required), window
    /// (default 128), bottleneck start (small_init, the default, or pca) and implementation. Other
    /// kinds, and keys that do not apply, are refused naming the key.
    pub fn resolve_finetune(mut self) -> Result<AttentionSpec, Invalid> {
        let bad = |k: &str, m: String| Err((format!("attention.{k}"), m));
        self.note = None;
        match self.kind {
            AttentionKind::Vanilla => {
                let set = [("d_down", self.d_down.is_some()), ("window", self.window.is_some()), ("init", self.init.is_some()), ("dar_act", self.dar_act != DarAct::Linear), ("impl", self.implementation != AttentionImpl::Auto)];
                if let Some((k, _)) = set.into_iter().find(|s| s.1) {
                    return bad(k, "is meaningless for kind: vanilla (the fine-tuned model keeps the base model's attention; use kind: dar)".into());
                }
            }
            AttentionKind::Dar => {
                match self.d_down {
                    None => return bad("d_down", "is required for kind: dar (the bottleneck width)".into()),
                    Some(d) if d <= 0 => return bad("d_down", format!("{d} must be > 0")),
                    Some(_) => {}
                }
                let w = *self.window.get_or_insert(128);
                if w < 0 {
                    return bad("window", format!("{w} is negative"));
                }
                match *self.init.get_or_insert_default() {
                    AttentionInit::SmallInit | AttentionInit::Pca => {}
                    AttentionInit::Orthogonal => return bad("init", "orthogonal is a pretraining start; finetune starts the bottleneck with small_init or pca".into()),
                }
                if self.dar_act != DarAct::Linear {
                    return bad("dar_act", "finetune adds the linear bottleneck (dar.md §4.2); sigmoid is a pretraining variant".into());
                }
            }
            AttentionKind::Uniform | AttentionKind::Window => {
                return bad("kind", format!("finetune keeps vanilla or changes the attention to dar, not to {} (uniform is dar with window: 0)", self.kind.name()));
            }
        }
        Ok(self)
    }
}

/// `#[serde(with)]` for a finetune spec's `attention:`: reads the spec's attention type and resolves
/// it for fine-tuning (`resolve_finetune`), and writes only the keys that are set or differ from
/// their defaults: the form finetune run directories (config.yaml) and sweep hashes already record.
pub mod finetune_form {
    use super::*;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize)]
    struct Compact<'a> {
        kind: AttentionKind,
        #[serde(skip_serializing_if = "Option::is_none")]
        d_down: Option<i64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        window: Option<i64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        dar_act: Option<DarAct>,
        #[serde(rename = "impl", skip_serializing_if = "Option::is_none")]
        implementation: Option<AttentionImpl>,
        #[serde(skip_serializing_if = "Option::is_none")]
        init: Option<AttentionInit>,
        #[serde(skip_serializing_if = "Option::is_none")]
        note: Option<&'a str>,
    }

    pub fn serialize<S: Serializer>(a: &AttentionSpec, s: S) -> Result<S::Ok, S::Error> {
        Compact {
            kind: a.kind,
            d_down: a.d_down,
            window: a.window,
            dar_act: Some(a.dar_act).filter(|&x| x != DarAct::Linear),
            implementation: Some(a.implementation).filter(|&x| x != AttentionImpl::Auto),
            init: a.init,
            note: a.note.as_deref(),
        }
        .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<AttentionSpec, D::Error> {
        AttentionSpec::deserialize(d)?.resolve_finetune().map_err(|(k, m)| serde::de::Error::custom(format!("{k}: {m}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `name` is the serde spelling, and every kind reads back from it.
    #[test]
    fn names_are_the_spec_spelling() {
        for k in AttentionKind::ALL {
            assert_eq!(serde_json::to_value(k).unwrap(), serde_json::Value::String(k.name().into()));
            assert_eq!(AttentionKind::from_name(k.name()), Some(k));
            assert_eq!(serde_yaml::from_str::<AttentionKind>(k.name()).unwrap(), k);
        }
        for i in [AttentionInit::SmallInit, AttentionInit::Orthogonal, AttentionInit::Pca] {
            assert_eq!(serde_json::to_value(i).unwrap(), serde_json::Value::String(i.name().into()));
        }
        assert_eq!(AttentionKind::from_name("DAR"), None);
        assert_eq!(AttentionKind::names(), "vanilla, dar, uniform, window");
        assert_eq!(AttentionKind::ALL.map(AttentionKind::order), [0, 1, 2, 3]);
        assert_eq!(AttentionKind::ALL.map(AttentionKind::is_local_only), [false, false, false, true]);
        assert_eq!([AttentionKind::Dar.op_window(8), AttentionKind::Uniform.op_window(8), AttentionKind::Window.op_window(8)], [8, 0, 8]);
    }

    fn resolved(attention: &str) -> AttentionSpec {
        let text = format!("attention: {attention}\ndata: {{train: {{synthetic: {{docs: 4}}}}}}\ntrain: {{steps: 1}}\n");
        crate::spec::from_str(&text, "t.yaml", &[]).unwrap().attention
    }

    /// The labels the report prints (tables, legends, run lists) for each kind.
    #[test]
    fn labels_and_table_names() {
        let cases = [
            ("{kind: vanilla}", "vanilla", "Vanilla"),
            ("{kind: dar, d_down: 16, window: 8}", "DAR (d_down 16, w 8)", "DAR"),
            ("{kind: dar, d_down: 16, window: 0}", "uniform (d_down 16)", "Uniform"),
            ("{kind: uniform, d_down: 16, init: orthogonal}", "uniform (d_down 16, orthogonal)", "Uniform (orthogonal)"),
            ("{kind: dar, d_down: 16, window: 4, init: orthogonal, dar_act: sigmoid}", "DAR (d_down 16, w 4, orthogonal)", "DAR (orthogonal)"),
            ("{kind: window, window: 32}", "window-only (w 32)", "Window-only"),
        ];
        for (yaml, label, table) in cases {
            let a = resolved(yaml);
            assert_eq!((a.label().as_str(), a.table_name().as_str()), (label, table), "{yaml}");
        }
        // Unresolved kinds without a bottleneck show what they set.
        let w = AttentionSpec { kind: AttentionKind::Window, ..AttentionSpec::default() };
        assert_eq!(w.label(), "window");
        assert_eq!(AttentionSpec::bottleneck(8, 0).with_init(AttentionInit::Pca).label(), "uniform (d_down 8, pca)");
    }

    /// The comparable form keeps what tells configurations apart and nothing else.
    #[test]
    fn comparable_form_and_sizes() {
        let dar = resolved("{kind: dar, d_down: 16, window: 8, impl: sdpa, dar_act: sigmoid}");
        assert_eq!(dar.comparable(), AttentionSpec::bottleneck(16, 8));
        assert_eq!(resolved("{kind: dar, d_down: 16, window: 0}").comparable(), resolved("{kind: uniform, d_down: 16}").comparable());
        assert_eq!(resolved("{kind: vanilla}").comparable(), AttentionSpec::vanilla());
        assert_ne!(resolved("{kind: uniform, d_down: 16, init: orthogonal}").comparable(), AttentionSpec::bottleneck(16, 0));
        let win = resolved("{kind: window, window: 32}");
        assert_eq!((win.comparable().window_len(), win.comparable().d_down_width(), win.comparable().init), (Some(32), None, None));
        assert_eq!((dar.d_down_width(), dar.window_len(), dar.dar_window(), dar.min_context()), (Some(16), Some(8), Some(8), 8));
        let uni = resolved("{kind: uniform, d_down: 16}");
        assert_eq!((uni.window_len(), uni.dar_window(), uni.has_bottleneck()), (Some(0), None, true));
        assert_eq!((win.dar_window(), win.min_context(), win.has_bottleneck()), (None, 32, false));
        let van = resolved("{kind: vanilla}");
        assert_eq!((van.d_down_width(), van.window_len(), van.min_context(), van.is_vanilla()), (None, None, 0, true));
    }
}
