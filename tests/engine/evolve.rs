//! Properties of the evolution operators on small adapters (2 layers, hidden 32,
//! FFN 48, rank 4): function preservation, agreement with the dense truncated
//! SVD, invariance under re-factorisation, determinism, degenerate inputs.

use candle_core::{Device, Tensor, Var};
use faer::linalg::solvers::DenseSolveCore;
use faer::Mat;
use populora::base::{Arch, ModelConfig};
use populora::evolve::lowrank::A_ROW_NORM;
use populora::evolve::{self, OperatorKind, OperatorSpec};
use populora::keyed_stream;
use populora::lora::{AdamW, AdamWConfig, Adapter, AdapterGrads, LoraConfig, LoraModule};
use rand::Rng;

const RANK: usize = 4;

fn model() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        name: "evolve-test".to_string(),
        vocab_size: 64,
        hidden_size: 32,
        intermediate_size: 48,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        max_position_embeddings: 128,
        tie_word_embeddings: true,
    }
}

fn var(data: Vec<f32>, rows: usize, cols: usize) -> Var {
    Var::from_tensor(&Tensor::from_vec(data, (rows, cols), &Device::Cpu).unwrap()).unwrap()
}

/// An adapter with both factors random (a trained-looking adapter), from `seed`.
fn random_adapter(seed: u64) -> Adapter {
    let mut rng = keyed_stream!(seed, "evolve-test-adapter");
    let config = LoraConfig {
        rank: RANK,
        ..LoraConfig::default()
    };
    let mut adapter = Adapter::new(config, &model(), &mut rng, &Device::Cpu).unwrap();
    for module in adapter.modules.values_mut() {
        let (out, r) = module.b.as_tensor().dims2().unwrap();
        let b = (0..out * r)
            .map(|_| rng.random_range(-0.5f32..0.5))
            .collect();
        module.b = var(b, out, r);
    }
    adapter
}

/// `f(B, Aᵀ)` applied to every module's factors (as f64 matrices).
fn map_factors(adapter: &Adapter, f: impl Fn(&mut Mat<f64>, &mut Mat<f64>)) -> Adapter {
    let mut out = adapter.clone();
    for module in out.modules.values_mut() {
        let (mut b, mut at) = (
            to_mat(module.b.as_tensor()),
            to_mat(module.a.as_tensor()).transpose().to_owned(),
        );
        f(&mut b, &mut at);
        *module = LoraModule {
            b: var(flatten(&b), b.nrows(), b.ncols()),
            a: var(flatten(&at.transpose().to_owned()), at.ncols(), at.nrows()),
        };
    }
    out
}

fn to_mat(t: &Tensor) -> Mat<f64> {
    let rows: Vec<Vec<f32>> = t.to_vec2().unwrap();
    Mat::from_fn(rows.len(), rows[0].len(), |i, j| rows[i][j] as f64)
}

fn flatten(m: &Mat<f64>) -> Vec<f32> {
    (0..m.nrows())
        .flat_map(|i| (0..m.ncols()).map(move |j| m[(i, j)] as f32))
        .collect()
}

/// The same adapter as (B·M, M⁻¹·A) for a random well-conditioned M per module.
fn refactored(adapter: &Adapter, seed: u64) -> Adapter {
    let mut rng = keyed_stream!(seed, "evolve-test-refactor");
    let mut out = adapter.clone();
    for module in out.modules.values_mut() {
        let m = Mat::from_fn(RANK, RANK, |i, j| {
            (if i == j { 1.0 } else { 0.0 }) + rng.random_range(-0.3..0.3)
        });
        let inverse = m.partial_piv_lu().inverse();
        let b = to_mat(module.b.as_tensor()) * &m;
        let a = &inverse * to_mat(module.a.as_tensor());
        *module = LoraModule {
            b: var(flatten(&b), b.nrows(), b.ncols()),
            a: var(flatten(&a), a.nrows(), a.ncols()),
        };
    }
    out
}

fn delta(module: &LoraModule) -> Mat<f64> {
    to_mat(module.b.as_tensor()) * to_mat(module.a.as_tensor())
}

fn frobenius(m: &Mat<f64>) -> f64 {
    m.norm_l2()
}

