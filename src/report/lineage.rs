//! The lineage figure: one row per member, time (step) along x. A member's bar
//! runs from its birth to its cull or kill (×, bar greyed) or to the end of
//! the run; spawn edges run from each parent's row to the child's birth and the
//! child is labelled with its operators. Rows are in depth-first order from
//! the initial members, so offspring sit under their first parent.

use super::chart::{nice_ticks, tick_label};
use super::font::text_width;
use super::history::{Fate, History, Life};
use super::order::{distinct, id_key, role_rank, sorted};
use super::scene::{Anchor, Color, Scene, Stroke, AXIS, BLACK, GRID, MUTED, TEXT};

const WIDTH: f32 = 960.0;
const ROW: f32 = 24.0;
const TOP: f32 = 70.0;
const BOTTOM: f32 = 50.0;
const LABEL_SIZE: f32 = 11.0;
const OPERATOR_SIZE: f32 = 9.5;
const DEAD_BAR: Color = Color::hex(0xc8c8c8);
const CULL_MARK: Color = Color::hex(0xd62728);
const KILL_MARK: Color = BLACK;
const FAULT_MARK: Color = Color::hex(0xf28e2b);

pub(crate) fn role_color(role: &str) -> Color {
    match role {
        "teacher" => Color::hex(0x4e79a7),
        "student" => Color::hex(0x59a14f),
        "solo" => Color::hex(0xb07aa1),
        _ => Color::hex(0x9c755f),
    }
}

/// Members in display order: roots by (role, id), each followed depth-first by
/// the offspring whose first parent it is.
pub(crate) fn row_order(history: &History) -> Vec<&Life> {
    let lives = &history.lives;
    let index_of = |id: &str| lives.iter().position(|l| l.id == id);
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); lives.len()];
    let mut roots = Vec::new();
    for (i, life) in lives.iter().enumerate() {
        match life.parents.first().and_then(|p| index_of(p)) {
            Some(p) if p != i => children[p].push(i),
            _ => roots.push(i),
        }
    }
    let roots = sorted(roots, |&i| id_key(role_rank(&lives[i].role), &lives[i].id));
    let children: Vec<Vec<usize>> = children
        .into_iter()
        .map(|kids| sorted(kids, |&i| id_key(lives[i].born, &lives[i].id)))
        .collect();
    let mut visited = vec![false; lives.len()];
    let mut order = Vec::with_capacity(lives.len());
    let mut stack: Vec<usize> = roots.into_iter().rev().collect();
    while let Some(i) = stack.pop() {
        if std::mem::replace(&mut visited[i], true) {
            continue;
        }
        order.push(i);
        stack.extend(children[i].iter().rev());
    }
    // Members on a parent cycle (corrupt journal) are still shown.
    order.extend((0..lives.len()).filter(|&i| !visited[i]));
    order.into_iter().map(|i| &lives[i]).collect()
}

/// The rows of the figure: where each member's line is.
struct Rows<'a> {
    lives: Vec<&'a Life>,
}

impl Rows<'_> {
    fn y_of_row(row: usize) -> f32 {
        TOP + row as f32 * ROW + ROW / 2.0
    }

    fn y(&self, id: &str) -> Option<f32> {
        self.lives
            .iter()
            .position(|l| l.id == id)
            .map(Self::y_of_row)
    }
}

/// Draws the lineage tree.
pub(crate) fn render(history: &History) -> Scene {
    let rows = Rows {
        lives: row_order(history),
    };
    let height = TOP + BOTTOM + (rows.lives.len().max(4) as f32) * ROW;
    let mut scene = Scene::new(WIDTH, height, "Lineage");
    scene.text(
        16.0,
        26.0,
        "Lineage: spawns, culls and kills over time",
        16.0,
        Anchor::Start,
        BLACK,
    );
    draw_legend(&mut scene, history, 16.0, 50.0);

    let last = history.last_step.unwrap_or(0).max(1) as f64;
    let ticks = nice_ticks(0.0, last, 10, true);
    let root_label = rows
        .lives
        .iter()
        .filter(|l| l.born == 0)
        .map(|l| text_width(&l.id, LABEL_SIZE))
        .fold(40.0, f32::max);
    let left = 16.0 + root_label + 14.0;
    let right = WIDTH - 24.0;
    let x = |step: f64| left + (right - left) * (step / ticks.hi) as f32;
    let bottom = TOP + rows.lives.len().max(4) as f32 * ROW;

    for &v in &ticks.values {
        let px = x(v).floor() + 0.5;
        scene.line((px, TOP - 6.0), (px, bottom), Stroke::solid(GRID, 1.0));
        scene.text(
            px,
            bottom + 16.0,
            &tick_label(v, ticks.step),
            LABEL_SIZE,
            Anchor::Middle,
            TEXT,
        );
    }
    scene.line(
        (left, bottom + 0.5),
        (right, bottom + 0.5),
        Stroke::solid(AXIS, 1.0),
    );
    scene.text(
        (left + right) / 2.0,
        bottom + 36.0,
        "step",
        12.0,
        Anchor::Middle,
        TEXT,
    );
    if rows.lives.is_empty() {
        scene.text(
            (left + right) / 2.0,
            TOP + 2.0 * ROW,
            "no members recorded",
            14.0,
            Anchor::Middle,
            MUTED,
        );
        return scene;
    }

    let end_of_run = ticks.hi.min(last);
    for life in &rows.lives {
        draw_edges(&mut scene, life, &rows, &x);
    }
    for (row, life) in rows.lives.iter().enumerate() {
        let y = Rows::y_of_row(row);
        draw_life(&mut scene, life, y, end_of_run, &x, right);
    }
    draw_faults(&mut scene, history, &rows, &x);
    scene
}

