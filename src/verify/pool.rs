//! `VerifierPool`: checkers and zygotes behind a synchronous API. Jobs are
//! independent, so a result does not depend on which server ran it or when
//! (one exception: see `CHECKER_RETIRE_KB` in `server.py`).

use super::server::{Reply, Request, Role, Server};
use super::{Error, HarnessResult, Judgement, Layer, Limits, SandboxConfig, Status, Validation};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// One stage's reply for one job of a batch; `None` where the stage had
/// nothing to do for it.
type Slot = Option<Result<Reply, Error>>;

/// Checker jobs per message in a batch: one wake-up for many jobs, and a
/// checker whose caches stay warm from one job to the next.
const CHECKS_PER_MESSAGE: usize = 32;

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
    /// A benchmark's own check of `program`: the trusted Python `harness`
    /// defines `main(program, args)`, which runs `program` as that benchmark's
    /// harness does and returns the result. No AST filter: the OS layers
    /// contain whatever the program does. The job's own wall-clock and
    /// memory limits replace the configured ones.
    Harness {
        harness: &'static str,
        program: String,
        args: serde_json::Value,
        timeout_ms: u64,
        memory_mb: u64,
    },
}

/// The result of one [`Job`].
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Proposal(Validation),
    Check(Judgement),
    Harness(HarnessResult),
}

impl Outcome {
    pub fn status(&self) -> Status {
        match self {
            Outcome::Proposal(v) => v.status,
            Outcome::Check(j) => j.status,
            Outcome::Harness(h) => h.status,
        }
    }

    /// Why it did not succeed (empty when it did).
    pub fn reason(&self) -> &str {
        match self {
            Outcome::Proposal(v) => &v.reason,
            Outcome::Check(j) => &j.reason,
            Outcome::Harness(h) => &h.reason,
        }
    }
}

/// `config.workers` checkers and as many zygotes. A program is prepared by a
/// checker (parsed, checked, compiled) and run by a zygote; answers are
/// compared by a checker. All methods are synchronous and may be called from
/// many threads at once; a call waits for a free server of the role it needs.
pub struct VerifierPool {
    config: SandboxConfig,
    checkers: Servers,
    zygotes: Servers,
}

impl VerifierPool {
    /// Start `config.workers` servers of each role (fails if one cannot start).
    pub fn new(config: SandboxConfig) -> Result<VerifierPool, Error> {
        if config.workers == 0 {
            return Err(Error::Config("workers must be at least 1".into()));
        }
        Ok(VerifierPool {
            checkers: Servers::start(&config, Role::Checker)?,
            zygotes: Servers::start(&config, Role::Zygote)?,
            config,
        })
    }

    /// Isolation layers active in the most recently started zygote: those of
    /// every program run.
    pub fn layers(&self) -> Vec<Layer> {
        lock(&self.zygotes.layers).clone()
    }

    /// Isolation layers active in the most recently started checker, which
    /// parses programs and answers but never runs them.
    pub fn checker_layers(&self) -> Vec<Layer> {
        lock(&self.checkers.layers).clone()
    }

    /// Process ids of the checkers waiting for work (all of them between
    /// batches): the processes that `ps` or a test may look at.
    pub fn checker_pids(&self) -> Vec<u32> {
        lock(&self.checkers.idle)
            .iter()
            .flatten()
            .map(Server::pid)
            .collect()
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
        match self.run(&Job::Proposal {
            program: program.into(),
            input: input.into(),
        })? {
            Outcome::Proposal(validation) => Ok(validation),
            _ => Err(Error::Job("a proposal was answered as another job".into())),
        }
    }

    /// Deduction: `predicted` and `gold` are reprs; equal as Python literals
    /// (or, when either is not a literal, as stripped strings).
    pub fn check_output(&self, predicted: &str, gold: &str) -> Result<Judgement, Error> {
        judged(self.run(&Job::Output {
            predicted: predicted.into(),
            gold: gold.into(),
        })?)
    }

    /// Abduction: run `program` on `predicted_input` and compare with `gold_output`.
    pub fn check_input(
        &self,
        program: &str,
        predicted_input: &str,
        gold_output: &str,
    ) -> Result<Judgement, Error> {
        judged(self.run(&Job::Input {
            program: program.into(),
            predicted_input: predicted_input.into(),
            gold_output: gold_output.into(),
        })?)
    }

