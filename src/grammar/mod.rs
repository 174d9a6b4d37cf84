//! Structured decoding: which tokens a reply may continue with.
//!
//! A Lark grammar (llguidance's dialect) is compiled once against the base
//! model's vocabulary ([`Vocabulary::compile`]) into a [`Grammar`]. Every
//! generation row that follows it starts its own [`Constraint`], a parser
//! state that advances with the row's tokens. At each point the constraint
//! either forces tokens (text the grammar fixes, such as a fence: they are
//! appended without sampling, "fast-forward") or hands out the [`TokenMask`]
//! that the next token is sampled from. A mask is a pure function of the
//! grammar and the tokens so far, so a seeded row decodes the same every time.
//!
//! The engine is llguidance, the structured-output engine that serving stacks
//! use; the vocabulary is the model's tokenizer's ([`vocabulary`]). A grammar fixes the
//! syntax of a reply only: whether a program runs is the verifier's business.

mod vocabulary;

use std::sync::Arc;

use llguidance::api::{StopReason, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};

use crate::base::{kernels, Tokenizer};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the tokenizer cannot drive structured decoding: {0}")]
    Vocabulary(String),
    #[error("the grammar does not compile: {0}")]
    Compile(String),
    /// A token the grammar does not allow, or a grammar that dead-ends.
    #[error("structured decoding failed: {0}")]
    Decode(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// The base model's vocabulary as llguidance sees it: every token's bytes and
/// the token that ends a reply. Built once per model; compiles grammars.
pub struct Vocabulary {
    factory: Arc<ParserFactory>,
    size: usize,
    stop: u32,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocabulary")
            .field("size", &self.size)
            .finish()
    }
}

impl Vocabulary {
    /// The vocabulary of `tokenizer`, padded to the model's `size` logits. A
    /// completed grammar allows exactly the tokenizer's first stop token (the
    /// model's end of an assistant turn), so every constrained reply ends as
    /// an unconstrained one does.
    pub fn new(tokenizer: &Tokenizer, size: usize) -> Result<Vocabulary> {
        let stop = *tokenizer
            .stop_ids
            .first()
            .ok_or_else(|| Error::Vocabulary("the tokenizer has no stop token".into()))?;
        if stop as usize >= tokenizer.inner().get_vocab_size(true) {
            return Err(Error::Vocabulary(format!(
                "stop token {stop} is outside the vocabulary"
            )));
        }
        let env = vocabulary::token_env(tokenizer.inner(), size, stop)?;
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| Error::Vocabulary(e.to_string()))?;
        // Problems come back as errors; nothing is printed.
        factory.quiet();
        Ok(Vocabulary {
            factory: Arc::new(factory),
            size,
            stop,
        })
    }

    /// Compile a Lark grammar (llguidance's dialect: `start` is the top rule;
    /// `name[max_tokens=N]: TERMINAL` bounds a part in tokens).
    pub fn compile(&self, lark: &str) -> Result<Grammar> {
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_lark(lark.to_string()))
            .map_err(|e| Error::Compile(e.to_string()))?;
        let prototype = Matcher::new(Ok(parser));
        if let Some(e) = prototype.get_error() {
            return Err(Error::Compile(e));
        }
        Ok(Grammar {
            prototype,
            size: self.size,
            stop: self.stop,
        })
    }

    /// Number of logits a mask covers.
    pub fn size(&self) -> usize {
        self.size
    }
}

/// A compiled grammar; [`Grammar::start`] gives a fresh parse of it.
pub struct Grammar {
    prototype: Matcher,
    size: usize,
    stop: u32,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").field("size", &self.size).finish()
    }
}

impl Grammar {
    /// Number of logits its masks cover.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The state of a reply that has not started yet.
    pub fn start(&self) -> Constraint {
        Constraint {
            matcher: self.prototype.deep_clone(),
            size: self.size,
            stop: self.stop,
        }
    }
}

/// One reply's position in its grammar.
pub struct Constraint {
    matcher: Matcher,
    size: usize,
    /// The token that ends a reply.
    stop: u32,
}

