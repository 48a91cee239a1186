//! Line charts as PNG and SVG (plotters): title, labelled axes, legend, optional log y axis. The
//! report's figures and `bench-decode --plot` draw with it (`report::plots` is this module). Heat maps
//! of ratios to chance (`heatmaps`, PNG): `attnlab saliency-words`' per-(layer, head) rates.
//! plotters is built without system-font support, so the text font (DejaVu Sans, see
//! assets/fonts/LICENSE-DejaVu.txt) is embedded and registered once as "sans-serif".
use crate::{Error, Result};
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::ops::Range;
use std::path::{Path, PathBuf};

static FONT: &[u8] = include_bytes!("../assets/fonts/DejaVuSans.ttf");
const FAMILY: &str = "sans-serif";
const SIZE: (u32, u32) = (960, 600);

/// How a line is stroked: a sweep's charts use one per attention kind (`AttentionKind::line_style`).
pub use crate::spec::LineStyle as Dash;

pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    /// (x, low, high): a shaded band behind the line (the spread over seeds); empty for none.
    pub band: Vec<(f64, f64, f64)>,
    /// Index into the palette (the same configuration keeps its colour across a sweep's charts);
    /// None is black (vanilla).
    pub color: Option<usize>,
    pub dash: Dash,
    /// A reference line (vanilla = 100%): black, thinner, no markers.
    pub reference: bool,
}

impl Line {
    /// A plain solid line in palette colour `color`.
    pub fn solid(label: String, points: Vec<(f64, f64)>, color: usize) -> Line {
        Line { label, points, band: Vec::new(), color: Some(color), dash: Dash::Solid, reference: false }
    }
}

/// Matplotlib's "tab10" colours (distinct, and readable on white, unlike pure yellow), then
/// tab20's lighter partners: twenty colours before any repeats.
pub const PALETTE: [(u8, u8, u8); 20] = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
    (174, 199, 232),
    (255, 187, 120),
    (152, 223, 138),
    (255, 152, 150),
    (197, 176, 213),
    (196, 156, 148),
    (247, 182, 210),
    (199, 199, 199),
    (219, 219, 141),
    (158, 218, 229),
];

pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub lines: Vec<Line>,
    pub log_y: bool,
    /// A logarithmic x axis (x > 0 only): loss by position, whose first tokens change fastest.
    pub log_x: bool,
}

impl Chart {
    /// Log y when the values span more than a factor of 3 (perplexity early vs late in training).
    pub fn log_y_if_wide(mut self) -> Self {
        let ys = self.lines.iter().flat_map(|l| l.points.iter().map(|p| p.1));
        let (lo, hi) = ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), y| (lo.min(y), hi.max(y)));
        self.log_y = lo > 0.0 && hi / lo > 3.0;
        self
    }

    pub fn is_empty(&self) -> bool {
        self.lines.iter().all(|l| l.points.is_empty())
    }
}

fn register_font() -> Result<()> {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *REGISTERED.get_or_init(|| plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_ok()) {
        Ok(())
    } else {
        Err(Error::Other("the embedded font assets/fonts/DejaVuSans.ttf could not be read".into()))
    }
}

/// Write `stem.png` and `stem.svg`; returns their paths.
pub fn save(chart: &Chart, stem: &Path) -> Result<Vec<PathBuf>> {
    register_font()?;
    if let Some(dir) = stem.parent() {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    let png = PathBuf::from(format!("{}.png", stem.display()));
    let svg = PathBuf::from(format!("{}.svg", stem.display()));
    let fail = |p: &Path, e: String| Error::Other(format!("plot {}: {e}", p.display()));
    {
        let root = BitMapBackend::new(&png, SIZE).into_drawing_area();
        draw(&root, chart).map_err(|e| fail(&png, e))?;
        root.present().map_err(|e| fail(&png, e.to_string()))?;
    }
    {
        let root = SVGBackend::new(&svg, SIZE).into_drawing_area();
        draw(&root, chart).map_err(|e| fail(&svg, e))?;
        root.present().map_err(|e| fail(&svg, e.to_string()))?;
    }
    Ok(vec![png, svg])
}

fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, chart: &Chart) -> std::result::Result<(), String> {
    let (x, y) = bounds(chart);
    // plotters' own log ticks skip whole decades of a narrow range: place 1-2-5 ticks ourselves.
    let (xt, yt) = (log_ticks(x.start, x.end), log_ticks(y.start, y.end));
    match (chart.log_x, chart.log_y) {
        (false, false) => draw_in(root, chart, x, y),
        (false, true) => draw_in(root, chart, x, y.log_scale().with_key_points(yt)),
        (true, false) => draw_in(root, chart, x.log_scale().with_key_points(xt), y),
        (true, true) => draw_in(root, chart, x.log_scale().with_key_points(xt), y.log_scale().with_key_points(yt)),
    }
}

