//! Comparing evaluated rows: each row's answers tallied per cluster of
//! items (a HumanEval problem with its HumanEval-IO items), and a bootstrap
//! over training seeds and clusters for any difference of rows' scores.
//!
//! Crossed: every seed's rows answered the same items, so a resample draws
//! seeds with replacement and, independently, clusters with replacement, and
//! scores every drawn seed on the same draw of clusters (the two-way
//! "pigeonhole" bootstrap). The interval then covers both which seeds the
//! runs happened to get and which problems the benchmark happens to hold.
//! Items of one problem stay together, since they are not independent.
//! Seeded, so the same records give the same interval.

use std::collections::BTreeMap;

use rand::Rng;
use serde::{Deserialize, Serialize};

use super::ItemRecord;

/// A difference of scores with its bootstrap interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Difference {
    /// On the seeds and the items as they are.
    pub estimate: f64,
    /// 2.5th and 97.5th percentiles over the resamples.
    pub low: f64,
    pub high: f64,
    pub resamples: usize,
}

impl Difference {
    /// Whether the 95 % interval leaves out 0 (a claim can be made).
    pub fn excludes_zero(&self) -> bool {
        self.low > 0.0 || self.high < 0.0
    }
}

/// One row's answers on one benchmark, per cluster: samples passed and
/// samples answered.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tallies {
    pub passed: Vec<f64>,
    pub answered: Vec<f64>,
}

impl Tallies {
    /// `row`'s answers on `benchmark`, into the clusters `cluster_of` names
    /// (by task id; an item whose cluster is not listed is left out).
    pub fn of(
        records: &[ItemRecord],
        benchmark: &str,
        row: &str,
        cluster_of: &BTreeMap<String, usize>,
    ) -> Tallies {
        let n = cluster_of.values().max().map_or(0, |&m| m + 1);
        let mut t = Tallies {
            passed: vec![0.0; n],
            answered: vec![0.0; n],
        };
        for r in records
            .iter()
            .filter(|r| r.benchmark == benchmark && r.member == row)
        {
            if let Some(&c) = cluster_of.get(&r.task_id) {
                t.passed[c] += f64::from(u8::from(r.passed));
                t.answered[c] += 1.0;
            }
        }
        t
    }

    /// The pass rate over clusters drawn with multiplicities `weights`
    /// (all ones: the benchmark as it is); 0 when nothing was answered.
    pub fn score(&self, weights: &[f64]) -> f64 {
        let (mut passed, mut answered) = (0.0, 0.0);
        for ((p, a), w) in self.passed.iter().zip(&self.answered).zip(weights) {
            passed += w * p;
            answered += w * a;
        }
        if answered > 0.0 {
            passed / answered
        } else {
            0.0
        }
    }

    /// Samples answered in all.
    pub fn items(&self) -> usize {
        self.answered.iter().sum::<f64>() as usize
    }
}

/// `statistic(seeds, weights)` on every seed (`0..seeds`) and every cluster
/// once, with its 95 % percentile interval over `resamples` crossed draws:
/// seeds with replacement, and clusters with replacement (`weights[c]`: how
/// often cluster c was drawn). `None` without seeds or clusters.
pub fn crossed_bootstrap(
    seeds: usize,
    clusters: usize,
    resamples: usize,
    rng: &mut impl Rng,
    statistic: impl Fn(&[usize], &[f64]) -> f64,
) -> Option<Difference> {
    if seeds == 0 || clusters == 0 {
        return None;
    }
    let all_seeds: Vec<usize> = (0..seeds).collect();
    let estimate = statistic(&all_seeds, &vec![1.0; clusters]);
    let mut values: Vec<f64> = (0..resamples.max(1))
        .map(|_| {
            let drawn: Vec<usize> = (0..seeds).map(|_| rng.random_range(0..seeds)).collect();
            let mut weights = vec![0.0; clusters];
            for _ in 0..clusters {
                weights[rng.random_range(0..clusters)] += 1.0;
            }
            statistic(&drawn, &weights)
        })
        .collect();
    values.sort_by(f64::total_cmp);
    let at =
        |q: f64| values[((q * (values.len() - 1) as f64).round() as usize).min(values.len() - 1)];
    Some(Difference {
        estimate,
        low: at(0.025),
        high: at(0.975),
        resamples: values.len(),
    })
}