fn draw_edges(scene: &mut Scene, life: &Life, rows: &Rows<'_>, x: &impl Fn(f64) -> f32) {
    let Some(child_y) = rows.y(&life.id) else {
        return;
    };
    let child_x = x(life.born as f64);
    for parent in &life.parents {
        if let Some(parent_y) = rows.y(parent) {
            let name = Some(format!("{parent} → {}", life.id));
            scene.polyline(
                vec![(child_x - 10.0, parent_y), (child_x, child_y)],
                Stroke::solid(MUTED, 1.1),
                Some("edge"),
                name,
            );
        }
    }
}

fn draw_life(
    scene: &mut Scene,
    life: &Life,
    y: f32,
    end_of_run: f64,
    x: &impl Fn(f64) -> f32,
    right: f32,
) {
    let color = role_color(&life.role);
    let born = x(life.born as f64);
    let (end_step, bar) = match life.end {
        Some((step, _)) => (step as f64, DEAD_BAR),
        None => (end_of_run.max(life.born as f64), color),
    };
    scene.polyline(
        vec![(born, y), (x(end_step), y)],
        Stroke::solid(bar, 3.0),
        Some("member"),
        Some(life.id.clone()),
    );
    scene.circle(born, y, 4.0, Some(color), None);
    match life.end {
        Some((step, Fate::Culled)) => {
            scene.cross(x(step as f64), y, 5.0, Stroke::solid(CULL_MARK, 2.2))
        }
        Some((step, Fate::Killed)) => {
            scene.cross(x(step as f64), y, 5.0, Stroke::solid(KILL_MARK, 2.2))
        }
        None => {}
    }
    let label_color = if life.end.is_some() { MUTED } else { TEXT };
    scene.text(
        born - 14.0,
        y + 4.0,
        &life.id,
        LABEL_SIZE,
        Anchor::End,
        label_color,
    );
    if !life.operators.is_empty() {
        let ops = life.operators.join(" + ");
        let w = text_width(&ops, OPERATOR_SIZE);
        let ox = (born + 8.0).min(right - w).max(born - 4.0 - w);
        scene.text(ox, y - 5.0, &ops, OPERATOR_SIZE, Anchor::Start, MUTED);
    }
}

fn draw_faults(scene: &mut Scene, history: &History, rows: &Rows<'_>, x: &impl Fn(f64) -> f32) {
    for fault in &history.faults {
        let (step, Some(member)) = (fault.step, fault.member.as_deref()) else {
            continue;
        };
        if let Some(y) = rows.y(member) {
            let name = Some(format!("fault at step {step}: {}", fault.message));
            scene.diamond(x(step as f64), y, 5.0, FAULT_MARK, name);
        }
    }
}

/// One line of keys under the title: roles present, then the marks.
fn draw_legend(scene: &mut Scene, history: &History, x0: f32, y: f32) {
    let mut x = x0;
    let roles = distinct(history.lives.iter().map(|l| l.role.as_str()), role_rank);
    for role in &roles {
        scene.line((x, y), (x + 18.0, y), Stroke::solid(role_color(role), 3.0));
        scene.circle(x, y, 4.0, Some(role_color(role)), None);
        x = legend_text(scene, x + 24.0, y, role);
    }
    scene.line((x, y), (x + 18.0, y), Stroke::solid(DEAD_BAR, 3.0));
    x = legend_text(scene, x + 24.0, y, "ended");
    scene.cross(x + 6.0, y, 5.0, Stroke::solid(CULL_MARK, 2.2));
    x = legend_text(scene, x + 18.0, y, "culled");
    scene.cross(x + 6.0, y, 5.0, Stroke::solid(KILL_MARK, 2.2));
    x = legend_text(scene, x + 18.0, y, "killed");
    scene.diamond(x + 6.0, y, 5.0, FAULT_MARK, None);
    x = legend_text(scene, x + 18.0, y, "fault");
    scene.line((x, y), (x + 18.0, y - 6.0), Stroke::solid(MUTED, 1.1));
    legend_text(scene, x + 24.0, y, "parent → child (operators)");
}

/// Writes a legend label and returns where the next key starts.
fn legend_text(scene: &mut Scene, x: f32, y: f32, text: &str) -> f32 {
    scene.text(x, y + 4.0, text, LABEL_SIZE, Anchor::Start, TEXT);
    x + text_width(text, LABEL_SIZE) + 18.0
}
