//! The proposer half of a step: prompts, then reading and validating what the
//! proposers wrote, then growing the task buffers.

use serde::Serialize;

use super::{check_len, MemberId, Result, Roster, StepContext};
use crate::compute::{GenRequest, Generation};
use crate::keyed_stream;
use crate::task::grammar::arity;
use crate::task::{
    parse_induction_proposal, parse_proposal, proposer_prompt, solver_prompt, FormatError,
    InductionTask, IoPair, ProposerPrompt, Role, SolverTask, TaskBuffers, TaskKind, Triplet,
};
use crate::verify::{Features, Job, Outcome, Status, VerifierPool};

/// One proposal to generate.
#[derive(Debug, Clone)]
pub struct ProposalJob {
    pub author: MemberId,
    pub kind: TaskKind,
    /// Which of the author's proposals of this kind (0..proposals_per_teacher).
    pub index: usize,
    pub prompt: ProposerPrompt,
    /// The start of the reply given to the model (empty unless prefilling).
    pub prefix: String,
    /// Prompt and prefix tokens.
    pub tokens: Vec<u32>,
}

impl ProposalJob {
    /// The generation request, sampled from the author's own stream.
    pub fn request(&self, ctx: &StepContext) -> GenRequest {
        let s = ctx.settings;
        GenRequest {
            adapter: Some(self.author),
            prompt: self.tokens.clone(),
            max_new_tokens: s.max_new_tokens,
            stop: ctx.tokenizer.stop_ids.clone(),
            sampling: s.sampling,
            rng: keyed_stream!(
                ctx.seed,
                "propose-sample",
                self.author,
                ctx.step,
                self.kind.name(),
                self.index
            ),
            grammar: ctx.grammars.get(
                self.kind,
                Role::Proposer,
                self.prompt.program.as_deref().and_then(arity),
            ),
        }
    }
}

/// A valid proposal, ready for the buffers and the solvers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum AcceptedTask {
    Triplet(Triplet),
    Induction(InductionTask),
}

/// What the verifier made of a proposal.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Malformed(FormatError),
    /// Parsed, but the sandbox rejected the program or an input.
    Invalid {
        status: Status,
        reason: String,
    },
    /// Valid, but a solver prompt for it would be over the prompt budget
    /// (`tokens` > `prompt.max_prompt_tokens`): a program's output can be
    /// longer than anything the grammar bounds.
    TooLong {
        tokens: usize,
    },
    Valid {
        task: AcceptedTask,
        features: Option<Features>,
    },
}