    /// Induction: the solver's `program` must map every hidden input to its
    /// output (all must pass).
    pub fn check_induction(
        &self,
        program: &str,
        pairs: &[(String, String)],
    ) -> Result<Judgement, Error> {
        judged(self.run(&Job::Induction {
            program: program.into(),
            pairs: pairs.to_vec(),
        })?)
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
        judged(self.run(&Job::HumanEval {
            program: program.into(),
            test: test.into(),
            entry_point: entry_point.into(),
        })?)
    }

    /// Run one job of any kind.
    pub fn run(&self, job: &Job) -> Result<Outcome, Error> {
        self.batch(std::slice::from_ref(job))
            .pop()
            .unwrap_or_else(|| Err(Error::Job("a batch of one returned nothing".into())))
    }

    /// Run many jobs over all servers; results come back in input order. Three
    /// stages, each spread over every server of its role:
    /// 1. checkers prepare every program (parse, checks, features, compile)
    ///    and compare every plain answer, many jobs per message;
    /// 2. zygotes run every prepared program and HumanEval problem, each in a
    ///    fresh child;
    /// 3. checkers compare what abduction and induction runs returned.
    pub fn batch(&self, jobs: &[Job]) -> Vec<Result<Outcome, Error>> {
        let rejected: Vec<Option<Judgement>> = jobs
            .iter()
            .map(|job| rejection(job, self.limits()))
            .collect();
        let live: Vec<Option<&Job>> = jobs
            .iter()
            .zip(&rejected)
            .map(|(job, rejected)| rejected.is_none().then_some(job))
            .collect();
        let first: Vec<Option<Request>> = live.iter().map(|job| first_check((*job)?)).collect();
        let mut checked = self.dispatch(Role::Checker, &first, CHECKS_PER_MESSAGE);
        let runs: Vec<Option<Request>> = live
            .iter()
            .zip(&checked)
            .map(|(job, checked)| run_request((*job)?, checked))
            .collect();
        let mut ran = self.dispatch(Role::Zygote, &runs, 1);
        drop(runs);
        let last: Vec<Option<Request>> = live
            .iter()
            .zip(&ran)
            .map(|(job, ran)| compare_request((*job)?, ran))
            .collect();
        let mut compared = self.dispatch(Role::Checker, &last, CHECKS_PER_MESSAGE);
        drop(last);
        jobs.iter()
            .zip(rejected)
            .enumerate()
            .map(|(i, (job, rejected))| match rejected {
                Some(rejected) => Ok(rejected_outcome(job, rejected)),
                None => outcome(
                    job,
                    Stages {
                        checked: checked[i].take(),
                        ran: ran[i].take(),
                        compared: compared[i].take(),
                    },
                ),
            })
            .collect()
    }

    /// Requests to servers of `role`, up to `per_message` of them in one
    /// message (a `Many`: checkers only); a slot without a request stays empty.
    fn dispatch(&self, role: Role, requests: &[Option<Request>], per_message: usize) -> Vec<Slot> {
        let work: Vec<(usize, &Request)> = requests
            .iter()
            .enumerate()
            .filter_map(|(i, request)| Some((i, request.as_ref()?)))
            .collect();
        let size = work
            .len()
            .div_ceil(self.config.workers)
            .clamp(1, per_message);
        let chunks: Vec<&[(usize, &Request)]> = work.chunks(size).collect();
        let replies = self.parallel(&chunks, |chunk| self.send(role, chunk));
        let mut slots: Vec<Slot> = requests.iter().map(|_| None).collect();
        for (chunk, replies) in chunks.iter().zip(replies) {
            let replies =
                replies.unwrap_or_else(|| chunk.iter().map(|_| Err(panicked())).collect());
            for ((i, _), reply) in chunk.iter().zip(replies) {
                slots[*i] = Some(reply);
            }
        }
        slots
    }

    /// One message for a chunk of requests. When a `Many` fails as a whole (an
    /// input too slow to parse, a checker that died), each request again on its
    /// own, so that only the one at fault gets that verdict.
    fn send(&self, role: Role, chunk: &[(usize, &Request)]) -> Vec<Result<Reply, Error>> {
        if let [(_, one)] = chunk {
            return vec![self.call(role, one)];
        }
        let many = Request::Many {
            jobs: chunk.iter().map(|(_, request)| *request).collect(),
        };
        // When the message fails as a whole, the requests one by one find out
        // which of them it was: one try each, as the message was their first.
        match self.call_once(role, &many) {
            Ok(Ok(reply)) if reply.status == Status::Ok && reply.replies.len() == chunk.len() => {
                reply.replies.into_iter().map(Ok).collect()
            }
            Err(start) => {
                let why = format!("no server could be started ({start})");
                chunk.iter().map(|_| Err(Error::Job(why.clone()))).collect()
            }
            _ => chunk
                .iter()
                .map(|(_, request)| self.call_with(role, request, 1))
                .collect(),
        }
    }

