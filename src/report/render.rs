//! A table as a grid of cells, written as Markdown, LaTeX (booktabs) or CSV. Our value for each
//! corpus sits next to the paper's; CSV keeps full precision, the others two decimals. A value over
//! several seeds reads "mean ± s.d. (n) [95% interval]"; CSV gives each part its own column.
use super::paper;
use super::stats::Stat;
use super::tables::Table;

pub enum Cell {
    Text(String),
    Num(f64),
    /// A value summarised over seeds (plain `Num` text when n = 1).
    Stat(Stat),
    Empty,
}

/// Header and body of a table.
pub fn grid(t: &Table) -> (Vec<String>, Vec<Vec<Cell>>) {
    let (u, alt) = (t.unit.name(), t.unit.other().name());
    let mut head = Vec::new();
    if t.number == 2 {
        head.push("scale".to_string());
    }
    head.extend(["model", "d_down", "w"].map(String::from));
    for c in &t.corpora {
        head.push(format!("{c} ({u})"));
        head.push(format!("{c} ({alt})"));
        if let Some(p) = t.paper_cols.get(c) {
            head.push(format!("paper {}", paper::column_title(p)));
        }
    }
    head.extend([format!("Rel.% ({u})"), format!("Rel.% ({alt})"), "paper Rel.%".to_string()]);
    let same = t.has_paper_rel_same();
    if same {
        head.push("paper Rel.% (same corpora)".into());
    }
    head.push("run".into());

    let num = |v: Option<f64>| v.map_or(Cell::Empty, Cell::Num);
    let stat = |v: Option<&Stat>| v.map_or(Cell::Empty, |s| Cell::Stat(*s));
    let int = |v: Option<usize>| v.map_or(Cell::Empty, |x| Cell::Text(x.to_string()));
    let body = t
        .rows
        .iter()
        .map(|r| {
            let mut cells = Vec::new();
            if t.number == 2 {
                cells.push(Cell::Text(r.scale.clone()));
            }
            cells.push(Cell::Text(r.model().into()));
            cells.push(int(r.config.d_down_width()));
            cells.push(if r.config.is_vanilla() { Cell::Empty } else { int(r.config.window_len()) });
            for c in &t.corpora {
                cells.push(stat(r.ppl_stat.get(c)));
                cells.push(stat(r.ppl_alt_stat.get(c)));
                if let Some(p) = t.paper_cols.get(c) {
                    cells.push(num(r.paper.as_ref().and_then(|x| x.ppl.get(p).copied())));
                }
            }
            cells.push(stat(r.rel_stat.as_ref()));
            cells.push(stat(r.rel_alt_stat.as_ref()));
            cells.push(num(r.paper.as_ref().map(|p| p.rel)));
            if same {
                cells.push(num(r.paper_rel_same));
            }
            let runs: Vec<&str> = r.seeds.values().filter(|s| !s.ppl.is_empty()).map(|s| s.run.as_str()).collect();
            cells.push(match (&r.run, &r.missing) {
                (Some(_), None) if runs.len() > 1 => Cell::Text(runs.join(", ")),
                (Some(run), None) => Cell::Text(run.clone()),
                (Some(run), Some(_)) => Cell::Text(format!("{run} (no result)")),
                (None, _) => Cell::Text("missing".into()),
            });
            cells
        })
        .collect();
    (head, body)
}

/// The paired differences of a table (tables.rs `PairedDiff`): one row per pair of arms.
pub fn paired_grid(t: &Table) -> (Vec<String>, Vec<Vec<Cell>>) {
    let u = t.unit.name();
    let head = vec!["A".to_string(), "B".into(), format!("A − B: Rel.% points ({u})"), "per seed".into(), "p (paired t)".into(), "95% interval excludes 0".into()];
    let body = t
        .pairs
        .iter()
        .map(|d| {
            let seeds: Vec<String> = d.by_seed.iter().map(|(s, v)| format!("s{s} {v:.2}")).collect();
            vec![
                Cell::Text(d.a.clone()),
                Cell::Text(d.b.clone()),
                Cell::Stat(d.stat),
                Cell::Text(seeds.join(", ")),
                d.p.map_or(Cell::Empty, |p| Cell::Text(Stat::p_text(p))),
                d.significant().map_or(Cell::Empty, |s| Cell::Text(if s { "yes" } else { "no" }.into())),
            ]
        })
        .collect();
    (head, body)
}

/// The paired differences as a standalone file in `format` (md, tex or csv).
pub fn paired_file(t: &Table, format: &str) -> String {
    let (head, body) = paired_grid(t);
    let title = format!("Paired differences, {}", t.title);
    match format {
        "md" => format!("**{title}**\n\n{}", markdown_grid(&head, &body)),
        "tex" => latex_grid(&title, &head, &body),
        _ => csv_grid(&head, &body),
    }
}