/// Axis ranges over every point, padded so that lines do not sit on the frame.
fn bounds(chart: &Chart) -> (Range<f64>, Range<f64>) {
    let band = chart.lines.iter().flat_map(|l| l.band.iter().flat_map(|&(x, lo, hi)| [(x, lo), (x, hi)]));
    let pts: Vec<(f64, f64)> = chart
        .lines
        .iter()
        .flat_map(|l| l.points.iter().copied())
        .chain(band)
        .filter(|p| p.0.is_finite() && p.1.is_finite() && (!chart.log_y || p.1 > 0.0) && (!chart.log_x || p.0 > 0.0))
        .collect();
    let span = |v: &mut dyn Iterator<Item = f64>| v.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)));
    let (x0, x1) = span(&mut pts.iter().map(|p| p.0));
    let (y0, y1) = span(&mut pts.iter().map(|p| p.1));
    if pts.is_empty() {
        return (0.0..1.0, 1.0..2.0);
    }
    let pad = |lo: f64, hi: f64, frac: f64| {
        let d = if hi > lo { (hi - lo) * frac } else { lo.abs().max(1.0) * frac.max(0.05) };
        (lo - d, hi + d)
    };
    let (x0, x1) = if chart.log_x { (x0 / 1.05, x1 * 1.05) } else { pad(x0, x1, 0.02) };
    let (y0, y1) = if chart.log_y { (y0 / 1.08, y1 * 1.08) } else { pad(y0, y1, 0.06) };
    (x0..x1, y0..y1)
}

/// The corner of the plot the fewest points (and bands) fall in, for the legend: upper right
/// unless the data sit there.
fn legend_corner(c: &Chart) -> SeriesLabelPosition {
    let (x, y) = bounds(c);
    let ty = |v: f64| if c.log_y { v.max(f64::MIN_POSITIVE).ln() } else { v };
    let tx = |v: f64| if c.log_x { v.max(f64::MIN_POSITIVE).ln() } else { v };
    let (y0, y1) = (ty(y.start), ty(y.end));
    let (x0, x1) = (tx(x.start), tx(x.end));
    let pts = c.lines.iter().flat_map(|l| l.points.iter().copied().chain(l.band.iter().flat_map(|&(px, lo, hi)| [(px, lo), (px, hi)])));
    let mut counts = [0usize; 4]; // upper right, lower right, upper left, lower left
    for (px, py) in pts.filter(|p| p.0.is_finite() && p.1.is_finite()) {
        let fx = (tx(px) - x0) / (x1 - x0);
        let fy = (ty(py) - y0) / (y1 - y0);
        let (right, up) = (fx > 0.55, fy > 0.6);
        let (left, down) = (fx < 0.45, fy < 0.4);
        if right && up {
            counts[0] += 1;
        }
        if right && down {
            counts[1] += 1;
        }
        if left && up {
            counts[2] += 1;
        }
        if left && down {
            counts[3] += 1;
        }
    }
    let best = (0..4).min_by_key(|&i| (counts[i], i)).unwrap_or(0);
    [SeriesLabelPosition::UpperRight, SeriesLabelPosition::LowerRight, SeriesLabelPosition::UpperLeft, SeriesLabelPosition::LowerLeft][best].clone()
}

/// 1, 2, 5 × 10^k inside [lo, hi] (every integer multiple when that gives fewer than 4 ticks).
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let decades = lo.log10().floor() as i32..=hi.log10().ceil() as i32;
    let within =
        |ms: &[f64]| -> Vec<f64> { decades.clone().flat_map(|k| ms.iter().map(move |m| m * 10f64.powi(k))).filter(|v| (lo..=hi).contains(v)).collect() };
    let ticks = within(&[1.0, 2.0, 5.0]);
    if ticks.len() >= 4 {
        ticks
    } else {
        within(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    }
}

