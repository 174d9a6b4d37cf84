//! What a person watching `populora run` sees: a live progress line on a
//! terminal (step, phase, ETA) and one summary line per step on stdout.

use std::io::{IsTerminal, Write};

use populora::run_files::MetricsLine;

/// The live line: only on a terminal, overwritten in place.
pub fn phase(step: u64, steps: u64, phase: &str, step_seconds: &[f64]) {
    let mut err = std::io::stderr();
    if !err.is_terminal() {
        return;
    }
    let done = step.saturating_sub(1).min(steps);
    let width = 24usize;
    let filled = if steps == 0 {
        width
    } else {
        (done as usize * width) / steps as usize
    };
    let eta = match step_seconds.len() {
        0 => "ETA --".to_string(),
        n => {
            let mean = step_seconds.iter().sum::<f64>() / n as f64;
            format!("ETA {}", clock(mean * steps.saturating_sub(done) as f64))
        }
    };
    let _ = write!(
        err,
        "\r[{}{}] step {}/{} {:<9} {eta}   ",
        "#".repeat(filled),
        ".".repeat(width - filled),
        step.min(steps),
        steps,
        phase
    );
    let _ = err.flush();
}

/// One line per finished step.
pub fn summary(line: &MetricsLine, steps: u64) {
    if std::io::stderr().is_terminal() {
        eprint!("\r{}\r", " ".repeat(72));
    }
    let rates: Vec<String> = line
        .solve_rate
        .iter()
        .map(|(kind, rate)| match rate {
            Some(r) => format!("{} {:.2}", &kind.name()[..3], r),
            None => format!("{} -", &kind.name()[..3]),
        })
        .collect();
    let compute = line.phase_ms.get("compute").copied().unwrap_or(0.0);
    println!(
        "step {}/{}  proposals {}/{} valid, {} learnable  solve [{}]  resp {:.0} tok  {:.1}s ({:.0}% model)",
        line.step,
        steps,
        line.proposals.valid,
        line.proposals.total,
        line.proposals.learnable.unwrap_or(0),
        rates.join(", "),
        line.tokens.response_mean,
        line.wall_ms / 1e3,
        100.0 * compute / line.wall_ms.max(1e-9)
    );
}

fn clock(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else {
        format!("{}m{:02}s", s / 60, s % 60)
    }
}
