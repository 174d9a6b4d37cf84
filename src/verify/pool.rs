//! `VerifierPool`: a set of zygote workers behind a synchronous API. Jobs are
//! independent, so results never depend on which worker ran them or when.

use super::zygote::{Reply, Request, Zygote};
use super::{Error, Judgement, Layer, Limits, SandboxConfig, Status, Validation};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

/// One unit of verification work, for [`VerifierPool::batch`].
#[derive(Debug, Clone, PartialEq)]
pub enum Job {
    /// Validate a proposed (program, input): see [`VerifierPool::validate_proposal`].
    Proposal { program: String, input: String },
    /// Deduction: is `predicted` the same value as `gold`?
    Output { predicted: String, gold: String },
    /// Abduction: does `f(predicted_input) == gold_output`?
    Input {
        program: String,
        predicted_input: String,
        gold_output: String,
    },
    /// Induction: does the solver's program map every input to its output?
    Induction {
        program: String,
        pairs: Vec<(String, String)>,
    },
    HumanEval {
        program: String,
        test: String,
        entry_point: String,
    },
}

/// The result of one [`Job`].
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Proposal(Validation),
    Check(Judgement),
}

impl Outcome {
    pub fn status(&self) -> Status {
        match self {
            Outcome::Proposal(v) => v.status,
            Outcome::Check(j) => j.status,
        }
    }
}

/// Workers each owning one zygote. All methods are synchronous and may be
/// called from many threads at once; a call waits for a free worker.
pub struct VerifierPool {
    config: SandboxConfig,
    idle: Mutex<Vec<Option<Zygote>>>,
    freed: Condvar,
    layers: Mutex<Vec<Layer>>,
}

impl VerifierPool {
    /// Start `config.workers` zygotes (fails if none can start).
    pub fn new(config: SandboxConfig) -> Result<VerifierPool, Error> {
        if config.workers == 0 {
            return Err(Error::Config("workers must be at least 1".into()));
        }
        let mut zygotes = Vec::with_capacity(config.workers);
        for _ in 0..config.workers {
            zygotes.push(Zygote::start(&config)?);
        }
        let layers = zygotes[0].layers.clone();
        Ok(VerifierPool {
            config,
            idle: Mutex::new(zygotes.into_iter().map(Some).collect()),
            freed: Condvar::new(),
            layers: Mutex::new(layers),
        })
    }

    /// Isolation layers active in the most recently started zygote.
    pub fn layers(&self) -> Vec<Layer> {
        lock(&self.layers).clone()
    }

    pub fn config(&self) -> &SandboxConfig {
        &self.config
    }

    pub fn limits(&self) -> &Limits {
        &self.config.limits
    }

    /// Validate a proposal exactly as AZR does: parses, exactly one top-level
    /// function, no `input(`, no banned imports or names, runs within the
    /// limits, and two runs give the same `repr(f(*args))[:400]`.
    pub fn validate_proposal(&self, program: &str, input: &str) -> Result<Validation, Error> {
        let limits = self.limits();
        if let Some(rejected) = oversize(program, limits.program_bytes, Text::Code("program"))
            .or_else(|| oversize(input, limits.answer_bytes, Text::Answer("input")))
        {
            return Ok(Validation {
                status: rejected.status,
                output: None,
                reason: rejected.reason,
                features: None,
                function: None,
                wall_ms: 0.0,
            });
        }
        let reply = self.call(&Request::Program {
            program,
            inputs: vec![input],
            checks: true,
            runs: 2,
        })?;
        let ok = reply.status == Status::Ok;
        Ok(Validation {
            status: reply.status,
            output: if ok {
                reply.outputs.into_iter().next()
            } else {
                None
            },
            reason: reply.reason,
            features: if ok { reply.features } else { None },
            function: if ok { reply.function } else { None },
            wall_ms: reply.wall_ms,
        })
    }

    /// Deduction: `predicted` and `gold` are reprs; equal as Python literals
    /// (or, when either is not a literal, as stripped strings).
    pub fn check_output(&self, predicted: &str, gold: &str) -> Result<Judgement, Error> {
        if let Some(rejected) = oversize(
            predicted,
            self.limits().answer_bytes,
            Text::Answer("predicted output"),
        ) {
            return Ok(rejected);
        }
        self.compare(&[(predicted, gold)], 0.0)
    }

