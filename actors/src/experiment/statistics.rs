//! The experiment's statistics: which problems choose the best member and
//! which are reported on, every seed's scores, and the pooled differences
//! with their intervals.
//!
//! - **Split.** The evaluated problems (task ids) are shuffled once with a
//!   stream keyed by the first seed; the first `eval.selection` share of them
//!   choose each seed's best and weakest member, the rest are reported on.
//!   The same split holds for every row and benchmark (a HumanEval-IO item
//!   follows its HumanEval problem, a CRUXEval-I item the function its
//!   CRUXEval-O item has), so no row is scored on the items that chose it.
//! - **Groups.** Per seed: the mean over all members, over the students, over
//!   the teachers; the best and the weakest member; the baseline at its
//!   per-adapter mark or at its end.
//! - **Intervals.** Each difference (group − baseline, averaged over seeds)
//!   gets a crossed bootstrap over seeds and reported problems
//!   ([`crossed_bootstrap`]): with 3 seeds the seed level has only 10
//!   distinct draws, which the report says next to the intervals.

use std::collections::BTreeMap;

use anyhow::bail;
use populora::eval::compare::{crossed_bootstrap, distinct_seed_draws, Tallies};
use populora::eval::ItemRecord;
use populora::keyed_stream;
use populora::report::experiment::{
    Comparison, Contrast, ExperimentSummary, Matching, SeedRow, SeedRuns,
};
use populora::scenario::experiment::LoadedExperiment;
use rand::seq::{IndexedRandom, SliceRandom};

use super::evaluate::BASE_ROW;
use super::stages::{Evaluated, SeedRows};

/// Everything the experiment found.
pub fn summarize(
    loaded: &LoadedExperiment,
    runs: &[SeedRuns],
    evaluated: &Evaluated,
) -> anyhow::Result<ExperimentSummary> {
    let first_seed = loaded.seeds()[0];
    let split = Split::of(
        &evaluated.records,
        first_seed,
        loaded.experiment.eval.selection,
    )?;
    let mut comparisons = Vec::new();
    let mut base_model = BTreeMap::new();
    for benchmark in benchmarks(&evaluated.records) {
        let base = Tallies::of(&evaluated.records, &benchmark, BASE_ROW, &split.report);
        if base.items() > 0 {
            base_model.insert(benchmark.clone(), base.score(&split.ones()));
        }
        let run = |m: &Matching| loaded.experiment.matching.contains(m);
        for matching in Matching::BOTH.into_iter().filter(run) {
            let table = Table::of(
                &evaluated.records,
                &benchmark,
                matching,
                &evaluated.rows,
                &split,
                first_seed,
            )?;
            let resamples = loaded.experiment.eval.bootstrap;
            comparisons.push(table.compare(first_seed, resamples));
        }
    }
    Ok(ExperimentSummary {
        name: loaded.experiment.name.clone(),
        scenarios: super::stages::scenario_hashes(loaded),
        seeds: runs.to_vec(),
        subset: super::stages::subset(loaded)?,
        selection: split.selected,
        report_problems: split.report.len(),
        base_model,
        comparisons,
        evaluation: evaluated.totals,
    })
}

/// The benchmarks in the records, in the order first met.
fn benchmarks(records: &[ItemRecord]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in records {
        if !out.contains(&r.benchmark) {
            out.push(r.benchmark.clone());
        }
    }
    out
}

/// The split of HumanEval problems (clusters) into selection and report.
struct Split {
    /// Problem ids that choose the best and weakest members.
    selected: Vec<String>,
    /// Cluster index of every problem id in each part.
    selection: BTreeMap<String, usize>,
    report: BTreeMap<String, usize>,
}

impl Split {
    fn of(records: &[ItemRecord], seed: u64, share: f64) -> anyhow::Result<Split> {
        let mut problems: Vec<String> = records.iter().map(|r| r.task_id.clone()).collect();
        problems.sort_by_key(|id| (problem_number(id), id.clone()));
        problems.dedup();
        if problems.len() < 2 {
            bail!(
                "the evaluation holds {} problem(s): choosing the best member on some and reporting on the others needs at least 2 (raise eval.limit)",
                problems.len()
            );
        }
        problems.shuffle(&mut keyed_stream!(seed, "experiment-selection"));
        let chosen =
            ((share * problems.len() as f64).round() as usize).clamp(1, problems.len() - 1);
        let mut selected = problems[..chosen].to_vec();
        selected.sort_by_key(|id| (problem_number(id), id.clone()));
        let index = |ids: &[String]| -> BTreeMap<String, usize> {
            ids.iter()
                .enumerate()
                .map(|(i, id)| (id.clone(), i))
                .collect()
        };
        let mut reported = problems[chosen..].to_vec();
        reported.sort_by_key(|id| (problem_number(id), id.clone()));
        Ok(Split {
            selection: index(&selected),
            report: index(&reported),
            selected,
        })
    }

