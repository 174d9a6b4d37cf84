//! Task buffers: one per task kind, seeded with the identity task, appended to
//! with every valid proposal (with its step and author), sampled only through
//! a caller's seeded random stream. They are plain data and serialise into
//! checkpoints.

use rand::seq::index;
use rand::Rng;
use serde::{Deserialize, Serialize};

use super::prompt::SolverTask;
use super::{Error, InductionTask, TaskKind, Triplet};

/// The three buffers. Deduction and abduction hold [`Triplet`]s, induction
/// holds [`InductionTask`]s (a program with its message and pairs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskBuffers {
    deduction: Vec<Triplet>,
    abduction: Vec<Triplet>,
    induction: Vec<InductionTask>,
}

impl Default for TaskBuffers {
    fn default() -> Self {
        TaskBuffers::seeded()
    }
}

impl TaskBuffers {
    /// Every buffer holds exactly its identity seed.
    pub fn seeded() -> TaskBuffers {
        TaskBuffers {
            deduction: vec![Triplet::identity()],
            abduction: vec![Triplet::identity()],
            induction: vec![InductionTask::identity()],
        }
    }

    /// Entries in the buffer of `kind`.
    pub fn len(&self, kind: TaskKind) -> usize {
        match kind {
            TaskKind::Deduction => self.deduction.len(),
            TaskKind::Abduction => self.abduction.len(),
            TaskKind::Induction => self.induction.len(),
        }
    }

    /// True when the buffer of `kind` is empty (only after loading an empty one).
    pub fn is_empty(&self, kind: TaskKind) -> bool {
        self.len(kind) == 0
    }

    /// The deduction or abduction buffer, oldest first.
    pub fn triplets(&self, kind: TaskKind) -> Result<&[Triplet], Error> {
        match kind {
            TaskKind::Deduction => Ok(&self.deduction),
            TaskKind::Abduction => Ok(&self.abduction),
            TaskKind::Induction => Err(Error::NotATripletBuffer(kind)),
        }
    }

    /// The induction buffer, oldest first.
    pub fn induction_tasks(&self) -> &[InductionTask] {
        &self.induction
    }

    /// Appends a valid deduction or abduction proposal.
    pub fn push_triplet(&mut self, kind: TaskKind, triplet: Triplet) -> Result<(), Error> {
        match kind {
            TaskKind::Deduction => self.deduction.push(triplet),
            TaskKind::Abduction => self.abduction.push(triplet),
            TaskKind::Induction => return Err(Error::NotATripletBuffer(kind)),
        }
        Ok(())
    }

    /// Appends a valid induction proposal.
    pub fn push_induction(&mut self, task: InductionTask) {
        self.induction.push(task);
    }

    /// Up to `k` distinct triplets of `kind`, uniformly without replacement,
    /// in draw order (all of them, shuffled, when the buffer holds fewer).
    pub fn sample_triplets(
        &self,
        kind: TaskKind,
        k: usize,
        rng: &mut impl Rng,
    ) -> Result<Vec<&Triplet>, Error> {
        let all = self.triplets(kind)?;
        let amount = k.min(all.len());
        Ok(index::sample(rng, all.len(), amount)
            .into_iter()
            .map(|i| &all[i])
            .collect())
    }

    /// One triplet drawn uniformly from the deduction and abduction buffers
    /// together: the program an induction proposer writes inputs for (as AZR,
    /// which takes `code_f` programs from the `code_i`/`code_o` buffers).
    pub fn sample_program(&self, rng: &mut impl Rng) -> Result<&Triplet, Error> {
        let total = self.deduction.len() + self.abduction.len();
        if total == 0 {
            return Err(Error::EmptyBuffer(TaskKind::Deduction));
        }
        let i = rng.random_range(0..total);
        Ok(self
            .deduction
            .get(i)
            .unwrap_or_else(|| &self.abduction[i - self.deduction.len()]))
    }

    /// `n` solver tasks of `kind`, each drawn uniformly with replacement (a
    /// batch may be larger than the buffer). Induction tasks are split into
    /// `shown` visible pairs and hidden ones with the same stream.
    pub fn sample_solver_tasks(
        &self,
        kind: TaskKind,
        n: usize,
        shown: usize,
        rng: &mut impl Rng,
    ) -> Result<Vec<SolverTask>, Error> {
        if self.is_empty(kind) {
            return Err(Error::EmptyBuffer(kind));
        }
        let len = self.len(kind);
        let mut tasks = Vec::with_capacity(n);
        for _ in 0..n {
            let i = rng.random_range(0..len);
            tasks.push(match kind {
                TaskKind::Deduction => SolverTask::Deduction(self.deduction[i].clone()),
                TaskKind::Abduction => SolverTask::Abduction(self.abduction[i].clone()),
                TaskKind::Induction => solver_task_from_induction(&self.induction[i], shown, rng),
            });
        }
        Ok(tasks)
    }
}

/// The solver's view of an induction task: `shown` pairs drawn with `rng`, the
/// rest hidden.
pub fn solver_task_from_induction(
    task: &InductionTask,
    shown: usize,
    rng: &mut impl Rng,
) -> SolverTask {
    let (shown, hidden) = task.split(shown, rng);
    SolverTask::Induction {
        program: task.program.clone(),
        message: task.message.clone(),
        shown,
        hidden,
    }
}