/// Tick labels without float noise: 12,000 → "12000", 0.5 → "0.5", 123.456 → "123.5".
fn tick(v: f64) -> String {
    let a = v.abs();
    let s = if a >= 100.0 || v == v.round() {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    };
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

fn draw_in<DB, X, Y>(root: &DrawingArea<DB, Shift>, c: &Chart, x: X, y: Y) -> std::result::Result<(), String>
where
    DB: DrawingBackend,
    X: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let mut chart =
        ChartBuilder::on(root).caption(&c.title, (FAMILY, 22)).margin(18).x_label_area_size(52).y_label_area_size(78).build_cartesian_2d(x, y).map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(&c.x_label)
        .y_desc(&c.y_label)
        .x_label_formatter(&|v| tick(*v))
        .y_label_formatter(&|v| tick(*v))
        .axis_desc_style((FAMILY, 18))
        .label_style((FAMILY, 14))
        .light_line_style(RGBColor(248, 248, 248))
        .bold_line_style(RGBColor(220, 220, 220))
        .draw()
        .map_err(err)?;
    let rgb = |l: &Line| -> RGBAColor {
        match l.color {
            Some(i) => {
                let (r, g, b) = PALETTE[i % PALETTE.len()];
                RGBColor(r, g, b).to_rgba()
            }
            None => BLACK.to_rgba(),
        }
    };
    // Bands first, so that every line stays visible on top of them.
    for line in c.lines.iter().filter(|l| l.band.len() > 1) {
        let mut poly: Vec<(f64, f64)> = line.band.iter().map(|&(x, _, hi)| (x, hi)).collect();
        poly.extend(line.band.iter().rev().map(|&(x, lo, _)| (x, if c.log_y { lo.max(f64::MIN_POSITIVE) } else { lo })));
        chart.draw_series(std::iter::once(Polygon::new(poly, rgb(line).mix(0.16).filled()))).map_err(err)?;
    }
    // Lines without points (a run not evaluated yet) would only clutter the legend.
    for line in c.lines.iter().filter(|l| !l.points.is_empty()) {
        let color = rgb(line);
        let style = color.stroke_width(if line.reference { 1 } else { 2 });
        let pts = line.points.clone();
        let anno = match line.dash {
            Dash::Solid => chart.draw_series(LineSeries::new(pts, style)).map_err(err)?,
            Dash::Dashed => chart.draw_series(DashedLineSeries::new(pts, 10, 6, style)).map_err(err)?,
            Dash::Dotted => chart.draw_series(DashedLineSeries::new(pts, 2, 5, style)).map_err(err)?,
        };
        let anno = anno.label(line.label.as_str());
        // The legend sample is stroked like the line.
        match line.dash {
            Dash::Solid => anno.legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style)),
            Dash::Dashed => anno.legend(move |(x, y)| EmptyElement::at((x, y)) + PathElement::new(vec![(0, 0), (9, 0)], style) + PathElement::new(vec![(15, 0), (24, 0)], style)),
            Dash::Dotted => anno.legend(move |(x, y)| {
                EmptyElement::at((x, y))
                    + PathElement::new(vec![(0, 0), (2, 0)], style)
                    + PathElement::new(vec![(7, 0), (9, 0)], style)
                    + PathElement::new(vec![(14, 0), (16, 0)], style)
                    + PathElement::new(vec![(21, 0), (23, 0)], style)
            }),
        };
        // Markers only where points are few (evaluations), so dense loss curves stay clean.
        if !line.reference && line.points.len() <= 40 {
            chart.draw_series(line.points.iter().map(|&p| Circle::new(p, 3, color.filled()))).map_err(err)?;
        }
    }
    chart
        .configure_series_labels()
        .label_font((FAMILY, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(160, 160, 160))
        .position(legend_corner(c))
        .draw()
        .map_err(err)?;
    Ok(())
}

/// One panel of [`heatmaps`]: `values[row][col]` (a ratio to chance: 1 is white), rows drawn bottom up.
pub struct HeatPanel {
    pub title: String,
    pub values: Vec<Vec<f64>>,
}