/// max over modules of ‖ΔW_x − ΔW_y‖ / max(‖ΔW_y‖, floor).
fn relative_gap(x: &Adapter, y: &Adapter) -> f64 {
    x.modules
        .iter()
        .map(|(key, mx)| {
            let (dx, dy) = (delta(mx), delta(&y.modules[key]));
            frobenius(&(&dx - &dy)) / frobenius(&dy).max(1e-12)
        })
        .fold(0.0, f64::max)
}

/// Dense reference: best rank-r approximation of Σ wᵢ·ΔWᵢ by a full SVD.
fn dense_truncated(
    parents: &[&Adapter],
    weights: &[f64],
    key: &populora::lora::ModuleKey,
) -> Mat<f64> {
    let mut sum = delta(&parents[0].modules[key]) * weights[0];
    for (p, w) in parents.iter().zip(weights).skip(1) {
        sum += delta(&p.modules[key]) * *w;
    }
    let svd = sum.thin_svd().unwrap();
    let (u, s, v) = (svd.U(), svd.S().column_vector(), svd.V());
    Mat::from_fn(sum.nrows(), sum.ncols(), |i, j| {
        (0..RANK).map(|k| u[(i, k)] * s[k] * v[(j, k)]).sum()
    })
}

fn gap_to_dense(child: &Adapter, parents: &[&Adapter], weights: &[f64]) -> f64 {
    child
        .modules
        .iter()
        .map(|(key, m)| {
            let reference = dense_truncated(parents, weights, key);
            frobenius(&(&delta(m) - &reference)) / frobenius(&reference).max(1e-12)
        })
        .fold(0.0, f64::max)
}

fn assert_well_formed(child: &Adapter, parent: &Adapter) {
    assert_eq!(child.config, parent.config);
    assert!(child.modules.keys().eq(parent.modules.keys()));
    for (key, m) in &child.modules {
        let p = &parent.modules[key];
        assert_eq!(m.a.as_tensor().dims(), p.a.as_tensor().dims());
        assert_eq!(m.b.as_tensor().dims(), p.b.as_tensor().dims());
        for t in [m.a.as_tensor(), m.b.as_tensor()] {
            let values: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            assert!(values.iter().all(|v| v.is_finite()), "{key:?} has NaN/Inf");
        }
    }
}

fn crossover_specs() -> Vec<OperatorSpec> {
    evolve::operators()
        .iter()
        .filter(|o| o.kind == OperatorKind::Crossover)
        .map(|o| OperatorSpec::new(o.name))
        .collect()
}

fn mutation_specs() -> Vec<OperatorSpec> {
    evolve::operators()
        .iter()
        .filter(|o| o.kind == OperatorKind::Mutation)
        .map(|o| OperatorSpec::new(o.name))
        .collect()
}

fn cross(spec: &OperatorSpec, parents: &[&Adapter], fitness: &[f64], seed: u64) -> Adapter {
    let mut rng = keyed_stream!(seed, "evolve-test-op");
    evolve::crossover(spec, parents, fitness, &mut rng)
        .unwrap_or_else(|e| panic!("{}: {e}", spec.name))
        .0
}

fn mutate(spec: &OperatorSpec, adapter: &Adapter, seed: u64) -> Adapter {
    let mut rng = keyed_stream!(seed, "evolve-test-op");
    evolve::mutate(spec, adapter, &mut rng)
        .unwrap_or_else(|e| panic!("{}: {e}", spec.name))
        .0
}

#[test]
fn registry_has_five_mutations_and_six_crossovers() {
    assert!(mutation_specs().len() >= 5);
    assert!(crossover_specs().len() >= 6);
    let names = evolve::operator_names();
    for name in ["svd_noise", "layer_gaussian", "mask", "gaussian", "neftune"] {
        assert!(names.contains(&name), "{name}");
    }
    for name in [
        "average",
        "dare",
        "ties",
        "layer_pick",
        "subspace_mix",
        "extrapolate",
        "fitness_weighted",
    ] {
        assert!(names.contains(&name), "{name}");
    }
}

