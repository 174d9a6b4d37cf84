//! The tokenizer and chat format of a base model.
//!
//! GGUF files carry a byte-level BPE vocabulary (`tokenizer.ggml.tokens`,
//! `tokenizer.ggml.merges`) that we rebuild with the `tokenizers` crate; HF
//! directories carry a `tokenizer.json`. Either way the result is a [`Tokenizer`]
//! that knows its special tokens and the ChatML turn format.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::AddedToken;

use super::error::{Error, Result};

/// ChatML markers (SmolLM2, Qwen2).
pub const IM_START: &str = "<|im_start|>";
pub const IM_END: &str = "<|im_end|>";

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: impl Into<String>) -> Message {
        Message {
            role: role.to_string(),
            content: content.into(),
        }
    }
}

/// The model's chat format: ChatML, with the default system prompt the
/// model's template inserts when a conversation does not start with one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTemplate {
    pub default_system: Option<String>,
}

impl ChatTemplate {
    /// Read the default system prompt out of a Jinja ChatML template, e.g.
    /// SmolLM2's `'<|im_start|>system\nYou are a helpful ...<|im_end|>\n'`.
    pub fn from_jinja(template: &str) -> ChatTemplate {
        // The newline after "system" is a real newline in some files and a
        // Jinja escape (`\n`) in others.
        let found = ["<|im_start|>system\n", "<|im_start|>system\\n"]
            .iter()
            .find_map(|m| template.find(m).map(|start| start + m.len()));
        let default_system = found.and_then(|start| {
            let rest = &template[start..];
            let end = rest.find(IM_END)?;
            let text = &rest[..end];
            // A literal in the template, not an expression such as `message['content']`.
            (!text.contains('\'') && !text.contains('{')).then(|| text.to_string())
        });
        ChatTemplate { default_system }
    }

    /// Render messages followed by the start of an assistant turn.
    pub fn render(&self, messages: &[Message]) -> String {
        let mut out = String::new();
        let has_system = messages.first().is_some_and(|m| m.role == "system");
        if let (false, Some(system)) = (has_system, &self.default_system) {
            push_turn(&mut out, "system", system);
        }
        for m in messages {
            push_turn(&mut out, &m.role, &m.content);
        }
        out.push_str(IM_START);
        out.push_str("assistant\n");
        out
    }
}

fn push_turn(out: &mut String, role: &str, content: &str) {
    out.push_str(IM_START);
    out.push_str(role);
    out.push('\n');
    out.push_str(content);
    out.push_str(IM_END);
    out.push('\n');
}

/// A tokenizer plus the ids that generation needs.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Tokens that end an assistant turn (`<|im_end|>`, eos).
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
    /// `special` lists the control tokens (matched whole, never split).
    pub fn from_bpe(
        tokens: &[String],
        merges: &[String],
        special: &[u32],
        chat: ChatTemplate,
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
        inner.add_special_tokens(&added);
        Ok(Self::from_inner(inner, chat))
    }

    /// Wrap a `tokenizer.json` tokenizer.
    pub fn from_inner(inner: tokenizers::Tokenizer, chat: ChatTemplate) -> Tokenizer {
        let stop_ids = [IM_END, "<|endoftext|>", "</s>"]
            .iter()
            .filter_map(|t| inner.token_to_id(t))
            .collect();
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

    /// Encode a user turn in the model's chat format, ready for the assistant.
    pub fn encode_chat(&self, messages: &[Message]) -> Result<Vec<u32>> {
        self.encode(&self.chat.render(messages))
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

    #[test]
    fn default_system_prompt_is_read_from_the_template() {
        let t = ChatTemplate::from_jinja(
            "{% if loop.first %}{{ '<|im_start|>system\\nYou are SmolLM<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}",
        );
        assert_eq!(t.default_system.as_deref(), Some("You are SmolLM"));
        let text = t.render(&[Message::new("user", "hi")]);
        assert_eq!(
            text,
            "<|im_start|>system\nYou are SmolLM<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        let with_system = t.render(&[Message::new("system", "S"), Message::new("user", "hi")]);
        assert!(with_system.starts_with("<|im_start|>system\nS<|im_end|>"));
    }
}
