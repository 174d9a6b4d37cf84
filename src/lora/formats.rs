//! An adapter directory of either format, told apart by its files: ours
//! (`adapter.json` + `adapter.safetensors`, see [`Adapter::save`]) or a
//! Hugging Face PEFT LoRA (`adapter_config.json` +
//! `adapter_model.safetensors`, see [`super::read_peft`]). Commands that use
//! an adapter take either, so a PEFT adapter needs no import step first.

use std::path::{Path, PathBuf};

use candle_core::Device;

use super::error::{Error, Result};
use super::peft::{read_peft, PEFT_CONFIG};
use super::store::ADAPTER_META;
use super::{Adapter, BaseRef};
use crate::base::ModelConfig;

/// Which files an adapter directory holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterFormat {
    Populora,
    Peft,
}

impl AdapterFormat {
    /// Ours when `adapter.json` is there, else PEFT's when
    /// `adapter_config.json` is.
    pub fn of(dir: &Path) -> Result<AdapterFormat> {
        if dir.join(ADAPTER_META).is_file() {
            Ok(AdapterFormat::Populora)
        } else if dir.join(PEFT_CONFIG).is_file() {
            Ok(AdapterFormat::Peft)
        } else {
            Err(Error::NotAnAdapter {
                path: PathBuf::from(dir),
            })
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            AdapterFormat::Populora => "populora",
            AdapterFormat::Peft => "peft",
        }
    }
}

/// An adapter read from a directory of either format.
#[derive(Debug, Clone)]
pub struct AdapterDir {
    pub adapter: Adapter,
    /// The base as the files name it (a PEFT file records no shape).
    pub base: BaseRef,
    pub format: AdapterFormat,
}

impl AdapterDir {
    /// Read `dir` with every check its format's reader makes (our checksum;
    /// PEFT's config fields, keys and shapes), but none against a base.
    pub fn read(dir: &Path, device: &Device) -> Result<AdapterDir> {
        let format = AdapterFormat::of(dir)?;
        let (adapter, base) = match format {
            AdapterFormat::Populora => Adapter::load(dir, device)?,
            AdapterFormat::Peft => {
                let peft = read_peft(dir, device)?;
                (peft.adapter, BaseRef::named(&peft.base_model))
            }
        };
        Ok(AdapterDir {
            adapter,
            base,
            format,
        })
    }

    /// [`AdapterDir::read`] for the base `cfg`: the base the files name must
    /// be `cfg` ([`BaseRef::check`]) and every shape must fit it.
    pub fn load_for(dir: &Path, cfg: &ModelConfig, device: &Device) -> Result<AdapterDir> {
        let read = AdapterDir::read(dir, device)?;
        read.base.check(cfg)?;
        read.adapter.check_against(cfg)?;
        Ok(read)
    }
}
