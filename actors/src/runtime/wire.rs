//! What crosses the wire between the coordinator and a worker node.
//!
//! Every request and reply is bincode 2 (serde) behind a SHA-256 of its bytes;
//! [`decode`] refuses bytes whose checksum does not match. Engine types carry
//! things that are not data (a grammar is a compiled automaton, a random
//! stream a generator), so they travel as the plain records below: a grammar
//! as its index among the run's compiled grammars (both sides compiled the
//! same scenario), a ChaCha stream as its seed, stream and word position, a
//! token mask as its bit words. A learner travels as the files `save` writes
//! (adapter safetensors + JSON, optimizer state), each file checked again by
//! `load`'s own checksums.

use std::collections::BTreeMap;
use std::path::Path;

use populora::compute::{GenRequest, Generation, Pick, Sampling, StopReason, TrainRow};
use populora::grammar::TokenMask;
use populora::lora::BaseRef;
use populora::selfplay::{Grammars, Learner, MemberId, Trained};
use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha12Rng;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::broker::Usage;
use super::member;

/// Bytes of the SHA-256 in front of every payload.
const DIGEST: usize = 32;

/// `value` as checksummed bytes.
pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    let body = bincode::serde::encode_to_vec(value, bincode::config::standard())
        .expect("wire records always encode");
    let mut out = Sha256::digest(&body).to_vec();
    out.extend_from_slice(&body);
    out
}

/// The value [`encode`] wrote, or why the bytes are not one.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> anyhow::Result<T> {
    anyhow::ensure!(
        bytes.len() >= DIGEST,
        "a wire message of {} bytes is too short to hold its checksum",
        bytes.len()
    );
    let (digest, body) = bytes.split_at(DIGEST);
    anyhow::ensure!(
        Sha256::digest(body).as_slice() == digest,
        "a wire message of {} bytes failed its SHA-256 check (corrupted in transit)",
        bytes.len()
    );
    let (value, used) = bincode::serde::decode_from_slice(body, bincode::config::standard())
        .map_err(|e| anyhow::anyhow!("a wire message does not decode: {e}"))?;
    anyhow::ensure!(used == body.len(), "a wire message has trailing bytes");
    Ok(value)
}

/// What the coordinator asks of a node.
#[derive(Serialize, Deserialize)]
pub enum Request {
    /// Become this run's node: check the version and the base model, compile
    /// the scenario's grammars, drop any members of an earlier run.
    Hello {
        version: String,
        /// [`super::engine::fingerprint`] of the coordinator's base.
        fingerprint: String,
        /// The resolved scenario (`Scenario::to_toml`).
        scenario: String,
        /// The coordinator's name in the cluster: a node serves one at a time.
        coordinator: String,
    },
    /// Start a member here from its learner.
    Place {
        member: MemberId,
        name: String,
        learner: PackedLearner,
    },
    Remove {
        member: MemberId,
    },
    Generate {
        requests: Vec<WireGenRequest>,
    },
    /// A train step on these rows, then each member's update.
    Train {
        step: u64,
        rows: Vec<WireTrainRow>,
    },
    /// Keep every member's state as it is now (a step's starting point) ...
    Keep,
    /// ... and go back to it (the step is retried).
    Restore,
    /// A copy of a member's adapter and optimizer.
    Learner {
        member: MemberId,
    },
    /// Compute since the last `Usage`.
    Usage,
}

/// A node's answer.
#[derive(Serialize, Deserialize)]
pub enum Reply {
    Hello { node: String },
    Done,
    Generations(Vec<WireGeneration>),
    Trained(BTreeMap<MemberId, Trained>),
    Learner(PackedLearner),
    Usage(Usage),
}

/// Why a node could not answer; `member` names a member that died.
#[derive(Debug, Serialize, Deserialize)]
pub struct Failure {
    pub message: String,
    pub member: Option<String>,
}

pub type Answer = Result<Reply, Failure>;

/// A learner as the files of its saved directory, by relative path.
#[derive(Serialize, Deserialize)]
pub struct PackedLearner {
    pub files: BTreeMap<String, Vec<u8>>,
}

