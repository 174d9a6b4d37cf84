//! `index.html`: a self-contained page (inline CSS, no scripts) with the run
//! summary, warnings, the figures (as relative links to their SVGs), the time
//! split per phase, the evaluation table and the control and fault events.

use std::fmt::Write;
use std::path::Path;

use super::history::{Fate, History};
use super::input::{EvalResult, MetricsLine, RunData, EVAL_FILE};
use super::order::{distinct, distinct_ids, rank_key, sorted};
use super::svg::escape;

/// A figure as the page shows it.
pub(crate) struct FigureRef {
    pub name: &'static str,
    pub title: String,
    pub caption: &'static str,
    pub width: f32,
    pub height: f32,
}

/// Phases in the order the step loop runs them.
const PHASES: [&str; 7] = [
    "propose",
    "validate",
    "solve",
    "score",
    "train",
    "evolve",
    "checkpoint",
];
/// Rows shown per event table.
const EVENT_ROWS: usize = 100;

pub(crate) const STYLE: &str = "
body { font-family: 'DejaVu Sans', Verdana, Arial, sans-serif; color: #222; margin: 0; background: #f6f6f4; }
main { max-width: 1000px; margin: 0 auto; padding: 16px 20px 48px; background: #fff; }
h1 { font-size: 22px; margin: 8px 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.sub { color: #666; margin: 0 0 12px; font-size: 13px; }
dl.summary { display: grid; grid-template-columns: max-content 1fr; gap: 4px 16px; font-size: 14px; margin: 0; }
dl.summary dt { color: #666; } dl.summary dd { margin: 0; }
.warnings { background: #fff6d8; border: 1px solid #e8cf73; padding: 8px 12px 8px 28px; font-size: 13px; }
figure { margin: 18px 0; } figure img { max-width: 100%; height: auto; border: 1px solid #e4e4e4; }
figcaption { font-size: 13px; color: #555; margin-top: 4px; }
table { border-collapse: collapse; font-size: 13px; } th, td { padding: 4px 10px; border-bottom: 1px solid #e6e6e6; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.bar { background: #4e79a7; height: 10px; display: inline-block; vertical-align: middle; }
.small { color: #777; font-size: 11px; } code { background: #f1f1f1; padding: 1px 4px; }
";

/// The page's HTML.
pub(crate) fn page(
    run_dir: &Path,
    data: &RunData,
    history: &History,
    figures: &[FigureRef],
    warnings: &[String],
) -> String {
    let mut out = String::with_capacity(32 * 1024);
    let scenario = history.scenario.as_deref().unwrap_or("unknown scenario");
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n<title>populora report: {}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<main>\n",
        escape(scenario)
    );
    let _ = writeln!(out, "<h1>populora run report: {}</h1>", escape(scenario));
    let _ = writeln!(
        out,
        "<p class=\"sub\">{}</p>",
        escape(&run_dir.display().to_string())
    );
    summary(&mut out, data, history);
    warning_list(&mut out, warnings);
    out.push_str("<h2>Dynamics</h2>\n");
    for f in figures {
        figure(&mut out, f);
    }
    phase_table(&mut out, &data.metrics);
    eval_section(&mut out, run_dir, data.eval.as_deref());
    events(&mut out, history);
    out.push_str("</main>\n</body>\n</html>\n");
    out
}

fn summary(out: &mut String, data: &RunData, history: &History) {
    let mut rows: Vec<(&str, String)> = Vec::new();
    rows.push((
        "scenario",
        history.scenario.clone().unwrap_or_else(|| "unknown".into()),
    ));
    rows.push((
        "seed",
        history.seed.map_or("unknown".into(), |s| s.to_string()),
    ));
    let steps = match (data.metrics.len(), history.last_step) {
        (0, None) => "none recorded".to_string(),
        (n, Some(last)) => format!("{n} with metrics, last step {last}"),
        (n, None) => format!("{n} with metrics"),
    };
    rows.push(("steps", steps));
    let status = if history.ended {
        "finished (journal has an end event)".to_string()
    } else if data.has_journal_file {
        "incomplete: no end event in the journal".to_string()
    } else {
        "unknown: no journal".to_string()
    };
    rows.push(("status", status));
    let initial = history.lives.iter().filter(|l| l.initial).count();
    rows.push(("initial members", initial.to_string()));
    let alive = distinct_ids(history.alive_at_end().iter().map(|l| l.id.as_str()));
    rows.push((
        "alive at the end",
        format!("{}: {}", alive.len(), shorten_list(&alive, 24)),
    ));
    rows.push((
        "evolution",
        format!(
            "{} spawned, {} culled, {} killed",
            history.spawn_count(),
            history.fate_count(Fate::Culled),
            history.fate_count(Fate::Killed)
        ),
    ));
    rows.push((
        "events",
        format!(
            "{} control commands, {} faults, {} checkpoints",
            history.controls.len(),
            history.faults.len(),
            history.checkpoints.len()
        ),
    ));
    if let Some(wall) = super::history::mean(data.metrics.iter().map(|m| m.wall_ms)) {
        rows.push(("mean step time", format_ms(wall)));
    }
    out.push_str("<dl class=\"summary\">\n");
    for (key, value) in rows {
        let _ = writeln!(out, "<dt>{key}</dt><dd>{}</dd>", escape(&value));
    }
    out.push_str("</dl>\n");
}

fn shorten_list(items: &[String], max: usize) -> String {
    let mut text = items
        .iter()
        .take(max)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > max {
        let _ = write!(text, ", … ({} more)", items.len() - max);
    }
    if text.is_empty() {
        "none".to_string()
    } else {
        text
    }
}

fn warning_list(out: &mut String, warnings: &[String]) {
    if warnings.is_empty() {
        return;
    }
    out.push_str("<h2>What is missing</h2>\n<ul class=\"warnings\">\n");
    for w in warnings {
        let _ = writeln!(out, "<li>{}</li>", escape(w));
    }
    out.push_str("</ul>\n");
}

fn figure(out: &mut String, f: &FigureRef) {
    let _ = writeln!(
        out,
        "<figure id=\"{name}\"><a href=\"{name}.svg\"><img src=\"{name}.svg\" width=\"{w}\" height=\"{h}\" alt=\"{alt}\"/></a>\n<figcaption>{caption} <a href=\"{name}.png\">PNG</a> · <a href=\"{name}.svg\">SVG</a></figcaption></figure>",
        name = f.name,
        w = f.width.round(),
        h = f.height.round(),
        alt = escape(&f.title),
        caption = escape(f.caption),
    );
}

/// Mean milliseconds per phase over the steps that report it, in step-loop
/// order and then alphabetically.
fn phase_means(metrics: &[MetricsLine]) -> Vec<(String, f64)> {
    let rank = |name: &str| {
        PHASES
            .iter()
            .position(|p| *p == name)
            .unwrap_or(PHASES.len()) as u64
    };
    let names = distinct(
        metrics
            .iter()
            .flat_map(|m| m.phase_ms.keys().map(String::as_str)),
        rank,
    );
    names
        .into_iter()
        .filter_map(|name| {
            let values = metrics
                .iter()
                .filter_map(|m| m.phase_ms.get(&name).copied());
            super::history::mean(values).map(|v| (name, v))
        })
        .collect()
}

fn phase_table(out: &mut String, metrics: &[MetricsLine]) {
    out.push_str("<h2>Time per step, by phase</h2>\n");
    let mut phases = phase_means(metrics);
    if phases.is_empty() {
        out.push_str("<p>No phase timings recorded.</p>\n");
        return;
    }
    let phase_sum: f64 = phases.iter().map(|(_, v)| v.max(0.0)).sum();
    let wall = super::history::mean(metrics.iter().map(|m| m.wall_ms)).unwrap_or(0.0);
    // Wall time the phases do not account for (barriers, journaling, …).
    if wall > phase_sum * 1.005 {
        phases.push(("other (wall − phases)".to_string(), wall - phase_sum));
    }
    let total = wall.max(phase_sum);
    out.push_str("<table>\n<tr><th>phase</th><th>mean per step</th><th>share</th><th></th></tr>\n");
    for (name, ms) in &phases {
        let share = if total > 0.0 {
            ms.max(0.0) / total
        } else {
            0.0
        };
        let _ = writeln!(
            out,
            "<tr><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{:.1}%</td><td><span class=\"bar\" style=\"width:{:.0}px\"></span></td></tr>",
            escape(name),
            format_ms(*ms),
            share * 100.0,
            share * 300.0
        );
    }
    let _ = writeln!(
        out,
        "</table>\n<p class=\"small\">Averaged over the {} steps with metrics; shares are of the mean wall time per step (or of the phases' sum when that is larger).</p>",
        metrics.len()
    );
}

fn format_ms(ms: f64) -> String {
    if ms >= 10_000.0 {
        format!("{:.1} s", ms / 1000.0)
    } else if ms >= 100.0 {
        format!("{ms:.0} ms")
    } else {
        format!("{ms:.1} ms")
    }
}

fn eval_section(out: &mut String, run_dir: &Path, eval: Option<&[EvalResult]>) {
    out.push_str("<h2>Evaluation</h2>\n");
    let Some(rows) = eval.filter(|rows| !rows.is_empty()) else {
        let dir = escape(&run_dir.display().to_string());
        let _ = writeln!(
            out,
            "<p>No evaluation in this run directory yet. Run <code>populora eval {dir}</code> to write <code>{EVAL_FILE}</code>, then regenerate the report.</p>"
        );
        return;
    };
    let benchmarks = distinct_ids(rows.iter().map(|r| r.benchmark.as_str()));
    let members = distinct_ids(rows.iter().map(|r| r.member.as_str()));
    // The last row for a (member, benchmark) pair wins.
    let cell_of = |m: &String, b: &String| {
        rows.iter()
            .rev()
            .find(|r| r.member == *m && r.benchmark == *b)
    };
    out.push_str("<table>\n<tr><th>member</th>");
    for b in &benchmarks {
        let _ = write!(out, "<th>{}</th>", escape(b));
    }
    out.push_str("</tr>\n");
    for m in &members {
        let _ = write!(out, "<tr><td>{}</td>", escape(m));
        for b in &benchmarks {
            let cell = cell_of(m, b).map_or("–".to_string(), eval_cell);
            let _ = write!(out, "<td class=\"num\">{cell}</td>");
        }
        out.push_str("</tr>\n");
    }
    out.push_str(
        "</table>\n<p class=\"small\">pass@1 (correct / n), and pass@k where sampled.</p>\n",
    );
}

fn eval_cell(r: &EvalResult) -> String {
    let mut text = match r.pass_at_1 {
        Some(p) if p.is_finite() => format!("{:.1}%", p * 100.0),
        _ => "–".to_string(),
    };
    if let (Some(c), Some(n)) = (r.correct, r.n) {
        let _ = write!(text, " <span class=\"small\">{c}/{n}</span>");
    }
    if let Some((k, p)) = r.pass_at_k.filter(|(_, p)| p.is_finite()) {
        let _ = write!(
            text,
            "<br/><span class=\"small\">pass@{k} {:.1}%</span>",
            p * 100.0
        );
    }
    text
}

fn events(out: &mut String, history: &History) {
    if history.controls.is_empty() && history.faults.is_empty() {
        return;
    }
    out.push_str("<h2>Control commands and faults</h2>\n<table>\n<tr><th>step</th><th>event</th><th>detail</th></tr>\n");
    let mut rows: Vec<(u64, String, String)> = Vec::new();
    for c in &history.controls {
        let detail = format!("{} (from {}) → {}", c.command, c.source.name(), c.outcome);
        rows.push((c.step, "control".into(), detail));
    }
    for f in &history.faults {
        // The runtime's message names the actor that died.
        let detail = format!("{} → {}", f.message, f.action);
        rows.push((f.step, "fault".into(), detail));
    }
    let rows = sorted(rows, |(step, _, _)| rank_key(*step));
    for (step, kind, detail) in rows.iter().take(EVENT_ROWS) {
        let _ = writeln!(
            out,
            "<tr><td class=\"num\">{step}</td><td>{kind}</td><td>{}</td></tr>",
            escape(detail)
        );
    }
    out.push_str("</table>\n");
    if rows.len() > EVENT_ROWS {
        let _ = writeln!(
            out,
            "<p class=\"small\">… {} more in the journal.</p>",
            rows.len() - EVENT_ROWS
        );
    }
}