#[test]
fn canonical_form_keeps_delta_w_and_balances_factors() {
    let parent = random_adapter(1);
    let canonical = evolve::canonicalize(&parent).unwrap();
    assert_well_formed(&canonical, &parent);
    assert!(
        relative_gap(&canonical, &parent) < 1e-5,
        "{}",
        relative_gap(&canonical, &parent)
    );
    let c2 = A_ROW_NORM * A_ROW_NORM;
    for m in canonical.modules.values() {
        // B = U·S/c, A = c·Vᵀ: A·Aᵀ = c²·I (orthogonal rows at the norm of a
        // Kaiming-uniform row), BᵀB = S²/c², diagonal, decreasing.
        let b = to_mat(m.b.as_tensor());
        let a = to_mat(m.a.as_tensor());
        let btb = b.transpose() * &b;
        let aat = &a * a.transpose();
        let scale = btb[(0, 0)];
        for i in 0..RANK {
            for j in 0..RANK {
                let identity = if i == j { c2 } else { 0.0 };
                assert!((aat[(i, j)] - identity).abs() < 1e-5 * c2);
                if i != j {
                    assert!(btb[(i, j)].abs() < 1e-5 * scale);
                }
            }
            if i > 0 {
                assert!(btb[(i, i)] <= btb[(i - 1, i - 1)] * (1.0 + 1e-6));
            }
        }
    }
    // Canonical form depends on ΔW only, not on the factorisation.
    let again = evolve::canonicalize(&refactored(&parent, 2)).unwrap();
    for (key, m) in &again.modules {
        let (x, y) = (
            to_mat(m.b.as_tensor()),
            to_mat(canonical.modules[key].b.as_tensor()),
        );
        assert!(frobenius(&(&x - &y)) < 1e-4 * frobenius(&y), "{key:?}");
    }
}

#[test]
fn weighted_sums_match_the_dense_truncated_svd() {
    let (p1, p2, p3) = (random_adapter(1), random_adapter(2), random_adapter(3));
    let parents = [&p1, &p2, &p3];
    let child = cross(&OperatorSpec::new("average"), &parents, &[], 7);
    assert_well_formed(&child, &p1);
    let gap = gap_to_dense(&child, &parents, &[1.0 / 3.0; 3]);
    assert!(gap < 1e-5, "average vs dense: {gap}");

    let spec = OperatorSpec::new("extrapolate").with("alpha", 0.7);
    let child = cross(&spec, &[&p1, &p2], &[0.1, 0.9], 7);
    let gap = gap_to_dense(&child, &[&p2, &p1], &[1.7, -0.7]);
    assert!(gap < 1e-5, "extrapolate vs dense: {gap}");

    let child = cross(
        &OperatorSpec::new("fitness_weighted"),
        &parents,
        &[3.0, 3.0, 3.0],
        7,
    );
    let gap = gap_to_dense(&child, &parents, &[1.0 / 3.0; 3]);
    assert!(
        gap < 1e-5,
        "fitness_weighted with equal fitness vs dense average: {gap}"
    );
}

/// The dense reference paths (full and randomized SVD of the formed ΔW)
/// against the low-rank path, and `dense::frobenius_of_sum` against the
/// norm of the formed matrices.
#[test]
fn dense_paths_match_the_low_rank_path() {
    use populora::evolve::dense::{frobenius_of_sum, weighted_sum_module, Truncation};
    let (p1, p2) = (random_adapter(1), random_adapter(2));
    let child = cross(&OperatorSpec::new("average"), &[&p1, &p2], &[], 7);
    let randomized = |oversample| Truncation::Randomized {
        oversample,
        power_iterations: 0,
        seed: 3,
    };
    for (key, module) in &child.modules {
        let parents = [&p1.modules[key], &p2.modules[key]];
        let dense = |truncation| {
            weighted_sum_module(key, &parents, &[0.5, 0.5], RANK, truncation)
                .unwrap()
                .0
        };
        let gap = |x: &LoraModule| {
            frobenius_of_sum(key, &[x, module], &[1.0, -1.0]).unwrap()
                / frobenius_of_sum(key, &[module], &[1.0]).unwrap()
        };
        let full = gap(&dense(Truncation::FullSvd));
        assert!(full < 1e-5, "{key:?}: full SVD vs low rank: {full}");
        // The sum has rank ≤ 2r, so 2r probes hold its whole range.
        let exact = gap(&dense(randomized(RANK)));
        assert!(exact < 1e-5, "{key:?}: randomized SVD, 2r probes: {exact}");
        // r + 1 probes without power iterations miss part of it.
        let rough = dense(randomized(1));
        let (x, y) = (delta(&rough), delta(module));
        let formed = frobenius(&(&x - &y)) / frobenius(&y);
        assert!(gap(&rough) > 1e-3, "{key:?}: r + 1 probes: {}", gap(&rough));
        assert!(
            (gap(&rough) - formed).abs() < 1e-6,
            "{key:?}: {} vs {formed}",
            gap(&rough)
        );
    }
}