    fn ones(&self) -> Vec<f64> {
        vec![1.0; self.report.len()]
    }
}

/// `HumanEval/12` → 12, `sample_12` → 12, so problems sort as their
/// benchmark orders them.
fn problem_number(id: &str) -> u64 {
    id.rsplit(['/', '_'])
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(u64::MAX)
}

/// One benchmark under one matching: every seed's rows' tallies on the
/// reported problems, and who is best and weakest on the selection ones.
struct Table {
    benchmark: String,
    matching: Matching,
    seeds: Vec<SeedTable>,
    clusters: usize,
}

struct SeedTable {
    seed: u64,
    /// (name, is a student, tallies on the reported problems)
    members: Vec<(String, bool, Tallies)>,
    best: Choice,
    weakest: Choice,
    baseline: Tallies,
}

/// A member chosen on the selection problems, and the members that tied
/// with it there (by index; empty when it was alone), among which a seeded
/// draw chose it.
struct Choice {
    member: usize,
    tied: Vec<usize>,
}

impl Choice {
    /// The best (`sign` 1) or weakest (`sign` -1) of `scores`, a tie broken
    /// by a draw from `rng` among the tied members less `besides`.
    fn of(scores: &[f64], sign: f64, besides: Option<usize>, rng: &mut impl rand::Rng) -> Choice {
        let top = scores
            .iter()
            .map(|s| sign * s)
            .fold(f64::NEG_INFINITY, f64::max);
        let tied: Vec<usize> = (0..scores.len())
            .filter(|&i| sign * scores[i] == top)
            .collect();
        if tied.len() == 1 {
            return Choice {
                member: tied[0],
                tied: Vec::new(),
            };
        }
        let eligible: Vec<usize> = tied
            .iter()
            .copied()
            .filter(|&i| Some(i) != besides)
            .collect();
        let member = *eligible.choose(rng).expect("at least two tied members");
        Choice { member, tied }
    }
}

/// Which members a difference averages.
#[derive(Clone, Copy)]
enum Group {
    All,
    Students,
    Teachers,
    Best,
    Weakest,
}

impl Group {
    const ALL: [Group; 5] = [
        Group::All,
        Group::Students,
        Group::Teachers,
        Group::Best,
        Group::Weakest,
    ];

    fn label(self) -> &'static str {
        match self {
            Group::All => "all members − baseline",
            Group::Students => "students − baseline",
            Group::Teachers => "teachers − baseline",
            Group::Best => "best member − baseline",
            Group::Weakest => "weakest member − baseline",
        }
    }
}

