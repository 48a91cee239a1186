//! The small template language of task files: literal text with `{expr}` placeholders over a
//! document (a JSON object). `expr` is a path — `question`, `choices[0]`, `choices.text[4]` — followed
//! by filters: `{question|strip}`, `{subject|spaces}`. `{{` and `}}` are literal braces. A template
//! that is exactly one placeholder yields the value itself, so `{endings|hellaswag}` can be a list.
//!
//! Filters (Python semantics where they mirror lm-eval's Jinja/Python):
//! - `strip`: str.strip(); `capitalize`: str.capitalize() (first character upper, the rest lower);
//! - `spaces`: `_` → ` ` (MMLU subjects); `lines`: a list joined with `\n`;
//! - `hellaswag`: lm-eval's HellaSwag `preprocess` (strip, ` [title]` → `. `, drop `[...]`, `  ` → ` `).
//!
//! Filters on a list apply to each element.
use crate::{Error, Result};
use serde_json::Value;

enum Part {
    Lit(String),
    Expr { path: Vec<Step>, filters: Vec<String> },
}

enum Step {
    Key(String),
    Index(usize),
}

const FILTERS: [&str; 6] = ["strip", "capitalize", "spaces", "lines", "hellaswag", "int"];

fn parse(t: &str) -> Result<Vec<Part>> {
    let bad = |m: String| Error::Data(format!("template `{t}`: {m}"));
    let mut parts = Vec::new();
    let mut lit = String::new();
    let mut chars = t.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                lit.push('{');
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                lit.push('}');
            }
            '{' => {
                let mut e = String::new();
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some(c) => e.push(c),
                        None => return Err(bad("unclosed `{`".into())),
                    }
                }
                if !lit.is_empty() {
                    parts.push(Part::Lit(std::mem::take(&mut lit)));
                }
                parts.push(parse_expr(e.trim()).map_err(bad)?);
            }
            '}' => return Err(bad("lone `}` (write `}}`)".into())),
            c => lit.push(c),
        }
    }
    if !lit.is_empty() {
        parts.push(Part::Lit(lit));
    }
    Ok(parts)
}

fn parse_expr(e: &str) -> std::result::Result<Part, String> {
    let mut pieces = e.split('|').map(str::trim);
    let path_s = pieces.next().unwrap_or("");
    let filters: Vec<String> = pieces.map(str::to_string).collect();
    if let Some(f) = filters.iter().find(|f| !FILTERS.contains(&f.as_str())) {
        return Err(format!("unknown filter `{f}` (known: {})", FILTERS.join(", ")));
    }
    let mut path = Vec::new();
    for seg in path_s.split('.') {
        let (name, rest) = seg.split_once('[').map_or((seg, ""), |(a, b)| (a, b));
        if name.is_empty() {
            return Err(format!("empty field name in `{e}`"));
        }
        path.push(Step::Key(name.to_string()));
        for idx in rest.split('[').filter(|s| !s.is_empty()) {
            let n = idx.trim_end_matches(']').parse::<usize>().map_err(|_| format!("bad index `[{idx}` in `{e}`"))?;
            path.push(Step::Index(n));
        }
    }
    Ok(Part::Expr { path, filters })
}

fn lookup<'a>(doc: &'a Value, path: &[Step]) -> std::result::Result<&'a Value, String> {
    let mut v = doc;
    for s in path {
        v = match s {
            Step::Key(k) => v.get(k).ok_or_else(|| format!("no field `{k}`"))?,
            Step::Index(i) => v.get(i).ok_or_else(|| format!("no element [{i}]"))?,
        };
    }
    Ok(v)
}

/// Python's str.capitalize(): the first character upper-cased, every other lower-cased.
pub fn capitalize(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c.flat_map(char::to_lowercase)).collect(),
        None => String::new(),
    }
}

/// lm-eval's HellaSwag `preprocess` (tasks/hellaswag/utils.py).
pub fn hellaswag_preprocess(s: &str) -> String {
    static BRACKETS: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let re = BRACKETS.get_or_init(|| regex::Regex::new(r"\[.*?\]").expect("valid regex"));
    let t = s.trim().replace(" [title]", ". ");
    re.replace_all(&t, "").replace("  ", " ")
}

