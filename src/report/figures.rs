//! The line charts of the report, computed from the step metrics: valid and
//! learnable proposals, problem complexity, solve rate, problem-space
//! coverage, rewards, learning signal, fitness and ratings.
//!
//! Colours are stable within a run: a task kind has the same colour in every
//! figure, and members are coloured in natural id order.

use std::collections::BTreeSet;

use super::chart::{EndMark, LegendKey, LineChart, Panel, Series};
use super::history::{mean, Fate, History};
use super::input::MetricsLine;
use super::order::{distinct, distinct_ids, id_key, role_rank, sorted};
use super::scene::{Stroke, BLACK, DASHES, MUTED, PALETTE};
use crate::rating::Rating;
use crate::run_files::{MemberGroup, ProgramLine, ProposalCounts};
use crate::task::{Role, TaskKind};

const STEP: &str = "step";

/// Every task kind the metrics mention, in display (AZR) order.
pub(crate) fn kinds(metrics: &[MetricsLine]) -> Vec<TaskKind> {
    let mut all = BTreeSet::new();
    for m in metrics {
        all.extend(m.solve_rate.keys().copied());
        all.extend(m.groups.iter().map(|g| g.kind));
        all.extend(m.programs.iter().map(|p| p.kind));
    }
    all.into_iter().collect()
}

fn kind_stroke(kinds: &[TaskKind], kind: TaskKind) -> Stroke {
    let index = kinds.iter().position(|&k| k == kind).unwrap_or(0);
    Stroke::solid(PALETTE[index % PALETTE.len()], 2.0)
}

/// The i-th of many similar lines: palette colour, then a dash pattern once
/// the palette has been used up.
fn nth_stroke(i: usize, width: f32) -> Stroke {
    Stroke {
        color: PALETTE[i % PALETTE.len()],
        width,
        dash: DASHES[(i / PALETTE.len()) % DASHES.len()],
    }
}

fn line(name: &str, points: Vec<(f64, Option<f64>)>, stroke: Stroke) -> Series {
    Series {
        name: name.to_string(),
        points,
        stroke,
        end: EndMark::None,
    }
}

/// Mean AST nodes and mean cyclomatic complexity of the valid proposals, over
/// all authors (black) and per author.
pub(crate) fn complexity(metrics: &[MetricsLine]) -> LineChart {
    let authors = distinct_ids(
        metrics
            .iter()
            .flat_map(|m| m.programs.iter().map(|p| p.author.as_str())),
    );
    let feature_panel = |label: &str, feature: fn(&ProgramLine) -> u32| {
        let all = metrics
            .iter()
            .filter_map(|m| {
                let v = mean(m.programs.iter().map(feature).map(f64::from))?;
                Some((m.step as f64, Some(v)))
            })
            .collect();
        let mut series = vec![line("all authors (mean)", all, Stroke::solid(BLACK, 2.6))];
        for (i, author) in authors.iter().enumerate() {
            let points = metrics
                .iter()
                .filter_map(|m| {
                    let mine = m.programs.iter().filter(|p| p.author == *author);
                    let v = mean(mine.map(feature).map(f64::from))?;
                    Some((m.step as f64, Some(v)))
                })
                .collect();
            series.push(line(author, points, nth_stroke(i, 1.3)));
        }
        Panel {
            title: None,
            y_label: label.to_string(),
            series,
            y_range: None,
        }
    };
    LineChart {
        title: "Problem complexity of valid proposals".to_string(),
        x_label: STEP.to_string(),
        panels: vec![
            feature_panel("mean AST nodes", |p| p.features.ast_nodes),
            feature_panel("mean cyclomatic complexity", |p| p.features.cyclomatic),
        ],
        notes: Vec::new(),
    }
}

