//! Where the base model computes: `"cpu"` or `"cuda[:N]"` (an NVIDIA GPU, in a
//! build with the `cuda` feature).

use candle_core::Device;

use super::error::{Error, Result};

/// The GPU ordinal `spec` names (`None` for the CPU), or why it names no device.
pub fn parse(spec: &str) -> std::result::Result<Option<usize>, String> {
    match spec {
        "cpu" => Ok(None),
        "cuda" => Ok(Some(0)),
        _ => match spec.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(Some(n)),
            _ => Err(format!(
                "{spec:?} is not a device (write \"cpu\", \"cuda\" or \"cuda:N\")"
            )),
        },
    }
}

/// The device named by `spec`: `cpu`, `cuda` (GPU 0) or `cuda:N`.
pub fn open(spec: &str) -> Result<Device> {
    let Some(ordinal) = parse(spec).map_err(Error::Device)? else {
        return Ok(Device::Cpu);
    };
    if !cfg!(feature = "cuda") {
        return Err(Error::Device(format!(
            "{spec:?}: this build has no CUDA support (build with `cargo build --release --features cuda`)"
        )));
    }
    Device::new_cuda(ordinal).map_err(|e| Error::Device(format!("{spec:?}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(open("cpu").unwrap().is_cpu());
        for bad in ["gpu", "cuda:", "cuda:x", "CPU"] {
            let err = open(bad).unwrap_err().to_string();
            assert!(err.contains("is not a device"), "{bad}: {err}");
        }
        if !cfg!(feature = "cuda") {
            let err = open("cuda:0").unwrap_err().to_string();
            assert!(err.contains("--features cuda"), "{err}");
        }
    }
}
