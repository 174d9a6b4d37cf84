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
    let diffs: Vec<f64> = a
        .iter()
        .filter_map(|(item, x)| Some(x - b.get(item)?))
        .collect();
    if diffs.is_empty() {
        return None;
    }
    let n = diffs.len();
    let estimate = diffs.iter().sum::<f64>() / n as f64;
    let mut means: Vec<f64> = (0..resamples.max(1))
        .map(|_| (0..n).map(|_| diffs[rng.random_range(0..n)]).sum::<f64>() / n as f64)
        .collect();
    means.sort_by(f64::total_cmp);
    let at = |q: f64| means[((q * (means.len() - 1) as f64).round() as usize).min(means.len() - 1)];
    Some(Difference {
        estimate,
        low: at(0.025),
        high: at(0.975),
        resamples: means.len(),
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
    /// Paired bootstrap (95 %) of weakest member − baseline.
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
    let by_score = |a: &&(String, f64), b: &&(String, f64)| a.1.total_cmp(&b.1);
    let best = means.iter().max_by(by_score)?.clone();
    let weakest = means.iter().min_by(by_score)?.clone();
    let weakest_row = &rows[means.iter().position(|m| m.0 == weakest.0)?];
    let population = mean_scores(&rows);
    Some(BenchmarkComparison {
        benchmark: benchmark.to_string(),
        items: baseline_scores.len(),
        population_mean: mean(&population),
        baseline: mean(&baseline_scores),
        base_model: base.map(|b| mean(&item_scores(records, benchmark, b))),
        mean_minus_baseline: paired_bootstrap(&population, &baseline_scores, resamples, rng),
        weakest_minus_baseline: paired_bootstrap(weakest_row, &baseline_scores, resamples, rng),
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
