//! The node's host tier from the host: `--host-budget` as a size (`64GiB`) or a share of
//! the memory this process may use (`50%`: of the cgroup's memory limit, or of the
//! machine's memory without one), refused when it asks for more than that memory.
//! [`host_budget`] is sans-IO; [`HostMemory::read`] reads `/proc` and `/sys`.

use std::fs;

use thiserror::Error;

/// Granularity of a budget taken as a share: 2 MiB, the default page size.
pub const BUDGET_ALIGN: u64 = 2 << 20;
/// A cgroup v1 limit at or above this (about 8 EiB, rounded to pages) means "no limit".
const CGROUP_V1_UNLIMITED: u64 = 1 << 62;

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
}

impl HostMemory {
    /// The smaller of the two.
    pub fn usable(&self) -> u64 {
        self.cgroup_limit.map_or(self.total, |l| l.min(self.total))
    }

    /// Reads `/proc/meminfo` and the cgroup limit (v2 `memory.max`, else v1
    /// `memory.limit_in_bytes`, of this process's cgroup or the root's).
    pub fn read() -> Option<HostMemory> {
        let meminfo = fs::read_to_string("/proc/meminfo").ok()?;
        let total = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())?
            * 1024;
        let v2 = fs::read_to_string("/proc/self/cgroup")
            .ok()
            .and_then(|c| {
                c.lines()
                    .find_map(|l| l.strip_prefix("0::").map(str::to_string))
            })
            .and_then(|path| fs::read_to_string(format!("/sys/fs/cgroup{path}/memory.max")).ok());
        let v1 = || fs::read_to_string("/sys/fs/cgroup/memory/memory.limit_in_bytes").ok();
        let cgroup_limit = v2.or_else(v1).and_then(|t| parse_cgroup_limit(&t));
        Some(HostMemory {
            total,
            cgroup_limit,
        })
    }
}

/// A cgroup memory limit file's value: `max` or a v1 near-2^63 value is no limit.
pub fn parse_cgroup_limit(text: &str) -> Option<u64> {
    let t = text.trim();
    if t == "max" {
        return None;
    }
    t.parse::<u64>().ok().filter(|&v| v < CGROUP_V1_UNLIMITED)
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
    /// A share smaller than one page.
    #[error("--host-budget {share} of {usable} bytes is less than one {BUDGET_ALIGN}-byte page")]
    TooSmall {
        /// The share.
        share: f64,
        /// Usable.
        usable: u64,
    },
}

/// The host tier in bytes for `arg` on a host with `memory` (`None`: unknown).
pub fn host_budget(arg: BudgetArg, memory: Option<HostMemory>) -> Result<u64, SizingError> {
    let why = |m: &HostMemory| {
        if m.cgroup_limit.is_some_and(|l| l < m.total) {
            "the cgroup's memory limit"
        } else {
            "the machine's memory"
        }
    };
    match arg {
        BudgetArg::Bytes(asked) => match memory {
            Some(m) if asked > m.usable() => Err(SizingError::OverCommit {
                asked,
                usable: m.usable(),
                why: why(&m),
            }),
            _ => Ok(asked),
        },
        BudgetArg::Share(share) => {
            let m = memory.ok_or(SizingError::Unknown)?;
            let bytes = (m.usable() as f64 * share) as u64 / BUDGET_ALIGN * BUDGET_ALIGN;
            if bytes == 0 {
                return Err(SizingError::TooSmall {
                    share,
                    usable: m.usable(),
                });
            }
            Ok(bytes)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

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
        let m = HostMemory {
            total: 64 * GIB,
            cgroup_limit: Some(8 * GIB),
        };
        assert_eq!(host_budget(BudgetArg::Share(0.5), Some(m)), Ok(4 * GIB));
        let free = HostMemory {
            total: 64 * GIB,
            cgroup_limit: None,
        };
        assert_eq!(
            host_budget(BudgetArg::Share(0.25), Some(free)),
            Ok(16 * GIB)
        );
        // Rounded down to whole 2 MiB pages.
        let odd = HostMemory {
            total: 3 * GIB + 12345,
            cgroup_limit: None,
        };
        assert_eq!(host_budget(BudgetArg::Share(1.0), Some(odd)), Ok(3 * GIB));
        assert_eq!(
            host_budget(BudgetArg::Share(0.5), None),
            Err(SizingError::Unknown)
        );
    }

    #[test]
    fn over_commit_is_refused_naming_the_limit() {
        let m = HostMemory {
            total: 64 * GIB,
            cgroup_limit: Some(8 * GIB),
        };
        let e = host_budget(BudgetArg::Bytes(9 * GIB), Some(m)).unwrap_err();
        assert_eq!(
            e,
            SizingError::OverCommit {
                asked: 9 * GIB,
                usable: 8 * GIB,
                why: "the cgroup's memory limit"
            }
        );
        assert_eq!(host_budget(BudgetArg::Bytes(8 * GIB), Some(m)), Ok(8 * GIB));
        assert_eq!(host_budget(BudgetArg::Bytes(GIB), None), Ok(GIB));
    }

    #[test]
    fn cgroup_limit_files_parse() {
        assert_eq!(parse_cgroup_limit("max\n"), None);
        assert_eq!(parse_cgroup_limit("9223372036854771712\n"), None);
        assert_eq!(parse_cgroup_limit("8589934592\n"), Some(8 * GIB));
        assert_eq!(parse_cgroup_limit("garbage"), None);
    }
}