impl Table {
    fn of(
        records: &[ItemRecord],
        benchmark: &str,
        matching: Matching,
        rows: &[SeedRows],
        split: &Split,
        first_seed: u64,
    ) -> anyhow::Result<Table> {
        let seeds = rows
            .iter()
            .map(|r| {
                let tallies = |row: &str, part| Tallies::of(records, benchmark, row, part);
                let members: Vec<(String, bool, Tallies)> = r
                    .members
                    .iter()
                    .map(|m| {
                        (
                            m.clone(),
                            m.starts_with("student"),
                            tallies(&r.member(m), &split.report),
                        )
                    })
                    .collect();
                let chosen: Vec<f64> = r
                    .members
                    .iter()
                    .map(|m| {
                        tallies(&r.member(m), &split.selection)
                            .score(&vec![1.0; split.selection.len()])
                    })
                    .collect();
                let baseline = tallies(&r.baseline(matching), &split.report);
                if members.is_empty() || baseline.items() == 0 {
                    bail!(
                        "{benchmark}: the records hold no answers of seed {}'s population or of {}",
                        r.seed,
                        r.baseline(matching)
                    );
                }
                // The same draw under both matchings: the members and
                // their selection scores do not depend on the matching.
                let mut rng = keyed_stream!(first_seed, "experiment-ties", benchmark, r.seed);
                let best = Choice::of(&chosen, 1.0, None, &mut rng);
                let weakest = Choice::of(&chosen, -1.0, Some(best.member), &mut rng);
                Ok(SeedTable {
                    seed: r.seed,
                    best,
                    weakest,
                    members,
                    baseline,
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Table {
            benchmark: benchmark.to_string(),
            matching,
            seeds,
            clusters: split.report.len(),
        })
    }

    fn compare(&self, first_seed: u64, resamples: usize) -> Comparison {
        let ones = vec![1.0; self.clusters];
        let per_seed = self
            .seeds
            .iter()
            .map(|s| {
                let named = |i: usize| (s.members[i].0.clone(), s.members[i].2.score(&ones));
                let tied = |c: &Choice| c.tied.iter().map(|&i| s.members[i].0.clone()).collect();
                SeedRow {
                    seed: s.seed,
                    members: (0..s.members.len()).map(named).collect(),
                    all: s.group(Group::All, &ones),
                    students: s.group(Group::Students, &ones),
                    teachers: s.group(Group::Teachers, &ones),
                    best: named(s.best.member),
                    weakest: named(s.weakest.member),
                    best_drawn_from: tied(&s.best),
                    weakest_drawn_from: tied(&s.weakest),
                    baseline: s.baseline.score(&ones),
                }
            })
            .collect();
        let differences = Group::ALL
            .iter()
            .filter_map(|&group| {
                let mut rng = keyed_stream!(
                    first_seed,
                    "experiment-bootstrap",
                    self.benchmark.as_str(),
                    self.matching.name(),
                    group.label()
                );
                let statistic = |drawn: &[usize], w: &[f64]| {
                    let diffs = drawn.iter().map(|&i| {
                        let s = &self.seeds[i];
                        s.group(group, w) - s.baseline.score(w)
                    });
                    diffs.sum::<f64>() / drawn.len() as f64
                };
                let difference = crossed_bootstrap(
                    self.seeds.len(),
                    self.clusters,
                    resamples,
                    &mut rng,
                    statistic,
                )?;
                Some(Contrast {
                    label: group.label().to_string(),
                    difference,
                })
            })
            .collect();
        Comparison {
            benchmark: self.benchmark.clone(),
            matching: self.matching,
            items: self.seeds.first().map_or(0, |s| s.baseline.items()),
            per_seed,
            differences,
            distinct_seed_draws: distinct_seed_draws(self.seeds.len()),
        }
    }
}

impl SeedTable {
    /// The group's mean score on clusters drawn with `weights` (a group
    /// with no member, e.g. no teacher left, scores as all members do).
    fn group(&self, group: Group, weights: &[f64]) -> f64 {
        let score = |i: usize| self.members[i].2.score(weights);
        let pick: Vec<usize> = match group {
            Group::Best => return score(self.best.member),
            Group::Weakest => return score(self.weakest.member),
            Group::All => (0..self.members.len()).collect(),
            Group::Students => (0..self.members.len())
                .filter(|&i| self.members[i].1)
                .collect(),
            Group::Teachers => (0..self.members.len())
                .filter(|&i| !self.members[i].1)
                .collect(),
        };
        let pick = if pick.is_empty() {
            (0..self.members.len()).collect()
        } else {
            pick
        };
        pick.iter().map(|&i| score(i)).sum::<f64>() / pick.len() as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(member: &str, task: &str, passed: bool) -> ItemRecord {
        ItemRecord {
            benchmark: "humaneval".into(),
            task_id: task.into(),
            item: 0,
            member: member.into(),
            sample: 0,
            passed,
            base_passed: None,
            response: String::new(),
            completion: None,
        }
    }

    #[test]
    fn the_split_is_seeded_the_same_for_every_row_and_leaves_both_parts_non_empty() {
        let records: Vec<ItemRecord> = (0..20)
            .flat_map(|p| ["a", "b"].map(|m| record(m, &format!("HumanEval/{p}"), p % 2 == 0)))
            .collect();
        let split = Split::of(&records, 5, 0.3).unwrap();
        assert_eq!(split.selected.len(), 6);
        assert_eq!(split.report.len(), 14);
        assert!(split
            .selected
            .iter()
            .all(|id| !split.report.contains_key(id)));
        let again = Split::of(&records, 5, 0.3).unwrap();
        assert_eq!(again.selected, split.selected);
        let other = Split::of(&records, 6, 0.3).unwrap();
        assert_ne!(other.selected, split.selected);
        assert!(Split::of(&records[..2], 5, 0.3).is_err());
    }

    /// Members that tie on the selection problems are not chosen by name
    /// order: a seeded draw picks the best among them and the weakest
    /// among the others, the same under both matchings, and the rows say
    /// which members tied.
    #[test]
    fn tied_members_are_drawn_and_best_and_weakest_differ() {
        let probe: Vec<ItemRecord> = (0..10)
            .map(|p| record("x", &format!("HumanEval/{p}"), true))
            .collect();
        let split = Split::of(&probe, 1, 0.3).unwrap();
        let names = ["student-0", "student-1", "teacher-0", "teacher-1"];
        let mut records = Vec::new();
        for p in 0..10 {
            let id = format!("HumanEval/{p}");
            // Every member passes the same problems: all tie everywhere.
            for name in names {
                records.push(record(&format!("seed-1/{name}"), &id, p % 3 == 0));
            }
            for row in [
                "seed-1/baseline/solo-0",
                "seed-1/baseline-per-adapter/solo-0",
            ] {
                records.push(record(row, &id, p % 2 == 0));
            }
        }
        let rows = [SeedRows {
            seed: 1,
            members: names.map(String::from).to_vec(),
            baseline: "solo-0".into(),
        }];
        let chosen = |matching, first_seed| {
            let table =
                Table::of(&records, "humaneval", matching, &rows, &split, first_seed).unwrap();
            let row = table.compare(first_seed, 100).per_seed[0].clone();
            (row.best.0.clone(), row.weakest.0.clone(), row)
        };
        let (best, weakest, row) = chosen(Matching::Total, 1);
        assert_ne!(best, weakest);
        assert_eq!(row.best_drawn_from, names.map(String::from).to_vec());
        assert_eq!(row.weakest_drawn_from, names.map(String::from).to_vec());
        let (best2, weakest2, _) = chosen(Matching::PerAdapter, 1);
        assert_eq!((best2, weakest2), (best.clone(), weakest.clone()));
        // Another first seed draws again (not always the same pair).
        let pairs: std::collections::BTreeSet<(String, String)> = (1..12)
            .map(|seed| {
                let (b, w, _) = chosen(Matching::Total, seed);
                (b, w)
            })
            .collect();
        assert!(pairs.len() > 1, "{pairs:?}");
    }

    #[test]
    fn the_best_member_is_chosen_on_the_selection_and_reported_on_the_rest() {
        // "a" wins every selection problem and loses every reported one:
        // it is the best member, with its reported score.
        let mut records = Vec::new();
        let split_probe: Vec<ItemRecord> = (0..10)
            .map(|p| record("x", &format!("HumanEval/{p}"), true))
            .collect();
        let split = Split::of(&split_probe, 1, 0.3).unwrap();
        for p in 0..10 {
            let id = format!("HumanEval/{p}");
            let chosen = split.selection.contains_key(&id);
            records.push(record("seed-1/student-0", &id, chosen));
            records.push(record("seed-1/teacher-0", &id, !chosen && p % 2 == 0));
            records.push(record("seed-1/baseline/solo-0", &id, p % 2 == 0));
            records.push(record("seed-1/baseline-per-adapter/solo-0", &id, false));
        }
        let rows = [SeedRows {
            seed: 1,
            members: vec!["student-0".into(), "teacher-0".into()],
            baseline: "solo-0".into(),
        }];
        let table = Table::of(&records, "humaneval", Matching::Total, &rows, &split, 1).unwrap();
        let c = table.compare(1, 200);
        let row = &c.per_seed[0];
        assert_eq!(row.best.0, "student-0");
        assert_eq!(row.best.1, 0.0);
        assert_eq!(row.students, 0.0);
        assert_eq!(c.items, split.report.len());
        assert_eq!(c.differences.len(), 5);
        assert_eq!(c.distinct_seed_draws, 1);
        let best = &c.differences[3];
        assert_eq!(best.label, "best member − baseline");
        assert!(best.difference.estimate < 0.0);
    }
}
