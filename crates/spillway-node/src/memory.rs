//! Memory honesty: how much RAM a node takes, checked at start against what the machine
//! lets it have, and the local clients' host tiers admitted only while it has room.
//!
//! What a node holds resident (`VmRSS`), at most ([`MemoryPlan`]):
//!
//! - the **host budget** (`host_budget`): the pages the node keeps for its peers
//!   ([`crate::store::HostStore`], a [`HostBudget`] of its own; a put past it is
//!   `NoCapacity`);
//! - times [`HOST_BUDGET_SLACK`] (1.05): the allocator's rounding and the page index
//!   (about 100 bytes a page). Page buffers are their own mappings
//!   ([`return_page_buffers_to_the_os`]), so a page freed is memory returned: glibc's
//!   heap otherwise kept up to 25 % of the budget after the pages that used it were gone;
//! - plus [`NODE_BASE_OVERHEAD_BYTES`] (32 MiB): code, the async runtime, QUIC state, the
//!   Raft log's cache, the metrics (an idle node of a 3-node pool: 15 MiB, 10 of them code);
//! - plus the **buffers in flight**, bounded by the config: page payloads received from
//!   peers and not yet stored, at most `quic.peer_bytes_in_flight_max` per peer (64 MiB
//!   each by default), and the page copies of one local client's ops,
//!   [`crate::local::OPS_IN_FLIGHT_PER_CLIENT_DEFAULT`] x `page_size` (128 MiB with 2 MiB
//!   pages; each further client busy at that rate adds as much);
//! - plus the **host tiers of its local clients**: shared memory the node creates and
//!   maps (`VmRSS` counts it as `RssShmem`), each of the size the client asked for (its
//!   own host budget). They are not the node's to shrink, so they are admitted instead:
//!   with a cgroup limit, the clients' host tiers together get what the limit leaves
//!   after the node's plan (a [`HostBudget`] in [`crate::local::LocalServerConfig`]), and
//!   a client past it is refused at its hello with the numbers, not OOM-killed later.
//!   A node of `host_budget` H serving a client of host tier C holds up to H + C (the
//!   "1.9x" seen with C close to H): size the two together.
//!
//! [`check`] compares that figure with the cgroup's memory limit (cgroup v2
//! `memory.max`, v1 `memory.limit_in_bytes`, of this process's own cgroup and every
//! ancestor, read through `/proc/self/cgroup`), and the memory the node pins with
//! `RLIMIT_MEMLOCK`: over-commit is a [`MemoryError`] at start naming the numbers and
//! what to change, instead of an OOM kill under load. The node pins memory only with
//! `transport = "ucx"` over an RDMA transport (UCX registers the pages it sends and
//! receives, up to the whole host tier); QUIC and UCX over TCP pin nothing.
//!
//! The parsing is sans-IO ([`parse_proc_cgroup`], [`parse_limit`]); [`MemoryLimits::read`]
//! reads the files, under a root that tests point at fixtures
//! ([`MemoryLimits::read_under`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::{NodeConfig, PageTransport};

/// Slack over the host budget the resident memory may take: 5 % (allocator rounding, the
/// page index). A node's `VmRSS` stays within this times `host_budget` plus its overhead.
pub const HOST_BUDGET_SLACK: f64 = 1.05;
/// The node's fixed overhead: 32 MiB (code, runtime, QUIC state, Raft's log cache,
/// metrics). Measured: 15 MiB for an idle node of a 3-node pool, 10 MiB of it code.
pub const NODE_BASE_OVERHEAD_BYTES: u64 = 32 << 20;
/// Local clients whose ops' page copies [`MemoryPlan`] counts: 1 (one job process per
/// node is the common case; each further client busy at full rate adds as much).
pub const LOCAL_CLIENTS_PLANNED: u64 = 1;
/// A cgroup v1 limit at or above this (about 4.6e18, v1's "no limit" rounded to pages) is
/// no limit.
const CGROUP_V1_UNLIMITED: u64 = 1 << 62;
/// UCX transports (`UCX_TLS` names) that register memory with a NIC, i.e. pin it.
const UCX_PINNING_TLS: &[&str] = &["rc", "ud", "dc", "ib", "rdmacm", "gdr_copy", "all"];