#[test]
fn subspace_mix_takes_leading_directions_from_the_fitter_parent() {
    let (p1, p2) = (random_adapter(1), random_adapter(2));
    let spec = OperatorSpec::new("subspace_mix").with("keep", 0.5);
    let child = cross(&spec, &[&p1, &p2], &[0.0, 1.0], 3);
    for (key, m) in &child.modules {
        let part = |p: &Adapter, range: std::ops::Range<usize>| {
            let d = delta(&p.modules[key]);
            let svd = d.thin_svd().unwrap();
            let (u, s, v) = (svd.U(), svd.S().column_vector(), svd.V());
            Mat::from_fn(d.nrows(), d.ncols(), |i, j| {
                range
                    .clone()
                    .map(|k| u[(i, k)] * s[k] * v[(j, k)])
                    .sum::<f64>()
            })
        };
        let expected = part(&p2, 0..2) + part(&p1, 2..RANK);
        let gap = frobenius(&(&delta(m) - &expected)) / frobenius(&expected);
        assert!(gap < 1e-5, "{key:?}: {gap}");
    }
}

#[test]
fn ties_of_aligned_parents_is_their_mean_and_dare_without_drop_is_the_average() {
    let p = random_adapter(4);
    let doubled = map_factors(&p, |b, _| *b = &*b * faer::Scale(2.0));
    let spec = OperatorSpec::new("ties").with("density", 1.0);
    let child = cross(&spec, &[&p, &doubled], &[], 5);
    let expected = map_factors(&p, |b, _| *b = &*b * faer::Scale(1.5));
    assert!(
        relative_gap(&child, &expected) < 1e-5,
        "{}",
        relative_gap(&child, &expected)
    );

    let (p1, p2) = (random_adapter(1), random_adapter(2));
    let dare = cross(
        &OperatorSpec::new("dare").with("drop", 0.0),
        &[&p1, &p2],
        &[],
        5,
    );
    let average = cross(&OperatorSpec::new("average"), &[&p1, &p2], &[], 5);
    assert!(relative_gap(&dare, &average) < 1e-5);
    let dropped = cross(
        &OperatorSpec::new("dare").with("drop", 0.5),
        &[&p1, &p2],
        &[],
        5,
    );
    assert!(
        relative_gap(&dropped, &average) > 1e-2,
        "drop 0.5 changed nothing"
    );
}

#[test]
fn crossover_of_identical_parents_returns_the_parent() {
    let parent = random_adapter(5);
    for spec in crossover_specs() {
        // DARE drops coordinates at random: identical parents give the parent
        // only in expectation, or exactly with drop 0.
        let spec = if spec.name == "dare" {
            spec.with("drop", 0.0)
        } else {
            spec
        };
        let child = cross(&spec, &[&parent, &parent], &[0.3, 0.3], 11);
        assert_well_formed(&child, &parent);
        let gap = relative_gap(&child, &parent);
        assert!(gap < 1e-5, "{}: {gap}", spec.name);
    }
}

#[test]
fn mutation_with_strength_zero_is_the_identity() {
    let parent = random_adapter(6);
    let zero = [
        OperatorSpec::new("svd_noise")
            .with("sigma", 0.0)
            .with("angle", 0.0),
        OperatorSpec::new("layer_gaussian").with("sigma", 0.0),
        OperatorSpec::new("layer_gaussian").with("fraction", 0.0),
        OperatorSpec::new("mask").with("fraction", 0.0),
        OperatorSpec::new("gaussian").with("sigma", 0.0),
        OperatorSpec::new("neftune").with("alpha", 0.0),
    ];
    for spec in &zero {
        let child = mutate(spec, &parent, 3);
        assert_well_formed(&child, &parent);
        assert!(relative_gap(&child, &parent) < 1e-5, "{}", spec.name);
    }
    // ... and with default strength every mutation changes ΔW.
    for spec in mutation_specs() {
        let child = mutate(&spec, &parent, 3);
        assert_well_formed(&child, &parent);
        assert!(
            relative_gap(&child, &parent) > 1e-4,
            "{} changed nothing",
            spec.name
        );
    }
}

