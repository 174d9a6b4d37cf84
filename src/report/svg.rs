//! Serialises a [`Scene`] as a standalone SVG document.
//!
//! Data lines carry `class="series"` and `data-name`, and a `<title>` child so
//! a browser shows the series name on hover when the SVG is opened directly.

use std::fmt::Write;

use super::font::CSS_FAMILY;
use super::scene::{Anchor, CircleItem, Item, PathItem, Scene, Stroke, TextItem, WHITE};

/// The SVG text of `scene`.
pub(crate) fn to_svg(scene: &Scene) -> String {
    let mut out = String::with_capacity(16 * 1024);
    let (w, h) = (num(scene.width), num(scene.height));
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="{}">"#,
        escape(CSS_FAMILY)
    );
    let _ = writeln!(out, "<title>{}</title>", escape(&scene.title));
    let _ = writeln!(
        out,
        r#"<rect x="0" y="0" width="{w}" height="{h}" fill="{}"/>"#,
        WHITE.css()
    );
    for item in &scene.items {
        match item {
            Item::Path(p) => write_path(&mut out, p),
            Item::Circle(c) => write_circle(&mut out, c),
            Item::Text(t) => write_text(&mut out, t),
        }
    }
    out.push_str("</svg>\n");
    out
}

fn write_path(out: &mut String, p: &PathItem) {
    if p.points.is_empty() {
        return;
    }
    let tag = if p.closed { "polygon" } else { "polyline" };
    let points: Vec<String> = p
        .points
        .iter()
        .map(|&(x, y)| format!("{},{}", num(x), num(y)))
        .collect();
    let _ = write!(out, r#"<{tag} points="{}""#, points.join(" "));
    if let Some(class) = p.class {
        let _ = write!(out, r#" class="{class}""#);
    }
    if let Some(name) = &p.name {
        let _ = write!(out, r#" data-name="{}""#, escape(name));
    }
    write_paint(out, p.fill, p.stroke);
    if !p.closed {
        out.push_str(r#" stroke-linejoin="round" stroke-linecap="round""#);
    }
    match &p.name {
        Some(name) => {
            let _ = writeln!(out, "><title>{}</title></{tag}>", escape(name));
        }
        None => out.push_str("/>\n"),
    }
}

fn write_circle(out: &mut String, c: &CircleItem) {
    let _ = write!(
        out,
        r#"<circle cx="{}" cy="{}" r="{}""#,
        num(c.cx),
        num(c.cy),
        num(c.r)
    );
    write_paint(out, c.fill, c.stroke);
    out.push_str("/>\n");
}

fn write_paint(out: &mut String, fill: Option<super::scene::Color>, stroke: Option<Stroke>) {
    match fill {
        Some(color) => {
            let _ = write!(out, r#" fill="{}""#, color.css());
        }
        None => out.push_str(r#" fill="none""#),
    }
    if let Some(s) = stroke {
        let _ = write!(
            out,
            r#" stroke="{}" stroke-width="{}""#,
            s.color.css(),
            num(s.width)
        );
        if let Some([on, off]) = s.dash {
            let _ = write!(out, r#" stroke-dasharray="{} {}""#, num(on), num(off));
        }
    }
}

fn write_text(out: &mut String, t: &TextItem) {
    let anchor = match t.anchor {
        Anchor::Start => "start",
        Anchor::Middle => "middle",
        Anchor::End => "end",
    };
    let (x, y) = (num(t.x), num(t.y));
    let _ = write!(
        out,
        r#"<text x="{x}" y="{y}" font-size="{}" fill="{}" text-anchor="{anchor}""#,
        num(t.size),
        t.color.css()
    );
    if t.vertical {
        let _ = write!(out, r#" transform="rotate(-90 {x} {y})""#);
    }
    let _ = writeln!(out, ">{}</text>", escape(&t.text));
}

/// A coordinate with at most two decimals and no trailing zeros.
fn num(v: f32) -> String {
    if !v.is_finite() {
        return "0".to_string();
    }
    let s = format!("{v:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".to_string()
    } else {
        s.to_string()
    }
}

/// Escapes text for XML content and attribute values.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out
}