/// Student solve rate per task kind; a step without problems of a kind is a gap.
pub(crate) fn solve_rate(metrics: &[MetricsLine]) -> LineChart {
    let kinds = kinds(metrics);
    let solve_kinds: BTreeSet<TaskKind> = metrics
        .iter()
        .flat_map(|m| m.solve_rate.keys().copied())
        .collect();
    let series = solve_kinds
        .into_iter()
        .map(|kind| {
            let points = metrics
                .iter()
                .map(|m| (m.step as f64, m.solve_rate.get(&kind).copied().flatten()))
                .collect();
            line(kind.name(), points, kind_stroke(&kinds, kind))
        })
        .collect();
    LineChart {
        title: "Student solve rate per task kind".to_string(),
        x_label: STEP.to_string(),
        panels: vec![Panel {
            title: None,
            y_label: "solve rate".to_string(),
            series,
            y_range: Some((0.0, 1.0)),
        }],
        notes: Vec::new(),
    }
}

/// Cumulative count of distinct program signatures (ast_nodes, max_depth,
/// node_types, cyclomatic), over all kinds and per kind.
pub(crate) fn coverage(metrics: &[MetricsLine]) -> LineChart {
    let kinds = kinds(metrics);
    let program_kinds: BTreeSet<TaskKind> = metrics
        .iter()
        .flat_map(|m| m.programs.iter().map(|p| p.kind))
        .collect();
    let cumulative = |kind: Option<TaskKind>| {
        let matches = move |p: &&ProgramLine| kind.is_none_or(|k| p.kind == k);
        let sightings = metrics.iter().enumerate().flat_map(|(i, m)| {
            let programs = m.programs.iter().filter(matches);
            programs.map(move |p| {
                let f = p.features;
                (f.ast_nodes, f.max_depth, f.node_types, f.cyclomatic, i)
            })
        });
        new_per_step(sightings.collect(), metrics.len())
            .into_iter()
            .zip(metrics)
            .scan(0, |total, (new, m)| {
                *total += new;
                Some((m.step as f64, Some(*total as f64)))
            })
            .collect()
    };
    let mut series = vec![line(
        "all kinds",
        cumulative(None),
        Stroke::solid(BLACK, 2.6),
    )];
    for kind in program_kinds {
        series.push(line(
            kind.name(),
            cumulative(Some(kind)),
            kind_stroke(&kinds, kind),
        ));
    }
    LineChart {
        title: "Problem-space coverage (distinct program signatures)".to_string(),
        x_label: STEP.to_string(),
        panels: vec![Panel {
            title: None,
            y_label: "distinct signatures so far".to_string(),
            series,
            y_range: None,
        }],
        notes: Vec::new(),
    }
}

/// How many signatures are first seen at each step index, from
/// (signature, step index) sightings.
fn new_per_step(mut sightings: Vec<(u32, u32, u32, u32, usize)>, steps: usize) -> Vec<usize> {
    // Sorted by signature, then step: the first of each run is its first sighting.
    sightings.sort_unstable();
    sightings.dedup_by(|later, first| {
        (later.0, later.1, later.2, later.3) == (first.0, first.1, first.2, first.3)
    });
    let mut counts = vec![0; steps];
    for (.., step) in sightings {
        if let Some(c) = counts.get_mut(step) {
            *c += 1;
        }
    }
    counts
}

/// Mean reward per task kind, one panel per role (proposer, solver).
pub(crate) fn rewards(metrics: &[MetricsLine]) -> LineChart {
    let kinds = kinds(metrics);
    let roles: BTreeSet<Role> = metrics
        .iter()
        .flat_map(|m| m.groups.iter().map(|g| g.role))
        .collect();
    let panels = roles
        .into_iter()
        .map(|role| {
            let role_kinds: BTreeSet<TaskKind> = metrics
                .iter()
                .flat_map(|m| m.groups.iter().filter(|g| g.role == role).map(|g| g.kind))
                .collect();
            let series = role_kinds
                .into_iter()
                .map(|kind| {
                    let points = metrics
                        .iter()
                        .map(|m| {
                            let groups =
                                m.groups.iter().filter(|g| g.role == role && g.kind == kind);
                            (m.step as f64, mean(groups.map(|g| g.reward_mean)))
                        })
                        .collect();
                    line(kind.name(), points, kind_stroke(&kinds, kind))
                })
                .collect();
            let role = role.name();
            Panel {
                title: Some(format!("{role}s")),
                y_label: format!("{role} mean reward"),
                series,
                y_range: None,
            }
        })
        .collect();
    LineChart {
        title: "Mean reward per task kind and role".to_string(),
        x_label: STEP.to_string(),
        panels,
        notes: Vec::new(),
    }
}

