//! Compute matching, two ways from one baseline run: the baseline's budget
//! is what the whole population spent, and its other compute mark is what
//! one member spent (the population's total over its members). With the
//! per-adapter matching alone (`matching = ["per_adapter"]`), the budget is
//! what one member spent and the run stops there. Each mark is
//! the step boundary nearest its target, chosen by the run after the fact
//! (the coordinator's `compute_marks`); both must land within
//! [`MATCH_TOLERANCE`] of their targets.

use anyhow::bail;
use populora::report::experiment::{ComputeMark, RunTotals};
use populora::run_files::Event;
use populora::scenario::experiment::Matching;
use populora::scenario::Scenario;

use super::MATCH_TOLERANCE;
use crate::runtime::journal;
use crate::runtime::rundir::RunDir;

/// A baseline's two targets, from its population's totals.
#[derive(Debug, Clone, Copy)]
pub struct Targets {
    pub total_tflop: f64,
    pub per_adapter_tflop: f64,
}

impl Targets {
    pub fn of(population: &RunTotals, members: usize) -> Targets {
        let total_tflop = population.compute.flops / 1e12;
        Targets {
            total_tflop,
            per_adapter_tflop: total_tflop / members.max(1) as f64,
        }
    }

    /// The budget and the mark, on the baseline's scenario: the budget is
    /// the largest target `matching` names, and the per-adapter target is a
    /// checkpoint mark below it when both are named.
    pub fn apply(&self, baseline: &mut Scenario, matching: &[Matching]) {
        let total = matching.contains(&Matching::Total);
        let budget = match total {
            true => self.total_tflop,
            false => self.per_adapter_tflop,
        };
        baseline.budget_tflop = Some(budget);
        baseline.checkpoint.at_tflop = match total && matching.contains(&Matching::PerAdapter) {
            true => vec![self.per_adapter_tflop],
            false => Vec::new(),
        };
    }
}

/// The baseline's boundary nearest what the population spent (its budget's
/// compute mark; for a run from before budgets were marked, its end),
/// within [`MATCH_TOLERANCE`].
pub fn total_mark(population: &RunTotals, baseline: &RunTotals) -> anyhow::Result<ComputeMark> {
    let target_tflop = population.compute.flops / 1e12;
    let end = ComputeMark {
        step: baseline.steps,
        target_tflop,
        spent_tflop: baseline.compute.flops / 1e12,
    };
    let mark = journaled_mark(baseline, target_tflop)?.unwrap_or(end);
    if mark.gap().abs() <= MATCH_TOLERANCE {
        return Ok(mark);
    }
    let base_dir = baseline.dir.display();
    let why = if mark.gap() < 0.0 {
        format!(
            "it ran out of steps ({}) first; raise `steps` in the baseline scenario, delete {base_dir}",
            baseline.steps
        )
    } else {
        format!(
            "one baseline step is too large a share of the budget; run the population longer \
             (raise its `steps`, delete {} and {base_dir})",
            population.dir.display()
        )
    };
    bail!(
        "the baseline's step {} spent {:.3} TFLOP against the population's {:.3} ({:+.1} %, allowed ±{:.0} %): {why}, then run the experiment again",
        mark.step,
        mark.spent_tflop,
        target_tflop,
        100.0 * mark.gap(),
        100.0 * MATCH_TOLERANCE,
    )
}

/// The baseline's checkpoint at the per-adapter target, from its journal,
/// within [`MATCH_TOLERANCE`] of it.
pub fn per_adapter_mark(baseline: &RunTotals, target_tflop: f64) -> anyhow::Result<ComputeMark> {
    let Some(mark) = journaled_mark(baseline, target_tflop)? else {
        bail!(
            "{} has no compute mark at {target_tflop:.3} TFLOP (what one population member spent); delete it and run the experiment again",
            baseline.dir.display()
        );
    };
    if mark.gap().abs() > MATCH_TOLERANCE {
        bail!(
            "the baseline's per-adapter checkpoint (step {}) spent {:.3} TFLOP against one member's {:.3} ({:+.1} %, allowed ±{:.0} %): one baseline step is too large a share of it; run the population longer (raise its `steps`) and delete {}",
            mark.step,
            mark.spent_tflop,
            target_tflop,
            100.0 * mark.gap(),
            100.0 * MATCH_TOLERANCE,
            baseline.dir.display()
        );
    }
    Ok(mark)
}

/// The compute mark the baseline's journal holds for `target_tflop`.
fn journaled_mark(baseline: &RunTotals, target_tflop: f64) -> anyhow::Result<Option<ComputeMark>> {
    let events = journal::read(&RunDir::new(&baseline.dir).journal())?;
    Ok(events.iter().find_map(|e| match e {
        Event::ComputeMark {
            step,
            target_tflop: t,
            spent_tflop,
        } if (t - target_tflop).abs() <= 1e-9 * target_tflop.abs().max(1.0) => Some(ComputeMark {
            step: *step,
            target_tflop,
            spent_tflop: *spent_tflop,
        }),
        _ => None,
    }))
}