#[test]
fn crossovers_ignore_how_a_parent_is_factored() {
    let (p1, p2) = (random_adapter(7), random_adapter(8));
    let p2_refactored = refactored(&p2, 9);
    assert!(relative_gap(&p2_refactored, &p2) < 1e-5);
    for spec in crossover_specs() {
        let x = cross(&spec, &[&p1, &p2], &[0.2, 0.8], 13);
        let y = cross(&spec, &[&p1, &p2_refactored], &[0.2, 0.8], 13);
        let gap = relative_gap(&y, &x);
        assert!(gap < 1e-4, "{}: {gap}", spec.name);
    }
    // Factor-wise averaging, which is not an operator, fails this test.
    let naive = |q: &Adapter| {
        let mut out = p1.clone();
        for (key, m) in out.modules.iter_mut() {
            let other = &q.modules[key];
            let b = ((m.b.as_tensor() + other.b.as_tensor()).unwrap() * 0.5).unwrap();
            let a = ((m.a.as_tensor() + other.a.as_tensor()).unwrap() * 0.5).unwrap();
            *m = LoraModule {
                a: Var::from_tensor(&a).unwrap(),
                b: Var::from_tensor(&b).unwrap(),
            };
        }
        out
    };
    assert!(relative_gap(&naive(&p2_refactored), &naive(&p2)) > 1e-2);
}

#[test]
fn mutations_ignore_how_the_adapter_is_factored() {
    let parent = random_adapter(10);
    let other = refactored(&parent, 11);
    for spec in mutation_specs() {
        let gap = relative_gap(&mutate(&spec, &other, 17), &mutate(&spec, &parent, 17));
        assert!(gap < 1e-4, "{}: {gap}", spec.name);
    }
}

#[test]
fn operators_are_deterministic_given_the_stream() {
    let (p1, p2) = (random_adapter(12), random_adapter(13));
    let bits = |a: &Adapter| -> Vec<u32> {
        a.modules
            .values()
            .flat_map(|m| {
                let b: Vec<f32> = m.b.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                let a: Vec<f32> = m.a.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                b.into_iter().chain(a).map(f32::to_bits).collect::<Vec<_>>()
            })
            .collect()
    };
    for spec in crossover_specs() {
        let x = cross(&spec, &[&p1, &p2], &[1.0, 0.0], 21);
        let y = cross(&spec, &[&p1, &p2], &[1.0, 0.0], 21);
        assert_eq!(bits(&x), bits(&y), "{}", spec.name);
    }
    for spec in mutation_specs() {
        let (x, y, z) = (
            mutate(&spec, &p1, 21),
            mutate(&spec, &p1, 21),
            mutate(&spec, &p1, 22),
        );
        assert_eq!(bits(&x), bits(&y), "{}", spec.name);
        assert_ne!(
            bits(&x),
            bits(&z),
            "{}: another seed gave the same child",
            spec.name
        );
    }
    let random_crossovers = ["dare", "layer_pick"];
    for name in random_crossovers {
        let x = cross(&OperatorSpec::new(name), &[&p1, &p2], &[], 21);
        let found_other = (22..30).any(|seed| {
            let y = cross(&OperatorSpec::new(name), &[&p1, &p2], &[], seed);
            relative_gap(&x, &y) > 1e-3
        });
        assert!(found_other, "{name} ignores its stream");
    }
}