fn apply(filter: &str, v: Value) -> std::result::Result<Value, String> {
    if let Value::Array(items) = v {
        if filter == "lines" {
            return Ok(Value::String(items.iter().map(as_text).collect::<Vec<_>>().join("\n")));
        }
        return items.into_iter().map(|x| apply(filter, x)).collect::<std::result::Result<Vec<_>, _>>().map(Value::Array);
    }
    let s = as_text(&v);
    Ok(match filter {
        "strip" => Value::String(s.trim().to_string()),
        "capitalize" => Value::String(capitalize(&s)),
        "spaces" => Value::String(s.replace('_', " ")),
        "hellaswag" => Value::String(hellaswag_preprocess(&s)),
        "int" => Value::from(s.trim().parse::<i64>().map_err(|_| format!("`{s}` is not an integer"))?),
        _ => Value::String(s), // `lines` on a scalar
    })
}

/// A value as prompt text: strings as they are, numbers and others as JSON.
pub fn as_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Render `template` over `doc`: a string, or the value itself when the template is one placeholder.
pub fn render_value(template: &str, doc: &Value) -> Result<Value> {
    let parts = parse(template)?;
    let eval = |path: &[Step], filters: &[String]| -> Result<Value> {
        let mut v = lookup(doc, path).map_err(|m| Error::Data(format!("template `{template}`: {m} in document {}", short(doc))))?.clone();
        for f in filters {
            v = apply(f, v).map_err(|m| Error::Data(format!("template `{template}`: {m}")))?;
        }
        Ok(v)
    };
    if let [Part::Expr { path, filters }] = parts.as_slice() {
        return eval(path, filters);
    }
    let mut out = String::new();
    for p in &parts {
        match p {
            Part::Lit(s) => out.push_str(s),
            Part::Expr { path, filters } => out.push_str(&as_text(&eval(path, filters)?)),
        }
    }
    Ok(Value::String(out))
}

/// Render `template` over `doc` as text.
pub fn render(template: &str, doc: &Value) -> Result<String> {
    render_value(template, doc).map(|v| as_text(&v))
}

/// Check a template's syntax (task files are validated when loaded).
pub fn check(template: &str) -> Result<()> {
    parse(template).map(|_| ())
}

fn short(doc: &Value) -> String {
    let s = doc.to_string();
    if s.len() > 120 {
        format!("{}…", &s[..s.char_indices().nth(120).map_or(s.len(), |(i, _)| i)])
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn renders_paths_filters_and_braces() {
        let doc = json!({"question": "  Why? ", "subject": "abstract_algebra", "choices": {"text": ["a", "b"]}, "n": 3, "xs": [" p ", "q"]});
        assert_eq!(render("Q: {question|strip} {{lit}} {choices.text[1]} {n}", &doc).unwrap(), "Q: Why? {lit} b 3");
        assert_eq!(render("about {subject|spaces}.", &doc).unwrap(), "about abstract algebra.");
        assert_eq!(render_value("{xs|strip}", &doc).unwrap(), json!(["p", "q"]));
        assert_eq!(render("{xs|lines}", &doc).unwrap(), " p \nq");
        assert!(render("{missing}", &doc).unwrap_err().to_string().contains("no field `missing`"));
        assert!(check("{x|nope}").unwrap_err().to_string().contains("unknown filter"));
        assert!(check("a } b").is_err() && check("{open").is_err());
    }

    /// Python: "hELLO wORLD".capitalize() == "Hello world"; the HellaSwag preprocess on a WikiHow-like string.
    #[test]
    fn python_string_semantics() {
        assert_eq!(capitalize("hELLO wORLD"), "Hello world");
        assert_eq!(capitalize(""), "");
        // " [title]" → ". ", "[step]" removed, then one double space collapsed.
        assert_eq!(hellaswag_preprocess(" Cooking [title] Boil water. [step] Add  salt "), "Cooking. Boil water. Add salt");
    }
}
