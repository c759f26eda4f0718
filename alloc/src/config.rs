//! Configuration: a `key=value,key=value` string (the C API's `gpu_arena_configure`, the
//! `GPU_ARENA_CONF` environment variable) and backend selection.
//!
//! The keys, their values, defaults and meaning: [`KEY_TABLE`], the one table
//! (docs/configuration.md's Keys table is generated from it).
//!
//! Sizes: bytes (`4096`), or a number (fractions too: `1.5GiB`) with a unit: `KiB`, `MiB`,
//! `GiB`, `TiB` and `K`, `M`, `G`, `T` alone are binary (2^10...), `KB`, `MB`, `GB`, `TB`
//! decimal (10^3...); see [`crate::units`]. In `max_reserved`, a plain number up to 1 is a
//! fraction, a larger whole number a byte count. A fraction is resolved against each
//! device's total memory (`mem_info`) on the device's first allocation that grows the pool.
//!
//! `auto` picks cuda if libcuda loads and has a device, else hip if built in and a device
//! exists, else sim; the choice and the reasons are logged (`info`).

use std::sync::Arc;

use crate::backend::sim::{SimBackend, SimConfig};
use crate::backend::vmm::FabricHandles;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::pool::{MaxReserved, Pool, PoolConfig};
use crate::units::{parse_fraction, SIZE_FORMS};

/// One configuration key: a row of [`KEY_TABLE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfigKey {
    /// The key, as `key=value` names it.
    pub name: &'static str,
    /// The values it takes (Markdown).
    pub values: &'static str,
    /// Its default (Markdown; a value in backticks is one `key=value` accepts).
    pub default: &'static str,
    /// What it does (Markdown).
    pub help: &'static str,
}

/// Every configuration key, as [`Config::apply`] accepts them: the one table, from which
/// [`KEYS`] and docs/configuration.md's Keys table are generated
/// (`alloc/tests/generated_docs.rs` checks the doc; this module's tests check the table
/// against `apply` and each default against [`Config::default`]).
pub const KEY_TABLE: [ConfigKey; 14] = [
    ConfigKey {
        name: "backend",
        values: "`auto`, `sim`, `cuda`, `hip`",
        default: "`auto`",
        help: "the driver: `auto` picks cuda if libcuda loads and has a device, else hip if built in and a device exists, else sim (`GPU_ARENA_LOG=info` says why). `GPU_ARENA_BACKEND` sets it too",
    },
    ConfigKey {
        name: "arena_size",
        values: "a size, at least `2MiB`",
        default: "`1GiB`",
        help: "regular arena size with fixed arenas (`grow_arenas=0`); smaller is refused: every request above `arena_size` gets an arena of its own; rounded up to the device's granularity. With growing arenas (the default) it only caps the arenas of CUDA-graph pools. Larger than the device: allocations fail with an error naming `arena_size`",
    },
    ConfigKey {
        name: "max_reserved",
        values: "a size (`40GiB`), a fraction of the device (`0.9`, `90%`; above 0, at most 1), or `none`",
        default: "`none`",
        help: "cap on the bytes gpu-arena reserves per device. A fraction is of each device's total memory as its driver reports it (PyTorch's `set_per_process_memory_fraction`), resolved per device when gpu-arena first grows on it. A plain number up to 1 is a fraction, a larger whole number bytes",
    },
    ConfigKey {
        name: "validate",
        values: "`0`/`1`",
        default: "`1` in debug builds, `0` in release builds",
        help: "check every invariant after each operation",
    },
    ConfigKey {
        name: "sim_devices",
        values: "1 to 64",
        default: "`1`",
        help: "the sim backend's number of devices",
    },
    ConfigKey {
        name: "sim_capacity",
        values: "a size (a multiple of the granularity)",
        default: "`16GiB`",
        help: "the memory of each sim device",
    },
    ConfigKey {
        name: "sim_granularity",
        values: "a size (a power of two, at least 4 KiB)",
        default: "`2MiB`",
        help: "the sim devices' allocation granularity",
    },
    ConfigKey {
        name: "legacy_pin",
        values: "`0`/`1`",
        default: "`0`",
        help: "sim exports pin their memory for the process's life, as ROCm 7.2's legacy IPC does (the start-up self-test detects it; pinned arenas are recycled)",
    },
    ConfigKey {
        name: "legacy_ipc",
        values: "`0`/`1`",
        default: "`0`",
        help: "cuda, hip: arenas from `cuMemAlloc`/`hipMalloc`, shared with `cuIpc`/`hipIpc` handles: what UCX's cuda_ipc opens on hosts without fabric handles; sleep/wake unavailable",
    },
    ConfigKey {
        name: "fabric_handles",
        values: "`auto`/`0`/`1`",
        default: "`auto`",
        help: "cuda: VMM arenas also exportable as FABRIC handles (what UCX's cuda_ipc opens) where the device supports them; `auto` stays on POSIX fds for good on a device whose driver refuses them (no IMEX channel), `1` fails instead",
    },
    ConfigKey {
        name: "allowed_uids",
        values: "`:`-separated uids",
        default: "none",
        help: "uids whose processes may import our shares, besides our own",
    },
    ConfigKey {
        name: "unsafe_ignore_streams",
        values: "`0`/`1`",
        default: "`0`",
        help: "demonstration only: disables the stream rules (cross-stream reuse races are not prevented)",
    },
    ConfigKey {
        name: "trim_on_empty_cache",
        values: "`0`/`1`",
        default: "`0`",
        help: "every `empty_cache` is a trim (`pool/growth/trim.rs`: arenas with survivors cut down to their 2 MiB pages); only where `empty_cache` runs at idle points (no other thread using gpu-arena memory on the device meanwhile)",
    },
    ConfigKey {
        name: "grow_arenas",
        values: "`0`/`1`",
        default: "`1`",
        help: "large blocks (above 1 MiB) live in arenas that grow with the work (`pool/growth/grow.rs`): each reserves the device's address range and maps memory chunk by chunk as it fills (exactly the shortfall for requests of 8 MiB and more; for smaller ones up to 8 MiB more while it holds under 64 MiB, then at least a quarter of the arena), so reserved follows live; only blocks up to 2 MiB are cached (larger ones too while a thread finds the device lock contended); `empty_cache` gives back every chunk no live block touches (past the last one and between them, nothing moved) and `trim` splits grown arenas down to their survivors' pages; a shared arena stops growing (its export is one fd per chunk), as does one while an arena observer is registered. `0`: fixed arenas of `arena_size`, mapped whole: the fastest per operation, reserving whole arenas (a class's last one partly empty, a small program 1 GiB for its large blocks)",
    },
];