impl Verdict {
    /// The metrics key of a rejection: `format.<code>` or the sandbox status.
    pub fn rejection(&self) -> Option<String> {
        match self {
            Verdict::Malformed(e) => Some(format!("format.{}", e.code())),
            Verdict::Invalid { status, .. } => Some(status.name().to_string()),
            Verdict::TooLong { .. } => Some("prompt_too_long".to_string()),
            Verdict::Valid { .. } => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ProposalResult {
    pub job: ProposalJob,
    pub generation: Generation,
    pub text: String,
    pub verdict: Verdict,
}

/// Proposer prompts for every proposer, task kind and index, in that order.
/// References are drawn from the author's stream for this step.
pub fn proposal_jobs(
    ctx: &StepContext,
    roster: &Roster,
    buffers: &TaskBuffers,
) -> Result<Vec<ProposalJob>> {
    let s = ctx.settings;
    let mut jobs = Vec::new();
    for &author in &roster.proposers {
        for &kind in &s.task_kinds {
            for index in 0..s.proposals_per_teacher {
                let mut rng = keyed_stream!(
                    ctx.seed,
                    "propose-prompt",
                    author,
                    ctx.step,
                    kind.name(),
                    index
                );
                let prompt =
                    proposer_prompt(kind, buffers, &s.prompt, &mut rng, &|c| ctx.measure(c))?;
                let prefix = ctx.prefix(kind, crate::task::Role::Proposer);
                let tokens = ctx.encode_with(&prompt.prompt.chat, prefix)?;
                jobs.push(ProposalJob {
                    author,
                    kind,
                    index,
                    prompt,
                    prefix: prefix.to_string(),
                    tokens,
                });
            }
        }
    }
    Ok(jobs)
}

/// A parsed proposal and the sandbox jobs that validate it.
enum Parsed {
    Triplet {
        program: String,
        input: String,
    },
    Induction {
        program: String,
        inputs: Vec<String>,
        message: String,
    },
}

impl Parsed {
    fn jobs(&self) -> Vec<Job> {
        match self {
            Parsed::Triplet { program, input } => vec![Job::Proposal {
                program: program.clone(),
                input: input.clone(),
            }],
            Parsed::Induction {
                program, inputs, ..
            } => inputs
                .iter()
                .map(|input| Job::Proposal {
                    program: program.clone(),
                    input: input.clone(),
                })
                .collect(),
        }
    }
}

fn parse(
    ctx: &StepContext,
    job: &ProposalJob,
    text: &str,
) -> std::result::Result<Parsed, FormatError> {
    match (job.kind, &job.prompt.program) {
        (TaskKind::Induction, Some(program)) => {
            let p = parse_induction_proposal(text, ctx.settings.prompt.induction_inputs)?;
            Ok(Parsed::Induction {
                program: program.clone(),
                inputs: p.inputs,
                message: p.message,
            })
        }
        _ => {
            let p = parse_proposal(text)?;
            Ok(Parsed::Triplet {
                program: p.program,
                input: p.input,
            })
        }
    }
}

/// Parse every response and validate the parsed ones in one sandbox batch.
/// Induction proposals are valid when the program runs on every input.
pub fn judge_proposals(
    ctx: &StepContext,
    jobs: Vec<ProposalJob>,
    generations: Vec<Generation>,
    pool: &VerifierPool,
) -> Result<Vec<ProposalResult>> {
    check_len("judge_proposals", jobs.len(), generations.len())?;
    let texts: Vec<String> = jobs
        .iter()
        .zip(&generations)
        .map(|(j, g)| ctx.reply_text(&j.prefix, &g.tokens))
        .collect::<Result<_>>()?;
    let parsed: Vec<_> = jobs
        .iter()
        .zip(&texts)
        .map(|(j, t)| parse(ctx, j, t))
        .collect();
    let sandbox_jobs: Vec<Job> = parsed.iter().flatten().flat_map(Parsed::jobs).collect();
    let mut outcomes = pool.batch(&sandbox_jobs).into_iter();
    let mut results = Vec::with_capacity(jobs.len());
    for (((job, generation), text), parsed) in
        jobs.into_iter().zip(generations).zip(texts).zip(parsed)
    {
        let verdict = match parsed {
            Err(e) => Verdict::Malformed(e),
            Ok(p) => {
                let n = p.jobs().len();
                let validations = outcomes
                    .by_ref()
                    .take(n)
                    .map(|o| match o? {
                        Outcome::Proposal(v) => Ok(v),
                        _ => Err(crate::verify::Error::Protocol(
                            "a proposal job returned another job's result".into(),
                        )),
                    })
                    .collect::<std::result::Result<Vec<_>, crate::verify::Error>>()?;
                verdict(ctx, &job, p, validations)
            }
        };
        results.push(ProposalResult {
            job,
            generation,
            text,
            verdict,
        });
    }
    Ok(results)
}

fn verdict(
    ctx: &StepContext,
    job: &ProposalJob,
    parsed: Parsed,
    validations: Vec<crate::verify::Validation>,
) -> Verdict {
    if let Some(bad) = validations.iter().find(|v| !v.is_valid()) {
        return Verdict::Invalid {
            status: bad.status,
            reason: bad.reason.clone(),
        };
    }
    let features = validations.first().and_then(|v| v.features);
    let outputs = validations
        .into_iter()
        .map(|v| v.output.unwrap_or_default());
    let task = match parsed {
        Parsed::Triplet { program, input } => AcceptedTask::Triplet(Triplet {
            program,
            input,
            output: outputs.into_iter().next().unwrap_or_default(),
            step: ctx.step,
            author: Some(job.author),
        }),
        Parsed::Induction {
            program,
            inputs,
            message,
        } => AcceptedTask::Induction(InductionTask {
            program,
            message,
            pairs: inputs
                .into_iter()
                .zip(outputs)
                .map(|(input, output)| IoPair { input, output })
                .collect(),
            step: ctx.step,
            author: Some(job.author),
        }),
    };
    match longest_solver_prompt(ctx, job.kind, &task) {
        Some(tokens) => Verdict::TooLong { tokens },
        None => Verdict::Valid { task, features },
    }
}

/// The solver task a triplet of `kind` poses.
pub(super) fn triplet_task(kind: TaskKind, triplet: &Triplet) -> SolverTask {
    match kind {
        TaskKind::Abduction => SolverTask::Abduction(triplet.clone()),
        _ => SolverTask::Deduction(triplet.clone()),
    }
}

/// The token length of the longest solver prompt `task` can give, when that
/// is over the budget. An induction task is measured showing its longest pairs.
fn longest_solver_prompt(ctx: &StepContext, kind: TaskKind, task: &AcceptedTask) -> Option<usize> {
    let solver_task = match task {
        AcceptedTask::Triplet(t) => triplet_task(kind, t),
        AcceptedTask::Induction(t) => {
            let mut shown = t.pairs.clone();
            shown.sort_by_key(|p| std::cmp::Reverse(p.input.len() + p.output.len()));
            let hidden = shown.split_off(ctx.settings.prompt.induction_shown.min(shown.len()));
            SolverTask::Induction {
                program: t.program.clone(),
                message: t.message.clone(),
                shown,
                hidden,
            }
        }
    };
    match solver_prompt(&solver_task, &ctx.settings.prompt, &|c| ctx.measure(c)) {
        Err(crate::task::Error::PromptTooLong { tokens, .. }) => Some(tokens),
        _ => None,
    }
}

/// Append every valid proposal to its buffer, in result order.
pub fn accept(buffers: &mut TaskBuffers, results: &[ProposalResult]) -> Result<()> {
    for r in results {
        if let Verdict::Valid { task, .. } = &r.verdict {
            match task {
                AcceptedTask::Triplet(t) => buffers.push_triplet(r.job.kind, t.clone())?,
                AcceptedTask::Induction(t) => buffers.push_induction(t.clone()),
            }
        }
    }
    Ok(())
}
