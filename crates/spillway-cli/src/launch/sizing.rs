//! The node's host tier from the host: `--host-budget` as a size (`64GiB`) or a share of
//! the memory this process may use (`50%`: of the cgroup's memory limit, or of the
//! machine's memory without one), refused when it asks for more than that memory.
//!
//! Pinned memory: a job's client with a GPU page-locks its host tier (the shared memory
//! its node gives it, registered with the CUDA driver), which is at most the host budget;
//! so where the job pins (`--pinned on`, or `auto` on a host with an NVIDIA device) the
//! budget must also fit `RLIMIT_MEMLOCK` (`ulimit -l`), and a share is taken of the
//! smaller of the two. A budget above it is refused at start with the numbers and what to
//! raise ([`SizingError::OverMemlock`]), not a failed registration mid-job. (The node
//! checks its own plan again when it starts: `spillway_node::memory`.)
//!
//! [`host_budget`] is sans-IO; [`HostMemory::read`] reads `/proc`, `/sys` and the rlimit.

use std::fs;

use thiserror::Error;

/// Granularity of a budget taken as a share: 2 MiB, the default page size.
pub const BUDGET_ALIGN: u64 = 2 << 20;

/// What `--host-budget` said.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum BudgetArg {
    /// A size in bytes.
    Bytes(u64),
    /// A share of the usable memory, in (0, 1].
    Share(f64),
}

/// `--host-budget`'s parser: `64GiB` or `50%`.
pub fn parse_budget(text: &str) -> Result<BudgetArg, String> {
    if let Some(p) = text.trim().strip_suffix('%') {
        let p: f64 = p
            .trim()
            .parse()
            .map_err(|_| format!("{text:?} is not a percentage"))?;
        if !(p > 0.0 && p <= 100.0) {
            return Err(format!(
                "{text:?}: a share must be above 0% and at most 100%"
            ));
        }
        return Ok(BudgetArg::Share(p / 100.0));
    }
    let bytes = crate::size::parse_size(text)?;
    if bytes > crate::size::BUDGET_BYTES_MAX {
        return Err(format!("{text:?} is more than 16TiB"));
    }
    Ok(BudgetArg::Bytes(bytes))
}

/// The memory of this host a node may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostMemory {
    /// `MemTotal` of `/proc/meminfo`.
    pub total: u64,
    /// The cgroup's memory limit, if it has one.
    pub cgroup_limit: Option<u64>,
    /// `RLIMIT_MEMLOCK`'s soft limit (`ulimit -l`); `None` is unlimited.
    pub memlock: Option<u64>,
}

impl HostMemory {
    /// The smaller of the two.
    pub fn usable(&self) -> u64 {
        self.cgroup_limit.map_or(self.total, |l| l.min(self.total))
    }

    /// Reads `/proc/meminfo`, the cgroup limit (v2 `memory.max` or v1
    /// `memory.limit_in_bytes` of this process's cgroup and its ancestors, the lowest:
    /// `spillway_node::MemoryLimits`) and `RLIMIT_MEMLOCK`.
    pub fn read() -> Option<HostMemory> {
        let meminfo = fs::read_to_string("/proc/meminfo").ok()?;
        let total = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())?
            * 1024;
        let limits = spillway_node::MemoryLimits::read();
        Some(HostMemory {
            total,
            cgroup_limit: limits.cgroup.map(|c| c.limit_bytes),
            memlock: limits.memlock_bytes,
        })
    }
}

/// Whether the job pins its host tier (`--pinned`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Pinned {
    /// Where the host has an NVIDIA device (`/dev/nvidiactl`): a client with a GPU
    /// page-locks its host tier.
    Auto,
    /// The job pins its host tier: the budget must fit `RLIMIT_MEMLOCK`.
    On,
    /// The job pins nothing (CPU-only clients): `RLIMIT_MEMLOCK` is not checked.
    Off,
}