    /// Abduction: run `program` on `predicted_input` and compare with `gold_output`.
    pub fn check_input(
        &self,
        program: &str,
        predicted_input: &str,
        gold_output: &str,
    ) -> Result<Judgement, Error> {
        let limits = self.limits();
        if let Some(rejected) = oversize(program, limits.program_bytes, Text::Code("program"))
            .or_else(|| {
                oversize(
                    predicted_input,
                    limits.answer_bytes,
                    Text::Answer("predicted input"),
                )
            })
        {
            return Ok(rejected);
        }
        let run = self.call(&Request::Program {
            program,
            inputs: vec![predicted_input],
            checks: true,
            runs: 1,
        })?;
        if run.status != Status::Ok {
            return Ok(judgement(run.status, run.reason, run.wall_ms));
        }
        let output = single_output(&run)?;
        self.compare(&[(output, gold_output)], run.wall_ms)
    }

    /// Induction: the solver's `program` must map every hidden input to its
    /// output (all must pass).
    pub fn check_induction(
        &self,
        program: &str,
        pairs: &[(String, String)],
    ) -> Result<Judgement, Error> {
        let limits = self.limits();
        if let Some(rejected) = oversize(program, limits.program_bytes, Text::Code("program")) {
            return Ok(rejected);
        }
        if pairs.is_empty() {
            return Ok(judgement(
                Status::BadInput,
                "no input/output pairs to check".into(),
                0.0,
            ));
        }
        if let Some(rejected) = pairs
            .iter()
            .find_map(|(i, _)| oversize(i, limits.answer_bytes, Text::Answer("input")))
        {
            return Ok(rejected);
        }
        let run = self.call(&Request::Program {
            program,
            inputs: pairs.iter().map(|(i, _)| i.as_str()).collect(),
            checks: true,
            runs: 1,
        })?;
        if run.status != Status::Ok {
            return Ok(judgement(run.status, run.reason, run.wall_ms));
        }
        if run.outputs.len() != pairs.len() {
            return Err(Error::Protocol(format!(
                "{} outputs for {} inputs",
                run.outputs.len(),
                pairs.len()
            )));
        }
        let compared: Vec<(&str, &str)> = run
            .outputs
            .iter()
            .zip(pairs)
            .map(|(got, (_, gold))| (got.as_str(), gold.as_str()))
            .collect();
        self.compare(&compared, run.wall_ms)
    }

    /// HumanEval-style: run `program`, then `test` (which defines
    /// `check(candidate)`), then `check(<entry_point>)`. No AST filter: the
    /// OS layers contain whatever it does.
    pub fn run_humaneval(
        &self,
        program: &str,
        test: &str,
        entry_point: &str,
    ) -> Result<Judgement, Error> {
        let limits = self.limits();
        if let Some(rejected) = oversize(program, limits.program_bytes, Text::Code("program"))
            .or_else(|| oversize(test, limits.program_bytes, Text::Code("test code")))
        {
            return Ok(rejected);
        }
        let reply = self.call(&Request::Humaneval {
            program,
            test,
            entry_point,
        })?;
        Ok(judgement(reply.status, reply.reason, reply.wall_ms))
    }

    /// Run one job of any kind.
    pub fn run(&self, job: &Job) -> Result<Outcome, Error> {
        Ok(match job {
            Job::Proposal { program, input } => {
                Outcome::Proposal(self.validate_proposal(program, input)?)
            }
            Job::Output { predicted, gold } => Outcome::Check(self.check_output(predicted, gold)?),
            Job::Input {
                program,
                predicted_input,
                gold_output,
            } => Outcome::Check(self.check_input(program, predicted_input, gold_output)?),
            Job::Induction { program, pairs } => {
                Outcome::Check(self.check_induction(program, pairs)?)
            }
            Job::HumanEval {
                program,
                test,
                entry_point,
            } => Outcome::Check(self.run_humaneval(program, test, entry_point)?),
        })
    }

