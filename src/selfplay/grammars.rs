//! The reply grammars of a run, compiled once against the base's vocabulary.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::Settings;
use crate::base::Tokenizer;
use crate::grammar::{Grammar, Vocabulary};
use crate::task::grammar::{arity, reply_grammar, ReplyShape, MAX_PARAMS};
use crate::task::{Role, SolverTask, TaskKind};

#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    #[error(transparent)]
    Grammar(#[from] crate::grammar::Error),
    /// The reply budget cannot hold the grammar (names the budget that can).
    #[error("{0}")]
    Budget(String),
}

/// Which grammar a reply follows: its kind, its role and, where the reply
/// writes arguments for a given function, that function's parameter count.
type Key = (TaskKind, Role, Option<usize>);

/// Every grammar self-play replies follow; empty when structured decoding is off.
#[derive(Debug, Default)]
pub struct Grammars {
    compiled: BTreeMap<Key, Arc<Grammar>>,
}

impl Grammars {
    /// No grammars: free decoding ([`Settings::constrained`] off).
    pub fn off() -> Grammars {
        Grammars::default()
    }

    /// The grammars of `settings` (none when it is unconstrained), for a
    /// model with `vocab_size` logits. Fails when `max_new_tokens` is too
    /// small for a reply's grammar, naming the budget that would do.
    pub fn compile(
        tokenizer: &Tokenizer,
        vocab_size: usize,
        settings: &Settings,
    ) -> Result<Grammars, GrammarError> {
        let keys = keys(settings);
        if keys.is_empty() {
            return Ok(Grammars::off());
        }
        let vocabulary = Vocabulary::new(tokenizer, vocab_size)?;
        let mut compiled = BTreeMap::new();
        for key in keys {
            let lark = lark(settings, key)?;
            compiled.insert(key, Arc::new(vocabulary.compile(&lark)?));
        }
        Ok(Grammars { compiled })
    }

    /// The grammar of a (kind, role) reply; `arity` is the parameter count
    /// of the function the reply writes arguments for, when there is one and
    /// it is known. `None` when decoding is unconstrained.
    pub fn get(&self, kind: TaskKind, role: Role, arity: Option<usize>) -> Option<Arc<Grammar>> {
        let arity = arity.filter(|a| (1..=MAX_PARAMS).contains(a));
        let arity = if keyed_by_arity(kind, role) {
            arity
        } else {
            None
        };
        self.compiled.get(&(kind, role, arity)).cloned()
    }

    /// Where `grammar` is among the compiled ones. Two processes that compiled
    /// the same settings against the same vocabulary agree on it, so a node
    /// receives this index instead of the grammar.
    pub fn index_of(&self, grammar: &Arc<Grammar>) -> Option<usize> {
        self.compiled.values().position(|g| Arc::ptr_eq(g, grammar))
    }

    /// The grammar at [`Grammars::index_of`]'s `index`.
    pub fn by_index(&self, index: usize) -> Option<Arc<Grammar>> {
        self.compiled.values().nth(index).cloned()
    }

    /// The grammar of a solver's reply to `task` (an abduction answer holds
    /// as many arguments as the task's program takes).
    pub fn solver(&self, task: &SolverTask) -> Option<Arc<Grammar>> {
        let arity = match task {
            SolverTask::Abduction(t) => arity(&t.program),
            _ => None,
        };
        self.get(task.kind(), Role::Solver, arity)
    }
}

/// Replies that write arguments for a given function, whose grammar
/// depends on that function's parameter count.
fn keyed_by_arity(kind: TaskKind, role: Role) -> bool {
    matches!(
        (role, kind),
        (Role::Proposer, TaskKind::Induction) | (Role::Solver, TaskKind::Abduction)
    )
}

/// The Lark text of a grammar of `settings`.
pub fn lark(settings: &Settings, (kind, role, arity): Key) -> Result<String, GrammarError> {
    let shape = ReplyShape {
        max_new_tokens: settings.max_new_tokens,
        arity,
        inputs: settings.prompt.induction_inputs,
    };
    let grammar = reply_grammar(kind, role, &shape).map_err(GrammarError::Budget)?;
    Ok(grammar.lark)
}

/// Every grammar a run of `settings` needs.
fn keys(settings: &Settings) -> Vec<Key> {
    if !settings.constrained {
        return Vec::new();
    }
    let arities = std::iter::once(None).chain((1..=MAX_PARAMS).map(Some));
    let mut keys = Vec::new();
    for &kind in &settings.task_kinds {
        for role in Role::ALL {
            if keyed_by_arity(kind, role) {
                keys.extend(arities.clone().map(|a| (kind, role, a)));
            } else {
                keys.push((kind, role, None));
            }
        }
    }
    keys
}
