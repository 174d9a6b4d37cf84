//! A tiny retained drawing model: a figure is a [`Scene`] of paths, circles and
//! text, which `svg` serialises and `raster` paints into a PNG. Both backends
//! measure text with the same embedded font, so the layout is computed once.

/// An sRGB colour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Color {
    pub r: u8,
    pub g: u8,
    pub b: u8,
}

impl Color {
    pub const fn hex(rgb: u32) -> Color {
        Color {
            r: (rgb >> 16) as u8,
            g: (rgb >> 8) as u8,
            b: rgb as u8,
        }
    }

    /// `#rrggbb`, for SVG and CSS.
    pub fn css(self) -> String {
        format!("#{:02x}{:02x}{:02x}", self.r, self.g, self.b)
    }
}

pub(crate) const BLACK: Color = Color::hex(0x222222);
pub(crate) const TEXT: Color = Color::hex(0x333333);
pub(crate) const MUTED: Color = Color::hex(0x777777);
pub(crate) const GRID: Color = Color::hex(0xe4e4e4);
pub(crate) const AXIS: Color = Color::hex(0x999999);
pub(crate) const WHITE: Color = Color::hex(0xffffff);

/// Tableau 10 with its grey swapped for indigo (grey means "ended" here):
/// distinct, colour-blind friendly enough, readable on white.
pub(crate) const PALETTE: [Color; 10] = [
    Color::hex(0x4e79a7),
    Color::hex(0xf28e2b),
    Color::hex(0x59a14f),
    Color::hex(0xe15759),
    Color::hex(0x76b7b2),
    Color::hex(0xedc948),
    Color::hex(0xb07aa1),
    Color::hex(0xff9da7),
    Color::hex(0x9c755f),
    Color::hex(0x6b6ecf),
];

/// Dash patterns used to tell apart series that share a colour.
pub(crate) const DASHES: [Option<[f32; 2]>; 3] = [None, Some([6.0, 4.0]), Some([2.0, 3.0])];

/// How a line is drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Stroke {
    pub color: Color,
    pub width: f32,
    pub dash: Option<[f32; 2]>,
}

impl Stroke {
    pub fn solid(color: Color, width: f32) -> Stroke {
        Stroke {
            color,
            width,
            dash: None,
        }
    }
}

/// Horizontal alignment of text relative to its anchor point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Anchor {
    Start,
    Middle,
    End,
}

/// A polyline or polygon.
#[derive(Debug, Clone)]
pub(crate) struct PathItem {
    pub points: Vec<(f32, f32)>,
    pub closed: bool,
    pub fill: Option<Color>,
    pub stroke: Option<Stroke>,
    /// SVG `class`, e.g. `series`, so tests and stylesheets can find data lines.
    pub class: Option<&'static str>,
    /// Tooltip and `data-name` in SVG.
    pub name: Option<String>,
}

/// A circle.
#[derive(Debug, Clone)]
pub(crate) struct CircleItem {
    pub cx: f32,
    pub cy: f32,
    pub r: f32,
    pub fill: Option<Color>,
    pub stroke: Option<Stroke>,
}

/// A single line of text; `y` is the baseline.
#[derive(Debug, Clone)]
pub(crate) struct TextItem {
    pub x: f32,
    pub y: f32,
    pub text: String,
    pub size: f32,
    pub anchor: Anchor,
    pub color: Color,
    /// Rotated 90° counter-clockwise about (x, y), for vertical axis titles.
    pub vertical: bool,
}

#[derive(Debug, Clone)]
pub(crate) enum Item {
    Path(PathItem),
    Circle(CircleItem),
    Text(TextItem),
}

/// A figure: a white canvas of `width` × `height` pixels and what is on it, in
/// painting order.
#[derive(Debug, Clone)]
pub(crate) struct Scene {
    pub width: f32,
    pub height: f32,
    pub title: String,
    pub items: Vec<Item>,
}

impl Scene {
    pub fn new(width: f32, height: f32, title: &str) -> Scene {
        Scene {
            width,
            height,
            title: title.to_string(),
            items: Vec::new(),
        }
    }

    /// A straight segment.
    pub fn line(&mut self, from: (f32, f32), to: (f32, f32), stroke: Stroke) {
        self.polyline(vec![from, to], stroke, None, None);
    }

    /// An open polyline, optionally tagged with a class and a name.
    pub fn polyline(
        &mut self,
        points: Vec<(f32, f32)>,
        stroke: Stroke,
        class: Option<&'static str>,
        name: Option<String>,
    ) {
        self.items.push(Item::Path(PathItem {
            points,
            closed: false,
            fill: None,
            stroke: Some(stroke),
            class,
            name,
        }));
    }

    pub fn circle(
        &mut self,
        cx: f32,
        cy: f32,
        r: f32,
        fill: Option<Color>,
        stroke: Option<Stroke>,
    ) {
        self.items.push(Item::Circle(CircleItem {
            cx,
            cy,
            r,
            fill,
            stroke,
        }));
    }

    /// A small diagonal cross centred on (x, y): the "ended here" mark.
    pub fn cross(&mut self, x: f32, y: f32, half: f32, stroke: Stroke) {
        self.line((x - half, y - half), (x + half, y + half), stroke);
        self.line((x - half, y + half), (x + half, y - half), stroke);
    }

    /// A filled diamond centred on (x, y): the fault mark (class `fault` when named).
    pub fn diamond(&mut self, x: f32, y: f32, half: f32, fill: Color, name: Option<String>) {
        self.items.push(Item::Path(PathItem {
            points: vec![(x, y - half), (x + half, y), (x, y + half), (x - half, y)],
            closed: true,
            fill: Some(fill),
            stroke: None,
            class: name.as_ref().map(|_| "fault"),
            name,
        }));
    }

    pub fn text(&mut self, x: f32, y: f32, text: &str, size: f32, anchor: Anchor, color: Color) {
        self.items.push(Item::Text(TextItem {
            x,
            y,
            text: text.to_string(),
            size,
            anchor,
            color,
            vertical: false,
        }));
    }

    /// Text rotated to read bottom-to-top, centred on (x, y).
    pub fn vertical_text(&mut self, x: f32, y: f32, text: &str, size: f32, color: Color) {
        self.items.push(Item::Text(TextItem {
            x,
            y,
            text: text.to_string(),
            size,
            anchor: Anchor::Middle,
            color,
            vertical: true,
        }));
    }
}