impl Pinned {
    /// Whether the job pins, on a host where a GPU `gpu` is present or not.
    pub fn pins(self, gpu: bool) -> bool {
        match self {
            Pinned::Auto => gpu,
            Pinned::On => true,
            Pinned::Off => false,
        }
    }
}

/// Whether this host has an NVIDIA device.
pub fn host_has_gpu() -> bool {
    std::path::Path::new("/dev/nvidiactl").exists()
}

/// A budget the host cannot hold.
#[derive(Debug, Error, PartialEq)]
pub enum SizingError {
    /// More than the usable memory.
    #[error(
        "--host-budget asks for {asked} bytes but this host may use {usable} bytes ({why}); \
         give less, or a share such as 50%"
    )]
    OverCommit {
        /// Asked.
        asked: u64,
        /// Usable.
        usable: u64,
        /// Where the limit comes from.
        why: &'static str,
    },
    /// A share of memory that could not be read.
    #[error("--host-budget as a share needs /proc/meminfo, which could not be read")]
    Unknown,
    /// A budget the job pins that is above `RLIMIT_MEMLOCK`.
    #[error(
        "--host-budget {asked} bytes would be page-locked by the job's clients (a GPU's host \
         tier is pinned) but RLIMIT_MEMLOCK (`ulimit -l`) allows {memlock} bytes: raise it \
         (`ulimit -l unlimited`; Slurm: the limit in slurmd's unit and \
         PropagateResourceLimits; Kubernetes: the container runtime's memlock ulimit), give \
         --host-budget at most {memlock} bytes, or --pinned off if the job pins nothing"
    )]
    OverMemlock {
        /// Asked.
        asked: u64,
        /// `RLIMIT_MEMLOCK`.
        memlock: u64,
    },
    /// A share smaller than one page.
    #[error("--host-budget {share} of {usable} bytes is less than one {BUDGET_ALIGN}-byte page")]
    TooSmall {
        /// The share.
        share: f64,
        /// Usable.
        usable: u64,
    },
}

