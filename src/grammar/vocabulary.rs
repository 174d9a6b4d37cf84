//! The vocabulary as llguidance sees it: every token's bytes in a token trie,
//! and how to tokenize the text a grammar fixes. Built from the model's own
//! tokenizer, as `toktrie_hf_tokenizers` does (whose rules this follows), so
//! that the `tokenizers` crate is built once, at the version candle uses.
//!
//! - A special token (an added token marked special, or any added `<...>`)
//!   is its text behind toktrie's special-token marker byte, so text never
//!   matches it.
//! - A byte-level vocabulary (GPT-2, SmolLM2, Qwen, Llama 3) writes each byte
//!   as a printable character ([`byte_to_char`]); a byte-fallback one
//!   (SentencePiece: Llama 2, Mistral) has `<0xNN>` byte tokens and `▁` (or
//!   its decoder's replacement) for a space.
//! - Ids past the tokenizer's vocabulary, up to the model's logits, are
//!   placeholder special tokens that no text produces.

use std::collections::HashSet;
use std::sync::Arc;

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use tokenizers::{DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper};

use super::{Error, Result};
use crate::base::byte_to_char;

/// How a vocabulary spells bytes.
enum Spelling {
    ByteLevel,
    /// `<0xNN>` byte tokens; `space` stands for ' ' in the others.
    ByteFallback {
        space: char,
    },
}

/// The trie of `tokenizer`'s vocabulary padded to `size` ids, ending
/// generation at `eos`, and the tokenizer that encodes what it does not
/// hold as one token.
pub fn token_env(tokenizer: &tokenizers::Tokenizer, size: usize, eos: u32) -> Result<TokEnv> {
    let mut hf = tokenizer.clone();
    never_prepend_space(&mut hf)?;
    let spelling = spelling(&hf)?;
    let count = hf.get_vocab_size(true);
    if size < count {
        return Err(Error::Vocabulary(format!(
            "the model has {size} logits, fewer than the tokenizer's {count} tokens"
        )));
    }
    let mut info = TokRxInfo::new(size as u32, eos);
    let mut added: Vec<_> = hf.get_added_tokens_decoder().into_iter().collect();
    added.sort_by_key(|(id, _)| *id);
    let mut specials = HashSet::new();
    for (id, token) in &added {
        let content = token.content.as_str();
        if token.special || (content.starts_with('<') && content.ends_with('>')) {
            match content {
                "<|end|>" | "<|eot_id|>" | "<|im_end|>" => info.tok_end_of_turn = Some(*id),
                "<unk>" | "<|unk|>" => info.tok_unk = Some(*id),
                "<pad>" | "<|pad|>" => info.tok_pad = Some(*id),
                _ => {}
            }
            specials.insert(*id);
        }
    }
    let chars = byte_to_char();
    let mut words: Vec<Vec<u8>> = Vec::with_capacity(size);
    for id in 0..size as u32 {
        let word = match hf.id_to_token(id) {
            Some(name) if specials.contains(&id) => special(name.as_bytes()),
            // An entry that is not spelled in bytes: an added token stands
            // for its text, anything else for nothing (no text matches it).
            Some(name) => spelled(&name, &spelling, &chars).unwrap_or_else(|| {
                let content = added.iter().find(|(a, _)| *a == id);
                content.map_or_else(Vec::new, |(_, t)| t.content.clone().into_bytes())
            }),
            None if (id as usize) < count => Vec::new(),
            // Past the tokenizer's vocabulary: never produced by text.
            None => special(format!("<[{id}]>").as_bytes()),
        };
        words.push(word);
    }
    let trie = TokTrie::from(&info, &words);
    Ok(Arc::new(Env { trie, hf }))
}

/// `name` behind the special-token marker.
fn special(name: &[u8]) -> Vec<u8> {
    [&[TokTrie::SPECIAL_TOKEN_MARKER], name].concat()
}