/// What comes next in a constrained reply, after the tokens it forces.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Sample the next token from these.
    Sample(TokenMask),
    /// The grammar is complete; the forced tokens end with the stop token.
    Finished,
}

/// [`Constraint::advance`]: the tokens the grammar forces from here (already
/// taken), then what follows them.
#[derive(Debug, Clone, PartialEq)]
pub struct Advance {
    pub forced: Vec<u32>,
    pub next: Next,
}

impl Constraint {
    /// Take every token the grammar forces from here: text it fixes
    /// (llguidance's fast-forward tokens) and any point where exactly one
    /// token is allowed. Then either a mask to sample from, or the end: a
    /// complete grammar forces the stop token.
    pub fn advance(&mut self) -> Result<Advance> {
        let mut forced = Vec::new();
        loop {
            if self.matcher.is_stopped() {
                self.check()?;
                match self.matcher.stop_reason() {
                    // Complete, and the stop token already taken.
                    StopReason::EndOfSentence => {}
                    // Complete: nothing else can follow.
                    StopReason::NoExtension | StopReason::NoExtensionBias => forced.push(self.stop),
                    other => {
                        return Err(Error::Decode(format!("the grammar stopped early: {other}")))
                    }
                }
                return Ok(Advance {
                    forced,
                    next: Next::Finished,
                });
            }
            let fast = self.matcher.consume_ff_tokens();
            self.check()?;
            if !fast.is_empty() {
                forced.extend(fast);
                continue;
            }
            let mask = self
                .matcher
                .compute_mask()
                .map_err(|e| Error::Decode(e.to_string()))?;
            match mask.num_set() {
                0 => return Err(Error::Decode("the grammar allows no token here".into())),
                1 => {
                    let only = mask.first_bit_set().unwrap_or_default() as u32;
                    self.commit(only)?;
                    forced.push(only);
                }
                _ => {
                    return Ok(Advance {
                        forced,
                        next: Next::Sample(TokenMask::new(mask.as_slice(), self.size)),
                    })
                }
            }
        }
    }

    /// Take a sampled token (one the last mask allowed).
    pub fn commit(&mut self, token: u32) -> Result<()> {
        self.matcher
            .consume_token(token)
            .map_err(|e| Error::Decode(e.to_string()))
    }

    fn check(&self) -> Result<()> {
        match self.matcher.get_error() {
            Some(e) => Err(Error::Decode(e)),
            None => Ok(()),
        }
    }
}

/// The tokens allowed at one point of a reply: one bit per logit.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenMask {
    words: Arc<[u32]>,
    size: usize,
}

impl std::fmt::Debug for TokenMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenMask")
            .field("size", &self.size)
            .field("allowed", &self.count())
            .finish()
    }
}

impl TokenMask {
    /// A mask over `size` logits from bit words (bit `t % 32` of word `t / 32`).
    pub fn new(words: &[u32], size: usize) -> TokenMask {
        let mut words: Vec<u32> = words.iter().copied().take(size.div_ceil(32)).collect();
        words.resize(size.div_ceil(32), 0);
        if !size.is_multiple_of(32) {
            if let Some(last) = words.last_mut() {
                *last &= (1u32 << (size % 32)) - 1;
            }
        }
        TokenMask {
            words: words.into(),
            size,
        }
    }

    /// A mask that allows exactly `tokens` (ids at or past `size` are ignored).
    pub fn from_tokens(tokens: &[u32], size: usize) -> TokenMask {
        let mut words = vec![0u32; size.div_ceil(32)];
        for &t in tokens.iter().filter(|&&t| (t as usize) < size) {
            words[t as usize / 32] |= 1 << (t % 32);
        }
        TokenMask {
            words: words.into(),
            size,
        }
    }

    /// Number of logits it covers.
    pub fn size(&self) -> usize {
        self.size
    }

    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.size && kernels::bit_set(&self.words, token)
    }

    /// The bits: bit `t % 32` of word `t / 32` is set when token `t` is allowed.
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Every logit the mask does not allow becomes `masked` (−∞ for a
    /// renormalised softmax over the allowed tokens).
    pub fn apply<T: Copy>(&self, logits: &mut [T], masked: T) {
        kernels::mask_out(logits, &self.words, masked);
    }
}
