//! The `Evolution` actor: every E steps it ranks each role by fitness, culls
//! the bottom fraction and breeds one offspring per culled member from
//! tournament-selected parents (crossover, then mutation, in ΔW space). It
//! also breeds members injected by live commands. Culled members' places
//! (sub-populations) go to their replacements.

use std::collections::BTreeMap;

use populora::evolve::select::{cull, pick_weighted, tournament, Candidate};
use populora::evolve::{self, OperatorKind, OperatorSpec};
use populora::keyed_stream;
use populora::lora::{AdamW, AdamWConfig, Adapter};
use populora::scenario::{EvolutionSection, OptimizerInit};
use populora::selfplay::{Learner, MemberId};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use rand_chacha::ChaCha12Rng;

/// A member of one role as evolution sees it: fitness and a snapshot.
pub struct Contender {
    pub id: MemberId,
    pub name: String,
    pub subpop: usize,
    pub fitness: f64,
    pub learner: Learner,
}

pub struct Newborn {
    pub subpop: usize,
    pub parents: Vec<String>,
    pub operators: Vec<String>,
    /// Where its AdamW state came from: `reset`, or `inherited from <parent>`.
    pub optimizer: String,
    pub learner: Learner,
}

pub struct Plan {
    /// (id, fitness), worst first.
    pub culled: Vec<(MemberId, f64)>,
    pub born: Vec<Newborn>,
}

#[derive(ractor_cluster::RactorMessage)]
pub enum EvolutionMsg {
    /// Cull and replace within one role (`label` keys the streams: "teacher", "student").
    Evolve {
        step: u64,
        label: String,
        contenders: Vec<Contender>,
        reply: RpcReplyPort<anyhow::Result<Plan>>,
    },
    /// One new member of a role: from the given parents (or tournament-chosen
    /// ones) with the given operator (or the scenario's usual draw).
    Inject {
        step: u64,
        label: String,
        contenders: Vec<Contender>,
        from: Vec<MemberId>,
        op: Option<String>,
        subpop: usize,
        reply: RpcReplyPort<anyhow::Result<Newborn>>,
    },
}

pub struct EvolutionArgs {
    pub seed: u64,
    pub config: EvolutionSection,
    pub adamw: AdamWConfig,
}

pub struct Evolution;

impl Actor for Evolution {
    type Msg = EvolutionMsg;
    type State = EvolutionArgs;
    type Arguments = EvolutionArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<EvolutionMsg>,
        args: EvolutionArgs,
    ) -> Result<EvolutionArgs, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        _myself: ActorRef<EvolutionMsg>,
        msg: EvolutionMsg,
        state: &mut EvolutionArgs,
    ) -> Result<(), ActorProcessingErr> {
        let (seed, config, adamw) = (state.seed, state.config.clone(), state.adamw);
        match msg {
            EvolutionMsg::Evolve {
                step,
                label,
                contenders,
                reply,
            } => {
                let plan = tokio::task::spawn_blocking(move || {
                    evolve_role(seed, step, &label, &config, adamw, contenders)
                })
                .await
                .unwrap_or_else(|e| Err(anyhow::anyhow!("evolution thread: {e}")));
                let _ = reply.send(plan);
            }
            EvolutionMsg::Inject {
                step,
                label,
                contenders,
                from,
                op,
                subpop,
                reply,
            } => {
                let born = tokio::task::spawn_blocking(move || {
                    let mut rng = keyed_stream!(seed, "inject", step, label.as_str());
                    let breeder = Breeder {
                        config: &config,
                        adamw,
                        contenders: &contenders,
                    };
                    let parents = if from.is_empty() {
                        breeder.parents(
                            &contenders.iter().map(|c| c.id).collect::<Vec<_>>(),
                            &mut rng,
                        )
                    } else {
                        from
                    };
                    breeder.breed(&parents, op.as_deref(), subpop, &mut rng)
                })
                .await
                .unwrap_or_else(|e| Err(anyhow::anyhow!("evolution thread: {e}")));
                let _ = reply.send(born);
            }
        }
        Ok(())
    }
}