/// The share of rollouts with a non-zero advantage (the ones that train),
/// one panel per task kind: over all members (black) and per member, both
/// roles of a member together. Runs from before this was measured have none.
pub(crate) fn signal(metrics: &[MetricsLine]) -> LineChart {
    let members = member_roles(metrics);
    let kinds: BTreeSet<TaskKind> = metrics
        .iter()
        .flat_map(|m| {
            m.members
                .iter()
                .flat_map(|x| x.groups.iter().map(|g| g.kind))
        })
        .collect();
    let share = |groups: &mut dyn Iterator<Item = &MemberGroup>| {
        let (nonzero, rollouts) = groups.fold((0, 0), |(n, r), g| {
            (n + g.nonzero_advantage, r + g.rollouts)
        });
        (rollouts > 0).then(|| nonzero as f64 / rollouts as f64)
    };
    let panels = kinds
        .into_iter()
        .map(|kind| {
            let of_kind = move |g: &&MemberGroup| g.kind == kind;
            let all = metrics
                .iter()
                .filter_map(|m| {
                    let mut groups = m
                        .members
                        .iter()
                        .flat_map(|x| x.groups.iter().filter(of_kind));
                    Some((m.step as f64, Some(share(&mut groups)?)))
                })
                .collect();
            let mut series = vec![line("all members", all, Stroke::solid(BLACK, 2.6))];
            for (i, (id, _)) in members.iter().enumerate() {
                let points = metrics
                    .iter()
                    .filter_map(|m| {
                        let member = m.members.iter().find(|x| x.id == *id)?;
                        let v = share(&mut member.groups.iter().filter(of_kind))?;
                        Some((m.step as f64, Some(v)))
                    })
                    .collect::<Vec<_>>();
                if !points.is_empty() {
                    series.push(line(id, points, nth_stroke(i, 1.3)));
                }
            }
            Panel {
                title: Some(kind.name().to_string()),
                y_label: "non-zero advantage".to_string(),
                series,
                y_range: Some((0.0, 1.0)),
            }
        })
        .collect();
    LineChart {
        title: "Rollouts with a learning signal per task kind".to_string(),
        x_label: STEP.to_string(),
        panels,
        notes: Vec::new(),
    }
}

/// The share of proposals that were valid, and the number of learnable
/// problems (solved in some rollouts but not all), per step.
pub(crate) fn proposals(metrics: &[MetricsLine]) -> LineChart {
    let points = |f: fn(&ProposalCounts) -> Option<f64>| {
        metrics
            .iter()
            .map(|m| (m.step as f64, f(&m.proposals)))
            .collect()
    };
    let valid = |p: &ProposalCounts| (p.total > 0).then(|| p.valid as f64 / p.total as f64);
    let learnable = |p: &ProposalCounts| p.learnable.map(|n| n as f64);
    LineChart {
        title: "Valid proposals and learnable problems".to_string(),
        x_label: STEP.to_string(),
        panels: vec![
            Panel {
                title: None,
                y_label: "valid share".to_string(),
                series: vec![line(
                    "valid / proposed",
                    points(valid),
                    Stroke::solid(BLACK, 2.0),
                )],
                y_range: Some((0.0, 1.0)),
            },
            Panel {
                title: None,
                y_label: "learnable problems".to_string(),
                series: vec![line(
                    "0 < solve rate < 1",
                    points(learnable),
                    nth_stroke(0, 2.0),
                )],
                y_range: None,
            },
        ],
        notes: Vec::new(),
    }
}

