//! The operator registry: names, parameters with their defaults, and the
//! lineage record every operator returns.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Error;

/// Mutations change one adapter; crossovers combine several.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OperatorKind {
    Mutation,
    Crossover,
}

/// An operator by name with numeric parameters, as written in scenario files and
/// the lineage log. Missing parameters take their defaults ([`operators`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OperatorSpec {
    pub name: String,
    #[serde(default)]
    pub params: BTreeMap<String, f64>,
}

impl OperatorSpec {
    pub fn new(name: &str) -> OperatorSpec {
        OperatorSpec {
            name: name.to_string(),
            params: BTreeMap::new(),
        }
    }

    pub fn with(mut self, param: &str, value: f64) -> OperatorSpec {
        self.params.insert(param.to_string(), value);
        self
    }

    /// Parse `name` or `name:param=value,param=value` (the CLI form).
    pub fn parse(text: &str) -> Result<OperatorSpec, Error> {
        let (name, rest) = text.split_once(':').unwrap_or((text, ""));
        let mut spec = OperatorSpec::new(name.trim());
        for pair in rest.split(',').filter(|p| !p.trim().is_empty()) {
            let (key, value) = pair.split_once('=').ok_or_else(|| Error::BadSpec {
                text: text.to_string(),
                problem: format!("`{pair}` is not param=value"),
            })?;
            let value: f64 = value.trim().parse().map_err(|_| Error::BadSpec {
                text: text.to_string(),
                problem: format!("`{value}` is not a number"),
            })?;
            spec.params.insert(key.trim().to_string(), value);
        }
        Ok(spec)
    }
}

/// One parameter of an operator: its name, default, allowed range, and meaning.
#[derive(Debug, Clone, Copy)]
pub struct ParamInfo {
    pub name: &'static str,
    pub default: f64,
    pub min: f64,
    pub max: f64,
    pub doc: &'static str,
}

/// One registered operator.
#[derive(Debug, Clone, Copy)]
pub struct OperatorInfo {
    pub name: &'static str,
    pub kind: OperatorKind,
    pub doc: &'static str,
    pub params: &'static [ParamInfo],
}

const fn param(
    name: &'static str,
    default: f64,
    min: f64,
    max: f64,
    doc: &'static str,
) -> ParamInfo {
    ParamInfo {
        name,
        default,
        min,
        max,
        doc,
    }
}

const OPERATORS: &[OperatorInfo] = &[
    OperatorInfo {
        name: "svd_noise",
        kind: OperatorKind::Mutation,
        doc: "log-normal noise on singular values and a small random rotation of the left and right singular bases (within the adapter's subspace)",
        params: &[
            param("sigma", 0.1, 0.0, 10.0, "std of the log-normal factor on each singular value"),
            param("angle", 0.05, 0.0, 10.0, "scale of the random rotation: its generator is angle × a standard Gaussian skew matrix / √(2r)"),
        ],
    },
    OperatorInfo {
        name: "layer_gaussian",
        kind: OperatorKind::Mutation,
        doc: "Gaussian noise, scaled to each factor's std, on the balanced factors (U·S^½, V·S^½) of a random subset of layers",
        params: &[
            param("fraction", 0.25, 0.0, 1.0, "fraction of layers that get noise (rounded up; 0 picks none)"),
            param("sigma", 0.05, 0.0, 10.0, "noise std in units of each factor's element std"),
        ],
    },
    OperatorInfo {
        name: "mask",
        kind: OperatorKind::Mutation,
        doc: "component masking: each singular direction is switched off (its B column zeroed, its A row kept so it can learn again) with probability `fraction`",
        params: &[param("fraction", 0.1, 0.0, 1.0, "probability of masking each singular direction")],
    },
    OperatorInfo {
        name: "gaussian",
        kind: OperatorKind::Mutation,
        doc: "Gaussian noise on every balanced factor (U·S^½, V·S^½), scaled to that factor's element std",
        params: &[param("sigma", 0.02, 0.0, 10.0, "noise std in units of each factor's element std")],
    },
    OperatorInfo {
        name: "neftune",
        kind: OperatorKind::Mutation,
        doc: "NEFTune-style uniform noise U(-1,1)·alpha/√(numel)·std on every balanced factor (U·S^½, V·S^½; NEFTune's alpha/√(L·d) with the factor's element count for L·d, in units of the factor's element std)",
        params: &[param("alpha", 5.0, 0.0, 1e6, "NEFTune's alpha")],
    },
    OperatorInfo {
        name: "average",
        kind: OperatorKind::Crossover,
        doc: "best rank-r approximation of the mean ΔW of all parents",
        params: &[],
    },
    OperatorInfo {
        name: "dare",
        kind: OperatorKind::Crossover,
        doc: "DARE: drop each coordinate of every parent's ΔW (in the parents' shared orthonormal bases) with probability `drop`, rescale survivors by 1/(1-drop), average, truncate to rank r",
        params: &[param("drop", 0.5, 0.0, 0.99, "drop probability")],
    },
    OperatorInfo {
        name: "ties",
        kind: OperatorKind::Crossover,
        doc: "TIES: trim each parent's ΔW coordinates (shared orthonormal bases) to the top `density` fraction by magnitude (never fewer than r), elect a sign per coordinate by summed mass, average the agreeing values, truncate to rank r",
        params: &[param("density", 0.2, 0.0, 1.0, "fraction of coordinates kept per parent")],
    },
    OperatorInfo {
        name: "layer_pick",
        kind: OperatorKind::Crossover,
        doc: "each layer (all its target modules) is copied from one parent picked uniformly at random",
        params: &[],
    },
    OperatorInfo {
        name: "subspace_mix",
        kind: OperatorKind::Crossover,
        doc: "the first k singular directions from the fitter parent, directions k..r from the other (two parents)",
        params: &[param("keep", 0.5, 0.0, 1.0, "k as a fraction of r (rounded)")],
    },
    OperatorInfo {
        name: "extrapolate",
        kind: OperatorKind::Crossover,
        doc: "ΔW_fit + alpha·(ΔW_fit − ΔW_other), truncated to rank r (two parents)",
        params: &[param("alpha", 0.5, 0.0, 10.0, "step beyond the fitter parent")],
    },
    OperatorInfo {
        name: "fitness_weighted",
        kind: OperatorKind::Crossover,
        doc: "Σ wᵢ·ΔWᵢ with w = softmax(standardised fitness / temperature), truncated to rank r (any number of parents)",
        params: &[param("temperature", 1.0, 1e-6, 1e6, "softmax temperature on standardised fitness")],
    },
    OperatorInfo {
        name: "clone",
        kind: OperatorKind::Crossover,
        doc: "a copy of the fittest parent (first on ties)",
        params: &[],
    },
];