#[test]
fn degenerate_inputs_give_finite_children_of_the_same_shape() {
    let zero = map_factors(&random_adapter(14), |b, at| {
        *b = Mat::zeros(b.nrows(), b.ncols());
        *at = Mat::zeros(at.nrows(), at.ncols());
    });
    let fresh = Adapter::new(
        LoraConfig {
            rank: RANK,
            ..LoraConfig::default()
        },
        &model(),
        &mut keyed_stream!(1, "fresh"),
        &Device::Cpu,
    )
    .unwrap();
    // Rank one: every column of B is a multiple of the first.
    let rank_deficient = map_factors(&random_adapter(15), |b, _| {
        let first = b.col(0).to_owned();
        for j in 0..b.ncols() {
            b.col_mut(j).copy_from(&first * faer::Scale(j as f64 + 1.0));
        }
    });
    let normal = random_adapter(16);
    let cases: [(&str, [&Adapter; 2]); 5] = [
        ("zero+zero", [&zero, &zero]),
        ("zero+normal", [&zero, &normal]),
        ("fresh+fresh", [&fresh, &fresh]),
        ("rank-deficient+normal", [&rank_deficient, &normal]),
        ("identical", [&normal, &normal]),
    ];
    for (label, parents) in cases {
        for spec in crossover_specs() {
            let child = cross(&spec, &parents, &[0.5, 0.5], 1);
            assert_well_formed(&child, parents[0]);
            let mutated: Vec<Adapter> = mutation_specs()
                .iter()
                .map(|m| mutate(m, &child, 2))
                .collect();
            for m in &mutated {
                assert_well_formed(m, parents[0]);
            }
            if label == "zero+zero" || label == "fresh+fresh" {
                // Nothing to combine: ΔW stays zero, and A is alive (not all zero)
                // so that B can learn again, unless the operator copies a parent
                // whose A is dead.
                let copies = spec.name == "layer_pick" || spec.name == "clone";
                for m in child.modules.values() {
                    assert_eq!(frobenius(&delta(m)), 0.0, "{label} {}", spec.name);
                    let a = to_mat(m.a.as_tensor());
                    if !(copies && label == "zero+zero") {
                        assert!(frobenius(&a) > 0.0, "{label} {}: dead A", spec.name);
                    }
                }
            }
        }
    }
    let child = cross(
        &OperatorSpec::new("average"),
        &[&rank_deficient, &rank_deficient],
        &[],
        3,
    );
    assert!(relative_gap(&child, &rank_deficient) < 1e-5);
}

#[test]
fn mask_switches_directions_off_but_keeps_a_alive() {
    let parent = random_adapter(18);
    let child = mutate(&OperatorSpec::new("mask").with("fraction", 1.0), &parent, 4);
    for m in child.modules.values() {
        assert_eq!(frobenius(&to_mat(m.b.as_tensor())), 0.0);
        assert!(frobenius(&to_mat(m.a.as_tensor())) > 0.0);
    }
    let values = evolve::singular_values(&parent).unwrap();
    let noisy = evolve::singular_values(&mutate(
        &OperatorSpec::new("svd_noise").with("angle", 0.0),
        &parent,
        4,
    ))
    .unwrap();
    // Log-normal noise with σ = 0.1: each value moves, none by a wild factor.
    for (key, s) in &values {
        for (x, y) in s.iter().zip(&noisy[key]) {
            let ratio = y / x;
            assert!(
                ratio > 0.5 && ratio < 2.0 && (ratio - 1.0).abs() > 1e-9,
                "{key:?}: {ratio}"
            );
        }
    }
}

#[test]
fn layer_pick_copies_whole_layers() {
    let (p1, p2) = (random_adapter(19), random_adapter(20));
    let mut rng = keyed_stream!(3, "evolve-test-op");
    let (child, record) =
        evolve::crossover(&OperatorSpec::new("layer_pick"), &[&p1, &p2], &[], &mut rng).unwrap();
    let picks = &record.choices["layer_parent"];
    assert_eq!(picks.len(), model().num_layers);
    for (key, m) in &child.modules {
        let source = if picks[key.layer] == 0.0 { &p1 } else { &p2 };
        assert_eq!(frobenius(&(&delta(m) - &delta(&source.modules[key]))), 0.0);
    }
}

