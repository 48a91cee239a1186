//! Sweep file → the list of runs it describes: axis expansion, overrides (with `null` deleting a
//! key), validation through `crate::spec::from_str`, names from the template, de-duplication.
use crate::finetune::FinetuneSpec;
use crate::linearize::LinearizeSpec;
use crate::run_kind::RunKind;
use crate::spec::Spec;
use crate::{Error, IoContext, Result};
use serde::Deserialize;
use serde_yaml::{Mapping, Value};
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

/// The sweep file as written (format: module documentation of `crate::sweep`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SweepFile {
    base: PathBuf,
    output: PathBuf,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    set: Mapping,
    #[serde(default)]
    grid: Mapping,
    #[serde(default)]
    zip: Mapping,
    #[serde(default)]
    runs: Vec<Mapping>,
    /// Seeds as an axis: every run once per seed (`train.seed`), outermost; names get `-s<seed>`
    /// unless the template names `{train.seed}` itself.
    #[serde(default)]
    seeds: Option<Vec<u64>>,
}

/// One run of a sweep, fully resolved.
#[derive(Debug, Clone)]
pub struct PlannedRun {
    /// The name template rendered on the resolved spec (unique within a sweep).
    pub name: String,
    /// `<name>-<hash of the resolved config>`: names the run directory and the spec file.
    pub id: String,
    /// The assignments that distinguish this run (axes and `runs` entry), as `key=value` words.
    pub overrides: String,
    /// The resolved spec, with `name` and `output` (= `dir`) set by the sweep.
    pub spec: RunSpec,
    /// `<sweep output>/<id>`.
    pub dir: PathBuf,
    /// `<sweep output>/specs/<id>.yaml`: the file the child `attnlab train` runs.
    pub spec_path: PathBuf,
}

/// What a run of a sweep is: an `attnlab train`, `finetune` or `linearize` spec (chosen by the base,
/// `RunKind::of_config`). All follow the same run-directory contract.
#[derive(Debug, Clone, PartialEq)]
pub enum RunSpec {
    Train(Spec),
    Linearize(LinearizeSpec),
    Finetune(FinetuneSpec),
}

impl RunSpec {
    /// The attnlab subcommand that runs it.
    pub fn command(&self) -> &'static str {
        match self {
            RunSpec::Train(_) => "train",
            RunSpec::Linearize(_) => "linearize",
            RunSpec::Finetune(_) => "finetune",
        }
    }

    pub fn to_yaml(&self) -> String {
        match self {
            RunSpec::Train(s) => s.to_yaml(),
            RunSpec::Linearize(s) => s.to_yaml(),
            RunSpec::Finetune(s) => s.to_yaml(),
        }
    }

    pub fn as_train(&self) -> Option<&Spec> {
        match self {
            RunSpec::Train(s) => Some(s),
            RunSpec::Linearize(_) | RunSpec::Finetune(_) => None,
        }
    }

    fn set_name_and_output(&mut self, name: &str, dir: &Path) {
        match self {
            RunSpec::Train(s) => {
                s.name = Some(name.to_string());
                s.output = Some(dir.to_path_buf());
            }
            RunSpec::Linearize(s) => {
                s.name = Some(name.to_string());
                s.output = dir.to_path_buf();
            }
            // A finetune spec has no name: the run directory carries it.
            RunSpec::Finetune(s) => s.output = dir.to_path_buf(),
        }
    }

    fn tree(&self) -> Result<Value, String> {
        match self {
            RunSpec::Train(s) => serde_yaml::to_value(s),
            RunSpec::Linearize(s) => serde_yaml::to_value(s),
            RunSpec::Finetune(s) => serde_yaml::to_value(s),
        }
        .map_err(|e| e.to_string())
    }
}

/// A sweep file expanded into runs.
#[derive(Debug, Clone)]
pub struct SweepPlan {
    pub file: PathBuf,
    pub base: PathBuf,
    pub output: PathBuf,
    pub runs: Vec<PlannedRun>,
    /// Expanded points whose resolved config equalled an earlier one (dropped).
    pub merged_duplicates: usize,
}

/// An ordered list of `key → value` assignments (one point of the axes, or a `set:` map).
type Assign = Vec<(String, Value)>;

