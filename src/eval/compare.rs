//! Comparing evaluated rows item by item: scores per item from the answer
//! records, and a paired bootstrap over items for the difference of two
//! rows' mean scores (population mean − baseline, weakest − baseline).
//!
//! Paired: each resample draws items with replacement and scores both rows on
//! the same draw, so the interval reflects which items happen to be in the
//! benchmark, not noise between rows. Seeded, so the same records give the
//! same interval.

use std::collections::BTreeMap;

use rand::Rng;
use serde::{Deserialize, Serialize};

use super::ItemRecord;

/// A difference of mean scores with its bootstrap interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Difference {
    /// On the benchmark as it is.
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

/// Each item's score for `member` on `benchmark`: the fraction of its
/// samples that passed, by the item's index in the benchmark.
pub fn item_scores(records: &[ItemRecord], benchmark: &str, member: &str) -> BTreeMap<usize, f64> {
    let mut tallies: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
    for r in records
        .iter()
        .filter(|r| r.benchmark == benchmark && r.member == member)
    {
        let t = tallies.entry(r.item).or_default();
        t.0 += usize::from(r.passed);
        t.1 += 1;
    }
    tallies
        .into_iter()
        .map(|(item, (passed, samples))| (item, passed as f64 / samples as f64))
        .collect()
}

/// The per-item mean of several rows' scores (the population mean row).
pub fn mean_scores(rows: &[BTreeMap<usize, f64>]) -> BTreeMap<usize, f64> {
    let mut sums: BTreeMap<usize, (f64, usize)> = BTreeMap::new();
    for row in rows {
        for (&item, &score) in row {
            let s = sums.entry(item).or_default();
            s.0 += score;
            s.1 += 1;
        }
    }
    sums.into_iter()
        .map(|(item, (sum, n))| (item, sum / n as f64))
        .collect()
}

pub fn mean(scores: &BTreeMap<usize, f64>) -> f64 {
    if scores.is_empty() {
        return 0.0;
    }
    scores.values().sum::<f64>() / scores.len() as f64
}

/// Paired bootstrap of `mean(a) − mean(b)` over the items both rows
/// answered; `None` when they share no item.
pub fn paired_bootstrap(
    a: &BTreeMap<usize, f64>,
    b: &BTreeMap<usize, f64>,
    resamples: usize,
    rng: &mut impl Rng,
) -> Option<Difference> {
    bootstrap(&[a], b, resamples, rng, |means| means[0])
}

/// Paired bootstrap of `min over rows of mean(row) − mean(b)`. The weakest
/// row is found again in every resample, so the interval is that of "the
/// weakest member", not of whichever member was weakest on the full set.
pub fn weakest_minus(
    rows: &[&BTreeMap<usize, f64>],
    b: &BTreeMap<usize, f64>,
    resamples: usize,
    rng: &mut impl Rng,
) -> Option<Difference> {
    bootstrap(rows, b, resamples, rng, |means| {
        means.iter().copied().fold(f64::INFINITY, f64::min)
    })
}