/// The Markdown table with its title and notes, for a standalone file.
pub fn markdown_file(t: &Table) -> String {
    let notes: String = t.notes.iter().map(|n| format!("{n}\n\n")).collect();
    format!("**{}**\n\n{notes}{}", t.title, markdown(t))
}

pub fn markdown(t: &Table) -> String {
    let (head, body) = grid(t);
    markdown_grid(&head, &body)
}

/// Any header and body as a Markdown table (two decimals).
pub fn markdown_grid(head: &[String], body: &[Vec<Cell>]) -> String {
    let show = |c: &Cell| match c {
        Cell::Text(s) => s.replace('|', "\\|"),
        Cell::Num(v) => format!("{v:.2}"),
        Cell::Stat(s) => s.text(),
        Cell::Empty => "–".into(),
    };
    let mut out = format!("| {} |\n|{}|\n", head.join(" | "), head.iter().map(|_| "---").collect::<Vec<_>>().join("|"));
    for row in body {
        out += &format!("| {} |\n", row.iter().map(show).collect::<Vec<_>>().join(" | "));
    }
    out
}

pub fn latex(t: &Table) -> String {
    let (head, body) = grid(t);
    latex_grid(&t.title, &head, &body)
}

/// Any header and body as a booktabs tabular (two decimals).
pub fn latex_grid(title: &str, head: &[String], body: &[Vec<Cell>]) -> String {
    let show = |c: &Cell| match c {
        Cell::Text(s) => tex_escape(s),
        Cell::Num(v) => format!("{v:.2}"),
        Cell::Stat(s) => s.text().replace('±', "$\\pm$"),
        Cell::Empty => "--".into(),
    };
    let mut out = String::new();
    out += &format!("% {title}\n% generated by `attnlab report`; needs \\usepackage{{booktabs}}\n");
    // Numeric columns right-aligned, text left.
    let align: String = (0..head.len()).map(|j| if body.iter().any(|r| matches!(r[j], Cell::Num(_) | Cell::Stat(_))) { 'r' } else { 'l' }).collect();
    out += &format!("\\begin{{tabular}}{{{align}}}\n\\toprule\n");
    out += &format!("{} \\\\\n\\midrule\n", head.iter().map(|h| tex_escape(h)).collect::<Vec<_>>().join(" & "));
    for row in body {
        out += &format!("{} \\\\\n", row.iter().map(show).collect::<Vec<_>>().join(" & "));
    }
    out += "\\bottomrule\n\\end{tabular}\n";
    out
}

pub fn csv(t: &Table) -> String {
    let (head, body) = grid(t);
    csv_grid(&head, &body)
}

/// Any header and body as CSV (full precision). A column holding values over seeds becomes five:
/// the mean under its own title, then `… sd`, `… n`, `… ci95_lo`, `… ci95_hi`.
pub fn csv_grid(head: &[String], body: &[Vec<Cell>]) -> String {
    let quote = |s: &str| if s.contains([',', '"', '\n']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_string() };
    let wide: Vec<bool> = (0..head.len()).map(|j| body.iter().any(|r| matches!(r.get(j), Some(Cell::Stat(s)) if s.n > 1))).collect();
    let mut titles = Vec::new();
    for (h, &w) in head.iter().zip(&wide) {
        titles.push(quote(h));
        if w {
            titles.extend(["sd", "n", "ci95_lo", "ci95_hi"].map(|x| quote(&format!("{h} {x}"))));
        }
    }
    let mut out = titles.join(",") + "\n";
    let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v}"));
    for row in body {
        let mut cells = Vec::new();
        for (c, &w) in row.iter().zip(&wide) {
            match c {
                Cell::Text(s) => cells.push(quote(s)),
                Cell::Num(v) => cells.push(format!("{v}")),
                Cell::Stat(s) => cells.push(format!("{}", s.mean)),
                Cell::Empty => cells.push(String::new()),
            }
            if w {
                match c {
                    Cell::Stat(s) => cells.extend([format!("{}", s.sd), s.n.to_string(), opt(s.ci.map(|c| c.0)), opt(s.ci.map(|c| c.1))]),
                    _ => cells.extend(std::iter::repeat_n(String::new(), 4)),
                }
            }
        }
        out += &(cells.join(",") + "\n");
    }
    out
}

fn tex_escape(s: &str) -> String {
    let mut out = String::new();
    for ch in s.chars() {
        match ch {
            '_' | '%' | '&' | '#' | '$' | '{' | '}' => {
                out.push('\\');
                out.push(ch);
            }
            '~' => out += "\\textasciitilde{}",
            '^' => out += "\\textasciicircum{}",
            '\\' => out += "\\textbackslash{}",
            c => out.push(c),
        }
    }
    out
}
