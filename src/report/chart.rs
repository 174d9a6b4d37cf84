//! Line charts over steps: one or more panels stacked on a shared step axis,
//! nice ticks, gaps where a value is missing, and a legend to the right of the
//! plot so it never covers data.
//!
//! Degenerate input is drawn, not rejected: an empty chart gets a [0, 1] axis
//! and a "no data" note; a constant series gets a padded range; non-finite
//! values are treated as missing.

use super::font::text_width;
use super::order::{rank_key, sorted};
use super::scene::{Anchor, Color, Scene, Stroke, AXIS, BLACK, GRID, MUTED, TEXT};

const WIDTH: f32 = 960.0;
const TITLE_SIZE: f32 = 16.0;
const LABEL_SIZE: f32 = 12.0;
const TICK_SIZE: f32 = 11.0;
const LEGEND_SIZE: f32 = 11.5;
const PANEL_HEIGHT: f32 = 250.0;
const PANEL_GAP: f32 = 48.0;
/// Space above the first panel: the chart title, then a panel title if any.
const TOP: f32 = 44.0;
const TOP_WITH_PANEL_TITLE: f32 = 60.0;
const BOTTOM: f32 = 52.0;
const LEGEND_ROW: f32 = 18.0;
const LEGEND_SWATCH: f32 = 22.0;
/// The legend may take this much of the width; the rest is for the plot.
const LEGEND_MAX_WIDTH: f32 = 340.0;
/// Longer legend labels are cut with an ellipsis.
const LEGEND_TEXT_MAX: f32 = 220.0;
/// Markers are drawn on every point when a series has at most this many.
const MARKER_LIMIT: usize = 40;

/// How a series ends, for an end mark on its last point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EndMark {
    None,
    Cross,
}

/// One line: `(step, value)` points in step order; `None` is a gap.
#[derive(Debug, Clone)]
pub(crate) struct Series {
    pub name: String,
    pub points: Vec<(f64, Option<f64>)>,
    pub stroke: Stroke,
    pub end: EndMark,
}

/// A plot area with its own y axis.
#[derive(Debug, Clone, Default)]
pub(crate) struct Panel {
    pub title: Option<String>,
    pub y_label: String,
    pub series: Vec<Series>,
    /// A fixed y range (e.g. [0, 1] for rates); otherwise fitted to the data.
    pub y_range: Option<(f64, f64)>,
}

/// A legend row that is not a series (e.g. explaining the × mark).
#[derive(Debug, Clone)]
pub(crate) enum LegendKey {
    Line(Stroke),
    Cross(Color),
}

#[derive(Debug, Clone)]
pub(crate) struct LineChart {
    pub title: String,
    pub x_label: String,
    pub panels: Vec<Panel>,
    /// Extra legend rows after the series.
    pub notes: Vec<(LegendKey, String)>,
}

/// Linear map from data to pixels.
#[derive(Debug, Clone, Copy)]
struct Axis {
    lo: f64,
    hi: f64,
    from: f32,
    to: f32,
}

impl Axis {
    fn map(&self, v: f64) -> f32 {
        let span = self.hi - self.lo;
        let t = if span > 0.0 {
            (v - self.lo) / span
        } else {
            0.5
        };
        self.from + (self.to - self.from) * t as f32
    }
}

/// Evenly spaced round tick values covering [lo, hi].
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Ticks {
    pub lo: f64,
    pub hi: f64,
    pub step: f64,
    pub values: Vec<f64>,
}

/// Round ticks (1, 2, 2.5 or 5 × 10ⁿ) for [lo, hi], about `target` of them.
/// `integer` forces a step of at least 1. Never returns a zero-width range.
pub(crate) fn nice_ticks(lo: f64, hi: f64, target: usize, integer: bool) -> Ticks {
    let (mut lo, mut hi) = if lo.is_finite() && hi.is_finite() && lo <= hi {
        (lo, hi)
    } else {
        (0.0, 1.0)
    };
    if hi - lo < 1e-12 {
        let pad = if lo.abs() > 1e-9 { lo.abs() * 0.1 } else { 0.5 };
        lo -= pad;
        hi += pad;
    }
    let raw = (hi - lo) / target.max(1) as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let mut step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * magnitude);
    if integer {
        step = step.max(1.0).round();
    }
    let lo = (lo / step).floor() * step;
    let hi = (hi / step).ceil() * step;
    let count = ((hi - lo) / step).round() as usize;
    let values = (0..=count).map(|i| lo + step * i as f64).collect();
    Ticks {
        lo,
        hi,
        step,
        values,
    }
}