/// The memory a node plans to hold, from its config (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// `host_budget`: the peers' pages and the local clients' host tiers together.
    pub host_budget_bytes: u64,
    /// [`NODE_BASE_OVERHEAD_BYTES`].
    pub base_overhead_bytes: u64,
    /// Page payloads received from peers and not stored yet: peers x
    /// `quic.peer_bytes_in_flight_max`.
    pub peer_receive_bytes: u64,
    /// Page copies of [`LOCAL_CLIENTS_PLANNED`] local clients' ops in flight.
    pub client_copy_bytes: u64,
    /// Memory pinned (locked): the host budget with `transport = "ucx"` over RDMA, else 0.
    pub pinned_bytes: u64,
}

impl MemoryPlan {
    /// The plan of a node with `config`; `ucx_tls` is the `UCX_TLS` environment variable
    /// (which UCX transports may carry pages; unset means any, RDMA included).
    pub fn of(config: &NodeConfig, ucx_tls: Option<&str>) -> MemoryPlan {
        let peers = config.initial_members().len().saturating_sub(1) as u64;
        let pins = config.transport == PageTransport::Ucx && ucx_may_pin(ucx_tls);
        MemoryPlan {
            host_budget_bytes: config.host_tier_bytes,
            base_overhead_bytes: NODE_BASE_OVERHEAD_BYTES,
            peer_receive_bytes: peers.saturating_mul(config.quic.peer_bytes_in_flight_max),
            client_copy_bytes: LOCAL_CLIENTS_PLANNED
                * crate::local::OPS_IN_FLIGHT_PER_CLIENT_DEFAULT as u64
                * config.page_size.bytes(),
            pinned_bytes: if pins { config.host_tier_bytes } else { 0 },
        }
    }

    /// Everything but the host budget: base overhead and buffers in flight.
    pub fn overhead_bytes(&self) -> u64 {
        self.base_overhead_bytes
            .saturating_add(self.peer_receive_bytes)
            .saturating_add(self.client_copy_bytes)
    }

    /// The most the node may hold resident: the host budget with its slack, plus the
    /// overhead.
    pub fn resident_max_bytes(&self) -> u64 {
        slack(self.host_budget_bytes).saturating_add(self.overhead_bytes())
    }

    /// The largest host budget whose plan fits in `limit_bytes` (0 if none does).
    pub fn host_budget_max_bytes(&self, limit_bytes: u64) -> u64 {
        let room = limit_bytes.saturating_sub(self.overhead_bytes());
        (room as f64 / HOST_BUDGET_SLACK) as u64
    }
}

fn slack(bytes: u64) -> u64 {
    (bytes as f64 * HOST_BUDGET_SLACK).ceil() as u64
}

/// Whether UCX may pin memory with `UCX_TLS` set to this (unset: it may).
fn ucx_may_pin(ucx_tls: Option<&str>) -> bool {
    let Some(tls) = ucx_tls.map(str::trim).filter(|t| !t.is_empty()) else {
        return true;
    };
    // `^a,b` excludes a and b: everything else, RDMA included, stays allowed.
    if tls.starts_with('^') {
        return true;
    }
    tls.split(',').any(|t| {
        let t = t.trim();
        UCX_PINNING_TLS
            .iter()
            .any(|p| t == *p || t.starts_with(&format!("{p}_")))
    })
}

/// The cgroup memory limit that applies to this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupLimit {
    /// The limit, bytes.
    pub limit_bytes: u64,
    /// The file it was read from (the lowest limit of the cgroup and its ancestors).
    pub file: PathBuf,
}

/// What the machine lets this process have.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryLimits {
    /// The cgroup's memory limit, `None` without one.
    pub cgroup: Option<CgroupLimit>,
    /// `RLIMIT_MEMLOCK`'s soft limit, bytes; `None` is unlimited.
    pub memlock_bytes: Option<u64>,
}