/// Every configuration key's name, in [`KEY_TABLE`]'s order.
pub const KEYS: &[&str] = &key_names();

const fn key_names() -> [&'static str; KEY_TABLE.len()] {
    let mut names = [""; KEY_TABLE.len()];
    let mut i = 0;
    while i < names.len() {
        names[i] = KEY_TABLE[i].name;
        i += 1;
    }
    names
}

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
    /// cuda/hip: legacy IPC arenas (`cuMemAlloc`/`hipMalloc`, `cuIpc`/`hipIpc` handles).
    pub legacy_ipc: bool,
    /// cuda: FABRIC handles on VMM arenas.
    pub fabric_handles: FabricHandles,
}

/// `key=value` as a size, or an error naming the key, the value and the accepted forms.
fn size_of(key: &str, value: &str) -> Result<u64> {
    crate::units::parse_size(value)
        .map_err(|why| Error::invalid(format!("{key}=`{value}`: {why}; expected {SIZE_FORMS}")))
}

/// A size as configuration values are written (`4096`, `1.5GiB`, `40GB`; the grammar is in
/// [`crate::units`]), or `InvalidArgument` saying what is wrong with it.
pub fn parse_size(text: &str) -> Result<u64> {
    crate::units::parse_size(text).map_err(Error::invalid)
}