/// A tick label with just enough decimals for `step`.
pub(crate) fn tick_label(v: f64, step: f64) -> String {
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10()).ceil().clamp(0.0, 6.0) as usize
    };
    let text = format!("{v:.decimals$}");
    if text.starts_with('-') && text[1..].chars().all(|c| c == '0' || c == '.') {
        text[1..].to_string()
    } else {
        text
    }
}

fn finite_values(series: &[Series]) -> impl Iterator<Item = f64> + '_ {
    series
        .iter()
        .flat_map(|s| s.points.iter())
        .filter_map(|&(_, v)| v)
        .filter(|v| v.is_finite())
}

fn min_max(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values.fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

fn x_range(chart: &LineChart) -> (f64, f64) {
    let xs = chart
        .panels
        .iter()
        .flat_map(|p| p.series.iter())
        .flat_map(|s| s.points.iter())
        .map(|&(x, _)| x)
        .filter(|x| x.is_finite());
    min_max(xs).unwrap_or((0.0, 1.0))
}

/// Legend rows: distinct series names in order of first appearance, series
/// that end with a mark (culled or killed members) after the others, so a
/// legend that overflows keeps the ones still running.
fn legend_rows(chart: &LineChart) -> Vec<(LegendKey, String)> {
    let mut seen: Vec<&Series> = Vec::new();
    for series in chart.panels.iter().flat_map(|p| p.series.iter()) {
        if !seen.iter().any(|s| s.name == series.name) {
            seen.push(series);
        }
    }
    sorted(seen, |s| rank_key(u64::from(s.end != EndMark::None)))
        .into_iter()
        .map(|s| (LegendKey::Line(s.stroke), s.name.clone()))
        .collect()
}

/// How the legend is laid out: rows per column and the width of one column.
struct LegendLayout {
    rows: Vec<(LegendKey, String)>,
    per_column: usize,
    column_width: f32,
    hidden: usize,
}

/// Fits the legend into `height` and at most [`LEGEND_MAX_WIDTH`]: series
/// rows beyond that are counted in a "+N more" row; notes are always shown.
fn layout_legend(
    series: Vec<(LegendKey, String)>,
    notes: &[(LegendKey, String)],
    height: f32,
) -> LegendLayout {
    let widest = series
        .iter()
        .chain(notes)
        .map(|(_, name)| text_width(name, LEGEND_SIZE))
        .fold(0.0, f32::max);
    let column_width = LEGEND_SWATCH + 8.0 + widest.min(LEGEND_TEXT_MAX) + 14.0;
    let per_column = ((height / LEGEND_ROW).floor() as usize).max(1);
    let columns = ((LEGEND_MAX_WIDTH / column_width).floor() as usize).max(1);
    let capacity = per_column * columns;
    let mut rows = series;
    let mut hidden = 0;
    if rows.len() + notes.len() > capacity {
        let keep = capacity.saturating_sub(notes.len() + 1);
        hidden = rows.len() - keep.min(rows.len());
        rows.truncate(keep);
    }
    rows.extend(notes.iter().cloned());
    LegendLayout {
        column_width,
        per_column,
        rows,
        hidden,
    }
}

impl LegendLayout {
    fn columns(&self) -> usize {
        let shown = self.rows.len() + usize::from(self.hidden > 0);
        shown.div_ceil(self.per_column).max(1)
    }

    fn width(&self) -> f32 {
        if self.rows.is_empty() {
            0.0
        } else {
            self.columns() as f32 * self.column_width
        }
    }
}

/// Draws the chart.
pub(crate) fn render(chart: &LineChart) -> Scene {
    let panels = chart.panels.len().max(1);
    let top = if chart.panels.iter().any(|p| p.title.is_some()) {
        TOP_WITH_PANEL_TITLE
    } else {
        TOP
    };
    let height = top + BOTTOM + panels as f32 * PANEL_HEIGHT + (panels - 1) as f32 * PANEL_GAP;
    let mut scene = Scene::new(WIDTH, height, &chart.title);
    scene.text(16.0, 26.0, &chart.title, TITLE_SIZE, Anchor::Start, BLACK);

    let y_ticks: Vec<Ticks> = chart.panels.iter().map(panel_ticks).collect();
    let tick_width = y_ticks
        .iter()
        .flat_map(|t| {
            t.values
                .iter()
                .map(move |v| text_width(&tick_label(*v, t.step), TICK_SIZE))
        })
        .fold(0.0, f32::max);
    let left = 16.0 + LABEL_SIZE + 10.0 + tick_width + 8.0;
    let legend = layout_legend(legend_rows(chart), &chart.notes, height - top - BOTTOM);
    let right = WIDTH - 16.0 - legend.width();
    let (x_lo, x_hi) = x_range(chart);
    let x_ticks = nice_ticks(x_lo, x_hi, 10, true);
    let x_axis = Axis {
        lo: x_ticks.lo,
        hi: x_ticks.hi,
        from: left,
        to: right,
    };

    for (i, (panel, ticks)) in chart.panels.iter().zip(&y_ticks).enumerate() {
        let panel_top = top + i as f32 * (PANEL_HEIGHT + PANEL_GAP);
        let y_axis = Axis {
            lo: ticks.lo,
            hi: ticks.hi,
            from: panel_top + PANEL_HEIGHT,
            to: panel_top,
        };
        draw_frame(&mut scene, panel, ticks, &x_ticks, x_axis, y_axis);
        let last = i + 1 == chart.panels.len();
        draw_x_labels(
            &mut scene,
            &x_ticks,
            x_axis,
            y_axis.from,
            last.then_some(&chart.x_label),
        );
        draw_series(&mut scene, panel, x_axis, y_axis);
    }
    if chart.panels.is_empty() {
        let y_axis = Axis {
            lo: 0.0,
            hi: 1.0,
            from: top + PANEL_HEIGHT,
            to: top,
        };
        draw_frame(
            &mut scene,
            &Panel::default(),
            &nice_ticks(0.0, 1.0, 5, false),
            &x_ticks,
            x_axis,
            y_axis,
        );
    }
    draw_legend(&mut scene, &legend, right + 16.0, top);
    scene
}

fn panel_ticks(panel: &Panel) -> Ticks {
    match panel.y_range {
        Some((lo, hi)) => nice_ticks(lo, hi, 5, false),
        None => {
            let (lo, hi) = min_max(finite_values(&panel.series)).unwrap_or((0.0, 1.0));
            nice_ticks(lo, hi, 5, false)
        }
    }
}

/// Grid, y ticks, axis lines, y label, panel title and the no-data note.
fn draw_frame(scene: &mut Scene, panel: &Panel, y: &Ticks, x: &Ticks, x_axis: Axis, y_axis: Axis) {
    let (left, right, top, bottom) = (x_axis.from, x_axis.to, y_axis.to, y_axis.from);
    for &v in &y.values {
        let py = crisp(y_axis.map(v));
        scene.line((left, py), (right, py), Stroke::solid(GRID, 1.0));
        let label = tick_label(v, y.step);
        scene.text(left - 6.0, py + 4.0, &label, TICK_SIZE, Anchor::End, TEXT);
    }
    for &v in &x.values {
        let px = crisp(x_axis.map(v));
        scene.line((px, top), (px, bottom), Stroke::solid(GRID, 1.0));
    }
    scene.line(
        (crisp(left), top),
        (crisp(left), bottom),
        Stroke::solid(AXIS, 1.0),
    );
    scene.line(
        (left, crisp(bottom)),
        (right, crisp(bottom)),
        Stroke::solid(AXIS, 1.0),
    );
    scene.vertical_text(
        16.0 + LABEL_SIZE,
        (top + bottom) / 2.0,
        &panel.y_label,
        LABEL_SIZE,
        TEXT,
    );
    if let Some(title) = &panel.title {
        scene.text(left, top - 8.0, title, LABEL_SIZE, Anchor::Start, MUTED);
    }
    if finite_values(&panel.series).next().is_none() {
        let (cx, cy) = ((left + right) / 2.0, (top + bottom) / 2.0);
        scene.text(cx, cy, "no data", 14.0, Anchor::Middle, MUTED);
    }
}

/// X tick labels under a panel, and the axis title under the last one.
fn draw_x_labels(scene: &mut Scene, x: &Ticks, x_axis: Axis, bottom: f32, title: Option<&String>) {
    for &v in &x.values {
        let px = x_axis.map(v);
        scene.text(
            px,
            bottom + 16.0,
            &tick_label(v, x.step),
            TICK_SIZE,
            Anchor::Middle,
            TEXT,
        );
    }
    if let Some(title) = title {
        let cx = (x_axis.from + x_axis.to) / 2.0;
        scene.text(cx, bottom + 36.0, title, LABEL_SIZE, Anchor::Middle, TEXT);
    }
}

/// Splits a series into runs of consecutive finite points (gaps break lines).
fn segments(series: &Series) -> Vec<Vec<(f64, f64)>> {
    let mut out: Vec<Vec<(f64, f64)>> = vec![Vec::new()];
    for &(x, v) in &series.points {
        match v.filter(|v| v.is_finite() && x.is_finite()) {
            Some(v) => out.last_mut().map(|seg| seg.push((x, v))).unwrap_or(()),
            None => out.push(Vec::new()),
        }
    }
    out.retain(|seg| !seg.is_empty());
    out
}

fn draw_series(scene: &mut Scene, panel: &Panel, x_axis: Axis, y_axis: Axis) {
    for series in &panel.series {
        let segs = segments(series);
        let count: usize = segs.iter().map(Vec::len).sum();
        let color = series.stroke.color;
        for seg in &segs {
            let pts: Vec<(f32, f32)> = seg
                .iter()
                .map(|&(x, v)| (x_axis.map(x), y_axis.map(v)))
                .collect();
            let pts = decimate(pts);
            if count <= MARKER_LIMIT || pts.len() == 1 {
                for &(px, py) in &pts {
                    scene.circle(px, py, 2.2 + series.stroke.width * 0.4, Some(color), None);
                }
            }
            scene.polyline(
                pts,
                series.stroke,
                Some("series"),
                Some(series.name.clone()),
            );
        }
        if series.end == EndMark::Cross {
            if let Some(&(x, v)) = segs.last().and_then(|s| s.last()) {
                scene.cross(x_axis.map(x), y_axis.map(v), 5.0, Stroke::solid(color, 2.2));
            }
        }
    }
}

fn draw_legend(scene: &mut Scene, legend: &LegendLayout, x0: f32, y0: f32) {
    for (i, (key, name)) in legend.rows.iter().enumerate() {
        let (col, row) = (i / legend.per_column, i % legend.per_column);
        let x = x0 + col as f32 * legend.column_width;
        let y = y0 + row as f32 * LEGEND_ROW + LEGEND_ROW / 2.0;
        match key {
            LegendKey::Line(stroke) => scene.line((x, y), (x + LEGEND_SWATCH, y), *stroke),
            LegendKey::Cross(color) => {
                scene.cross(x + LEGEND_SWATCH / 2.0, y, 5.0, Stroke::solid(*color, 2.2))
            }
        }
        let label = truncate(name, LEGEND_TEXT_MAX);
        scene.text(
            x + LEGEND_SWATCH + 8.0,
            y + 4.0,
            &label,
            LEGEND_SIZE,
            Anchor::Start,
            TEXT,
        );
    }
    if legend.hidden > 0 {
        let i = legend.rows.len();
        let (col, row) = (i / legend.per_column, i % legend.per_column);
        let x = x0 + col as f32 * legend.column_width;
        let y = y0 + row as f32 * LEGEND_ROW + LEGEND_ROW / 2.0 + 4.0;
        let text = format!("+{} more", legend.hidden);
        scene.text(x, y, &text, LEGEND_SIZE, Anchor::Start, MUTED);
    }
}

/// `text`, cut with an ellipsis to fit `max` pixels at legend size.
fn truncate(text: &str, max: f32) -> String {
    if text_width(text, LEGEND_SIZE) <= max {
        return text.to_string();
    }
    let mut out: String = text.to_string();
    while !out.is_empty() && text_width(&format!("{out}…"), LEGEND_SIZE) > max {
        out.pop();
    }
    format!("{out}…")
}

/// Thins a long line to at most four points per pixel column (first, lowest,
/// highest, last), which draws the same picture with far fewer points.
fn decimate(points: Vec<(f32, f32)>) -> Vec<(f32, f32)> {
    const KEEP_BELOW: usize = 2000;
    if points.len() < KEEP_BELOW {
        return points;
    }
    let mut out = Vec::new();
    let mut column: Vec<(f32, f32)> = Vec::new();
    for p in points {
        if column.first().is_some_and(|c| c.0.floor() != p.0.floor()) {
            flush_column(&mut column, &mut out);
        }
        column.push(p);
    }
    flush_column(&mut column, &mut out);
    out
}

fn flush_column(column: &mut Vec<(f32, f32)>, out: &mut Vec<(f32, f32)>) {
    let (Some(&first), Some(&last)) = (column.first(), column.last()) else {
        return;
    };
    let by_y = |a: &&(f32, f32), b: &&(f32, f32)| a.1.total_cmp(&b.1);
    let low = column.iter().min_by(by_y).copied().unwrap_or(first);
    let high = column.iter().max_by(by_y).copied().unwrap_or(first);
    let (a, b) = if low.0 <= high.0 {
        (low, high)
    } else {
        (high, low)
    };
    for p in [first, a, b, last] {
        if out.last() != Some(&p) {
            out.push(p);
        }
    }
    column.clear();
}

/// Centres a 1-pixel line on a pixel so it is not blurred over two.
fn crisp(v: f32) -> f32 {
    v.floor() + 0.5
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        let t = nice_ticks(0.03, 0.91, 5, false);
        assert_eq!((t.lo, t.hi, t.step), (0.0, 1.0, 0.2));
        assert_eq!(t.values.len(), 6);
        let t = nice_ticks(1.0, 20.0, 10, true);
        assert_eq!((t.lo, t.hi, t.step), (0.0, 20.0, 2.0));
    }

    #[test]
    fn degenerate_ranges_get_a_width() {
        for (lo, hi) in [
            (5.0, 5.0),
            (0.0, 0.0),
            (f64::NAN, 1.0),
            (2.0, 1.0),
            (f64::NEG_INFINITY, 0.0),
        ] {
            let t = nice_ticks(lo, hi, 5, false);
            assert!(
                t.hi > t.lo && t.lo.is_finite() && t.hi.is_finite(),
                "{lo}..{hi}: {t:?}"
            );
            assert!(t.values.len() >= 2);
        }
        assert!(nice_ticks(3.0, 3.0, 10, true).step >= 1.0);
    }

    #[test]
    fn tick_labels_have_just_enough_decimals() {
        assert_eq!(tick_label(0.2, 0.2), "0.2");
        assert_eq!(tick_label(0.25, 0.05), "0.25");
        assert_eq!(tick_label(-0.0, 0.1), "0.0");
        assert_eq!(tick_label(20.0, 5.0), "20");
    }

    #[test]
    fn decimation_keeps_the_extremes_of_each_column() {
        let points: Vec<(f32, f32)> = (0..10_000)
            .map(|i| {
                (
                    i as f32 / 100.0,
                    if i == 5_555 { -50.0 } else { (i % 7) as f32 },
                )
            })
            .collect();
        let thin = decimate(points);
        assert!(thin.len() <= 4 * 100 + 4, "{}", thin.len());
        assert!(thin.contains(&(55.55, -50.0)));
        assert_eq!(thin.first(), Some(&(0.0, 0.0)));
    }
}