    /// `f` on every item, on as many threads as there are servers of a role.
    fn parallel<T: Sync, R: Send>(
        &self,
        items: &[T],
        f: impl Fn(&T) -> R + Sync,
    ) -> Vec<Option<R>> {
        parallel_map(self.config.workers, items, f)
    }

    fn servers(&self, role: Role) -> &Servers {
        match role {
            Role::Checker => &self.checkers,
            Role::Zygote => &self.zygotes,
        }
    }

    /// Run a request on a free server of `role`; when the server fails, once
    /// more on another. See `call_with`.
    fn call(&self, role: Role, request: &Request) -> Result<Reply, Error> {
        self.call_with(role, request, 2)
    }

    /// Run a request on free servers of `role`, up to `tries` times while the
    /// server fails or cannot be started (a fresh one is started for the next
    /// try). When a checker still fails, that is the job's verdict: its input
    /// was too slow to parse (`Timeout`) or killed the checker (`Crashed`). A
    /// server that cannot be started on the last try is an `Err`.
    fn call_with(&self, role: Role, request: &Request, tries: usize) -> Result<Reply, Error> {
        let started = Instant::now();
        let mut attempt = self.call_once(role, request);
        for _ in 1..tries {
            if matches!(attempt, Ok(Ok(_))) {
                break;
            }
            attempt = self.call_once(role, request);
        }
        let result = attempt?;
        let wall_ms = started.elapsed().as_secs_f64() * 1e3;
        let times = if tries > 1 { ", every try" } else { "" };
        match (role, result) {
            (Role::Checker, Err(Error::Unresponsive(ms))) => Ok(Reply::verdict(
                Status::Timeout,
                format!("the checker did not answer within {ms} ms{times}"),
                wall_ms,
            )),
            (Role::Checker, Err(Error::Exited(how))) => Ok(Reply::verdict(
                Status::Crashed,
                format!("the checker died on this input{times} ({how})"),
                wall_ms,
            )),
            (_, result) => result,
        }
    }

    /// Run a request on a free server of `role`, once. The outer error: no
    /// server could be started; the inner result: the server's answer. A
    /// server that fails, or says it is retiring, is dropped; its slot gets a
    /// fresh one on next use.
    fn call_once(&self, role: Role, request: &Request) -> Result<Result<Reply, Error>, Error> {
        let servers = self.servers(role);
        let mut server = servers.checkout(&self.config)?;
        let result = server.call(request, self.limits());
        let keep = matches!(&result, Ok(reply) if !reply.retiring);
        servers.checkin(keep.then_some(server));
        Ok(result)
    }
}

/// The idle servers of one role. `None` marks a slot for a fresh server on
/// next use.
struct Servers {
    role: Role,
    idle: Mutex<Vec<Option<Server>>>,
    freed: Condvar,
    layers: Mutex<Vec<Layer>>,
}

impl Servers {
    fn start(config: &SandboxConfig, role: Role) -> Result<Servers, Error> {
        let mut servers = Vec::with_capacity(config.workers);
        for _ in 0..config.workers {
            servers.push(Server::start(config, role)?);
        }
        let layers = servers[0].layers.clone();
        Ok(Servers {
            role,
            idle: Mutex::new(servers.into_iter().map(Some).collect()),
            freed: Condvar::new(),
            layers: Mutex::new(layers),
        })
    }

