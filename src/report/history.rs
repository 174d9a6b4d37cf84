//! What happened in a run, distilled from the journal (and, where the journal
//! is silent, the metrics): who lived when, who descends from whom, what was
//! controlled or failed, and what is missing.

use super::input::{list_steps, Event, RunData, JOURNAL_FILE, METRICS_FILE};
use super::order::distinct_steps;
use crate::run_files::Source;

/// How a member left the population.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fate {
    Culled,
    Killed,
}

/// One member's life.
#[derive(Debug, Clone)]
pub(crate) struct Life {
    pub id: String,
    pub role: String,
    /// 0 for initial members, the spawn step for offspring.
    pub born: u64,
    pub initial: bool,
    pub parents: Vec<String>,
    pub operators: Vec<String>,
    pub end: Option<(u64, Fate)>,
}

/// A fault event.
#[derive(Debug, Clone)]
pub(crate) struct Fault {
    pub step: u64,
    /// `None` when an actor other than a member died.
    pub member: Option<String>,
    pub message: String,
    pub action: String,
}

/// A control command.
#[derive(Debug, Clone)]
pub(crate) struct Control {
    pub step: u64,
    /// As `populora ctl` takes it, e.g. `kill student-1`.
    pub command: String,
    pub source: Source,
    /// `applied`, or `refused: ` and why.
    pub outcome: String,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct History {
    pub scenario: Option<String>,
    pub seed: Option<u64>,
    pub ended: bool,
    /// The last step anything reports (metrics, step or end events).
    pub last_step: Option<u64>,
    /// Every member ever seen, in order of appearance.
    pub lives: Vec<Life>,
    pub controls: Vec<Control>,
    pub faults: Vec<Fault>,
    pub checkpoints: Vec<u64>,
}

impl History {
    pub fn life(&self, id: &str) -> Option<&Life> {
        self.lives.iter().find(|l| l.id == id)
    }

    pub fn alive_at_end(&self) -> Vec<&Life> {
        self.lives.iter().filter(|l| l.end.is_none()).collect()
    }

    pub fn spawn_count(&self) -> usize {
        self.lives.iter().filter(|l| !l.initial).count()
    }

    pub fn fate_count(&self, fate: Fate) -> usize {
        self.lives
            .iter()
            .filter(|l| matches!(l.end, Some((_, f)) if f == fate))
            .count()
    }
}

/// Builds the history and appends warnings about gaps to `warnings`.
pub(crate) fn build(data: &RunData, warnings: &mut Vec<String>) -> History {
    let mut h = History::default();
    let mut started = false;
    let mut journal_steps: Vec<u64> = Vec::new();
    for event in &data.events {
        match event {
            Event::Start {
                seed,
                scenario,
                members,
            } => {
                started = true;
                h.seed = Some(*seed);
                h.scenario = Some(scenario.clone());
                for m in members {
                    add_life(&mut h, &m.id, Some(&m.role), 0, true);
                }
            }
            Event::Step { step, .. } => journal_steps.push(*step),
            Event::Control {
                step,
                command,
                source,
                outcome,
            } => h.controls.push(Control {
                step: *step,
                command: command.to_string(),
                source: *source,
                outcome: outcome.clone(),
            }),
            Event::Spawn {
                step,
                id,
                role,
                parents,
                operators,
                ..
            } => {
                add_life(&mut h, id, Some(role), *step, false);
                if let Some(life) = h.lives.iter_mut().find(|l| l.id == *id) {
                    life.parents.clone_from(parents);
                    life.operators.clone_from(operators);
                }
            }
            Event::Cull { step, id, .. } => end_life(&mut h, id, *step, Fate::Culled),
            Event::Kill { step, id } => end_life(&mut h, id, *step, Fate::Killed),
            Event::Fault {
                step,
                member,
                message,
                action,
            } => h.faults.push(Fault {
                step: *step,
                member: member.clone(),
                message: message.clone(),
                action: action.clone(),
            }),
            Event::Checkpoint { step } => h.checkpoints.push(*step),
            Event::End { step, .. } => {
                h.ended = true;
                journal_steps.push(*step);
            }
            Event::CheckpointSkipped { .. }
            | Event::Seeding { .. }
            | Event::ComputeMark { .. }
            | Event::Layout { .. }
            | Event::NodeLost { .. }
            | Event::NodeBack { .. }
            | Event::Unknown => {}
        }
    }
    add_members_seen_only_in_metrics(&mut h, data);
    let journal_steps = distinct_steps(journal_steps);
    let metric_steps = distinct_steps(data.metrics.iter().map(|m| m.step));
    h.last_step = metric_steps
        .iter()
        .chain(&journal_steps)
        .chain(h.lives.iter().map(|l| &l.born))
        .max()
        .copied();
    warn_about_gaps(
        data,
        started,
        h.ended,
        &journal_steps,
        &metric_steps,
        warnings,
    );
    h
}

fn add_life(h: &mut History, id: &str, role: Option<&str>, born: u64, initial: bool) {
    if h.life(id).is_some() {
        return;
    }
    h.lives.push(Life {
        id: id.to_string(),
        role: role.unwrap_or("member").to_string(),
        born,
        initial,
        parents: Vec::new(),
        operators: Vec::new(),
        end: None,
    });
}

fn end_life(h: &mut History, id: &str, step: u64, fate: Fate) {
    if h.life(id).is_none() {
        add_life(h, id, None, 0, true);
    }
    if let Some(life) = h.lives.iter_mut().find(|l| l.id == id) {
        if life.end.is_none() {
            life.end = Some((step, fate));
        }
    }
}

/// Members that the metrics mention but the journal never introduced (no
/// journal, or a journal cut short) become roots born where they first appear.
fn add_members_seen_only_in_metrics(h: &mut History, data: &RunData) {
    for (index, record) in data.metrics.iter().enumerate() {
        for m in &record.members {
            if h.life(&m.id).is_none() {
                let born = if index == 0 { 0 } else { record.step };
                add_life(h, &m.id, Some(&m.role), born, true);
            }
        }
    }
}

fn warn_about_gaps(
    data: &RunData,
    started: bool,
    ended: bool,
    journal_steps: &[u64],
    metric_steps: &[u64],
    warnings: &mut Vec<String>,
) {
    if data.has_journal_file && !started {
        warnings.push(format!(
            "{JOURNAL_FILE} has no `start` event: scenario, seed and the initial members are unknown"
        ));
    }
    if data.has_journal_file && !ended {
        warnings.push(format!(
            "{JOURNAL_FILE} has no `end` event: the run did not finish (or is still running)"
        ));
    }
    if data.has_metrics_file && metric_steps.is_empty() {
        warnings.push(format!("{METRICS_FILE} has no records"));
    }
    let missing: Vec<u64> = journal_steps
        .iter()
        .filter(|s| metric_steps.binary_search(s).is_err())
        .copied()
        .collect();
    if !missing.is_empty() && data.has_metrics_file {
        warnings.push(format!(
            "{METRICS_FILE} lacks steps that the journal records: {}",
            list_steps(&missing)
        ));
    }
}

/// Mean of `values`, `None` when empty.
pub(crate) fn mean(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values
        .into_iter()
        .filter(|v| v.is_finite())
        .fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_ignores_non_finite_and_empty() {
        assert_eq!(mean([]), None);
        assert_eq!(mean([f64::NAN]), None);
        assert_eq!(mean([1.0, f64::INFINITY, 3.0]), Some(2.0));
    }
}
