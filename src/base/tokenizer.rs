//! The tokenizer of a base model, with its chat template and stop tokens.
//!
//! GGUF files carry a byte-level BPE vocabulary (`tokenizer.ggml.tokens`,
//! `tokenizer.ggml.merges`) that we rebuild with the `tokenizers` crate; HF
//! directories carry a `tokenizer.json`. Either way the result is a [`Tokenizer`]
//! that knows its special tokens, the tokens that end a reply, and the model's
//! chat template.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::AddedToken;

use super::chat::{ChatTemplate, Message};
use super::error::{Error, Result};

/// Where byte-level BPE vocabularies (GPT-2, SmolLM, Qwen) end a pretraining
/// document. See [`Tokenizer::from_inner`].
const END_OF_TEXT: &str = "<|endoftext|>";

/// A tokenizer plus the ids that generation needs.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Tokens that end a reply; the first ends an assistant turn.
    pub stop_ids: Vec<u32>,
    pub chat: ChatTemplate,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("stop_ids", &self.stop_ids)
            .finish()
    }
}

/// The GPT-2 byte-to-unicode table that byte-level BPE vocabularies are written in.
pub fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            b as char
        } else {
            let c = char::from_u32(next).expect("256..512 are valid chars");
            next += 1;
            c
        };
    }
    table
}

impl Tokenizer {
    /// Build a byte-level BPE tokenizer (SmolLM2's pre-tokenizer: single digits,
    /// then GPT-2 byte-level splitting) from a vocabulary and merges.
    /// `special` lists the control tokens (matched whole, never split);
    /// `eos_ids` as in [`Tokenizer::from_inner`].
    pub fn from_bpe(
        tokens: &[String],
        merges: &[String],
        special: &[u32],
        chat: ChatTemplate,
        eos_ids: &[u32],
    ) -> Result<Tokenizer> {
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let merges = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| Error::Tokenizer(format!("merge {m:?} is not two tokens")))
            })
            .collect::<Result<Vec<_>>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre: Vec<PreTokenizerWrapper> = vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ];
        inner.with_pre_tokenizer(Some(Sequence::new(pre)));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let added: Vec<AddedToken> = special
            .iter()
            .filter_map(|&id| tokens.get(id as usize))
            .map(|t| AddedToken::from(t.clone(), true))
            .collect();
        inner
            .add_special_tokens(added)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(Self::from_inner(inner, chat, eos_ids))
    }

    /// Wrap a `tokenizer.json` tokenizer. `eos_ids` are the end-of-sequence
    /// ids the model's files declare, the one that ends an assistant turn
    /// first (a finished grammar emits it). They stop a reply, and so does
    /// `<|endoftext|>` where the vocabulary has it: a model that emits the end
    /// of a document is done (llama.cpp stops there too), and SmolLM2 declares
    /// only `<|im_end|>` but was always stopped at both.
    pub fn from_inner(
        inner: tokenizers::Tokenizer,
        chat: ChatTemplate,
        eos_ids: &[u32],
    ) -> Tokenizer {
        let mut stop_ids: Vec<u32> = Vec::new();
        for id in eos_ids
            .iter()
            .copied()
            .chain(inner.token_to_id(END_OF_TEXT))
        {
            if !stop_ids.contains(&id) {
                stop_ids.push(id);
            }
        }
        Tokenizer {
            inner,
            stop_ids,
            chat,
        }
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Encode text verbatim; special-token strings in it become their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decode ids to text, keeping special tokens visible.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// The text of a generated reply: its tokens without the stop token that
    /// ended it (the turn's end is not part of the reply).
    pub fn decode_reply(&self, tokens: &[u32]) -> Result<String> {
        let end = match tokens.last() {
            Some(t) if self.stop_ids.contains(t) => tokens.len() - 1,
            _ => tokens.len(),
        };
        self.decode(&tokens[..end])
    }

    /// Encode messages in the model's chat format, ready for the assistant.
    pub fn encode_chat(&self, messages: &[Message]) -> Result<Vec<u32>> {
        self.encode(&self.chat.render(messages)?)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_a_bijection_onto_printable_chars() {
        let table = byte_to_char();
        let mut seen: Vec<char> = table.to_vec();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 256);
        assert_eq!(table[b' ' as usize], 'Ġ');
        assert_eq!(table[b'a' as usize], 'a');
    }
}