impl MemoryLimits {
    /// No limit at all (tests; a node started with this checks nothing).
    pub fn unlimited() -> MemoryLimits {
        MemoryLimits::default()
    }

    /// This process's limits: its cgroup's (through `/proc/self/cgroup` and
    /// `/sys/fs/cgroup`) and `RLIMIT_MEMLOCK`.
    pub fn read() -> MemoryLimits {
        let memlock_bytes = rustix::process::getrlimit(rustix::process::Resource::Memlock).current;
        MemoryLimits {
            cgroup: cgroup_limit_under(Path::new("/")),
            memlock_bytes,
        }
    }

    /// The cgroup limit read under `root` instead of `/` (`root/proc/self/cgroup`,
    /// `root/sys/fs/cgroup/...`), with `memlock_bytes` as given: for fixture tests.
    pub fn read_under(root: &Path, memlock_bytes: Option<u64>) -> MemoryLimits {
        MemoryLimits {
            cgroup: cgroup_limit_under(root),
            memlock_bytes,
        }
    }
}

/// One line of `/proc/self/cgroup`: `hierarchy-id:controllers:path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupLine {
    /// The hierarchy id (0 for cgroup v2).
    pub hierarchy: u32,
    /// The v1 controllers bound to it (empty for v2).
    pub controllers: Vec<String>,
    /// The cgroup's path in that hierarchy, from `/`.
    pub path: String,
}

/// Where this process's memory limit lives, from `/proc/self/cgroup`'s text: the v1
/// `memory` controller's line if there is one (a hybrid machine enforces v1's limit),
/// else the v2 line (`0::/path`). Lines that do not parse are skipped.
pub fn parse_proc_cgroup(text: &str) -> Option<(CgroupVersion, String)> {
    let lines: Vec<CgroupLine> = text.lines().filter_map(parse_cgroup_line).collect();
    if let Some(l) = lines
        .iter()
        .find(|l| l.controllers.iter().any(|c| c == "memory"))
    {
        return Some((CgroupVersion::V1, l.path.clone()));
    }
    lines
        .iter()
        .find(|l| l.hierarchy == 0 && l.controllers.is_empty())
        .map(|l| (CgroupVersion::V2, l.path.clone()))
}

fn parse_cgroup_line(line: &str) -> Option<CgroupLine> {
    let mut parts = line.splitn(3, ':');
    let hierarchy = parts.next()?.trim().parse().ok()?;
    let controllers = parts
        .next()?
        .split(',')
        .filter(|c| !c.is_empty())
        .map(str::to_string)
        .collect();
    let path = parts.next()?.trim().to_string();
    path.starts_with('/').then_some(CgroupLine {
        hierarchy,
        controllers,
        path,
    })
}

/// Which cgroup hierarchy holds the memory limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    /// cgroup v1: `/sys/fs/cgroup/memory/<path>/memory.limit_in_bytes`.
    V1,
    /// cgroup v2: `/sys/fs/cgroup/<path>/memory.max`.
    V2,
}

impl CgroupVersion {
    fn mount(self) -> &'static str {
        match self {
            CgroupVersion::V1 => "sys/fs/cgroup/memory",
            CgroupVersion::V2 => "sys/fs/cgroup",
        }
    }

    fn file(self) -> &'static str {
        match self {
            CgroupVersion::V1 => "memory.limit_in_bytes",
            CgroupVersion::V2 => "memory.max",
        }
    }
}

/// A limit file's value: `Some(bytes)`, or `None` for no limit (`max`, v1's near-2^63)
/// and for text that is not a number.
pub fn parse_limit(text: &str) -> Option<u64> {
    let t = text.trim();
    if t == "max" {
        return None;
    }
    t.parse::<u64>().ok().filter(|&v| v < CGROUP_V1_UNLIMITED)
}

