//! The solver half of a step: which problems each solver gets, then reading
//! and scoring the answers.

use std::collections::BTreeSet;

use super::{
    check_len, AcceptedTask, MemberId, ProposalResult, Result, Roster, StepContext, Verdict,
};
use crate::compute::{GenRequest, Generation};
use crate::keyed_stream;
use crate::rl::SolverOutcome;
use crate::task::buffer::solver_task_from_induction;
use crate::task::{
    parse_answer, solver_prompt, Answer, BuiltPrompt, FormatError, SolverTask, TaskBuffers,
};
use crate::verify::{Job, Status, VerifierPool};

/// A problem put to one or more solvers.
#[derive(Debug, Clone)]
pub struct Problem {
    /// The proposal it came from (an index into the step's proposal results);
    /// `None` for a problem drawn from the buffers.
    pub proposal: Option<usize>,
    pub author: Option<MemberId>,
    pub task: SolverTask,
    pub prompt: BuiltPrompt,
    /// The start of the reply given to the model (empty unless prefilling).
    pub prefix: String,
    /// Prompt and prefix tokens.
    pub tokens: Vec<u32>,
    /// Who solves it, each `solver_samples` times.
    pub solvers: Vec<MemberId>,
}

/// One solver rollout to generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SolveJob {
    pub problem: usize,
    pub solver: MemberId,
    pub sample: usize,
}

impl SolveJob {
    pub fn request(&self, ctx: &StepContext, problems: &[Problem]) -> GenRequest {
        let s = ctx.settings;
        let task = &problems[self.problem].task;
        GenRequest {
            adapter: Some(self.solver),
            prompt: problems[self.problem].tokens.clone(),
            max_new_tokens: s.max_new_tokens,
            stop: ctx.tokenizer.stop_ids.clone(),
            sampling: s.sampling,
            rng: keyed_stream!(
                ctx.seed,
                "solve-sample",
                self.solver,
                ctx.step,
                self.problem,
                self.sample
            ),
            grammar: ctx.grammars.solver(task),
        }
    }
}

#[derive(Debug, Clone)]
pub struct SolveResult {
    pub job: SolveJob,
    pub generation: Generation,
    pub text: String,
    pub outcome: SolverOutcome,
    /// Why the answer could not be read, when it could not.
    pub format: Option<FormatError>,
    /// The sandbox's judgement of a readable answer.
    pub status: Option<Status>,
}

/// Every valid proposal goes to its author's matched solvers, and every
/// solver gets `buffer_problems` problems per task kind from the buffers, as
/// AZR's solver trains on buffer tasks: they train it, and as they have no
/// author, no proposer's learnability counts them. With `buffer_problems` 0
/// a solver gets buffer problems only when left without a problem (then one
/// per kind), so every solver trains every step. Buffer problems are drawn
/// from the solver's own stream.
pub fn problems(
    ctx: &StepContext,
    roster: &Roster,
    proposals: &[ProposalResult],
    buffers: &TaskBuffers,
) -> Result<Vec<Problem>> {
    // (proposal, author, task, solvers)
    type Planned = (Option<usize>, Option<MemberId>, SolverTask, Vec<MemberId>);
    let mut tasks: Vec<Planned> = Vec::new();
    for (i, r) in proposals.iter().enumerate() {
        let Verdict::Valid { task, .. } = &r.verdict else {
            continue;
        };
        let solvers = roster
            .matches
            .get(&r.job.author)
            .cloned()
            .unwrap_or_default();
        if solvers.is_empty() {
            continue;
        }
        let task = match task {
            AcceptedTask::Triplet(t) => super::propose::triplet_task(r.job.kind, t),
            AcceptedTask::Induction(t) => {
                let mut rng = keyed_stream!(ctx.seed, "induction-split", ctx.step, i);
                solver_task_from_induction(t, ctx.settings.prompt.induction_shown, &mut rng)
            }
        };
        tasks.push((Some(i), Some(r.job.author), task, solvers));
    }
    let matched: BTreeSet<MemberId> = tasks.iter().flat_map(|t| t.3.iter().copied()).collect();
    for &solver in &roster.solvers {
        let count = match ctx.settings.buffer_problems {
            0 if matched.contains(&solver) => continue,
            0 => 1,
            n => n,
        };
        let mut rng = keyed_stream!(ctx.seed, "buffer-problems", solver, ctx.step);
        for &kind in &ctx.settings.task_kinds {
            let shown = ctx.settings.prompt.induction_shown;
            for task in buffers.sample_solver_tasks(kind, count, shown, &mut rng)? {
                tasks.push((None, None, task, vec![solver]));
            }
        }
    }
    // A prompt over the budget (a buffer task from before the check at
    // validation, or an unlucky induction split) is left out, not an error.
    let mut problems = Vec::new();
    for (proposal, author, task, solvers) in tasks {
        let prompt = match solver_prompt(&task, &ctx.settings.prompt, &|c| ctx.measure(c)) {
            Err(crate::task::Error::PromptTooLong { .. }) => continue,
            built => built?,
        };
        let prefix = ctx.prefix(task.kind(), crate::task::Role::Solver);
        let tokens = ctx.encode_with(&prompt.chat, prefix)?;
        problems.push(Problem {
            proposal,
            author,
            task,
            prompt,
            prefix: prefix.to_string(),
            tokens,
            solvers,
        });
    }
    Ok(problems)
}

