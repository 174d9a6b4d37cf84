//! Who is culled and who breeds: fitness ranking, tournament selection and
//! weighted operator choice. Pure and deterministic given the stream.

use rand::Rng;

/// A member as selection sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub id: u64,
    pub fitness: f64,
}

/// Rank best first; equal fitness ranks the older member (lower id) first, so
/// ties never depend on arrival order. NaN fitness ranks last.
pub fn rank(candidates: &[Candidate]) -> Vec<Candidate> {
    let mut ranked = candidates.to_vec();
    ranked.sort_by(|a, b| {
        let key = |c: &Candidate| {
            if c.fitness.is_nan() {
                f64::NEG_INFINITY
            } else {
                c.fitness
            }
        };
        key(b).total_cmp(&key(a)).then(a.id.cmp(&b.id))
    });
    ranked
}

/// The ids of the bottom `fraction` (rounded up; at least one when there are
/// two or more members, never all of them), worst first.
pub fn cull(candidates: &[Candidate], fraction: f64) -> Vec<u64> {
    let n = candidates.len();
    if n < 2 {
        return Vec::new();
    }
    let count = ((fraction * n as f64).ceil() as usize).clamp(1, n - 1);
    rank(candidates)
        .iter()
        .rev()
        .take(count)
        .map(|c| c.id)
        .collect()
}

/// Tournament selection: the fittest of `size` members drawn uniformly with
/// replacement. `None` when `pool` is empty.
pub fn tournament(pool: &[Candidate], size: usize, rng: &mut impl Rng) -> Option<u64> {
    if pool.is_empty() {
        return None;
    }
    let drawn: Vec<Candidate> = (0..size.max(1))
        .map(|_| pool[rng.random_range(0..pool.len())])
        .collect();
    rank(&drawn).first().map(|c| c.id)
}

/// An index into `weights` drawn with probability proportional to its weight.
/// `None` when there is no positive weight.
pub fn pick_weighted(weights: &[f64], rng: &mut impl Rng) -> Option<usize> {
    let total: f64 = weights.iter().filter(|w| **w > 0.0).sum();
    if total <= 0.0 || !total.is_finite() {
        return None;
    }
    let mut x = rng.random_range(0.0..total);
    for (i, &w) in weights.iter().enumerate() {
        if w <= 0.0 {
            continue;
        }
        if x < w {
            return Some(i);
        }
        x -= w;
    }
    weights.iter().rposition(|w| *w > 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn c(id: u64, fitness: f64) -> Candidate {
        Candidate { id, fitness }
    }

    #[test]
    fn cull_takes_the_worst_and_never_everyone() {
        let pop = [c(0, 0.5), c(1, -1.0), c(2, 0.9), c(3, f64::NAN)];
        assert_eq!(cull(&pop, 0.25), vec![3]);
        assert_eq!(cull(&pop, 0.5), vec![3, 1]);
        assert_eq!(cull(&pop, 0.99), vec![3, 1, 0]);
        assert_eq!(cull(&pop[..1], 0.5), Vec::<u64>::new());
        // ties: the younger member (higher id) goes first
        assert_eq!(cull(&[c(4, 0.0), c(7, 0.0), c(5, 1.0)], 0.3), vec![7]);
    }

    #[test]
    fn tournament_and_weights_follow_the_stream() {
        let pop = [c(0, 0.1), c(1, 0.2), c(2, 0.3)];
        let mut rng = rand_chacha::ChaCha12Rng::seed_from_u64(1);
        let picks: Vec<_> = (0..200)
            .map(|_| tournament(&pop, 3, &mut rng).unwrap())
            .collect();
        let best = picks.iter().filter(|&&id| id == 2).count();
        assert!(best > 100, "the fittest wins most tournaments: {best}/200");
        assert_eq!(tournament(&[], 2, &mut rng), None);
        let weights = [0.0, 3.0, 1.0];
        let picks: Vec<_> = (0..400)
            .map(|_| pick_weighted(&weights, &mut rng).unwrap())
            .collect();
        assert!(!picks.contains(&0));
        let ones = picks.iter().filter(|&&i| i == 1).count();
        assert!((250..350).contains(&ones), "{ones}");
        assert_eq!(pick_weighted(&[0.0, -1.0], &mut rng), None);
    }
}
