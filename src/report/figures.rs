//! The line charts of the report, computed from the step metrics: valid and
//! learnable proposals, problem complexity, solve rate, problem-space
//! coverage, rewards, fitness and ratings.
//!
//! Colours are stable within a run: a task kind has the same colour in every
//! figure, and members are coloured in natural id order.

use super::chart::{EndMark, LegendKey, LineChart, Panel, Series};
use super::history::{mean, Fate, History};
use super::input::{ProgramMetrics, ProposalCounts, Rating, StepMetrics};
use super::order::{distinct, distinct_ids, id_key, kind_order, role_rank, sorted};
use super::scene::{Stroke, BLACK, DASHES, MUTED, PALETTE};

const STEP: &str = "step";

/// Every task kind the metrics mention, in display order.
pub(crate) fn kinds(metrics: &[StepMetrics]) -> Vec<String> {
    let mut all: Vec<&String> = Vec::new();
    for m in metrics {
        all.extend(m.solve_rate.keys());
        all.extend(m.groups.iter().map(|g| &g.kind));
        all.extend(m.programs.iter().filter_map(|p| p.kind.as_ref()));
    }
    kind_order(all)
}

fn kind_stroke(kinds: &[String], kind: &str) -> Stroke {
    let index = kinds.iter().position(|k| k == kind).unwrap_or(0);
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
pub(crate) fn complexity(metrics: &[StepMetrics]) -> LineChart {
    let authors = distinct_ids(
        metrics
            .iter()
            .flat_map(|m| m.programs.iter().filter_map(|p| p.author.as_deref())),
    );
    let feature_panel = |label: &str, feature: fn(&ProgramMetrics) -> Option<u64>| {
        let all = metrics
            .iter()
            .filter_map(|m| {
                let v = mean(m.programs.iter().filter_map(feature).map(|v| v as f64))?;
                Some((m.step as f64, Some(v)))
            })
            .collect();
        let mut series = vec![line("all authors (mean)", all, Stroke::solid(BLACK, 2.6))];
        for (i, author) in authors.iter().enumerate() {
            let points = metrics
                .iter()
                .filter_map(|m| {
                    let mine = m
                        .programs
                        .iter()
                        .filter(|p| p.author.as_ref() == Some(author));
                    let v = mean(mine.filter_map(feature).map(|v| v as f64))?;
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
            feature_panel("mean AST nodes", |p| p.ast_nodes),
            feature_panel("mean cyclomatic complexity", |p| p.cyclomatic),
        ],
        notes: Vec::new(),
    }
}

/// Student solve rate per task kind; a step without problems of a kind is a gap.
pub(crate) fn solve_rate(metrics: &[StepMetrics]) -> LineChart {
    let kinds = kinds(metrics);
    let solve_kinds = kind_order(metrics.iter().flat_map(|m| m.solve_rate.keys()));
    let series = solve_kinds
        .iter()
        .map(|kind| {
            let points = metrics
                .iter()
                .map(|m| (m.step as f64, m.solve_rate.get(kind).copied().flatten()))
                .collect();
            line(kind, points, kind_stroke(&kinds, kind))
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
pub(crate) fn coverage(metrics: &[StepMetrics]) -> LineChart {
    let kinds = kinds(metrics);
    let program_kinds = kind_order(
        metrics
            .iter()
            .flat_map(|m| m.programs.iter().filter_map(|p| p.kind.as_ref())),
    );
    let cumulative = |kind: Option<&String>| {
        let matches = |p: &&ProgramMetrics| kind.is_none() || p.kind.as_ref() == kind;
        let sightings = metrics.iter().enumerate().flat_map(|(i, m)| {
            let programs = m.programs.iter().filter(matches);
            programs.filter_map(move |p| p.signature().map(|(a, b, c, d)| (a, b, c, d, i)))
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
    for kind in &program_kinds {
        series.push(line(
            kind,
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
fn new_per_step(mut sightings: Vec<(u64, u64, u64, u64, usize)>, steps: usize) -> Vec<usize> {
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
pub(crate) fn rewards(metrics: &[StepMetrics]) -> LineChart {
    let kinds = kinds(metrics);
    let roles = distinct(
        metrics
            .iter()
            .flat_map(|m| m.groups.iter().map(|g| g.role.as_str())),
        |r| match r {
            "proposer" => 0,
            "solver" => 1,
            _ => 2,
        },
    );
    let panels = roles
        .iter()
        .map(|role| {
            let role_kinds = kind_order(
                metrics
                    .iter()
                    .flat_map(|m| m.groups.iter().filter(|g| g.role == *role).map(|g| &g.kind)),
            );
            let series = role_kinds
                .iter()
                .map(|kind| {
                    let points = metrics
                        .iter()
                        .map(|m| {
                            let groups = m
                                .groups
                                .iter()
                                .filter(|g| g.role == *role && g.kind == *kind);
                            (m.step as f64, mean(groups.filter_map(|g| g.reward_mean)))
                        })
                        .collect();
                    line(kind, points, kind_stroke(&kinds, kind))
                })
                .collect();
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

/// The share of proposals that were valid, and the number of learnable
/// problems (solved in some rollouts but not all), per step.
pub(crate) fn proposals(metrics: &[StepMetrics]) -> LineChart {
    let points = |f: fn(&ProposalCounts) -> Option<f64>| {
        metrics
            .iter()
            .map(|m| (m.step as f64, m.proposals.as_ref().and_then(f)))
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
pub(crate) fn ratings(metrics: &[StepMetrics], history: &History) -> LineChart {
    let members = member_roles(metrics, history);
    let roles = distinct(members.iter().map(|(_, role)| role.as_str()), role_rank);
    let series_of = |id: &str, colour: usize, value: fn(&Rating) -> f64| {
        let points = metrics
            .iter()
            .filter_map(|m| {
                let member = m.members.iter().find(|x| x.id == id)?;
                Some((m.step as f64, member.rating.as_ref().map(value)))
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
pub(crate) fn fitness(metrics: &[StepMetrics], history: &History) -> LineChart {
    let members = member_roles(metrics, history);
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

/// Every member in the metrics with its role (from its first record, else the
/// journal), ordered by role and then naturally by id.
fn member_roles(metrics: &[StepMetrics], history: &History) -> Vec<(String, String)> {
    let seen: Vec<(&str, Option<&str>)> = metrics
        .iter()
        .flat_map(|m| m.members.iter())
        .map(|m| (m.id.as_str(), m.role.as_deref()))
        .collect();
    let mut members: Vec<(&str, Option<&str>)> = sorted(seen, |(id, _)| id_key(0, id));
    // Stable order: the first record of each id comes first and is kept.
    members.dedup_by(|later, first| later.0 == first.0);
    let with_roles: Vec<(String, String)> = members
        .into_iter()
        .map(|(id, role)| {
            let role = role
                .map(str::to_string)
                .or_else(|| history.life(id).map(|l| l.role.clone()))
                .unwrap_or_else(|| "member".to_string());
            (id.to_string(), role)
        })
        .collect();
    sorted(with_roles, |(id, role)| id_key(role_rank(role), id))
}

fn member_fitness(metrics: &[StepMetrics], history: &History, id: &str, stroke: Stroke) -> Series {
    let present: Vec<(f64, Option<f64>)> = metrics
        .iter()
        .filter_map(|m| {
            let member = m.members.iter().find(|x| x.id == id)?;
            Some((m.step as f64, member.fitness))
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