/// How many different multisets a bootstrap can draw from `n` seeds:
/// C(2n−1, n) (3 seeds: 10).
pub fn distinct_seed_draws(n: usize) -> u64 {
    (1..=n as u64).fold(1u64, |acc, i| acc * (n as u64 - 1 + i) / i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tallies(passed: &[f64]) -> Tallies {
        Tallies {
            passed: passed.to_vec(),
            answered: vec![1.0; passed.len()],
        }
    }

    #[test]
    fn a_clear_difference_excludes_zero_and_noise_does_not() {
        let mut rng = crate::keyed_stream!(1, "test-bootstrap");
        // Two seeds: the first row passes everything, the second a quarter.
        let better = [tallies(&[1.0; 40]), tallies(&[1.0; 40])];
        let worse = [
            tallies(&[[1.0, 0.0, 0.0, 0.0]; 10].concat()),
            tallies(&[[0.0, 1.0, 0.0, 0.0]; 10].concat()),
        ];
        let diff = |a: &[Tallies; 2], b: &[Tallies; 2]| {
            let (a, b) = (a.clone(), b.clone());
            move |seeds: &[usize], w: &[f64]| {
                seeds
                    .iter()
                    .map(|&s| a[s].score(w) - b[s].score(w))
                    .sum::<f64>()
                    / seeds.len() as f64
            }
        };
        let d = crossed_bootstrap(2, 40, 2000, &mut rng, diff(&better, &worse)).unwrap();
        assert!((d.estimate - 0.75).abs() < 1e-12);
        assert!(d.low > 0.5 && d.high <= 1.0 && d.excludes_zero(), "{d:?}");
        // Rows that differ on two of forty items, in opposite directions.
        let mut a = vec![0.0; 40];
        let mut b = vec![0.0; 40];
        a[3] = 1.0;
        b[7] = 1.0;
        let (a, b) = ([tallies(&a), tallies(&a)], [tallies(&b), tallies(&b)]);
        let d = crossed_bootstrap(2, 40, 2000, &mut rng, diff(&a, &b)).unwrap();
        assert_eq!(d.estimate, 0.0);
        assert!(!d.excludes_zero(), "{d:?}");
        assert!(crossed_bootstrap(0, 40, 10, &mut rng, |_, _| 0.0).is_none());
    }

    #[test]
    fn seeds_that_disagree_widen_the_interval() {
        // The same items, but seed 0's row is far ahead and seed 1's far
        // behind: over items alone the interval would be narrow around 0;
        // over seeds it spans both.
        let mut rng = crate::keyed_stream!(2, "test-bootstrap");
        let rows = [tallies(&[1.0; 50]), tallies(&[0.0; 50])];
        let baseline = tallies(&[0.5; 50]);
        let d = crossed_bootstrap(2, 50, 4000, &mut rng, |seeds, w| {
            seeds
                .iter()
                .map(|&s| rows[s].score(w) - baseline.score(w))
                .sum::<f64>()
                / seeds.len() as f64
        })
        .unwrap();
        assert_eq!(d.estimate, 0.0);
        assert!(d.low <= -0.49 && d.high >= 0.49, "{d:?}");
        assert_eq!(distinct_seed_draws(3), 10);
        assert_eq!(distinct_seed_draws(2), 3);
        assert_eq!(distinct_seed_draws(1), 1);
    }

    #[test]
    fn tallies_keep_a_problems_items_together() {
        let record = |task: &str, item, passed| ItemRecord {
            benchmark: "b".into(),
            task_id: task.into(),
            item,
            member: "m".into(),
            sample: 0,
            passed,
            base_passed: None,
            response: String::new(),
            completion: None,
        };
        let records = [
            record("P/0", 0, true),
            record("P/0", 1, false),
            record("P/1", 2, true),
            record("P/2", 3, true),
        ];
        let clusters = BTreeMap::from([("P/0".to_string(), 0), ("P/1".to_string(), 1)]);
        let t = Tallies::of(&records, "b", "m", &clusters);
        assert_eq!(t.passed, [1.0, 1.0]);
        assert_eq!(t.answered, [2.0, 1.0]);
        assert!((t.score(&[1.0, 1.0]) - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(t.score(&[0.0, 2.0]), 1.0);
        assert_eq!(t.items(), 3);
    }
}
