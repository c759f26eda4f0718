//! Configuration: a `key=value,key=value` string (the C API's `gpu_arena_configure`, the
//! `GPU_ARENA_CONF` environment variable) and backend selection.
//!
//! | key | value | default |
//! |---|---|---|
//! | `backend` | `auto`, `sim`, `cuda`, `hip` | `auto` (also `GPU_ARENA_BACKEND`) |
//! | `arena_size` | size, e.g. `1GiB`, `256MiB`, `4096` | `1GiB` |
//! | `max_reserved` | size cap per device, or `none` | `none` |
//! | `validate` | `0`/`1`: check every invariant after each operation | `1` in debug builds |
//! | `sim_devices` | number of simulated devices | `1` |
//! | `sim_capacity` | simulated memory per device | `16GiB` |
//! | `sim_granularity` | simulated granularity | `2MiB` |
//! | `legacy_pin` | `0`/`1`: sim exports pin for the process's life (ROCm 7.2) | `0` |
//! | `unsafe_ignore_streams` | `0`/`1`: demonstration only, disables the stream rules | `0` |
//! | `allowed_uids` | `:`-separated uids allowed to import, besides our own | (none) |
//!
//! `auto` picks cuda if libcuda loads and has a device, else hip if built in and a device
//! exists, else sim; the choice and the reasons are logged.

use std::sync::Arc;

use crate::backend::sim::{SimBackend, SimConfig};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::pool::{Pool, PoolConfig};

/// Which backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// cuda if present, else hip if built and present, else sim.
    #[default]
    Auto,
    /// The simulated device.
    Sim,
    /// CUDA (needs the `cuda` feature and a driver at run time).
    Cuda,
    /// HIP (needs the `hip` feature).
    Hip,
}

impl std::str::FromStr for BackendChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(BackendChoice::Auto),
            "sim" => Ok(BackendChoice::Sim),
            "cuda" => Ok(BackendChoice::Cuda),
            "hip" => Ok(BackendChoice::Hip),
            other => Err(Error::invalid(format!(
                "backend `{other}`: expected auto, sim, cuda or hip"
            ))),
        }
    }
}

/// Everything that can be configured.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Config {
    /// Backend selection.
    pub backend: BackendChoice,
    /// Pool settings.
    pub pool: PoolConfig,
    /// Settings of the sim backend (used when it is chosen).
    pub sim: SimConfig,
    /// Uids besides our own whose processes may import our shares.
    pub allowed_uids: Vec<u32>,
}

/// Parse a size: a number with an optional unit `B`, `K`/`KiB`/`KB`, `M`/`MiB`/`MB`,
/// `G`/`GiB`/`GB`, `T`/`TiB`/`TB` (all binary: 1K = 1024). Whitespace and `_` are ignored.
pub fn parse_size(text: &str) -> Result<u64> {
    let t: String = text
        .chars()
        .filter(|c| !c.is_whitespace() && *c != '_')
        .collect();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| {
        Error::invalid(format!(
            "size `{text}`: expected a number with a unit like 1GiB"
        ))
    })?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(Error::invalid(format!(
                "size `{text}`: unknown unit `{unit}`"
            )))
        }
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| Error::invalid(format!("size `{text}` overflows")))
}

fn parse_bool(key: &str, v: &str) -> Result<bool> {
    match v.trim() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Error::invalid(format!("{key}=`{v}`: expected 0 or 1"))),
    }
}

impl Config {
    /// Parse a configuration string over the defaults.
    pub fn parse(conf: &str) -> Result<Config> {
        let mut c = Config::default();
        c.apply(conf)?;
        Ok(c)
    }

