//! Find the line of a dotted key path in YAML text, for error messages. Handles block mappings and
//! keys inside one-line flow mappings (`attention: {kind: dar, window: -1}`); returns None otherwise.

/// 1-based line of `key` (e.g. `attention.window`) in `text`, or of its nearest present ancestor.
pub fn line_of(text: &str, key: &str) -> Option<usize> {
    let lines: Vec<&str> = text.lines().map(|l| l.split(" #").next().unwrap_or(l)).collect();
    let indent = |l: &str| l.len() - l.trim_start().len();
    let mut best: Option<usize> = None; // 0-based line of the deepest key found so far
    for part in key.split('.') {
        let block = format!("{part}:");
        let (flow1, flow2) = (format!("{{{part}:"), format!(" {part}:"));
        let start = best.unwrap_or(0);
        let min_indent = best.map_or(0, |b| indent(lines[b]) + 1);
        let mut found = None;
        for (i, l) in lines.iter().enumerate().skip(start) {
            let on_parent_line = best == Some(i);
            if !on_parent_line && !l.trim().is_empty() && indent(l) < min_indent {
                break; // left the parent's block
            }
            let flow = l.contains(&flow1) || (l.contains('{') && l.contains(&flow2));
            if (!on_parent_line && l.trim_start().starts_with(&block)) || (best.is_some() && flow) {
                found = Some(i);
                break;
            }
        }
        match found {
            Some(i) => best = Some(i),
            None => break,
        }
    }
    best.map(|b| b + 1)
}

#[cfg(test)]
mod tests {
    use super::line_of;

    #[test]
    fn finds_block_and_flow_keys() {
        let y = "model: {flavor: tiny}\nattention:\n  kind: dar\n  window: -3\ntrain: {steps: 0, lr: 1}\n";
        assert_eq!(line_of(y, "attention.window"), Some(4));
        assert_eq!(line_of(y, "attention.kind"), Some(3));
        assert_eq!(line_of(y, "train.steps"), Some(5));
        assert_eq!(line_of(y, "model.flavor"), Some(1));
        // Missing leaf: the parent's line.
        assert_eq!(line_of(y, "attention.d_down"), Some(2));
        assert_eq!(line_of(y, "eval.every"), None);
    }
}
