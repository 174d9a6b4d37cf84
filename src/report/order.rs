//! Deterministic ordering: natural id order (`student-2` before `student-10`),
//! role order, distinct values (task kinds and self-play roles sort as their
//! enums do).
//!
//! Everything the report sorts goes through [`sorted`], which sorts
//! `(SortKey, index)` pairs, and sets are sorted, deduplicated vectors. One
//! instantiation of the standard sort instead of one per closure, and no
//! B-tree per element type, halved this module's build time.

/// (rank, id without its trailing number, that number, the whole id).
pub(crate) type SortKey = (u64, String, u64, String);

/// Orders by `rank`, then naturally by `id`.
pub(crate) fn id_key(rank: u64, id: &str) -> SortKey {
    let digits = id.len() - id.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let (head, tail) = id.split_at(id.len() - digits);
    (
        rank,
        head.to_string(),
        tail.parse().unwrap_or(0),
        id.to_string(),
    )
}

/// Orders by `rank` alone (ties keep their input order).
pub(crate) fn rank_key(rank: u64) -> SortKey {
    (rank, String::new(), 0, String::new())
}

/// `items` ordered by `key`; equal keys keep their input order.
pub(crate) fn sorted<T>(items: Vec<T>, key: impl Fn(&T) -> SortKey) -> Vec<T> {
    let mut keyed: Vec<(SortKey, usize)> = items.iter().map(key).zip(0..).collect();
    keyed.sort_unstable();
    let mut slots: Vec<Option<T>> = items.into_iter().map(Some).collect();
    keyed
        .into_iter()
        .filter_map(|(_, i)| slots.get_mut(i).and_then(Option::take))
        .collect()
}

/// The distinct strings of `items`, ordered by `rank` and then naturally.
pub(crate) fn distinct<'a>(
    items: impl IntoIterator<Item = &'a str>,
    rank: impl Fn(&str) -> u64,
) -> Vec<String> {
    let all: Vec<String> = items.into_iter().map(str::to_string).collect();
    let mut out = sorted(all, |s| id_key(rank(s), s));
    out.dedup();
    out
}

/// Distinct ids in natural order.
pub(crate) fn distinct_ids<'a>(items: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    distinct(items, |_| 0)
}

/// Sorted distinct steps.
pub(crate) fn distinct_steps(steps: impl IntoIterator<Item = u64>) -> Vec<u64> {
    let mut out: Vec<u64> = steps.into_iter().collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Roles: teachers, students, solo, then anything else.
pub(crate) fn role_rank(role: &str) -> u64 {
    match role {
        "teacher" => 0,
        "student" => 1,
        "solo" => 2,
        _ => 3,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_sort_naturally() {
        let ids = vec![
            "student-10",
            "student-2",
            "teacher-0",
            "student-1",
            "student",
            "student-2",
        ];
        assert_eq!(
            distinct_ids(ids),
            [
                "student",
                "student-1",
                "student-2",
                "student-10",
                "teacher-0"
            ]
        );
    }

    #[test]
    fn sorted_is_stable_for_equal_keys() {
        let items = vec![(1, 'a'), (0, 'b'), (1, 'c'), (0, 'd')];
        let out = sorted(items, |(r, _)| rank_key(*r));
        assert_eq!(out, [(0, 'b'), (0, 'd'), (1, 'a'), (1, 'c')]);
    }

    #[test]
    fn task_kinds_sort_in_azr_order() {
        // The figures order kinds by TaskKind's Ord.
        use crate::task::TaskKind;
        let mut kinds = vec![
            TaskKind::Induction,
            TaskKind::Deduction,
            TaskKind::Abduction,
        ];
        kinds.sort();
        assert_eq!(kinds, TaskKind::ALL);
    }
}