    /// Apply `key=value,...` on top of this configuration. On error nothing changes.
    pub fn apply(&mut self, conf: &str) -> Result<()> {
        let mut next = self.clone();
        for item in conf.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| Error::invalid(format!("`{item}`: expected key=value")))?;
            let (key, value) = (key.trim(), value.trim());
            match key {
                "backend" => next.backend = value.parse()?,
                "arena_size" => {
                    let v = parse_size(value)?;
                    if v == 0 {
                        return Err(Error::invalid("arena_size must be > 0"));
                    }
                    next.pool.arena_size = v;
                }
                "max_reserved" => {
                    next.pool.max_reserved_bytes = match value {
                        "none" | "" => None,
                        v => Some(parse_size(v)?),
                    }
                }
                "validate" => next.pool.validate = parse_bool(key, value)?,
                "unsafe_ignore_streams" => {
                    next.pool.unsafe_ignore_streams = parse_bool(key, value)?;
                    if next.pool.unsafe_ignore_streams {
                        tracing::warn!("unsafe_ignore_streams=1: cross-stream reuse races are NOT prevented");
                    }
                }
                "sim_devices" => {
                    next.sim.devices = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=64).contains(n))
                        .ok_or_else(|| Error::invalid(format!("sim_devices=`{value}`: expected 1..64")))?
                }
                "sim_capacity" => next.sim.capacity = parse_size(value)?,
                "sim_granularity" => next.sim.granularity = parse_size(value)?,
                "legacy_pin" => next.sim.legacy_pin = parse_bool(key, value)?,
                "allowed_uids" => {
                    next.allowed_uids = value
                        .split(':')
                        .filter(|u| !u.is_empty())
                        .map(|u| {
                            u.parse::<u32>().map_err(|_| {
                                Error::invalid(format!("allowed_uids: `{u}` is not a uid"))
                            })
                        })
                        .collect::<Result<_>>()?
                }
                _ => {
                    return Err(Error::invalid(format!(
                        "unknown key `{key}` (known: backend, arena_size, max_reserved, validate, sim_devices, sim_capacity, sim_granularity, legacy_pin, allowed_uids, unsafe_ignore_streams)"
                    )))
                }
            }
        }
        *self = next;
        Ok(())
    }

    /// Defaults, then `GPU_ARENA_CONF`, then `GPU_ARENA_BACKEND`.
    pub fn from_env() -> Result<Config> {
        let mut c = Config::default();
        if let Ok(conf) = std::env::var("GPU_ARENA_CONF") {
            c.apply(&conf).map_err(|e| match e {
                Error::InvalidArgument(m) => Error::invalid(format!("GPU_ARENA_CONF: {m}")),
                e => e,
            })?;
        }
        if let Ok(b) = std::env::var("GPU_ARENA_BACKEND") {
            c.backend = b.parse().map_err(|e| match e {
                Error::InvalidArgument(m) => Error::invalid(format!("GPU_ARENA_BACKEND: {m}")),
                e => e,
            })?;
        }
        Ok(c)
    }

    /// Open the configured backend (resolving `auto`).
    pub fn open_backend(&self) -> Result<Arc<dyn Backend>> {
        match self.backend {
            BackendChoice::Sim => Ok(Arc::new(SimBackend::new(self.sim.clone())?)),
            BackendChoice::Cuda => open_cuda(),
            BackendChoice::Hip => open_hip(),
            BackendChoice::Auto => {
                let cuda = match open_cuda() {
                    Ok(b) => {
                        tracing::info!("gpu-arena: backend=auto chose cuda");
                        return Ok(b);
                    }
                    Err(e) => e,
                };
                tracing::info!(reason = %cuda, "gpu-arena: backend=auto: cuda unavailable");
                match open_hip() {
                    Ok(b) => {
                        tracing::info!("gpu-arena: backend=auto chose hip");
                        Ok(b)
                    }
                    Err(hip) => {
                        tracing::info!(reason = %hip, "gpu-arena: backend=auto: hip unavailable, using sim");
                        Ok(Arc::new(SimBackend::new(self.sim.clone())?))
                    }
                }
            }
        }
    }

    /// Open the backend and build a pool over it.
    pub fn build_pool(&self) -> Result<Pool> {
        Pool::new(self.open_backend()?, self.pool.clone())
    }
}

#[cfg(feature = "cuda")]
fn open_cuda() -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(crate::backend::cuda::CudaBackend::new()?))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda() -> Result<Arc<dyn Backend>> {
    Err(Error::Unavailable(
        "gpu-arena was built without the `cuda` feature".into(),
    ))
}

#[cfg(feature = "hip")]
fn open_hip() -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(crate::backend::hip::HipBackend::new()?))
}

#[cfg(not(feature = "hip"))]
fn open_hip() -> Result<Arc<dyn Backend>> {
    Err(Error::Unavailable(
        "gpu-arena was built without the `hip` feature".into(),
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        for (text, want) in [
            ("4096", 4096),
            ("1GiB", 1 << 30),
            ("256 MiB", 256 << 20),
            ("2M", 2 << 20),
            ("1_024k", 1 << 20),
            ("3tb", 3 << 40),
        ] {
            assert_eq!(parse_size(text).unwrap(), want, "{text}");
        }
        for bad in ["", "GiB", "1.5GiB", "12XB", "-1", "99999999999T"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn parse_and_reject() {
        let c = Config::parse("backend=sim, arena_size=256MiB,sim_devices=2,legacy_pin=1").unwrap();
        assert_eq!(c.backend, BackendChoice::Sim);
        assert_eq!(c.pool.arena_size, 256 << 20);
        assert_eq!(c.sim.devices, 2);
        assert!(c.sim.legacy_pin);
        let mut c2 = c.clone();
        for bad in [
            "backend=tpu",
            "arena_size=0",
            "nokey",
            "color=blue",
            "legacy_pin=maybe",
            "sim_devices=0",
        ] {
            let e = c2.apply(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad}: {e}");
            assert_eq!(c2, c, "a rejected configuration changes nothing");
        }
    }
}