impl PackedLearner {
    pub fn pack(learner: &Learner, base: &BaseRef) -> anyhow::Result<PackedLearner> {
        let dir = Scratch::new()?;
        member::save(learner, &dir.0, base)?;
        let mut files = BTreeMap::new();
        read_tree(&dir.0, &dir.0, &mut files)?;
        Ok(PackedLearner { files })
    }

    pub fn unpack(&self) -> anyhow::Result<Learner> {
        let dir = Scratch::new()?;
        for (name, bytes) in &self.files {
            let rel = Path::new(name);
            anyhow::ensure!(
                rel.components()
                    .all(|c| matches!(c, std::path::Component::Normal(_))),
                "a packed learner names a file outside its directory: {name:?}"
            );
            let path = dir.0.join(rel);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(path, bytes)?;
        }
        member::load(&dir.0)
    }
}

fn read_tree(root: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            read_tree(root, &path, out)?;
        } else {
            let rel = path.strip_prefix(root)?.to_string_lossy().into_owned();
            out.insert(rel, std::fs::read(&path)?);
        }
    }
    Ok(())
}

/// A directory of its own under the system's temp dir, removed on drop.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> anyhow::Result<Scratch> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("populora-wire-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A [`GenRequest`] as data.
#[derive(Serialize, Deserialize)]
pub struct WireGenRequest {
    adapter: Option<MemberId>,
    prompt: Vec<u32>,
    max_new_tokens: usize,
    stop: Vec<u32>,
    temperature: f32,
    top_p: f32,
    rng: WireRng,
    grammar: Option<usize>,
}

#[derive(Serialize, Deserialize)]
struct WireRng {
    seed: [u8; 32],
    stream: u64,
    word_pos: u128,
}

impl WireRng {
    fn of(rng: &ChaCha12Rng) -> WireRng {
        WireRng {
            seed: rng.get_seed(),
            stream: rng.get_stream(),
            word_pos: rng.get_word_pos(),
        }
    }

    fn rng(&self) -> ChaCha12Rng {
        let mut rng = ChaCha12Rng::from_seed(self.seed);
        rng.set_stream(self.stream);
        rng.set_word_pos(self.word_pos);
        rng
    }
}

impl WireGenRequest {
    pub fn of(r: GenRequest, grammars: &Grammars) -> anyhow::Result<WireGenRequest> {
        let grammar = match &r.grammar {
            None => None,
            Some(g) => Some(grammars.index_of(g).ok_or_else(|| {
                anyhow::anyhow!("a request's grammar is not one of the run's grammars")
            })?),
        };
        Ok(WireGenRequest {
            adapter: r.adapter,
            prompt: r.prompt,
            max_new_tokens: r.max_new_tokens,
            stop: r.stop,
            temperature: r.sampling.temperature,
            top_p: r.sampling.top_p,
            rng: WireRng::of(&r.rng),
            grammar,
        })
    }

    pub fn request(self, grammars: &Grammars) -> anyhow::Result<GenRequest> {
        let grammar = match self.grammar {
            None => None,
            Some(i) => Some(grammars.by_index(i).ok_or_else(|| {
                anyhow::anyhow!("grammar {i} is not one of this node's grammars")
            })?),
        };
        Ok(GenRequest {
            adapter: self.adapter,
            prompt: self.prompt,
            max_new_tokens: self.max_new_tokens,
            stop: self.stop,
            sampling: Sampling {
                temperature: self.temperature,
                top_p: self.top_p,
            },
            rng: self.rng.rng(),
            grammar,
        })
    }
}

/// A [`TokenMask`] as its bit words.
#[derive(Serialize, Deserialize)]
struct WireMask {
    words: Vec<u32>,
    size: usize,
}

impl WireMask {
    fn of(mask: &TokenMask) -> WireMask {
        WireMask {
            words: mask.words().to_vec(),
            size: mask.size(),
        }
    }

    fn mask(&self) -> TokenMask {
        TokenMask::new(&self.words, self.size)
    }
}

#[derive(Serialize, Deserialize)]
enum WirePick {
    Free,
    Masked(WireMask),
    Forced,
}

/// A [`Generation`] as data.
#[derive(Serialize, Deserialize)]
pub struct WireGeneration {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    picks: Vec<WirePick>,
    top: Vec<Vec<(u32, f32)>>,
    stop: StopReason,
}