/// The lowest limit of this process's cgroup and its ancestors, under `root`. Inside a
/// cgroup namespace `/proc/self/cgroup` says `/` and the mount is the namespace's own
/// cgroup, so the walk ends at the mount's top file either way.
fn cgroup_limit_under(root: &Path) -> Option<CgroupLimit> {
    let text = std::fs::read_to_string(root.join("proc/self/cgroup")).ok()?;
    let (version, path) = parse_proc_cgroup(&text)?;
    let mount = root.join(version.mount());
    let mut best: Option<CgroupLimit> = None;
    let mut dir = Some(Path::new(&path));
    while let Some(d) = dir {
        let file = mount
            .join(d.strip_prefix("/").unwrap_or(d))
            .join(version.file());
        if let Some(limit_bytes) = std::fs::read_to_string(&file)
            .ok()
            .and_then(|t| parse_limit(&t))
            && best.as_ref().is_none_or(|b| limit_bytes < b.limit_bytes)
        {
            best = Some(CgroupLimit { limit_bytes, file });
        }
        dir = d.parent();
    }
    best
}

/// Why a node's memory plan does not fit the machine's limits.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MemoryError {
    /// The plan is larger than the cgroup's memory limit: the node would be OOM-killed
    /// under load.
    #[error(
        "the node may hold {} (host_budget {} x {HOST_BUDGET_SLACK} + overhead {}: \
         {} base, {} from peers in flight, {} of local clients' page copies) but its \
         cgroup allows {} ({}): lower host_budget (`--host-budget`) to at most {}, lower \
         quic.peer_bytes_in_flight_max, or raise the cgroup's memory limit",
        size(*needed_bytes), size(plan.host_budget_bytes), size(plan.overhead_bytes()),
        size(plan.base_overhead_bytes), size(plan.peer_receive_bytes),
        size(plan.client_copy_bytes), size(*limit_bytes), file.display(),
        size(plan.host_budget_max_bytes(*limit_bytes))
    )]
    OverCgroupLimit {
        /// What the node may hold ([`MemoryPlan::resident_max_bytes`]).
        needed_bytes: u64,
        /// The cgroup's limit.
        limit_bytes: u64,
        /// Where the limit was read.
        file: PathBuf,
        /// The plan.
        plan: MemoryPlan,
    },
    /// The node would pin more than `RLIMIT_MEMLOCK` allows: UCX's registrations would
    /// fail under load.
    #[error(
        "transport = \"ucx\" may pin the whole host tier, {}, but RLIMIT_MEMLOCK allows {}: \
         raise it (`ulimit -l unlimited`; `LimitMEMLOCK=infinity` in a systemd unit; \
         `memlock` in /etc/security/limits.conf), lower host_budget (`--host-budget`) to at \
         most {}, or keep UCX off RDMA (UCX_TLS=tcp,self) or use transport = \"quic\"",
        size(*pinned_bytes), size(*memlock_bytes), size(*memlock_bytes)
    )]
    OverMemlock {
        /// Bytes the node may pin.
        pinned_bytes: u64,
        /// `RLIMIT_MEMLOCK`'s soft limit.
        memlock_bytes: u64,
    },
}

/// `bytes` for people: `1.5 GiB (1610612736 bytes)`.
pub fn size(bytes: u64) -> String {
    const UNITS: [(&str, u32); 4] = [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)];
    for (unit, shift) in UNITS {
        if bytes >= 1 << shift {
            let v = bytes as f64 / (1u64 << shift) as f64;
            return format!("{v:.1} {unit} ({bytes} bytes)");
        }
    }
    format!("{bytes} bytes")
}

/// Checks `plan` against `limits`: the resident maximum within the cgroup's limit, the
/// pinned bytes within `RLIMIT_MEMLOCK`.
pub fn check(plan: &MemoryPlan, limits: &MemoryLimits) -> Result<(), MemoryError> {
    if let Some(c) = &limits.cgroup {
        let needed_bytes = plan.resident_max_bytes();
        if needed_bytes > c.limit_bytes {
            return Err(MemoryError::OverCgroupLimit {
                needed_bytes,
                limit_bytes: c.limit_bytes,
                file: c.file.clone(),
                plan: *plan,
            });
        }
    }
    if let Some(memlock_bytes) = limits.memlock_bytes
        && plan.pinned_bytes > memlock_bytes
    {
        return Err(MemoryError::OverMemlock {
            pinned_bytes: plan.pinned_bytes,
            memlock_bytes,
        });
    }
    Ok(())
}