#[test]
fn specs_resolve_defaults_and_reject_bad_input() {
    let parent = random_adapter(21);
    let mut rng = keyed_stream!(1, "evolve-test-op");
    let (_, record) = evolve::mutate(
        &OperatorSpec::new("svd_noise").with("sigma", 0.2),
        &parent,
        &mut rng,
    )
    .unwrap();
    assert_eq!(record.kind, OperatorKind::Mutation);
    assert_eq!(record.operator.name, "svd_noise");
    assert_eq!(record.operator.params["sigma"], 0.2);
    assert_eq!(record.operator.params["angle"], 0.05);
    let json = serde_json::to_string(&record).unwrap();
    assert_eq!(
        serde_json::from_str::<evolve::LineageRecord>(&json).unwrap(),
        record
    );

    assert_eq!(
        OperatorSpec::parse("dare:drop=0.3").unwrap(),
        OperatorSpec::new("dare").with("drop", 0.3)
    );
    let errors = [
        evolve::mutate(&OperatorSpec::new("nope"), &parent, &mut rng).err(),
        evolve::mutate(&OperatorSpec::new("average"), &parent, &mut rng).err(),
        evolve::mutate(
            &OperatorSpec::new("mask").with("strength", 1.0),
            &parent,
            &mut rng,
        )
        .err(),
        evolve::mutate(
            &OperatorSpec::new("mask").with("fraction", 2.0),
            &parent,
            &mut rng,
        )
        .err(),
        evolve::crossover(&OperatorSpec::new("extrapolate"), &[&parent], &[], &mut rng).err(),
        evolve::crossover(
            &OperatorSpec::new("average"),
            &[&parent, &parent],
            &[1.0],
            &mut rng,
        )
        .err(),
        evolve::crossover(
            &OperatorSpec::new("average"),
            &[&parent, &parent],
            &[1.0, f64::NAN],
            &mut rng,
        )
        .err(),
    ];
    for (i, e) in errors.iter().enumerate() {
        assert!(e.is_some(), "case {i} was accepted");
    }
    assert!(OperatorSpec::parse("dare:drop").is_err());

    let mut other = random_adapter(22);
    other.config.rank = 3;
    assert!(evolve::crossover(
        &OperatorSpec::new("average"),
        &[&parent, &other],
        &[],
        &mut rng
    )
    .is_err());
    let poisoned = map_factors(&parent, |b, _| b[(0, 0)] = f64::NAN);
    assert!(evolve::mutate(&OperatorSpec::new("gaussian"), &poisoned, &mut rng).is_err());
}

#[test]
fn children_save_and_load_like_any_adapter() {
    let (p1, p2) = (random_adapter(23), random_adapter(24));
    let mut rng = keyed_stream!(5, "evolve-test-op");
    let (child, _) = evolve::offspring(
        &OperatorSpec::new("ties"),
        &OperatorSpec::new("svd_noise"),
        &[&p1, &p2],
        &[0.0, 1.0],
        &mut rng,
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("populora-evolve-test-{}", std::process::id()));
    let base = populora::lora::BaseRef::of(&model());
    child.save(&dir, &base).unwrap();
    let (loaded, loaded_base) = Adapter::load(&dir, &Device::Cpu).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(loaded_base, base);
    assert_eq!(loaded.checksum().unwrap(), child.checksum().unwrap());
}

/// A young adapter: A Kaiming-uniform, as `Adapter::new` makes it, and B
/// small, as after a few updates.
fn young_adapter(seed: u64) -> Adapter {
    let mut rng = keyed_stream!(seed, "evolve-test-young");
    let config = LoraConfig {
        rank: RANK,
        ..LoraConfig::default()
    };
    let mut adapter = Adapter::new(config, &model(), &mut rng, &Device::Cpu).unwrap();
    for module in adapter.modules.values_mut() {
        let (out, r) = module.b.as_tensor().dims2().unwrap();
        let b = (0..out * r)
            .map(|_| rng.random_range(-1e-3f32..1e-3))
            .collect();
        module.b = var(b, out, r);
    }
    adapter
}