/// `max_reserved`'s value: `none`, a fraction (`0.9`, `1`, `90%`) or a size.
fn max_reserved_of(value: &str) -> Result<Option<MaxReserved>> {
    let forms =
        "expected none, a fraction of the device above 0 and at most 1 (0.9, 90%), or a size";
    if value.is_empty() || value.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    let refuse = |why: String| {
        Error::invalid(format!(
            "max_reserved=`{value}`: {why}; {forms} ({SIZE_FORMS})"
        ))
    };
    match parse_fraction(value) {
        Ok(Some(f)) => return Ok(Some(MaxReserved::Fraction(f))),
        Err(why) => return Err(refuse(why)),
        Ok(None) => {}
    }
    if value
        .trim()
        .bytes()
        .all(|b| b.is_ascii_digit() || b == b'.')
        && value.contains('.')
    {
        return Err(refuse(format!(
            "`{value}` is neither a fraction (at most 1) nor a size with a unit"
        )));
    }
    match crate::units::parse_size(value) {
        Ok(0) => Err(refuse("the cap must be above 0".into())),
        Ok(b) => Ok(Some(MaxReserved::Bytes(b))),
        Err(why) => Err(refuse(why)),
    }
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
                    next.pool.arena_size = size_of(key, value)?;
                    next.pool.check().map_err(|e| match e {
                        Error::InvalidArgument(why) => {
                            Error::invalid(format!("arena_size=`{value}`: {why}"))
                        }
                        e => e,
                    })?;
                }
                "max_reserved" => next.pool.max_reserved = max_reserved_of(value)?,
                "validate" => next.pool.validate = parse_bool(key, value)?,
                "trim_on_empty_cache" => next.pool.trim_on_empty_cache = parse_bool(key, value)?,
                "grow_arenas" => next.pool.grow_arenas = parse_bool(key, value)?,
                "unsafe_ignore_streams" => {
                    next.pool.unsafe_ignore_streams = parse_bool(key, value)?;
                    if next.pool.unsafe_ignore_streams {
                        tracing::warn!(
                            "unsafe_ignore_streams=1: cross-stream reuse races are NOT prevented"
                        );
                    }
                }
                "sim_devices" => {
                    next.sim.devices = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=64).contains(n))
                        .ok_or_else(|| {
                            Error::invalid(format!("sim_devices=`{value}`: expected 1..64"))
                        })?
                }
                "sim_capacity" => next.sim.capacity = size_of(key, value)?,
                "sim_granularity" => next.sim.granularity = size_of(key, value)?,
                "legacy_pin" => next.sim.legacy_pin = parse_bool(key, value)?,
                "legacy_ipc" => next.legacy_ipc = parse_bool(key, value)?,
                "fabric_handles" => next.fabric_handles = value.parse()?,
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
                        "unknown key `{key}` (known: {})",
                        KEYS.join(", ")
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
            BackendChoice::Cuda => open_cuda(self),
            BackendChoice::Hip => open_hip(self),
            BackendChoice::Auto => {
                let cuda = match open_cuda(self) {
                    Ok(b) => {
                        tracing::info!("gpu-arena: backend=auto chose cuda");
                        return Ok(b);
                    }
                    Err(e) => e,
                };
                tracing::info!(reason = %cuda, "gpu-arena: backend=auto passed over cuda");
                match open_hip(self) {
                    Ok(b) => {
                        tracing::info!("gpu-arena: backend=auto chose hip");
                        Ok(b)
                    }
                    Err(hip) => {
                        tracing::info!(reason = %hip, "gpu-arena: backend=auto passed over hip; using sim");
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
fn open_cuda(c: &Config) -> Result<Arc<dyn Backend>> {
    let backend = crate::backend::cuda::CudaBackend::new()?
        .with_legacy_ipc(c.legacy_ipc)
        .with_fabric_handles(c.fabric_handles);
    Ok(Arc::new(backend))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_: &Config) -> Result<Arc<dyn Backend>> {
    Err(Error::Unavailable(
        "gpu-arena was built without the `cuda` feature".into(),
    ))
}

#[cfg(feature = "hip")]
fn open_hip(c: &Config) -> Result<Arc<dyn Backend>> {
    let backend = crate::backend::hip::HipBackend::new()?
        .with_legacy_ipc(c.legacy_ipc)
        .with_fabric_handles(c.fabric_handles);
    Ok(Arc::new(backend))
}

#[cfg(not(feature = "hip"))]
fn open_hip(_: &Config) -> Result<Arc<dyn Backend>> {
    Err(Error::Unavailable(
        "gpu-arena was built without the `hip` feature".into(),
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn max_reserved_forms() {
        let cap =
            |v: &str| Config::parse(&format!("max_reserved={v}")).map(|c| c.pool.max_reserved);
        assert_eq!(cap("40GiB").unwrap(), Some(MaxReserved::Bytes(40 << 30)));
        assert_eq!(
            cap("40GB").unwrap(),
            Some(MaxReserved::Bytes(40_000_000_000))
        );
        assert_eq!(
            cap("4294967296").unwrap(),
            Some(MaxReserved::Bytes(1 << 32))
        );
        assert_eq!(cap("0.9").unwrap(), Some(MaxReserved::Fraction(0.9)));
        assert_eq!(cap("90%").unwrap(), Some(MaxReserved::Fraction(0.9)));
        assert_eq!(cap("1").unwrap(), Some(MaxReserved::Fraction(1.0)));
        assert_eq!(cap("none").unwrap(), None);
        for bad in ["0", "0%", "150%", "1.5", "0GiB", "lots", "-0.5"] {
            let e = cap(bad).unwrap_err().to_string();
            assert!(e.contains("max_reserved") && e.contains(bad), "{bad}: {e}");
            assert!(
                e.contains("fraction") && e.contains("GiB"),
                "{bad}: names the forms: {e}"
            );
        }
    }

    #[test]
    fn sizes_are_refused_with_key_value_and_forms() {
        for (conf, value) in [
            ("arena_size=banana", "banana"),
            ("arena_size=12XB", "12XB"),
            ("sim_capacity=1e9", "1e9"),
        ] {
            let e = Config::parse(conf).unwrap_err().to_string();
            let key = conf.split('=').next().unwrap();
            assert!(e.contains(key) && e.contains(value), "{conf}: {e}");
            assert!(
                e.contains("KiB/MiB/GiB/TiB") && e.contains("KB/MB/GB/TB"),
                "{conf}: {e}"
            );
        }
        // Below the 2 MiB minimum: refused, naming the knob and the minimum.
        for tiny in ["1", "4096", "1MiB", "2MB"] {
            let e = Config::parse(&format!("arena_size={tiny}"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("arena_size") && e.contains("2 MiB"),
                "{tiny}: {e}"
            );
        }
        let c = Config::parse("arena_size=1.5GiB,sim_capacity=32GiB").unwrap();
        assert_eq!(c.pool.arena_size, 3 << 29);
        assert_eq!(
            Config::parse("arena_size=2MiB").unwrap().pool.arena_size,
            2 << 20
        );
    }

    /// A valid value for every key (each also changes the configuration from the default).
    fn sample(key: &str) -> &'static str {
        match key {
            "backend" => "sim",
            "arena_size" | "sim_capacity" | "sim_granularity" => "4MiB",
            "max_reserved" => "0.5",
            "sim_devices" => "2",
            "fabric_handles" | "grow_arenas" => "0",
            "allowed_uids" => "1000:1001",
            "validate" => {
                if cfg!(debug_assertions) {
                    "0"
                } else {
                    "1"
                }
            }
            _ => "1",
        }
    }

    #[test]
    fn keys_are_the_ones_apply_accepts() {
        for key in KEYS {
            let c = Config::parse(&format!("{key}={}", sample(key)))
                .unwrap_or_else(|e| panic!("{key}: {e}"));
            assert_ne!(c, Config::default(), "{key} changes nothing");
        }
        let e = Config::parse("color=blue").unwrap_err().to_string();
        assert!(
            KEYS.iter().all(|k| e.contains(k)),
            "the refusal names every key: {e}"
        );
        // The keys `apply` matches on, read from this file's source.
        let source = include_str!("config.rs");
        let body = &source[source.find("match key {").unwrap()..];
        let body = &body[..body.find("_ => {").unwrap()];
        let sorted = |mut v: Vec<&'static str>| {
            v.sort_unstable();
            v
        };
        let matched = body
            .lines()
            .filter_map(|l| {
                l.trim()
                    .strip_prefix('"')?
                    .split_once("\" =>")
                    .map(|(k, _)| k)
            })
            .collect();
        assert_eq!(sorted(matched), sorted(KEYS.to_vec()), "apply's match arms");
    }

    /// Each default the table writes as one value (`` `1GiB` ``) is the default: setting it
    /// changes nothing.
    #[test]
    fn the_tables_defaults_are_the_defaults() {
        let mut checked = 0;
        for k in &KEY_TABLE {
            let Some(value) = k
                .default
                .strip_prefix('`')
                .and_then(|d| d.strip_suffix('`'))
                .filter(|v| !v.contains('`'))
            else {
                continue;
            };
            let c = Config::parse(&format!("{}={value}", k.name))
                .unwrap_or_else(|e| panic!("{}: {e}", k.name));
            assert_eq!(
                c,
                Config::default(),
                "{}={value} is not the default",
                k.name
            );
            checked += 1;
        }
        assert_eq!(
            checked,
            KEY_TABLE.len() - 2,
            "all but validate and allowed_uids"
        );
        let validate = if cfg!(debug_assertions) { "1" } else { "0" };
        assert_eq!(
            Config::parse(&format!("validate={validate}")).unwrap(),
            Config::default()
        );
        assert_eq!(Config::parse("allowed_uids=").unwrap(), Config::default());
    }

    #[test]
    fn parse_and_reject() {
        let c = Config::parse("backend=sim, arena_size=256MiB,sim_devices=2,legacy_pin=1").unwrap();
        assert_eq!(c.backend, BackendChoice::Sim);
        assert!(!c.legacy_ipc);
        assert_eq!(c.fabric_handles, FabricHandles::Auto);
        let v = Config::parse("legacy_ipc=1,fabric_handles=0").unwrap();
        assert!(v.legacy_ipc);
        assert_eq!(v.fabric_handles, FabricHandles::Off);
        let on = Config::parse("fabric_handles=1").unwrap();
        assert_eq!(on.fabric_handles, FabricHandles::On);
        assert_eq!(
            Config::parse("fabric_handles=auto").unwrap().fabric_handles,
            FabricHandles::Auto
        );
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
            "legacy_ipc=2",
            "fabric_handles=sometimes",
        ] {
            let e = c2.apply(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad}: {e}");
            assert_eq!(c2, c, "a rejected configuration changes nothing");
        }
    }
}