/// A problem with one key of the sweep file: (key, message).
type Bad = (String, String);

/// Read and expand a sweep file. `sets` (`key=value`, values YAML, `null` deletes) apply to every
/// run after everything in the file; `output` replaces the file's `output:`.
pub fn plan(file: &Path, sets: &[String], output: Option<&Path>) -> Result<SweepPlan> {
    let text = std::fs::read_to_string(file).at(file)?;
    let origin = file.display().to_string();
    let bad = |(key, msg): Bad| Error::Spec { line: line_of(&text, &key), file: origin.clone(), key, msg };
    let sf: SweepFile = serde_yaml::from_str(&text).map_err(|e| Error::Schema { file: origin.clone(), msg: e.to_string() })?;

    // `base` is relative to the sweep file; every path inside specs stays relative to the current
    // directory (as for `attnlab train`).
    let base = file.parent().unwrap_or(Path::new("")).join(&sf.base);
    if !base.is_file() {
        return Err(bad(("base".into(), format!("cannot read {}: no such file", base.display()))));
    }
    // The base spec may itself inherit (`base:` in a spec file): merged here as `attnlab train` would.
    let base_value: Value = crate::spec::base::read_tree(&base)?.value;
    let out_dir = output.map(Path::to_path_buf).unwrap_or_else(|| sf.output.clone());
    let kind = RunKind::of_config(&serde_yaml::to_string(&base_value).expect("YAML serializes")).map_err(|msg| Error::Spec { file: base.display().to_string(), key: crate::run_kind::KEY.into(), line: None, msg })?;

    let common = assignments(&sf.set, "set").map_err(bad)?;
    let cli: Assign = sets.iter().map(|s| parse_set(s)).collect::<Result<_, Bad>>().map_err(|(k, m)| Error::Spec { file: "--set".into(), key: k, line: None, msg: m })?;
    let top = axis_points(&sf.grid, &sf.zip, "").map_err(bad)?;
    let seed_points = seed_points(sf.seeds.as_deref(), &sf).map_err(bad)?;
    let entries = if sf.runs.is_empty() { vec![Mapping::new()] } else { sf.runs.clone() };

    let mut runs: Vec<PlannedRun> = Vec::new();
    let mut seen = HashSet::new();
    let mut merged = 0;
    // Seeds outermost: every configuration of seed 1, then of seed 2, … (a sweep cut short still
    // has complete, paired seeds).
    for seed in &seed_points {
        for (e, entry) in entries.iter().enumerate() {
            let ctx = format!("runs[{e}]");
            let entry = Entry::parse(entry, &ctx).map_err(bad)?;
            let template = entry.name.clone().or_else(|| sf.name.clone()).ok_or_else(|| bad((format!("{ctx}.name"), "no name template: give `name:` at the top of the sweep file or in this runs entry".into())))?;
            let inner = axis_points(&entry.grid, &entry.zip, &format!("{ctx}.")).map_err(bad)?;
            for outer in &top {
                for point in &inner {
                    // Precedence, lowest first: base < set < seeds < grid/zip < runs entry < its grid/zip < --set.
                    let distinct: Assign = seed.iter().chain(outer).chain(&entry.set).chain(point).cloned().collect();
                    let mut value = base_value.clone();
                    for (k, v) in common.iter().chain(&distinct).chain(&cli) {
                        apply(&mut value, k, v).map_err(|msg| bad((k.clone(), msg)))?;
                    }
                    let described = describe(&distinct);
                    let origin = format!("{origin} (run {}{}; base {})", runs.len() + merged, if described.is_empty() { String::new() } else { format!(": {described}") }, base.display());
                    let mut spec = resolve(value, &origin, kind)?;
                    let hash = crate::util::short_hash(&spec.to_yaml());
                    if !seen.insert(hash.clone()) {
                        merged += 1;
                        continue;
                    }
                    let mut name = render(&template, &spec).map_err(|msg| Error::Spec { file: origin.clone(), key: format!("{ctx}.name"), line: None, msg })?;
                    if let Some(seed) = seed.first().filter(|_| !template.contains("train.seed")).and_then(|(_, v)| scalar_text(v)) {
                        name = format!("{name}-s{seed}");
                    }
                    let id = format!("{name}-{hash}");
                    let dir = out_dir.join(&id);
                    spec.set_name_and_output(&name, &dir);
                    runs.push(PlannedRun { name, id: id.clone(), overrides: described, spec, dir, spec_path: out_dir.join("specs").join(format!("{id}.yaml")) });
                }
            }
        }
    }
    // Names label table rows: two different configs under one name would be indistinguishable.
    let mut by_name: BTreeMap<&str, &PlannedRun> = BTreeMap::new();
    for r in &runs {
        if let Some(first) = by_name.insert(&r.name, r) {
            return Err(bad(("name".into(), format!("two different runs render the name `{}` ({} / {}); add the key that differs to the name template", r.name, first.overrides, r.overrides))));
        }
    }
    Ok(SweepPlan { file: file.to_path_buf(), base, output: out_dir, runs, merged_duplicates: merged })
}

