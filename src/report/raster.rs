//! Paints a [`Scene`] into a PNG with tiny-skia, drawing text from the embedded
//! font's glyph outlines.

use tiny_skia::{FillRule, LineCap, LineJoin, Paint, PathBuilder, Pixmap, StrokeDash, Transform};

use super::font::{outline_text, text_width, PenSink};
use super::scene::{Anchor, CircleItem, Color, Item, PathItem, Scene, Stroke, TextItem, WHITE};

/// Pixels per scene unit: 2 keeps text crisp in slides and on high-DPI screens.
pub(crate) const SCALE: f32 = 2.0;
/// A very tall figure (a lineage of thousands of members) is drawn at a lower
/// scale so that its canvas stays below this many pixels (~128 MB of RGBA).
const MAX_PIXELS: f32 = 32.0e6;

/// The scale at which `scene` is painted.
fn scale_for(scene: &Scene) -> f32 {
    let area = (scene.width * scene.height).max(1.0);
    SCALE.min((MAX_PIXELS / area).sqrt())
}

/// The PNG bytes of `scene`, or a message saying why it could not be encoded.
pub(crate) fn to_png(scene: &Scene) -> Result<Vec<u8>, String> {
    let scale = scale_for(scene);
    let width = (scene.width * scale).ceil().max(1.0) as u32;
    let height = (scene.height * scale).ceil().max(1.0) as u32;
    let mut pixmap = Pixmap::new(width, height)
        .ok_or_else(|| format!("cannot allocate a {width}×{height} canvas"))?;
    pixmap.fill(skia_color(WHITE));
    let base = Transform::from_scale(scale, scale);
    for item in &scene.items {
        match item {
            Item::Path(p) => paint_path(&mut pixmap, p, base),
            Item::Circle(c) => paint_circle(&mut pixmap, c, base),
            Item::Text(t) => paint_text(&mut pixmap, t, base),
        }
    }
    super::png::encode_rgb(pixmap.width(), pixmap.height(), pixmap.data())
        .ok_or_else(|| "pixel buffer does not match the canvas".to_string())
}

fn skia_color(c: Color) -> tiny_skia::Color {
    tiny_skia::Color::from_rgba8(c.r, c.g, c.b, 255)
}

fn paint_of(c: Color) -> Paint<'static> {
    let mut paint = Paint::default();
    paint.set_color(skia_color(c));
    paint.anti_alias = true;
    paint
}

fn skia_stroke(s: Stroke) -> tiny_skia::Stroke {
    tiny_skia::Stroke {
        width: s.width,
        line_cap: LineCap::Round,
        line_join: LineJoin::Round,
        dash: s
            .dash
            .and_then(|[on, off]| StrokeDash::new(vec![on, off], 0.0)),
        ..tiny_skia::Stroke::default()
    }
}

fn fill_and_stroke(
    pixmap: &mut Pixmap,
    path: &tiny_skia::Path,
    fill: Option<Color>,
    stroke: Option<Stroke>,
    transform: Transform,
) {
    if let Some(color) = fill {
        pixmap.fill_path(path, &paint_of(color), FillRule::Winding, transform, None);
    }
    if let Some(s) = stroke {
        pixmap.stroke_path(path, &paint_of(s.color), &skia_stroke(s), transform, None);
    }
}

fn paint_path(pixmap: &mut Pixmap, p: &PathItem, transform: Transform) {
    let mut points = p.points.iter();
    let Some(&(x0, y0)) = points.next() else {
        return;
    };
    let mut pb = PathBuilder::new();
    pb.move_to(x0, y0);
    for &(x, y) in points {
        pb.line_to(x, y);
    }
    if p.closed {
        pb.close();
    }
    if let Some(path) = pb.finish() {
        fill_and_stroke(pixmap, &path, p.fill, p.stroke, transform);
    }
}

fn paint_circle(pixmap: &mut Pixmap, c: &CircleItem, transform: Transform) {
    if let Some(path) = PathBuilder::from_circle(c.cx, c.cy, c.r) {
        fill_and_stroke(pixmap, &path, c.fill, c.stroke, transform);
    }
}

impl PenSink for PathBuilder {
    fn move_to(&mut self, x: f32, y: f32) {
        PathBuilder::move_to(self, x, y);
    }
    fn line_to(&mut self, x: f32, y: f32) {
        PathBuilder::line_to(self, x, y);
    }
    fn quad_to(&mut self, x1: f32, y1: f32, x: f32, y: f32) {
        PathBuilder::quad_to(self, x1, y1, x, y);
    }
    fn cubic_to(&mut self, x1: f32, y1: f32, x2: f32, y2: f32, x: f32, y: f32) {
        PathBuilder::cubic_to(self, x1, y1, x2, y2, x, y);
    }
    fn close(&mut self) {
        PathBuilder::close(self);
    }
}

fn paint_text(pixmap: &mut Pixmap, t: &TextItem, base: Transform) {
    let mut pb = PathBuilder::new();
    if !outline_text(&t.text, t.size, &mut pb) {
        return;
    }
    let Some(path) = pb.finish() else {
        return; // only whitespace
    };
    let shift = match t.anchor {
        Anchor::Start => 0.0,
        Anchor::Middle => -text_width(&t.text, t.size) / 2.0,
        Anchor::End => -text_width(&t.text, t.size),
    };
    let mut transform = base.pre_translate(t.x, t.y);
    if t.vertical {
        transform = transform.pre_rotate(-90.0);
    }
    transform = transform.pre_translate(shift, 0.0);
    pixmap.fill_path(
        &path,
        &paint_of(t.color),
        FillRule::Winding,
        transform,
        None,
    );
}