    /// Run many jobs over all workers in parallel; results come back in input order.
    pub fn batch(&self, jobs: &[Job]) -> Vec<Result<Outcome, Error>> {
        let next = AtomicUsize::new(0);
        let threads = self.config.workers.min(jobs.len());
        let finished: Vec<(usize, Result<Outcome, Error>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut done = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some(job) = jobs.get(i) else { break };
                            done.push((i, self.run(job)));
                        }
                        done
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        });
        let mut slots: Vec<Option<Result<Outcome, Error>>> =
            (0..jobs.len()).map(|_| None).collect();
        for (i, result) in finished {
            slots[i] = Some(result);
        }
        slots
            .into_iter()
            .map(|slot| slot.unwrap_or_else(|| Err(Error::Job("a worker thread panicked".into()))))
            .collect()
    }

    fn compare(&self, pairs: &[(&str, &str)], earlier_ms: f64) -> Result<Judgement, Error> {
        let reply = self.call(&Request::Compare {
            pairs: pairs.iter().map(|(a, b)| [*a, *b]).collect(),
        })?;
        let wall_ms = earlier_ms + reply.wall_ms;
        if reply.status != Status::Ok {
            return Ok(judgement(reply.status, reply.reason, wall_ms));
        }
        if reply.equal.len() != pairs.len() {
            return Err(Error::Protocol(format!(
                "{} comparisons for {} pairs",
                reply.equal.len(),
                pairs.len()
            )));
        }
        Ok(match reply.equal.iter().position(|same| !same) {
            None => judgement(Status::Ok, String::new(), wall_ms),
            Some(i) => {
                let (got, gold) = pairs[i];
                let reason = format!("pair {i}: expected {}, got {}", clip(gold), clip(got));
                judgement(Status::Mismatch, reason, wall_ms)
            }
        })
    }

    /// Run a request on a free worker. A zygote that fails is replaced and the
    /// request retried once on the fresh one.
    fn call(&self, request: &Request) -> Result<Reply, Error> {
        let mut zygote = self.checkout()?;
        let first = zygote.call(request, self.limits());
        let result = match first {
            Ok(reply) => Ok(reply),
            Err(_) => {
                drop(zygote);
                zygote = match self.restart() {
                    Ok(z) => z,
                    Err(e) => {
                        self.checkin(None);
                        return Err(e);
                    }
                };
                zygote.call(request, self.limits())
            }
        };
        if result.is_ok() {
            self.checkin(Some(zygote));
        } else {
            drop(zygote);
            self.checkin(None);
        }
        result
    }

    fn checkout(&self) -> Result<Zygote, Error> {
        let mut idle = lock(&self.idle);
        loop {
            if let Some(slot) = idle.pop() {
                drop(idle);
                return match slot {
                    Some(zygote) => Ok(zygote),
                    None => self.restart().inspect_err(|_| self.checkin(None)),
                };
            }
            idle = self.freed.wait(idle).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Return a worker slot; `None` marks it for a fresh zygote on next use.
    fn checkin(&self, zygote: Option<Zygote>) {
        lock(&self.idle).push(zygote);
        self.freed.notify_one();
    }

    fn restart(&self) -> Result<Zygote, Error> {
        let zygote = Zygote::start(&self.config)?;
        *lock(&self.layers) = zygote.layers.clone();
        Ok(zygote)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

fn judgement(status: Status, reason: String, wall_ms: f64) -> Judgement {
    Judgement {
        status,
        reason,
        wall_ms,
    }
}

/// A rejection when `text` exceeds `limit` bytes: oversize code is an
/// `InvalidProgram`, an oversize input or answer a `BadInput`.
fn oversize(text: &str, limit: usize, what: Text) -> Option<Judgement> {
    (text.len() > limit).then(|| {
        let (status, name) = match what {
            Text::Code(name) => (Status::InvalidProgram, name),
            Text::Answer(name) => (Status::BadInput, name),
        };
        judgement(
            status,
            format!("{name} is {} bytes, limit {limit}", text.len()),
            0.0,
        )
    })
}

/// What an oversize check is about.
#[derive(Clone, Copy)]
enum Text {
    Code(&'static str),
    Answer(&'static str),
}

fn single_output(reply: &Reply) -> Result<&str, Error> {
    match reply.outputs.as_slice() {
        [one] => Ok(one),
        many => Err(Error::Protocol(format!(
            "{} outputs for one input",
            many.len()
        ))),
    }
}

/// Short form of a value for a reason message.
fn clip(text: &str) -> String {
    const REASON_VALUE_CHARS: usize = 120;
    let mut out: String = text.chars().take(REASON_VALUE_CHARS).collect();
    if out.len() < text.len() {
        out.push('…');
    }
    out
}