/// Apply one override to a YAML tree: `null` deletes the key (so a default, or no value, applies),
/// anything else goes through `crate::spec::apply_override`.
pub fn apply(root: &mut Value, key: &str, value: &Value) -> Result<(), String> {
    if key.contains('=') || key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(format!("`{key}` is not a valid key path"));
    }
    if value.is_null() {
        return remove_path(root, key);
    }
    // apply_override parses its value as YAML: hand it the value serialized as YAML.
    let text = serde_yaml::to_string(value).map_err(|e| e.to_string())?;
    crate::spec::apply_override(root, &format!("{key}={text}"))
}

/// Delete the dotted `path` from `root`; a path that is not there is already deleted.
pub fn remove_path(root: &mut Value, path: &str) -> Result<(), String> {
    let parts: Vec<&str> = path.split('.').collect();
    let mut node = root;
    for (i, part) in parts.iter().enumerate() {
        let map = match node {
            Value::Null => return Ok(()),
            Value::Mapping(m) => m,
            _ => return Err(format!("`{}` is not a mapping", parts[..i].join("."))),
        };
        if i + 1 == parts.len() {
            map.remove(*part);
            return Ok(());
        }
        match map.get_mut(*part) {
            Some(next) => node = next,
            None => return Ok(()),
        }
    }
    Ok(())
}

/// The merged YAML tree → a resolved, validated spec. The sweep owns `name` and `output`, so they
/// are cleared first: the config hash then depends on nothing but the experiment itself.
fn resolve(mut value: Value, origin: &str, kind: RunKind) -> Result<RunSpec> {
    for key in ["name", "output"] {
        // A base that is not a mapping fails in from_str below, with serde's message.
        let _ = remove_path(&mut value, key);
    }
    // The spec types have no `command` key (config.yaml records it; a base may state it).
    let _ = remove_path(&mut value, crate::run_kind::KEY);
    if kind == RunKind::Finetune {
        // As for linearize below: a fixed `output` stand-in keeps the config hash free of it.
        apply(&mut value, "output", &Value::String(".".into())).map_err(|msg| Error::Spec { file: origin.into(), key: "output".into(), line: None, msg })?;
        let text = serde_yaml::to_string(&value).map_err(|e| Error::Other(format!("{origin}: {e}")))?;
        let spec = FinetuneSpec::from_yaml(&text).map_err(|e| Error::Other(format!("{origin}: {e}")))?;
        return Ok(RunSpec::Finetune(spec.resolved()));
    }
    if kind == RunKind::Linearize {
        // `output` is required in a linearize spec; a fixed stand-in keeps the config hash free of it.
        apply(&mut value, "output", &Value::String(".".into())).map_err(|msg| Error::Spec { file: origin.into(), key: "output".into(), line: None, msg })?;
        let text = serde_yaml::to_string(&value).map_err(|e| Error::Other(format!("{origin}: {e}")))?;
        let spec = LinearizeSpec::from_yaml(&text).map_err(|e| Error::Other(format!("{origin}: {e}")))?;
        return Ok(RunSpec::Linearize(spec.resolved()));
    }
    let text = serde_yaml::to_string(&value).map_err(|e| Error::Other(format!("{origin}: {e}")))?;
    crate::spec::from_str(&text, origin, &[]).map(RunSpec::Train).map_err(|e| match e {
        // Line numbers would point into the generated text, not into a file the user has.
        Error::Spec { file, key, msg, .. } => Error::Spec { file, key, line: None, msg },
        Error::Schema { file, msg } => Error::Schema { file, msg: msg.split(" at line ").next().unwrap_or(&msg).to_string() },
        e => e,
    })
}

