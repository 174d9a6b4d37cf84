//! The embedded font (DejaVu Sans, see `assets/DejaVuSans-LICENSE.txt`): text
//! measurement for layout and glyph outlines for the PNG backend. Embedding it
//! means the PNGs look the same on a bare CI machine with no fonts installed.
//!
//! If the font ever failed to parse, measurement falls back to an average glyph
//! width and the PNGs are drawn without text rather than failing.

use std::sync::OnceLock;

use ttf_parser::{Face, GlyphId, OutlineBuilder};

static FONT_DATA: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

/// The family name SVGs ask for, with fallbacks of similar width.
pub(crate) const CSS_FAMILY: &str = "'DejaVu Sans', Verdana, 'Bitstream Vera Sans', sans-serif";

/// Average advance of a DejaVu Sans glyph, in ems, for the fallback.
const FALLBACK_ADVANCE_EM: f32 = 0.6;

fn face() -> Option<&'static Face<'static>> {
    static FACE: OnceLock<Option<Face<'static>>> = OnceLock::new();
    FACE.get_or_init(|| Face::parse(FONT_DATA, 0).ok()).as_ref()
}

/// The glyph for `c`, or for `?` when the font lacks it.
fn glyph(face: &Face<'_>, c: char) -> Option<GlyphId> {
    face.glyph_index(c).or_else(|| face.glyph_index('?'))
}

fn units_per_em(face: &Face<'_>) -> f32 {
    f32::from(face.units_per_em().max(1))
}

/// Width of `text` set at `size` pixels.
pub(crate) fn text_width(text: &str, size: f32) -> f32 {
    let Some(face) = face() else {
        return text.chars().count() as f32 * size * FALLBACK_ADVANCE_EM;
    };
    let scale = size / units_per_em(face);
    text.chars()
        .map(|c| {
            glyph(face, c)
                .and_then(|g| face.glyph_hor_advance(g))
                .map_or(size * FALLBACK_ADVANCE_EM, |adv| f32::from(adv) * scale)
        })
        .sum()
}

/// Receives glyph outlines in pixel coordinates (y pointing down).
pub(crate) trait PenSink {
    fn move_to(&mut self, x: f32, y: f32);
    fn line_to(&mut self, x: f32, y: f32);
    fn quad_to(&mut self, x1: f32, y1: f32, x: f32, y: f32);
    fn cubic_to(&mut self, x1: f32, y1: f32, x2: f32, y2: f32, x: f32, y: f32);
    fn close(&mut self);
}

/// Adapts font units (y up, origin on the baseline) to pixels.
struct Scaled<'a, S: PenSink> {
    sink: &'a mut S,
    scale: f32,
    x0: f32,
}

impl<S: PenSink> Scaled<'_, S> {
    fn p(&self, x: f32, y: f32) -> (f32, f32) {
        (self.x0 + x * self.scale, -y * self.scale)
    }
}

impl<S: PenSink> OutlineBuilder for Scaled<'_, S> {
    fn move_to(&mut self, x: f32, y: f32) {
        let (x, y) = self.p(x, y);
        self.sink.move_to(x, y);
    }
    fn line_to(&mut self, x: f32, y: f32) {
        let (x, y) = self.p(x, y);
        self.sink.line_to(x, y);
    }
    fn quad_to(&mut self, x1: f32, y1: f32, x: f32, y: f32) {
        let (x1, y1) = self.p(x1, y1);
        let (x, y) = self.p(x, y);
        self.sink.quad_to(x1, y1, x, y);
    }
    fn curve_to(&mut self, x1: f32, y1: f32, x2: f32, y2: f32, x: f32, y: f32) {
        let (x1, y1) = self.p(x1, y1);
        let (x2, y2) = self.p(x2, y2);
        let (x, y) = self.p(x, y);
        self.sink.cubic_to(x1, y1, x2, y2, x, y);
    }
    fn close(&mut self) {
        self.sink.close();
    }
}

/// Emits the outlines of `text` at `size` pixels, starting at x = 0 on the
/// baseline y = 0. Returns false when no font is available.
pub(crate) fn outline_text<S: PenSink>(text: &str, size: f32, sink: &mut S) -> bool {
    let Some(face) = face() else {
        return false;
    };
    let scale = size / units_per_em(face);
    let mut x0 = 0.0;
    for c in text.chars() {
        let Some(g) = glyph(face, c) else {
            x0 += size * FALLBACK_ADVANCE_EM;
            continue;
        };
        let mut pen = Scaled {
            sink: &mut *sink,
            scale,
            x0,
        };
        // Whitespace has no outline; that is not an error.
        let _ = face.outline_glyph(g, &mut pen);
        x0 += face
            .glyph_hor_advance(g)
            .map_or(size * FALLBACK_ADVANCE_EM, |adv| f32::from(adv) * scale);
    }
    true
}