impl From<Generation> for WireGeneration {
    fn from(g: Generation) -> WireGeneration {
        let picks = g
            .picks
            .iter()
            .map(|p| match p {
                Pick::Free => WirePick::Free,
                Pick::Masked(m) => WirePick::Masked(WireMask::of(m)),
                Pick::Forced => WirePick::Forced,
            })
            .collect();
        WireGeneration {
            tokens: g.tokens,
            logprobs: g.logprobs,
            picks,
            top: g.top,
            stop: g.stop,
        }
    }
}

impl From<WireGeneration> for Generation {
    fn from(g: WireGeneration) -> Generation {
        let picks = g
            .picks
            .into_iter()
            .map(|p| match p {
                WirePick::Free => Pick::Free,
                WirePick::Masked(m) => Pick::Masked(m.mask()),
                WirePick::Forced => Pick::Forced,
            })
            .collect();
        Generation {
            tokens: g.tokens,
            logprobs: g.logprobs,
            picks,
            top: g.top,
            stop: g.stop,
        }
    }
}

/// A [`TrainRow`] as data.
#[derive(Serialize, Deserialize)]
pub struct WireTrainRow {
    adapter: MemberId,
    tokens: Vec<u32>,
    prompt_len: usize,
    loss_mask: Vec<bool>,
    advantages: Vec<f32>,
    old_logprobs: Vec<f32>,
    allowed: Vec<Option<WireMask>>,
    temperature: f32,
}

impl From<TrainRow> for WireTrainRow {
    fn from(r: TrainRow) -> WireTrainRow {
        WireTrainRow {
            adapter: r.adapter,
            tokens: r.tokens,
            prompt_len: r.prompt_len,
            loss_mask: r.loss_mask,
            advantages: r.advantages,
            old_logprobs: r.old_logprobs,
            allowed: r
                .allowed
                .iter()
                .map(|m| m.as_ref().map(WireMask::of))
                .collect(),
            temperature: r.temperature,
        }
    }
}

impl From<WireTrainRow> for TrainRow {
    fn from(r: WireTrainRow) -> TrainRow {
        TrainRow {
            adapter: r.adapter,
            tokens: r.tokens,
            prompt_len: r.prompt_len,
            loss_mask: r.loss_mask,
            advantages: r.advantages,
            old_logprobs: r.old_logprobs,
            allowed: r
                .allowed
                .iter()
                .map(|m| m.as_ref().map(WireMask::mask))
                .collect(),
            temperature: r.temperature,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::rand_core::RngCore;

    #[test]
    fn a_corrupted_message_is_refused_and_a_good_one_round_trips() {
        let rows = vec![WireTrainRow::from(TrainRow {
            adapter: 3,
            tokens: vec![1, 2, 3],
            prompt_len: 1,
            loss_mask: vec![false, true, true],
            advantages: vec![0.0, 0.5, -0.25],
            old_logprobs: vec![0.0, -1.5, -0.1],
            allowed: vec![None, Some(TokenMask::from_tokens(&[2, 40], 70)), None],
            temperature: 0.7,
        })];
        let bytes = encode(&Request::Train { step: 9, rows });
        let Request::Train { step, rows } = decode(&bytes).unwrap() else {
            panic!("not a train request");
        };
        let row = TrainRow::from(rows.into_iter().next().unwrap());
        assert_eq!((step, row.adapter, row.temperature), (9, 3, 0.7));
        let mask = row.allowed[1].as_ref().unwrap();
        assert!(mask.allows(40) && !mask.allows(41) && mask.size() == 70);
        let mut flipped = bytes.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        let err = decode::<Request>(&flipped).err().unwrap().to_string();
        assert!(err.contains("SHA-256"), "{err}");
        assert!(decode::<Request>(&bytes[..10]).is_err());
    }

    #[test]
    fn a_random_stream_continues_where_it_was_sent() {
        let mut rng = ChaCha12Rng::seed_from_u64(5);
        rng.set_stream(7);
        rng.next_u64();
        let mut sent = WireRng::of(&rng).rng();
        assert_eq!(rng.next_u64(), sent.next_u64());
    }
}