fn evolve_role(
    seed: u64,
    step: u64,
    label: &str,
    config: &EvolutionSection,
    adamw: AdamWConfig,
    contenders: Vec<Contender>,
) -> anyhow::Result<Plan> {
    let candidates: Vec<Candidate> = contenders
        .iter()
        .map(|c| Candidate {
            id: c.id,
            fitness: c.fitness,
        })
        .collect();
    let culled = cull(&candidates, config.cull_fraction);
    let survivors: Vec<MemberId> = candidates
        .iter()
        .map(|c| c.id)
        .filter(|id| !culled.contains(id))
        .collect();
    let breeder = Breeder {
        config,
        adamw,
        contenders: &contenders,
    };
    let mut born = Vec::new();
    let mut out = Vec::new();
    for (k, &dead) in culled.iter().enumerate() {
        let mut rng = keyed_stream!(seed, "evolve", step, label, k);
        let parents = breeder.parents(&survivors, &mut rng);
        let subpop = breeder.get(dead)?.subpop;
        born.push(breeder.breed(&parents, None, subpop, &mut rng)?);
        out.push((dead, breeder.get(dead)?.fitness));
    }
    Ok(Plan { culled: out, born })
}

struct Breeder<'a> {
    config: &'a EvolutionSection,
    adamw: AdamWConfig,
    contenders: &'a [Contender],
}

impl Breeder<'_> {
    fn get(&self, id: MemberId) -> anyhow::Result<&Contender> {
        self.contenders
            .iter()
            .find(|c| c.id == id)
            .ok_or_else(|| anyhow::anyhow!("member {id} is not among the contenders"))
    }

    /// Two tournament winners among `pool` (distinct when the pool allows).
    fn parents(&self, pool: &[MemberId], rng: &mut ChaCha12Rng) -> Vec<MemberId> {
        let candidates: Vec<Candidate> = self
            .contenders
            .iter()
            .filter(|c| pool.contains(&c.id))
            .map(|c| Candidate {
                id: c.id,
                fitness: c.fitness,
            })
            .collect();
        let size = self.config.tournament;
        let Some(first) = tournament(&candidates, size, rng) else {
            return Vec::new();
        };
        let others: Vec<Candidate> = candidates
            .iter()
            .copied()
            .filter(|c| c.id != first)
            .collect();
        match tournament(&others, size, rng) {
            Some(second) => vec![first, second],
            None => vec![first],
        }
    }

    /// A child of `parents`: the given operator alone, or a drawn crossover
    /// (two or more parents) followed by a drawn mutation.
    fn breed(
        &self,
        parents: &[MemberId],
        op: Option<&str>,
        subpop: usize,
        rng: &mut ChaCha12Rng,
    ) -> anyhow::Result<Newborn> {
        let chosen: Vec<&Contender> = parents
            .iter()
            .map(|&id| self.get(id))
            .collect::<anyhow::Result<_>>()?;
        if chosen.is_empty() {
            anyhow::bail!("no parents to breed from")
        }
        let adapters: Vec<&Adapter> = chosen.iter().map(|c| &c.learner.adapter).collect();
        let fitness: Vec<f64> = chosen.iter().map(|c| c.fitness).collect();
        let (adapter, records) = match op {
            Some(op) => {
                let spec = OperatorSpec::parse(op)?;
                let kind = evolve::operators()
                    .iter()
                    .find(|o| o.name == spec.name)
                    .map(|o| o.kind)
                    .ok_or_else(|| anyhow::anyhow!("unknown operator `{}`", spec.name))?;
                match kind {
                    OperatorKind::Mutation => {
                        let (a, r) = evolve::mutate(&spec, adapters[0], rng)?;
                        (a, vec![r])
                    }
                    OperatorKind::Crossover => {
                        let (a, r) = evolve::crossover(&spec, &adapters, &fitness, rng)?;
                        (a, vec![r])
                    }
                }
            }
            None => {
                let mut records = Vec::new();
                let mut child = adapters[0].deep_copy()?;
                if adapters.len() > 1 {
                    if let Some(spec) = draw(&self.config.crossover, rng)? {
                        let (a, r) = evolve::crossover(&spec, &adapters, &fitness, rng)?;
                        child = a;
                        records.push(r);
                    }
                }
                if let Some(spec) = draw(&self.config.mutation, rng)? {
                    let (a, r) = evolve::mutate(&spec, &child, rng)?;
                    child = a;
                    records.push(r);
                }
                (child, records)
            }
        };
        let (optimizer, origin) = match self.config.optimizer {
            OptimizerInit::Reset => (AdamW::new(self.adamw), "reset".to_string()),
            OptimizerInit::Inherit => match basis_kept(&adapter, &chosen)? {
                Some(parent) => (
                    parent.learner.optimizer.clone(),
                    format!("inherited from {}", parent.name),
                ),
                None => (AdamW::new(self.adamw), "reset".to_string()),
            },
        };
        Ok(Newborn {
            subpop,
            parents: chosen.iter().map(|c| c.name.clone()).collect(),
            operators: records.iter().map(|r| describe(&r.operator)).collect(),
            optimizer: origin,
            learner: Learner { adapter, optimizer },
        })
    }
}

