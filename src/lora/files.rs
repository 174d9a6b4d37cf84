//! File plumbing shared by our adapter format, PEFT and the optimizer state:
//! safetensors encoding, JSON reading, and atomic writes.
//!
//! A write never leaves a half-written file under its final name: every file
//! of a set is first written in full (and synced) under a temporary name in
//! the same directory, and only then renamed into place. Until the renames,
//! the previous files stay untouched.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use safetensors::tensor::{Dtype, TensorView};
use serde::de::DeserializeOwned;

use super::error::{Error, Result};

pub(crate) fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub(crate) fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(io_error(path))
}

pub(crate) fn read_json<T: DeserializeOwned>(path: &Path) -> Result<T> {
    let bytes = read_bytes(path)?;
    serde_json::from_slice(&bytes).map_err(|source| Error::Json {
        path: path.to_path_buf(),
        source,
    })
}

pub(crate) fn to_json_bytes(value: &impl serde::Serialize) -> Result<Vec<u8>> {
    let mut bytes = serde_json::to_vec_pretty(value).map_err(|source| Error::Json {
        path: PathBuf::from("<in memory>"),
        source,
    })?;
    bytes.push(b'\n');
    Ok(bytes)
}

/// The little-endian bytes of an F32 tensor, in row-major order.
pub(crate) fn f32_bytes(tensor: &Tensor) -> Result<Vec<u8>> {
    let values = tensor.flatten_all()?.to_vec1::<f32>()?;
    Ok(values.iter().flat_map(|x| x.to_le_bytes()).collect())
}

/// A safetensors file of F32 tensors, keys in sorted order.
pub(crate) fn encode_safetensors(
    tensors: &BTreeMap<String, Tensor>,
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let mut encoded = Vec::with_capacity(tensors.len());
    for (key, tensor) in tensors {
        encoded.push((key.as_str(), tensor.dims().to_vec(), f32_bytes(tensor)?));
    }
    let views = encoded
        .iter()
        .map(|(key, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes).map(|view| (*key, view))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Safetensors {
            path: PathBuf::from("<in memory>"),
            message: e.to_string(),
        })?;
    safetensors::serialize(views, metadata).map_err(|e| Error::Safetensors {
        path: PathBuf::from("<in memory>"),
        message: e.to_string(),
    })
}

/// Every tensor of the safetensors file at `path`, converted to F32.
/// F16 and BF16 are accepted (PEFT adapters are often saved in half precision).
pub(crate) fn read_safetensors(path: &Path, device: &Device) -> Result<BTreeMap<String, Tensor>> {
    let bytes = read_bytes(path)?;
    let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| Error::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let mut tensors = BTreeMap::new();
    for (key, view) in file.tensors() {
        let dtype = match view.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            other => {
                return Err(Error::UnsupportedDtype {
                    path: path.to_path_buf(),
                    key,
                    dtype: format!("{other:?}"),
                })
            }
        };
        let tensor = Tensor::from_raw_buffer(view.data(), dtype, view.shape(), device)?
            .to_dtype(DType::F32)?;
        tensors.insert(key, tensor);
    }
    Ok(tensors)
}

/// Writes every `(file name, contents)` into `dir` (created if absent) so that
/// each file appears whole or not at all; on error no final name is touched
/// unless every temporary file was written.
pub(crate) fn write_atomically(dir: &Path, files: &[(&str, Vec<u8>)]) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io_error(dir))?;
    let temps: Vec<PathBuf> = files
        .iter()
        .map(|(name, _)| dir.join(format!(".{name}.tmp.{}", std::process::id())))
        .collect();
    let written = files
        .iter()
        .zip(&temps)
        .try_for_each(|((_, contents), temp)| write_synced(temp, contents));
    if let Err(err) = written {
        for temp in &temps {
            // Best effort: the write already failed and that error is the one to report.
            let _ = std::fs::remove_file(temp);
        }
        return Err(err);
    }
    for ((name, _), temp) in files.iter().zip(&temps) {
        let target = dir.join(name);
        std::fs::rename(temp, &target).map_err(io_error(&target))?;
    }
    sync_dir(dir);
    Ok(())
}

fn write_synced(path: &Path, contents: &[u8]) -> Result<()> {
    let mut file = std::fs::File::create(path).map_err(io_error(path))?;
    file.write_all(contents).map_err(io_error(path))?;
    file.sync_all().map_err(io_error(path))
}

/// Makes the renames durable where the platform allows syncing a directory.
fn sync_dir(dir: &Path) {
    if let Ok(handle) = std::fs::File::open(dir) {
        // Some file systems refuse fsync on a directory; the renames are done either way.
        let _ = handle.sync_all();
    }
}