/// TrueSkill rating per member: mean μ, one panel per role, and the
/// uncertainty σ of every member (it starts at the prior and shrinks as a
/// member's matches are rated).
pub(crate) fn ratings(metrics: &[MetricsLine]) -> LineChart {
    let members = member_roles(metrics);
    let roles = distinct(members.iter().map(|(_, role)| role.as_str()), role_rank);
    let series_of = |id: &str, colour: usize, value: fn(&Rating) -> f64| {
        let points = metrics
            .iter()
            .filter_map(|m| {
                let member = m.members.iter().find(|x| x.id == id)?;
                Some((m.step as f64, Some(value(&member.rating))))
            })
            .collect();
        line(id, points, nth_stroke(colour, 1.6))
    };
    let colour = |id: &str| members.iter().position(|(m, _)| m == id).unwrap_or(0);
    let mut panels: Vec<Panel> = roles
        .iter()
        .map(|role| Panel {
            title: Some(format!("{role}s")),
            y_label: format!("{role} μ"),
            series: members
                .iter()
                .filter(|(_, r)| r == role)
                .map(|(id, _)| series_of(id, colour(id), |r| r.mu))
                .collect(),
            y_range: None,
        })
        .collect();
    panels.push(Panel {
        title: Some("every member".to_string()),
        y_label: "σ".to_string(),
        series: members
            .iter()
            .map(|(id, _)| series_of(id, colour(id), |r| r.sigma))
            .collect(),
        y_range: Some((0.0, 9.0)),
    });
    LineChart {
        title: "TrueSkill ratings per member".to_string(),
        x_label: STEP.to_string(),
        panels,
        notes: Vec::new(),
    }
}

/// Fitness per member, one panel per role; lines start when a member first
/// appears and end with × when it was culled or killed.
pub(crate) fn fitness(metrics: &[MetricsLine], history: &History) -> LineChart {
    let members = member_roles(metrics);
    let roles = distinct(members.iter().map(|(_, role)| role.as_str()), role_rank);
    let mut any_end = false;
    let mut colour = 0;
    let panels = roles
        .iter()
        .map(|role| {
            let series = members
                .iter()
                .filter(|(_, r)| r == role)
                .map(|(id, _)| {
                    let s = member_fitness(metrics, history, id, nth_stroke(colour, 1.6));
                    colour += 1;
                    any_end |= s.end == EndMark::Cross;
                    s
                })
                .collect();
            Panel {
                title: Some(format!("{role}s")),
                y_label: format!("{role} fitness"),
                series,
                y_range: None,
            }
        })
        .collect();
    let notes = if any_end {
        vec![(LegendKey::Cross(MUTED), "culled / killed".to_string())]
    } else {
        Vec::new()
    };
    LineChart {
        title: "Fitness per member".to_string(),
        x_label: STEP.to_string(),
        panels,
        notes,
    }
}

/// Every member in the metrics with its role (from its first record),
/// ordered by role and then naturally by id.
fn member_roles(metrics: &[MetricsLine]) -> Vec<(String, String)> {
    let seen: Vec<(String, String)> = metrics
        .iter()
        .flat_map(|m| m.members.iter())
        .map(|m| (m.id.clone(), m.role.clone()))
        .collect();
    let mut members = sorted(seen, |(id, _)| id_key(0, id));
    // Stable order: the first record of each id comes first and is kept.
    members.dedup_by(|later, first| later.0 == first.0);
    sorted(members, |(id, role)| id_key(role_rank(role), id))
}

fn member_fitness(metrics: &[MetricsLine], history: &History, id: &str, stroke: Stroke) -> Series {
    let present: Vec<(f64, Option<f64>)> = metrics
        .iter()
        .filter_map(|m| {
            let member = m.members.iter().find(|x| x.id == id)?;
            Some((m.step as f64, Some(member.fitness)))
        })
        .collect();
    let (name, end) = match history.life(id).and_then(|l| l.end) {
        Some((step, Fate::Culled)) => (format!("{id} (culled {step})"), EndMark::Cross),
        Some((step, Fate::Killed)) => (format!("{id} (killed {step})"), EndMark::Cross),
        None => (id.to_string(), EndMark::None),
    };
    Series {
        name,
        points: present,
        stroke,
        end,
    }
}