/// The colour of a ratio r on a log₂ scale clamped to ±3 (×1/8 … ×8): blue below 1, white at 1, red
/// above; grey for a missing value (NaN).
fn heat_color(r: f64) -> RGBColor {
    if !r.is_finite() || r < 0.0 {
        return RGBColor(200, 200, 200);
    }
    let x = (r.max(1e-9).log2() / 3.0).clamp(-1.0, 1.0);
    let mix = |a: u8, b: u8, t: f64| (a as f64 + (b as f64 - a as f64) * t).round() as u8;
    let (lo, hi) = ((33u8, 102u8, 172u8), (178u8, 24u8, 43u8));
    if x < 0.0 {
        let t = -x;
        RGBColor(mix(255, lo.0, t), mix(255, lo.1, t), mix(255, lo.2, t))
    } else {
        RGBColor(mix(255, hi.0, x), mix(255, hi.1, x), mix(255, hi.2, x))
    }
}

/// Heat maps of `panels` side by side (three per row) under one title, with a colour bar of the ratio
/// (log₂ scale, ×1/8 … ×8): `stem.png`. `attnlab saliency-words` draws its per-(layer, head) rates with it.
pub fn heatmaps(title: &str, x_label: &str, y_label: &str, panels: &[HeatPanel], stem: &Path) -> Result<PathBuf> {
    register_font()?;
    if let Some(dir) = stem.parent() {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    let png = PathBuf::from(format!("{}.png", stem.display()));
    let per_row = 3usize;
    let rows = panels.len().div_ceil(per_row).max(1);
    let size = (1200u32, 120 + 420 * rows as u32);
    let fail = |e: String| Error::Other(format!("plot {}: {e}", png.display()));
    let draw = || -> std::result::Result<(), String> {
        let err = |e: &dyn std::fmt::Display| e.to_string();
        let root = BitMapBackend::new(&png, size).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let root = root.titled(title, (FAMILY, 20)).map_err(|e| err(&e))?;
        let (grid, bar) = root.split_vertically(size.1 - 110);
        let areas = grid.split_evenly((rows, per_row));
        for (p, area) in panels.iter().zip(areas.iter()) {
            let nr = p.values.len().max(1);
            let nc = p.values.iter().map(|r| r.len()).max().unwrap_or(1).max(1);
            let mut chart = ChartBuilder::on(area)
                .caption(&p.title, (FAMILY, 16))
                .margin(8)
                .x_label_area_size(34)
                .y_label_area_size(40)
                .build_cartesian_2d(0f64..nc as f64, 0f64..nr as f64)
                .map_err(|e| err(&e))?;
            chart
                .configure_mesh()
                .disable_mesh()
                .x_desc(x_label)
                .y_desc(y_label)
                .x_labels(nc.min(12))
                .y_labels(nr.min(16))
                .x_label_formatter(&|v| format!("{}", v.floor() as i64))
                .y_label_formatter(&|v| format!("{}", v.floor() as i64))
                .label_style((FAMILY, 12))
                .axis_desc_style((FAMILY, 13))
                .draw()
                .map_err(|e| err(&e))?;
            let cells = p.values.iter().enumerate().flat_map(|(r, row)| row.iter().enumerate().map(move |(c, &v)| (r, c, v)));
            chart.draw_series(cells.map(|(r, c, v)| Rectangle::new([(c as f64, r as f64), (c as f64 + 1.0, r as f64 + 1.0)], heat_color(v).filled()))).map_err(|e| err(&e))?;
        }
        // The colour bar: ×1/8 … ×8 on a log₂ scale.
        let mut cb = ChartBuilder::on(&bar).margin_left(300).margin_right(300).margin_top(10).margin_bottom(10).x_label_area_size(40).build_cartesian_2d(-3f64..3f64, 0f64..1f64).map_err(|e| err(&e))?;
        cb.configure_mesh()
            .disable_mesh()
            .disable_y_axis()
            .x_desc("selection rate / chance (log scale)")
            .x_labels(7)
            .x_label_formatter(&|v| {
                let e = v.round() as i32;
                if e >= 0 {
                    format!("×{}", 1 << e)
                } else {
                    format!("×1/{}", 1 << -e)
                }
            })
            .label_style((FAMILY, 12))
            .axis_desc_style((FAMILY, 13))
            .draw()
            .map_err(|e| err(&e))?;
        let steps = 120;
        cb.draw_series((0..steps).map(|i| {
            let (a, b) = (-3.0 + 6.0 * i as f64 / steps as f64, -3.0 + 6.0 * (i + 1) as f64 / steps as f64);
            Rectangle::new([(a, 0.0), (b, 1.0)], heat_color(2f64.powf((a + b) / 2.0)).filled())
        }))
        .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
        Ok(())
    };
    draw().map_err(fail)?;
    Ok(png)
}