/// The parent whose factors the child has unchanged, module for module
/// (`clone`, a `layer_pick` that took every layer from one parent, and no
/// mutation after): the only child whose AdamW moments still describe its
/// factors. Every other child is written in a new basis of its ΔW (see
/// `populora::evolve`), where a parent's moments would push the wrong
/// coordinates, and with its step count, scale them wrongly too.
fn basis_kept<'a>(
    child: &Adapter,
    parents: &[&'a Contender],
) -> anyhow::Result<Option<&'a Contender>> {
    let checksum = child.checksum()?;
    for parent in parents {
        if parent.learner.adapter.checksum()? == checksum {
            return Ok(Some(parent));
        }
    }
    Ok(None)
}

fn draw(
    ops: &[populora::scenario::WeightedOperator],
    rng: &mut ChaCha12Rng,
) -> anyhow::Result<Option<OperatorSpec>> {
    let weights: Vec<f64> = ops.iter().map(|o| o.weight).collect();
    match pick_weighted(&weights, rng) {
        Some(i) => Ok(Some(OperatorSpec::parse(&ops[i].op)?)),
        None => Ok(None),
    }
}

/// `name` or `name:param=value,...` as written in scenarios.
fn describe(spec: &OperatorSpec) -> String {
    let params: BTreeMap<_, _> = spec.params.iter().collect();
    if params.is_empty() {
        return spec.name.clone();
    }
    let list: Vec<String> = params.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{}:{}", spec.name, list.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;
    use populora::base::tiny::{self, TinySpec};
    use populora::lora::LoraConfig;

    fn contender(id: MemberId, steps_taken: u64) -> Contender {
        let (model, _) = tiny::build(&TinySpec::default()).unwrap();
        let model = model.config;
        let mut rng = keyed_stream!(id, "evolution-test");
        let config = LoraConfig {
            rank: 4,
            ..LoraConfig::default()
        };
        let adapter = Adapter::new(config, &model, &mut rng, &candle_core::Device::Cpu).unwrap();
        let mut optimizer = AdamW::new(AdamWConfig::default());
        optimizer.steps_taken = steps_taken;
        Contender {
            id,
            name: format!("teacher-{id}"),
            subpop: 0,
            fitness: 0.0,
            learner: Learner { adapter, optimizer },
        }
    }

    /// With `optimizer = "inherit"`, only a child whose factors are a
    /// parent's takes that parent's AdamW state; a child written in a new
    /// basis (any operator through ΔW, even one that keeps ΔW) starts fresh.
    #[test]
    fn moments_are_inherited_only_where_the_basis_is_kept() {
        let contenders = [contender(0, 7), contender(1, 9)];
        let config = EvolutionSection {
            optimizer: OptimizerInit::Inherit,
            ..EvolutionSection::default()
        };
        let breeder = Breeder {
            config: &config,
            adamw: AdamWConfig::default(),
            contenders: &contenders,
        };
        let mut rng = keyed_stream!(1, "evolution-test-breed");
        // `clone` copies the fitter parent (the first on ties) unchanged.
        let clone = breeder.breed(&[1, 0], Some("clone"), 0, &mut rng).unwrap();
        assert_eq!(clone.optimizer, "inherited from teacher-1");
        assert_eq!(clone.learner.optimizer.steps_taken, 9);
        let same_delta_w = "svd_noise:sigma=0,angle=0";
        let mutated = breeder
            .breed(&[0], Some(same_delta_w), 0, &mut rng)
            .unwrap();
        assert_eq!(mutated.optimizer, "reset");
        assert_eq!(mutated.learner.optimizer.steps_taken, 0);
        // The scenario's drawn operators (a crossover, then a mutation).
        let drawn = breeder.breed(&[0, 1], None, 0, &mut rng).unwrap();
        assert_eq!(drawn.optimizer, "reset");
    }
}