/// `statistic` of the rows' mean differences from `b`, over the items every
/// row and `b` answered, with its 95 % percentile interval over `resamples`
/// draws of those items with replacement (the same draw for every row).
fn bootstrap(
    rows: &[&BTreeMap<usize, f64>],
    b: &BTreeMap<usize, f64>,
    resamples: usize,
    rng: &mut impl Rng,
    statistic: impl Fn(&[f64]) -> f64,
) -> Option<Difference> {
    let shared: Vec<usize> = b
        .keys()
        .copied()
        .filter(|item| rows.iter().all(|r| r.contains_key(item)))
        .collect();
    if rows.is_empty() || shared.is_empty() {
        return None;
    }
    let diffs: Vec<Vec<f64>> = rows
        .iter()
        .map(|r| shared.iter().map(|i| r[i] - b[i]).collect())
        .collect();
    let n = shared.len();
    let mean_of = |draw: &[usize]| -> Vec<f64> {
        diffs
            .iter()
            .map(|d| draw.iter().map(|&j| d[j]).sum::<f64>() / n as f64)
            .collect()
    };
    let everything: Vec<usize> = (0..n).collect();
    let estimate = statistic(&mean_of(&everything));
    let mut values: Vec<f64> = (0..resamples.max(1))
        .map(|_| {
            let draw: Vec<usize> = (0..n).map(|_| rng.random_range(0..n)).collect();
            statistic(&mean_of(&draw))
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

/// One benchmark of an experiment: every row's mean score and the two
/// differences a claim needs, with their intervals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchmarkComparison {
    pub benchmark: String,
    /// Items the baseline answered.
    pub items: usize,
    /// Each population member's mean score, in the order given.
    pub members: Vec<(String, f64)>,
    pub population_mean: f64,
    pub best: (String, f64),
    pub weakest: (String, f64),
    pub baseline: f64,
    /// The untouched base model, when it was evaluated.
    pub base_model: Option<f64>,
    /// Paired bootstrap (95 %) of population mean − baseline.
    pub mean_minus_baseline: Option<Difference>,
    /// Paired bootstrap (95 %) of weakest member − baseline, the weakest
    /// chosen anew in each resample.
    pub weakest_minus_baseline: Option<Difference>,
}

/// Compares `members` (a population) with the `baseline` row, and with the
/// `base` row if given, on `benchmark`'s records. `None` when there are no
/// members or no baseline answers.
pub fn compare(
    records: &[ItemRecord],
    benchmark: &str,
    members: &[String],
    baseline: &str,
    base: Option<&str>,
    resamples: usize,
    rng: &mut impl Rng,
) -> Option<BenchmarkComparison> {
    let rows: Vec<BTreeMap<usize, f64>> = members
        .iter()
        .map(|m| item_scores(records, benchmark, m))
        .collect();
    let baseline_scores = item_scores(records, benchmark, baseline);
    if rows.is_empty() || baseline_scores.is_empty() {
        return None;
    }
    let means: Vec<(String, f64)> = members.iter().cloned().zip(rows.iter().map(mean)).collect();
    // The first member wins a tie, as in `eval::table`.
    let first_where = |better: fn(f64, f64) -> bool| {
        means
            .iter()
            .skip(1)
            .fold(&means[0], |w, m| if better(m.1, w.1) { m } else { w })
            .clone()
    };
    let best = first_where(|a, b| a > b);
    let weakest = first_where(|a, b| a < b);
    let population = mean_scores(&rows);
    let row_refs: Vec<&BTreeMap<usize, f64>> = rows.iter().collect();
    Some(BenchmarkComparison {
        benchmark: benchmark.to_string(),
        items: baseline_scores.len(),
        population_mean: mean(&population),
        baseline: mean(&baseline_scores),
        base_model: base.map(|b| mean(&item_scores(records, benchmark, b))),
        mean_minus_baseline: paired_bootstrap(&population, &baseline_scores, resamples, rng),
        weakest_minus_baseline: weakest_minus(&row_refs, &baseline_scores, resamples, rng),
        members: means,
        best,
        weakest,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scores(values: &[f64]) -> BTreeMap<usize, f64> {
        values.iter().copied().enumerate().collect()
    }

    #[test]
    fn a_clear_difference_excludes_zero_and_noise_does_not() {
        let mut rng = crate::keyed_stream!(1, "test-bootstrap");
        let better = scores(&[1.0; 40]);
        let worse = scores(&[[1.0, 0.0, 0.0, 0.0]; 10].concat());
        let d = paired_bootstrap(&better, &worse, 2000, &mut rng).unwrap();
        assert!((d.estimate - 0.75).abs() < 1e-12);
        assert!(d.low > 0.5 && d.high <= 1.0 && d.excludes_zero(), "{d:?}");
        // Two rows that differ on two of forty items, in opposite directions.
        let mut a = vec![0.0; 40];
        let mut b = vec![0.0; 40];
        a[3] = 1.0;
        b[7] = 1.0;
        let d = paired_bootstrap(&scores(&a), &scores(&b), 2000, &mut rng).unwrap();
        assert_eq!(d.estimate, 0.0);
        assert!(!d.excludes_zero(), "{d:?}");
        assert!(paired_bootstrap(&scores(&[]), &better, 10, &mut rng).is_none());
    }

    #[test]
    fn the_weakest_is_chosen_in_every_resample() {
        let mut rng = crate::keyed_stream!(2, "test-bootstrap");
        let baseline = scores(&[0.5; 40]);
        // Two members, each worse than the baseline on a different half:
        // neither one alone is below it, but the weaker of the two always is.
        let mut a = vec![0.5; 40];
        let mut b = vec![0.5; 40];
        for i in 0..20 {
            a[i] = 0.0;
            a[i + 20] = 1.0;
            b[i] = 1.0;
            b[i + 20] = 0.0;
        }
        let (a, b) = (scores(&a), scores(&b));
        let d = weakest_minus(&[&a, &b], &baseline, 2000, &mut rng).unwrap();
        assert_eq!(d.estimate, 0.0);
        assert!(d.high <= 0.0 && d.low < -0.1, "{d:?}");
        let fixed = paired_bootstrap(&a, &baseline, 2000, &mut rng).unwrap();
        assert!(fixed.high > 0.05, "{fixed:?}");
    }

    #[test]
    fn item_scores_average_samples_and_means_average_rows() {
        let record = |member: &str, item, passed| ItemRecord {
            benchmark: "b".into(),
            task_id: format!("t{item}"),
            item,
            member: member.into(),
            sample: 0,
            passed,
            response: String::new(),
            completion: None,
        };
        let records = [
            record("m", 0, true),
            record("m", 0, false),
            record("m", 1, true),
            record("n", 0, false),
            record("n", 1, false),
        ];
        let m = item_scores(&records, "b", "m");
        assert_eq!(m, BTreeMap::from([(0, 0.5), (1, 1.0)]));
        let n = item_scores(&records, "b", "n");
        assert_eq!(
            mean_scores(&[m.clone(), n]),
            BTreeMap::from([(0, 0.25), (1, 0.5)])
        );
        assert_eq!(mean(&m), 0.75);
    }
}