/// The bytes a vocabulary entry stands for; `None` for a byte-level entry
/// with a character outside the byte table.
fn spelled(name: &str, spelling: &Spelling, chars: &[char; 256]) -> Option<Vec<u8>> {
    match spelling {
        Spelling::ByteLevel => name
            .chars()
            .map(|c| chars.iter().position(|&b| b == c).map(|b| b as u8))
            .collect(),
        Spelling::ByteFallback { space } => {
            let byte = name
                .strip_prefix("<0x")
                .and_then(|h| h.strip_suffix('>'))
                .filter(|h| h.len() == 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            Some(match byte {
                Some(b) => vec![b],
                None => name.replace(*space, " ").into_bytes(),
            })
        }
    }
}

/// Whether the decoder is byte-level or byte-fallback (and its space).
fn spelling(hf: &tokenizers::Tokenizer) -> Result<Spelling> {
    fn visit(d: &DecoderWrapper, level: &mut bool, fallback: &mut bool, space: &mut char) {
        match d {
            DecoderWrapper::ByteLevel(_) => *level = true,
            DecoderWrapper::ByteFallback(_) => *fallback = true,
            DecoderWrapper::Replace(r) if r.content == " " => {
                // The pattern has no accessor: read it from its serialisation.
                let pattern = serde_json::to_value(r).ok();
                let text = pattern
                    .as_ref()
                    .and_then(|v| v["pattern"]["String"].as_str());
                let mut it = text.unwrap_or("").chars();
                if let (Some(c), None) = (it.next(), it.next()) {
                    *space = c;
                }
            }
            DecoderWrapper::Sequence(seq) => {
                for d in seq.get_decoders() {
                    visit(d, level, fallback, space);
                }
            }
            _ => {}
        }
    }
    let (mut level, mut fallback, mut space) = (false, false, ' ');
    if let Some(d) = hf.get_decoder() {
        visit(d, &mut level, &mut fallback, &mut space);
    }
    match (level, fallback) {
        (_, true) => Ok(Spelling::ByteFallback { space }),
        (true, false) => Ok(Spelling::ByteLevel),
        _ => Err(Error::Vocabulary(format!(
            "cannot tell how the tokenizer spells bytes (decoder {:?})",
            hf.get_decoder()
        ))),
    }
}

/// Text a grammar fixes is tokenized as it stands: no normalizer or
/// pre-tokenizer may put a space before it.
fn never_prepend_space(hf: &mut tokenizers::Tokenizer) -> Result<()> {
    fn normalizer(n: NormalizerWrapper) -> Option<NormalizerWrapper> {
        match n {
            NormalizerWrapper::Prepend(_) => None,
            NormalizerWrapper::Sequence(seq) => {
                let kept: Vec<_> = seq
                    .as_ref()
                    .iter()
                    .filter_map(|n| normalizer(n.clone()))
                    .collect();
                (!kept.is_empty()).then(|| {
                    NormalizerWrapper::Sequence(tokenizers::normalizers::Sequence::new(kept))
                })
            }
            other => Some(other),
        }
    }
    fn pre(p: PreTokenizerWrapper) -> PreTokenizerWrapper {
        use tokenizers::pre_tokenizers::{metaspace::PrependScheme, sequence::Sequence};
        match p {
            PreTokenizerWrapper::Metaspace(mut m) => {
                m.prepend_scheme = PrependScheme::Never;
                PreTokenizerWrapper::Metaspace(m)
            }
            PreTokenizerWrapper::Sequence(seq) => PreTokenizerWrapper::Sequence(Sequence::new(
                seq.as_ref().iter().map(|p| pre(p.clone())).collect(),
            )),
            other => other,
        }
    }
    if let Some(n) = hf.get_normalizer().cloned() {
        hf.with_normalizer(normalizer(n))
            .map_err(|e| Error::Vocabulary(e.to_string()))?;
    }
    if let Some(p) = hf.get_pre_tokenizer().cloned() {
        hf.with_pre_tokenizer(Some(pre(p)));
    }
    Ok(())
}

/// The trie and the tokenizer behind it.
struct Env {
    trie: TokTrie,
    hf: tokenizers::Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The tokenizer's own encoding where it agrees with the trie, the
    /// trie's greedy longest match where it does not.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.hf
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}