    fn checkout(&self, config: &SandboxConfig) -> Result<Server, Error> {
        let mut idle = lock(&self.idle);
        loop {
            if let Some(slot) = idle.pop() {
                drop(idle);
                return match slot {
                    Some(server) => Ok(server),
                    None => self.restart(config).inspect_err(|_| self.checkin(None)),
                };
            }
            idle = self.freed.wait(idle).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn checkin(&self, server: Option<Server>) {
        lock(&self.idle).push(server);
        self.freed.notify_one();
    }

    fn restart(&self, config: &SandboxConfig) -> Result<Server, Error> {
        let server = Server::start(config, self.role)?;
        *lock(&self.layers) = server.layers.clone();
        Ok(server)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

fn panicked() -> Error {
    Error::Job("a worker thread panicked".into())
}

fn judged(outcome: Outcome) -> Result<Judgement, Error> {
    match outcome {
        Outcome::Check(judgement) => Ok(judgement),
        _ => Err(Error::Job("a check was answered as another job".into())),
    }
}

/// What a job gets without reaching a server: sizes over the limits, no pairs.
fn rejection(job: &Job, limits: &Limits) -> Option<Judgement> {
    let code = |text: &str, name| oversize(text, limits.program_bytes, Text::Code(name));
    let answer = |text: &str, name| oversize(text, limits.answer_bytes, Text::Answer(name));
    match job {
        Job::Proposal { program, input } => {
            code(program, "program").or_else(|| answer(input, "input"))
        }
        Job::Output { predicted, .. } => answer(predicted, "predicted output"),
        Job::Input {
            program,
            predicted_input,
            ..
        } => code(program, "program").or_else(|| answer(predicted_input, "predicted input")),
        Job::Induction { program, pairs } => code(program, "program")
            .or_else(|| {
                pairs.is_empty().then(|| {
                    judgement(
                        Status::BadInput,
                        "no input/output pairs to check".into(),
                        0.0,
                    )
                })
            })
            .or_else(|| pairs.iter().find_map(|(input, _)| answer(input, "input"))),
        Job::HumanEval { program, test, .. } => {
            code(program, "program").or_else(|| code(test, "test code"))
        }
        Job::Harness { program, .. } => code(program, "program"),
    }
}

fn rejected_outcome(job: &Job, rejected: Judgement) -> Outcome {
    match job {
        Job::Proposal { .. } => Outcome::Proposal(failed_validation(
            rejected.status,
            rejected.reason,
            rejected.wall_ms,
        )),
        Job::Harness { .. } => Outcome::Harness(HarnessResult {
            status: rejected.status,
            reason: rejected.reason,
            outputs: Vec::new(),
            wall_ms: rejected.wall_ms,
        }),
        _ => Outcome::Check(rejected),
    }
}

fn failed_validation(status: Status, reason: String, wall_ms: f64) -> Validation {
    Validation {
        status,
        output: None,
        reason,
        features: None,
        function: None,
        wall_ms,
    }
}

/// Stage 1: what a checker does for `job`.
fn first_check(job: &Job) -> Option<Request<'_>> {
    fn prepare<'a>(program: &'a str, inputs: Vec<&'a str>) -> Option<Request<'a>> {
        Some(Request::Prepare { program, inputs })
    }
    match job {
        Job::Proposal { program, input } => prepare(program, vec![input.as_str()]),
        Job::Output { predicted, gold } => Some(Request::Compare {
            pairs: vec![[predicted.as_str(), gold.as_str()]],
        }),
        Job::Input {
            program,
            predicted_input,
            ..
        } => prepare(program, vec![predicted_input.as_str()]),
        Job::Induction { program, pairs } => prepare(
            program,
            pairs.iter().map(|(input, _)| input.as_str()).collect(),
        ),
        Job::HumanEval { .. } | Job::Harness { .. } => None,
    }
}

/// Stage 2: what a zygote runs for `job`, given its stage-1 reply.
fn run_request<'a>(job: &'a Job, checked: &'a Slot) -> Option<Request<'a>> {
    let runs = match job {
        Job::Proposal { .. } => 2,
        Job::Input { .. } | Job::Induction { .. } => 1,
        Job::Output { .. } => return None,
        Job::HumanEval {
            program,
            test,
            entry_point,
        } => {
            return Some(Request::Humaneval {
                program,
                test,
                entry_point,
            })
        }
        Job::Harness {
            harness,
            program,
            args,
            timeout_ms,
            memory_mb,
        } => {
            return Some(Request::Harness {
                harness,
                program,
                args,
                timeout_ms: *timeout_ms,
                memory_mb: *memory_mb,
            })
        }
    };
    let prepared = checked.as_ref()?.as_ref().ok()?;
    if prepared.status != Status::Ok {
        return None;
    }
    Some(Request::Run {
        function: prepared.function.as_deref()?,
        code: prepared.code.as_deref()?,
        calls: &prepared.calls,
        runs,
    })
}

/// Stage 3: what a checker compares for `job`, given its stage-2 reply.
fn compare_request<'a>(job: &'a Job, ran: &'a Slot) -> Option<Request<'a>> {
    let pairs = compared_pairs(job, ran.as_ref()?.as_ref().ok()?)?.ok()?;
    Some(Request::Compare { pairs })
}

/// The (got, gold) pairs to compare for `job` after its run; `None` when there
/// is nothing to compare, an error when the run's outputs do not fit the job.
fn compared_pairs<'a>(job: &'a Job, run: &'a Reply) -> Option<Result<Vec<[&'a str; 2]>, Error>> {
    if run.status != Status::Ok {
        return None;
    }
    match job {
        Job::Input { gold_output, .. } => {
            Some(single_output(run).map(|got| vec![[got, gold_output.as_str()]]))
        }
        Job::Induction { pairs, .. } => Some(if run.outputs.len() == pairs.len() {
            Ok(run
                .outputs
                .iter()
                .zip(pairs)
                .map(|(got, (_, gold))| [got.as_str(), gold.as_str()])
                .collect())
        } else {
            Err(Error::Protocol(format!(
                "{} outputs for {} inputs",
                run.outputs.len(),
                pairs.len()
            )))
        }),
        _ => None,
    }
}

/// A job's replies from the three stages (`None` where a stage had nothing to do).
struct Stages {
    checked: Slot,
    ran: Slot,
    compared: Slot,
}

fn outcome(job: &Job, stages: Stages) -> Result<Outcome, Error> {
    let missing = || Error::Job("a sandbox stage gave no reply".into());
    let stage = |reply: Slot| reply.ok_or_else(missing).and_then(|r| r);
    match job {
        Job::Proposal { .. } => {
            let prepared = stage(stages.checked)?;
            if prepared.status != Status::Ok {
                return Ok(Outcome::Proposal(failed_validation(
                    prepared.status,
                    prepared.reason,
                    prepared.wall_ms,
                )));
            }
            let run = stage(stages.ran)?;
            let ok = run.status == Status::Ok;
            Ok(Outcome::Proposal(Validation {
                status: run.status,
                output: if ok {
                    run.outputs.into_iter().next()
                } else {
                    None
                },
                reason: run.reason,
                features: if ok { prepared.features } else { None },
                function: if ok { prepared.function } else { None },
                wall_ms: prepared.wall_ms + run.wall_ms,
            }))
        }
        Job::Output { predicted, gold } => {
            let compared = stage(stages.checked)?;
            judge(compared, &[[predicted, gold]], 0.0).map(Outcome::Check)
        }
        Job::Input { .. } | Job::Induction { .. } => {
            let prepared = stage(stages.checked)?;
            if prepared.status != Status::Ok {
                let failed = judgement(prepared.status, prepared.reason, prepared.wall_ms);
                return Ok(Outcome::Check(failed));
            }
            let run = stage(stages.ran)?;
            let wall_ms = prepared.wall_ms + run.wall_ms;
            if run.status != Status::Ok {
                return Ok(Outcome::Check(judgement(run.status, run.reason, wall_ms)));
            }
            let pairs = compared_pairs(job, &run).ok_or_else(missing)??;
            judge(stage(stages.compared)?, &pairs, wall_ms).map(Outcome::Check)
        }
        Job::HumanEval { .. } => {
            let run = stage(stages.ran)?;
            Ok(Outcome::Check(judgement(
                run.status,
                run.reason,
                run.wall_ms,
            )))
        }
        Job::Harness { .. } => {
            let run = stage(stages.ran)?;
            Ok(Outcome::Harness(HarnessResult {
                status: run.status,
                reason: run.reason,
                outputs: run.outputs,
                wall_ms: run.wall_ms,
            }))
        }
    }
}

/// The judgement of a checker's comparison of `pairs` (got, gold).
fn judge(reply: Reply, pairs: &[[&str; 2]], earlier_ms: f64) -> Result<Judgement, Error> {
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
            let [got, gold] = pairs[i];
            let reason = format!("pair {i}: expected {}, got {}", clip(gold), clip(got));
            judgement(Status::Mismatch, reason, wall_ms)
        }
    })
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

/// `f` on every item, on up to `threads` threads that take the next item as
/// they finish one; results in input order, `None` where a thread panicked.
pub fn parallel_map<T: Sync, R: Send>(
    threads: usize,
    items: &[T],
    f: impl Fn(&T) -> R + Sync,
) -> Vec<Option<R>> {
    let next = AtomicUsize::new(0);
    let threads = threads.clamp(1, items.len().max(1));
    let finished: Vec<(usize, R)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break };
                        done.push((i, f(item)));
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
    let mut slots: Vec<Option<R>> = items.iter().map(|_| None).collect();
    for (i, result) in finished {
        slots[i] = Some(result);
    }
    slots
}
