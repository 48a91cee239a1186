//! A finetune spec's `attention:` form. What commands and the report ask of an attention spec (names,
//! labels, resolved sizes, the comparable form) is answered by the kind itself
//! (`crate::attention::kinds`).
use super::schema::AttentionSpec;

/// `#[serde(with)]` for a finetune spec's `attention:`: reads the spec's attention type and resolves
/// it for fine-tuning (`AttentionSpec::resolve_finetune`), and writes only the keys that are set or
/// differ from their defaults: the form finetune run directories (config.yaml) and sweep hashes
/// already record.
pub mod finetune_form {
    use super::*;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(a: &AttentionSpec, s: S) -> Result<S::Ok, S::Error> {
        a.compact().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<AttentionSpec, D::Error> {
        AttentionSpec::deserialize(d)?.resolve_finetune().map_err(|(k, m)| serde::de::Error::custom(format!("{k}: {m}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{AttentionInit, AttentionKind};

    /// `name` is the serde spelling, every kind reads back from it, names are unique, and `ALL`'s
    /// order is the kinds' `order`.
    #[test]
    fn names_are_the_spec_spelling() {
        for (i, k) in AttentionKind::ALL.into_iter().enumerate() {
            assert_eq!(serde_json::to_value(k).unwrap(), serde_json::Value::String(k.name().into()));
            assert_eq!(AttentionKind::from_name(k.name()), Some(k));
            assert_eq!(serde_yaml::from_str::<AttentionKind>(k.name()).unwrap(), k);
            assert_eq!(k.order(), i);
            // A kind with nothing set reads back as itself.
            assert_eq!(serde_yaml::from_str::<AttentionSpec>(&format!("{{kind: {}}}", k.name())).unwrap(), k.spec());
        }
        for i in [AttentionInit::SmallInit, AttentionInit::Orthogonal, AttentionInit::Pca] {
            assert_eq!(serde_json::to_value(i).unwrap(), serde_json::Value::String(i.name().into()));
        }
        assert_eq!(AttentionKind::from_name("DAR"), None);
        // Aliases read as the kind and are written as its name; no alias is another kind's name.
        for k in AttentionKind::ALL {
            for a in k.aliases() {
                assert_eq!(AttentionKind::from_name(a), Some(k), "{a}");
                let spec: AttentionSpec = serde_yaml::from_str(&format!("{{kind: {a}}}")).unwrap();
                assert_eq!(spec.kind(), k);
                assert!(serde_yaml::to_string(&spec).unwrap().starts_with(&format!("kind: {}\n", k.name())));
                assert!(AttentionKind::ALL.iter().all(|o| o.name() != *a), "alias {a} is a kind's name");
            }
        }
        assert_eq!(AttentionKind::default(), AttentionKind::Vanilla);
        assert_eq!(serde_yaml::from_str::<AttentionSpec>("{}").unwrap(), AttentionSpec::vanilla());
        let names = AttentionKind::names();
        assert!(names.starts_with("vanilla, dar, uniform, window"), "{names}");
        assert_eq!(AttentionKind::ALL.iter().map(|k| k.name()).collect::<std::collections::BTreeSet<_>>().len(), AttentionKind::ALL.len());
        assert_eq!([AttentionKind::Dar.op_window(8), AttentionKind::Uniform.op_window(8), AttentionKind::Window.op_window(8)], [8, 0, 8]);
        let e = serde_yaml::from_str::<AttentionSpec>("{kind: bogus}").unwrap_err().to_string();
        assert!(e.contains("unknown attention kind `bogus`") && e.contains(&names), "{e}");
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
        let w = AttentionKind::Window.spec();
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
        assert_eq!((win.comparable().window_len(), win.comparable().d_down_width(), win.comparable().init()), (Some(32), None, None));
        assert_eq!((dar.d_down_width(), dar.window_len(), dar.dar_window(), dar.min_context()), (Some(16), Some(8), Some(8), 8));
        let uni = resolved("{kind: uniform, d_down: 16}");
        assert_eq!((uni.window_len(), uni.dar_window(), uni.has_bottleneck()), (Some(0), None, true));
        assert_eq!((win.dar_window(), win.min_context(), win.has_bottleneck()), (None, 32, false));
        let van = resolved("{kind: vanilla}");
        assert_eq!((van.d_down_width(), van.window_len(), van.min_context(), van.is_vanilla()), (None, None, 0, true));
    }

    /// Every train run directory committed under results/ (written by earlier versions) reads back,
    /// and its config.yaml is reproduced byte for byte: the text a sweep hashes into the run's name,
    /// so relaunching an existing sweep finds its runs.
    #[test]
    fn committed_run_configs_read_back_byte_for_byte() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
        let mut stack = vec![root];
        let mut checked = std::collections::BTreeSet::new();
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap().flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.file_name().is_some_and(|n| n == "config.yaml") {
                    let text = std::fs::read_to_string(&p).unwrap();
                    let Some(spec_text) = text.strip_prefix("command: train\n") else { continue };
                    let spec = crate::spec::from_str(&text, &p.display().to_string(), &[]).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                    assert_eq!(spec.to_yaml(), spec_text, "{}", p.display());
                    checked.insert(spec.attention.kind());
                }
            }
        }
        // The committed runs hold vanilla, DAR, uniform and window-only configurations.
        for k in [AttentionKind::Vanilla, AttentionKind::Dar, AttentionKind::Uniform, AttentionKind::Window] {
            assert!(checked.contains(&k), "no committed run of kind {}", k.name());
        }
    }
}