/// The host tier in bytes for `arg` on a host with `memory` (`None`: unknown), for a job
/// that `pins` its host tier or not.
pub fn host_budget(
    arg: BudgetArg,
    memory: Option<HostMemory>,
    pins: bool,
) -> Result<u64, SizingError> {
    let why = |m: &HostMemory| {
        if m.cgroup_limit.is_some_and(|l| l < m.total) {
            "the cgroup's memory limit"
        } else {
            "the machine's memory"
        }
    };
    let memlock = memory.and_then(|m| m.memlock).filter(|_| pins);
    match arg {
        BudgetArg::Bytes(asked) => match memory {
            Some(m) if asked > m.usable() => Err(SizingError::OverCommit {
                asked,
                usable: m.usable(),
                why: why(&m),
            }),
            _ => match memlock {
                Some(memlock) if asked > memlock => {
                    Err(SizingError::OverMemlock { asked, memlock })
                }
                _ => Ok(asked),
            },
        },
        BudgetArg::Share(share) => {
            let m = memory.ok_or(SizingError::Unknown)?;
            // A share of what the job may both use and pin.
            let of = memlock.map_or(m.usable(), |l| l.min(m.usable()));
            let bytes = (of as f64 * share) as u64 / BUDGET_ALIGN * BUDGET_ALIGN;
            if bytes == 0 {
                return Err(SizingError::TooSmall { share, usable: of });
            }
            Ok(bytes)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// A machine of 64 GiB whose cgroup may use 8; memlock unlimited.
    const CGROUP_LIMITED: HostMemory = HostMemory {
        total: 64 * GIB,
        cgroup_limit: Some(8 * GIB),
        memlock: None,
    };

    #[test]
    fn budgets_parse_as_sizes_or_shares() {
        assert_eq!(parse_budget("64GiB"), Ok(BudgetArg::Bytes(64 * GIB)));
        assert_eq!(parse_budget("50%"), Ok(BudgetArg::Share(0.5)));
        assert!(parse_budget("0%").is_err());
        assert!(parse_budget("101%").is_err());
        assert!(parse_budget("x%").is_err());
        assert!(parse_budget("17TiB").is_err());
    }

    #[test]
    fn a_share_is_of_the_cgroup_limit_when_lower() {
        let m = CGROUP_LIMITED;
        assert_eq!(
            host_budget(BudgetArg::Share(0.5), Some(m), false),
            Ok(4 * GIB)
        );
        let free = HostMemory {
            total: 64 * GIB,
            cgroup_limit: None,
            memlock: None,
        };
        assert_eq!(
            host_budget(BudgetArg::Share(0.25), Some(free), false),
            Ok(16 * GIB)
        );
        // Rounded down to whole 2 MiB pages.
        let odd = HostMemory {
            total: 3 * GIB + 12345,
            cgroup_limit: None,
            memlock: None,
        };
        assert_eq!(
            host_budget(BudgetArg::Share(1.0), Some(odd), false),
            Ok(3 * GIB)
        );
        assert_eq!(
            host_budget(BudgetArg::Share(0.5), None, false),
            Err(SizingError::Unknown)
        );
    }

    #[test]
    fn over_commit_is_refused_naming_the_limit() {
        let m = CGROUP_LIMITED;
        let e = host_budget(BudgetArg::Bytes(9 * GIB), Some(m), false).unwrap_err();
        assert_eq!(
            e,
            SizingError::OverCommit {
                asked: 9 * GIB,
                usable: 8 * GIB,
                why: "the cgroup's memory limit"
            }
        );
        assert_eq!(
            host_budget(BudgetArg::Bytes(8 * GIB), Some(m), false),
            Ok(8 * GIB)
        );
        assert_eq!(host_budget(BudgetArg::Bytes(GIB), None, false), Ok(GIB));
    }

    #[test]
    fn a_pinned_budget_must_fit_memlock() {
        let m = HostMemory {
            total: 64 * GIB,
            cgroup_limit: Some(32 * GIB),
            memlock: Some(8 * GIB),
        };
        let e = host_budget(BudgetArg::Bytes(9 * GIB), Some(m), true).unwrap_err();
        assert_eq!(
            e,
            SizingError::OverMemlock {
                asked: 9 * GIB,
                memlock: 8 * GIB
            }
        );
        let text = e.to_string();
        assert!(text.contains("ulimit -l"), "{text}");
        assert!(text.contains(&(8 * GIB).to_string()), "{text}");
        // At the limit it fits; a job that pins nothing is not held to it.
        assert_eq!(
            host_budget(BudgetArg::Bytes(8 * GIB), Some(m), true),
            Ok(8 * GIB)
        );
        assert_eq!(
            host_budget(BudgetArg::Bytes(9 * GIB), Some(m), false),
            Ok(9 * GIB)
        );
        // A share is of the smaller of the usable memory and memlock.
        assert_eq!(
            host_budget(BudgetArg::Share(0.5), Some(m), true),
            Ok(4 * GIB)
        );
        assert_eq!(
            host_budget(BudgetArg::Share(0.5), Some(m), false),
            Ok(16 * GIB)
        );
        // Unlimited memlock: only the usable memory bounds it.
        let open = HostMemory { memlock: None, ..m };
        assert_eq!(
            host_budget(BudgetArg::Bytes(20 * GIB), Some(open), true),
            Ok(20 * GIB)
        );
        // The cgroup's limit is checked first, with its own error.
        assert!(matches!(
            host_budget(BudgetArg::Bytes(40 * GIB), Some(m), true),
            Err(SizingError::OverCommit { .. })
        ));
    }

    #[test]
    fn pinned_auto_follows_the_gpu() {
        assert!(Pinned::Auto.pins(true));
        assert!(!Pinned::Auto.pins(false));
        assert!(Pinned::On.pins(false));
        assert!(!Pinned::Off.pins(true));
    }
}