/// Every registered operator, mutations first.
pub fn operators() -> &'static [OperatorInfo] {
    OPERATORS
}

/// Names of every registered operator.
pub fn operator_names() -> Vec<&'static str> {
    OPERATORS.iter().map(|o| o.name).collect()
}

/// Resolved parameters: every parameter of the operator, defaults filled in.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub info: &'static OperatorInfo,
    pub values: BTreeMap<String, f64>,
}

impl Resolved {
    pub fn get(&self, name: &str) -> f64 {
        self.values.get(name).copied().unwrap_or(f64::NAN)
    }

    pub fn spec(&self) -> OperatorSpec {
        OperatorSpec {
            name: self.info.name.to_string(),
            params: self.values.clone(),
        }
    }
}

/// Look up `spec`, check that it is of `kind`, fill defaults, check ranges.
pub fn resolve(spec: &OperatorSpec, kind: OperatorKind) -> Result<Resolved, Error> {
    let info = OPERATORS
        .iter()
        .find(|o| o.name == spec.name)
        .ok_or_else(|| Error::UnknownOperator {
            name: spec.name.clone(),
            known: operator_names().join(", "),
        })?;
    if info.kind != kind {
        return Err(Error::WrongKind {
            name: spec.name.clone(),
            expected: kind,
        });
    }
    for name in spec.params.keys() {
        if !info.params.iter().any(|p| p.name == name) {
            return Err(Error::UnknownParam {
                operator: info.name,
                param: name.clone(),
                known: info
                    .params
                    .iter()
                    .map(|p| p.name)
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
    }
    let mut values = BTreeMap::new();
    for p in info.params {
        let value = spec.params.get(p.name).copied().unwrap_or(p.default);
        if !(value.is_finite() && value >= p.min && value <= p.max) {
            return Err(Error::BadParam {
                operator: info.name,
                param: p.name,
                value,
                min: p.min,
                max: p.max,
            });
        }
        values.insert(p.name.to_string(), value);
    }
    Ok(Resolved { info, values })
}

/// What an operator did, for the lineage log: the operator with every parameter
/// resolved, the fitness it was given, and its random choices where they are few
/// (e.g. which parent each layer came from).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LineageRecord {
    pub kind: OperatorKind,
    pub operator: OperatorSpec,
    pub parents: usize,
    #[serde(default)]
    pub fitness: Vec<f64>,
    #[serde(default)]
    pub choices: BTreeMap<String, Vec<f64>>,
}