/// A `runs` entry: overrides plus its own optional `name`, `grid` and `zip` (reserved keys).
struct Entry {
    name: Option<String>,
    grid: Mapping,
    zip: Mapping,
    set: Assign,
}

impl Entry {
    fn parse(map: &Mapping, ctx: &str) -> Result<Entry, Bad> {
        let mut entry = Entry { name: None, grid: Mapping::new(), zip: Mapping::new(), set: Vec::new() };
        for (k, v) in map {
            let key = key_str(k, ctx)?;
            let sub = |m: &Value| m.as_mapping().cloned().ok_or_else(|| (format!("{ctx}.{key}"), "must be a map of key → list of values".to_string()));
            match key.as_str() {
                "name" => entry.name = Some(v.as_str().ok_or_else(|| (format!("{ctx}.name"), "must be a string".to_string()))?.to_string()),
                "grid" => entry.grid = sub(v)?,
                "zip" => entry.zip = sub(v)?,
                _ => entry.set.push((key, v.clone())),
            }
        }
        Ok(entry)
    }
}

fn key_str(k: &Value, ctx: &str) -> Result<String, Bad> {
    k.as_str().map(str::to_string).ok_or_else(|| (ctx.to_string(), format!("key `{}` must be a dotted string path", scalar_text(k).unwrap_or_default())))
}

/// A map of `key: value` as an ordered assignment list.
fn assignments(map: &Mapping, ctx: &str) -> Result<Assign, Bad> {
    map.iter().map(|(k, v)| Ok((key_str(k, ctx)?, v.clone()))).collect()
}

/// `key=value` from the command line (value parsed as YAML).
fn parse_set(s: &str) -> Result<(String, Value), Bad> {
    let (k, v) = s.split_once('=').ok_or_else(|| (s.to_string(), "is not of the form key.path=value".to_string()))?;
    let value = serde_yaml::from_str(v).map_err(|e| (k.to_string(), format!("value `{v}`: {e}")))?;
    Ok((k.trim().to_string(), value))
}

/// The points of `grid` (Cartesian product, the first key varying slowest) crossed with the
/// points of `zip` (the i-th value of every key together). No axes = one empty point.
fn axis_points(grid: &Mapping, zip: &Mapping, prefix: &str) -> Result<Vec<Assign>, Bad> {
    let lists = |map: &Mapping, section: &str| -> Result<Vec<(String, Vec<Value>)>, Bad> {
        map.iter()
            .map(|(k, v)| {
                let key = key_str(k, &format!("{prefix}{section}"))?;
                let err = |m: &str| (key.clone(), format!("{prefix}{section}: `{key}` {m}"));
                match v {
                    Value::Sequence(s) if s.is_empty() => Err(err("has an empty list of values")),
                    Value::Sequence(s) => Ok((key.clone(), s.clone())),
                    _ => Err(err("must be a list of values")),
                }
            })
            .collect()
    };
    let grid = lists(grid, "grid")?;
    let zip = lists(zip, "zip")?;
    if let Some((k, _)) = grid.iter().find(|(k, _)| zip.iter().any(|(z, _)| z == k)) {
        return Err((k.clone(), format!("{prefix}grid and {prefix}zip both set `{k}`")));
    }
    if let Some((first, vals)) = zip.first() {
        if let Some((k, v)) = zip.iter().find(|(_, v)| v.len() != vals.len()) {
            return Err((k.clone(), format!("{prefix}zip: `{k}` has {} values but `{first}` has {}; zip lists must have the same length", v.len(), vals.len())));
        }
    }
    let mut points: Vec<Assign> = vec![Vec::new()];
    for (key, values) in &grid {
        points = points.iter().flat_map(|p| values.iter().map(move |v| [p.clone(), vec![(key.clone(), v.clone())]].concat())).collect();
    }
    let zip_len = zip.first().map_or(1, |(_, v)| v.len());
    let zipped: Vec<Assign> = (0..zip_len).map(|i| zip.iter().map(|(k, v)| (k.clone(), v[i].clone())).collect()).collect();
    Ok(points.iter().flat_map(|p| zipped.iter().map(move |z| [p.clone(), z.clone()].concat())).collect())
}