/// Every (problem, solver, sample), in that order.
pub fn solve_jobs(ctx: &StepContext, problems: &[Problem]) -> Vec<SolveJob> {
    let mut jobs = Vec::new();
    for (problem, p) in problems.iter().enumerate() {
        for &solver in &p.solvers {
            for sample in 0..ctx.settings.solver_samples {
                jobs.push(SolveJob {
                    problem,
                    solver,
                    sample,
                });
            }
        }
    }
    jobs
}

/// The sandbox job that judges `answer` to `task`.
fn judge_job(task: &SolverTask, answer: Answer) -> Job {
    match (task, answer) {
        (SolverTask::Deduction(t), answer) => Job::Output {
            predicted: answer.text().to_string(),
            gold: t.output.clone(),
        },
        (SolverTask::Abduction(t), answer) => Job::Input {
            program: t.program.clone(),
            predicted_input: answer.text().to_string(),
            gold_output: t.output.clone(),
        },
        (SolverTask::Induction { hidden, .. }, answer) => Job::Induction {
            program: answer.text().to_string(),
            pairs: hidden
                .iter()
                .map(|p| (p.input.clone(), p.output.clone()))
                .collect(),
        },
    }
}

/// Parse every answer and judge the readable ones in one sandbox batch.
pub fn judge_solutions(
    ctx: &StepContext,
    problems: &[Problem],
    jobs: Vec<SolveJob>,
    generations: Vec<Generation>,
    pool: &VerifierPool,
) -> Result<Vec<SolveResult>> {
    check_len("judge_solutions", jobs.len(), generations.len())?;
    let texts: Vec<String> = jobs
        .iter()
        .zip(&generations)
        .map(|(j, g)| ctx.reply_text(&problems[j.problem].prefix, &g.tokens))
        .collect::<Result<_>>()?;
    let answers: Vec<_> = jobs
        .iter()
        .zip(&texts)
        .map(|(j, text)| {
            let task = &problems[j.problem].task;
            parse_answer(task.kind(), text).map(|a| judge_job(task, a))
        })
        .collect();
    let sandbox_jobs: Vec<Job> = answers.iter().flatten().cloned().collect();
    let mut judged = pool.batch(&sandbox_jobs).into_iter();
    let mut results = Vec::with_capacity(jobs.len());
    for (((job, generation), text), answer) in
        jobs.into_iter().zip(generations).zip(texts).zip(answers)
    {
        let (outcome, format, status) = match answer {
            Err(e) => (SolverOutcome::Malformed, Some(e), None),
            Ok(_) => {
                let status = match judged.next() {
                    Some(Ok(outcome)) => outcome.status(),
                    Some(Err(e)) => return Err(e.into()),
                    None => {
                        return Err(crate::verify::Error::Protocol(
                            "fewer sandbox results than jobs".into(),
                        )
                        .into())
                    }
                };
                let correct = status == Status::Ok;
                (SolverOutcome::Answered { correct }, None, Some(status))
            }
        };
        results.push(SolveResult {
            job,
            generation,
            text,
            outcome,
            format,
            status,
        });
    }
    Ok(results)
}