/// A byte budget that several holders take from and give back to: the host tier's pages
/// ([`crate::store::HostStore`]), the local clients' host tiers
/// ([`crate::local::LocalServerConfig::host_budget`]). Invariant: `used_bytes <=
/// budget_bytes`; every taker gives back exactly what it took.
#[derive(Debug)]
pub struct HostBudget {
    budget_bytes: u64,
    used_bytes: AtomicU64,
}

impl HostBudget {
    /// A budget of `budget_bytes`, none of it used.
    pub fn new(budget_bytes: u64) -> HostBudget {
        HostBudget {
            budget_bytes,
            used_bytes: AtomicU64::new(0),
        }
    }

    /// The budget.
    pub fn budget_bytes(&self) -> u64 {
        self.budget_bytes
    }

    /// Bytes taken now.
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes.load(Ordering::Acquire)
    }

    /// Takes `bytes` if they fit; `Err(used now)` if they do not (nothing taken).
    pub fn try_take(&self, bytes: u64) -> Result<(), u64> {
        self.used_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&u| u <= self.budget_bytes)
            })
            .map(|_| ())
    }

    /// Gives back `bytes` taken earlier.
    pub fn give_back(&self, bytes: u64) {
        let before = self.used_bytes.fetch_sub(bytes, Ordering::AcqRel);
        debug_assert!(before >= bytes, "gave back {bytes} of {before} taken");
    }
}

impl PartialEq for HostBudget {
    /// The same budget (identity): two budgets of equal size are still two budgets.
    fn eq(&self, other: &HostBudget) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Eq for HostBudget {}

/// The room a cgroup limit leaves the local clients' host tiers after the node's own
/// plan: `None` without a limit (clients are then bounded only per client).
pub fn client_room_bytes(plan: &MemoryPlan, limits: &MemoryLimits) -> Option<u64> {
    limits
        .cgroup
        .as_ref()
        .map(|c| c.limit_bytes.saturating_sub(plan.resident_max_bytes()))
}

/// `M_MMAP_THRESHOLD` of glibc's `mallopt`.
const M_MMAP_THRESHOLD: i32 = -3;
/// Smallest threshold set: 128 KiB, glibc's own starting value (smaller pages stay in
/// the heap, where they are cheap and their waste is small).
const MMAP_THRESHOLD_MIN_BYTES: u64 = 128 << 10;

/// Makes every allocation of half a page or more its own mapping, returned to the system
/// when freed (glibc's `M_MMAP_THRESHOLD`, fixed, which also stops glibc from raising it).
/// Without it glibc raises the threshold after the first large free and serves pages
/// from its heaps, which keep freed pages' memory: a node whose store held 128 MiB had a
/// peak of 178-190 MiB; with it, 156-158 MiB (`bench/cluster/node_memory.py`). The cost
/// is a fresh mapping (page faults) per page received. Process-wide: the `spillway node`
/// binary calls it before starting; a library embedding a node decides for itself.
pub fn return_page_buffers_to_the_os(page_bytes: u64) {
    let threshold = (page_bytes / 2).clamp(MMAP_THRESHOLD_MIN_BYTES, 32 << 20);
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        // SAFETY: mallopt only sets an allocator parameter; any value is accepted or
        // refused (returns 0), never undefined behaviour. `threshold` fits an i32.
        let ok = unsafe { mallopt(M_MMAP_THRESHOLD, threshold as i32) };
        if ok == 0 {
            tracing::warn!(
                threshold,
                "glibc refused M_MMAP_THRESHOLD; freed pages may stay in its heap"
            );
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = (threshold, M_MMAP_THRESHOLD);
}

#[cfg(test)]
mod tests;