/// `seeds: [..]` as points of their own (`train.seed = s`); one empty point without seeds. A seed
/// list may not be empty or repeat a seed, nor may a grid, zip or runs entry set `train.seed` too.
fn seed_points(seeds: Option<&[u64]>, sf: &SweepFile) -> Result<Vec<Assign>, Bad> {
    let Some(seeds) = seeds else { return Ok(vec![Vec::new()]) };
    if seeds.is_empty() {
        return Err(("seeds".into(), "is an empty list (leave it out for one run per configuration)".into()));
    }
    let in_axes = |m: &Mapping| m.keys().any(|k| k.as_str() == Some("train.seed"));
    if in_axes(&sf.grid) || in_axes(&sf.zip) || sf.runs.iter().any(|r| r.keys().any(|k| k.as_str() == Some("train.seed")) || ["grid", "zip"].iter().any(|g| r.get(*g).and_then(Value::as_mapping).is_some_and(in_axes))) {
        return Err(("seeds".into(), "and a grid, zip or runs entry both set `train.seed`: give the seeds in one place".into()));
    }
    let mut unique = seeds.to_vec();
    unique.sort_unstable();
    unique.dedup();
    if unique.len() != seeds.len() {
        return Err(("seeds".into(), format!("{seeds:?} repeats a seed")));
    }
    Ok(seeds.iter().map(|&s| vec![("train.seed".to_string(), Value::from(s))]).collect())
}

/// Fill `{dotted.path}` placeholders from the resolved spec; keep the result a safe folder name.
pub fn render(template: &str, spec: &RunSpec) -> Result<String, String> {
    let tree = spec.tree()?;
    let mut out = String::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let close = rest[open..].find('}').ok_or_else(|| format!("name template `{template}` has an unclosed `{{`"))? + open;
        let path = rest[open + 1..close].trim();
        let mut node = Some(&tree);
        for part in path.split('.') {
            node = node.and_then(|n| n.get(part));
        }
        match node.and_then(scalar_text) {
            Some(s) => out.push_str(&s),
            None if node.is_none_or(Value::is_null) => {
                return Err(format!("placeholder {{{path}}} of `{template}` has no value in this run's resolved spec (give this runs entry its own `name:`)"))
            }
            None => return Err(format!("placeholder {{{path}}} of `{template}` is not a single value")),
        }
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    let safe: String = out.chars().map(|c| if c.is_ascii_alphanumeric() || "._+-=".contains(c) { c } else { '_' }).collect();
    if safe.is_empty() || safe.starts_with('.') {
        return Err(format!("name template `{template}` renders `{safe}`, not a usable folder name"));
    }
    Ok(safe)
}

/// Text of a YAML scalar (strings unquoted); `None` for null, lists and maps.
fn scalar_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// `key=value key=value`: each key once, with the value that won, in order of first mention
/// (lists and maps as JSON).
fn describe(a: &Assign) -> String {
    let mut last: Vec<(&String, &Value)> = Vec::new();
    for (k, v) in a {
        match last.iter_mut().find(|(seen, _)| *seen == k) {
            Some(slot) => slot.1 = v,
            None => last.push((k, v)),
        }
    }
    last.into_iter()
        .map(|(k, v)| {
            let text = match v {
                Value::Null => "null".to_string(),
                v => scalar_text(v).unwrap_or_else(|| serde_json::to_string(v).unwrap_or_else(|_| "?".into())),
            };
            format!("{k}={text}")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// 1-based line of the first occurrence of the last part of `key` in `text` (for error messages).
fn line_of(text: &str, key: &str) -> Option<usize> {
    let needle = key.rsplit(['.', ']']).find(|s| !s.is_empty())?;
    let dotted = text.lines().position(|l| l.split('#').next().unwrap_or("").contains(key));
    dotted.or_else(|| text.lines().position(|l| l.split('#').next().unwrap_or("").contains(needle))).map(|i| i + 1)
}