/// How far ΔW moves, summed over modules (‖ΔW_after − ΔW_before‖_F), in
/// `steps` AdamW steps on a copy of `adapter` under the loss Σ ⟨G, B·A⟩ with
/// one fixed random G per module, the same for every adapter: the gradients
/// are dB = G·Aᵀ and dA = Bᵀ·G at the current factors.
fn delta_w_moved(adapter: &Adapter, steps: usize) -> f64 {
    let adapter = adapter.deep_copy().unwrap();
    let directions: Vec<Tensor> = adapter
        .modules
        .iter()
        .map(|(key, m)| {
            let mut rng = keyed_stream!(
                1,
                "evolve-test-direction",
                key.layer as u64,
                key.target.hf_name()
            );
            let (out, fan_in) = (
                m.b.as_tensor().dim(0).unwrap(),
                m.a.as_tensor().dim(1).unwrap(),
            );
            let g: Vec<f32> = (0..out * fan_in)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            Tensor::from_vec(g, (out, fan_in), &Device::Cpu).unwrap()
        })
        .collect();
    let before: Vec<Mat<f64>> = adapter.modules.values().map(delta).collect();
    let mut optimizer = AdamW::new(AdamWConfig {
        lr: 1e-3,
        ..AdamWConfig::default()
    });
    for _ in 0..steps {
        let grads: AdapterGrads = adapter
            .modules
            .iter()
            .zip(&directions)
            .map(|((key, m), g)| {
                let (a, b) = (m.a.as_tensor(), m.b.as_tensor());
                let d_a = b.t().unwrap().matmul(g).unwrap();
                let d_b = g.matmul(&a.t().unwrap()).unwrap();
                (*key, (d_a, d_b))
            })
            .collect();
        optimizer.step(&adapter, &grads).unwrap();
    }
    adapter
        .modules
        .values()
        .zip(&before)
        .map(|(m, b)| frobenius(&(&delta(m) - b)))
        .sum()
}

/// Median over modules of ‖A_child‖_F / ‖A_parent‖_F.
fn a_norm_ratio(child: &Adapter, parent: &Adapter) -> f64 {
    let mut ratios: Vec<f64> = child
        .modules
        .iter()
        .map(|(key, m)| {
            frobenius(&to_mat(m.a.as_tensor()))
                / frobenius(&to_mat(parent.modules[key].a.as_tensor()))
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    ratios[ratios.len() / 2]
}

/// DESIGN.md §6, "Scale of the canonical split": an offspring of young
/// parents keeps A at its initial scale, so that under the same gradients its
/// ΔW moves about as fast as its parent's. The balanced split B = U·S^½,
/// A = S^½·Vᵀ shrank A to about a tenth here and ΔW moved about ten times
/// slower.
#[test]
fn offspring_learn_as_fast_as_their_parents() {
    let (p1, p2) = (young_adapter(1), young_adapter(2));
    let identity = OperatorSpec::new("svd_noise")
        .with("sigma", 0.0)
        .with("angle", 0.0);
    let children = [
        ("svd_noise of strength 0", mutate(&identity, &p1, 3)),
        (
            "average",
            cross(&OperatorSpec::new("average"), &[&p1, &p2], &[], 3),
        ),
        ("gaussian", mutate(&OperatorSpec::new("gaussian"), &p1, 3)),
    ];
    let steps = 5;
    let parent = delta_w_moved(&p1, steps);
    for (what, child) in &children {
        let a = a_norm_ratio(child, &p1);
        let speed = delta_w_moved(child, steps) / parent;
        eprintln!("{what}: ‖A‖ child/parent {a:.3}, ΔW moved child/parent {speed:.3}");
        assert!(
            (0.5..=2.0).contains(&a),
            "{what}: A at {a:.3} of the parent's"
        );
        assert!(
            (0.5..=2.0).contains(&speed),
            "{what}: ΔW moves {speed:.3} times as fast as the parent's"
        );
    }
    assert!(relative_gap(&children[0].1, &p1) < 1e-5);
    // A child whose ΔW is zero (fresh parents, B = 0) has fresh Kaiming rows.
    let fresh = |seed| {
        let config = LoraConfig {
            rank: RANK,
            ..LoraConfig::default()
        };
        Adapter::new(
            config,
            &model(),
            &mut keyed_stream!(seed, "fresh"),
            &Device::Cpu,
        )
        .unwrap()
    };
    let (f1, f2) = (fresh(1), fresh(2));
    let child = cross(&OperatorSpec::new("average"), &[&f1, &f2], &[], 3);
    let a = a_norm_ratio(&child, &f1);
    let speed = delta_w_moved(&child, steps) / delta_w_moved(&f1, steps);
    assert!(
        (0.5..=2.0).contains(&a) && (0.5..=2.0).contains(&speed),
        "{a} {speed}"
    );
}
