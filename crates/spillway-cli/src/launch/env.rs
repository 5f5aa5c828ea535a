//! Where `spillway launch` runs: which hosts make up the job, which of them this is, and
//! which rank on this host this process is. Sans-IO: [`detect`] reads variables through a
//! lookup function, so every launcher's environment is a unit test.
//!
//! Precedence, first match wins:
//! 1. `--hosts a,b,c --host-index I` (explicit; local rank from `--local-rank` or 0);
//! 2. Slurm: `SLURM_JOB_NODELIST` is set (an `srun` step, possibly running torchrun
//!    inside: Slurm names every host, torchrun only the master);
//! 3. torchrun / Kubeflow PyTorchJob: `MASTER_ADDR` and `WORLD_SIZE` are set;
//! 4. Kubernetes LeaderWorkerSet: `LWS_LEADER_ADDRESS` is set;
//! 5. otherwise a job of one host (this one, on loopback), one rank.
//!
//! Slurm and the explicit form name every host. torchrun and LWS name only the master
//! (the leader, [`Hosts::Count`]): every host joins host 0, so host 0's address is all the
//! launcher needs.

use std::fmt;

use thiserror::Error;

/// Most hosts a hostlist may expand to: 65,536 (a `Vec<String>` of short names, a few MiB).
pub const HOSTS_MAX: usize = 1 << 16;

/// Which launcher's variables were used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// `--hosts` and `--host-index`.
    Explicit,
    /// `SLURM_*`.
    Slurm,
    /// torchrun or a Kubeflow PyTorchJob (`MASTER_ADDR`, `RANK`, ...).
    Torchrun,
    /// Kubernetes LeaderWorkerSet (`LWS_*`).
    LeaderWorkerSet,
    /// Nothing detected: one host, one rank.
    Single,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::Explicit => "--hosts",
            Source::Slurm => "slurm",
            Source::Torchrun => "torchrun",
            Source::LeaderWorkerSet => "leaderworkerset",
            Source::Single => "single host",
        })
    }
}

/// The job's hosts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hosts {
    /// Every host by name or address, in host-index order.
    Named(Vec<String>),
    /// Only how many, and host 0's address (torchrun's master, LWS's leader).
    Count {
        /// Hosts in the job.
        count: usize,
        /// Host 0's name or address.
        first: String,
    },
}

impl Hosts {
    /// Hosts in the job.
    pub fn len(&self) -> usize {
        match self {
            Hosts::Named(h) => h.len(),
            Hosts::Count { count, .. } => *count,
        }
    }
}

/// This process's place in the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Where it came from.
    pub source: Source,
    /// The job's hosts.
    pub hosts: Hosts,
    /// This host's index (0-based).
    pub host_index: usize,
    /// This process's rank among the ranks of its host (0 starts the node).
    pub local_rank: u32,
    /// Ranks on this host (the node stops when all have exited).
    pub local_world_size: u32,
    /// A name of this job, the same on every rank of every host: it names the host's run
    /// directory and the job's directory in the shared directory.
    pub job_key: String,
}

/// An environment `spillway launch` cannot use. Each names the variable to blame.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum EnvError {
    /// A variable the detected launcher needs is missing.
    #[error("{launcher} environment: {var} is not set")]
    Missing {
        /// The launcher.
        launcher: Source,
        /// The variable.
        var: &'static str,
    },
    /// A variable is not a number.
    #[error("{var}={value:?} is not a non-negative integer")]
    NotANumber {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// A hostlist does not parse.
    #[error("hostlist {list:?}: {problem}")]
    Hostlist {
        /// The list.
        list: String,
        /// What is wrong.
        problem: String,
    },
    /// Variables disagree with each other.
    #[error("inconsistent environment: {0}")]
    Inconsistent(String),
}

fn number(
    get: &dyn Fn(&str) -> Option<String>,
    launcher: Source,
    var: &'static str,
) -> Result<u64, EnvError> {
    let value = get(var).ok_or(EnvError::Missing { launcher, var })?;
    parse_number(var, &value)
}

fn parse_number(var: &'static str, value: &str) -> Result<u64, EnvError> {
    value
        .trim()
        .parse::<u64>()
        .map_err(|_| EnvError::NotANumber {
            var,
            value: value.to_string(),
        })
}

fn optional_number(
    get: &dyn Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<Option<u64>, EnvError> {
    get(var).map(|v| parse_number(var, &v)).transpose()
}

fn to_u32(var: &'static str, v: u64) -> Result<u32, EnvError> {
    u32::try_from(v).map_err(|_| EnvError::NotANumber {
        var,
        value: v.to_string(),
    })
}

/// `--hosts`, `--host-index` and `--local-rank`/`--local-world-size` as given.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Explicit {
    /// `--hosts` (comma list, hostlist syntax allowed).
    pub hosts: Option<String>,
    /// `--host-index`.
    pub host_index: Option<usize>,
    /// `--local-rank` (default 0).
    pub local_rank: Option<u32>,
    /// `--local-world-size` (default 1).
    pub local_world_size: Option<u32>,
    /// `--job-key`: replaces the detected one.
    pub job_key: Option<String>,
}

/// Detects the placement from `explicit` and the variables `get` returns.
pub fn detect(
    explicit: &Explicit,
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<Placement, EnvError> {
    let mut placement = if explicit.hosts.is_some() || explicit.host_index.is_some() {
        from_explicit(explicit)?
    } else if get("SLURM_JOB_NODELIST").is_some() {
        from_slurm(get)?
    } else if get("MASTER_ADDR").is_some() && get("WORLD_SIZE").is_some() {
        from_torchrun(get)?
    } else if get("LWS_LEADER_ADDRESS").is_some() {
        from_lws(get)?
    } else {
        Placement {
            source: Source::Single,
            hosts: Hosts::Named(vec!["127.0.0.1".to_string()]),
            host_index: 0,
            local_rank: explicit.local_rank.unwrap_or(0),
            local_world_size: explicit.local_world_size.unwrap_or(1),
            job_key: "single".to_string(),
        }
    };
    if let Some(key) = &explicit.job_key {
        placement.job_key = key.clone();
    }
    if placement.local_world_size == 0 || placement.local_rank >= placement.local_world_size {
        return Err(EnvError::Inconsistent(format!(
            "local rank {} is not below the {} ranks of this host",
            placement.local_rank, placement.local_world_size
        )));
    }
    if placement.host_index >= placement.hosts.len() {
        return Err(EnvError::Inconsistent(format!(
            "host index {} but the job has {} hosts",
            placement.host_index,
            placement.hosts.len()
        )));
    }
    Ok(placement)
}

fn from_explicit(e: &Explicit) -> Result<Placement, EnvError> {
    let (Some(list), Some(host_index)) = (&e.hosts, e.host_index) else {
        return Err(EnvError::Inconsistent(
            "--hosts and --host-index go together".to_string(),
        ));
    };
    let hosts = expand_hostlist(list)?;
    Ok(Placement {
        source: Source::Explicit,
        job_key: format!("hosts-{:016x}", fnv1a(list.as_bytes())),
        hosts: Hosts::Named(hosts),
        host_index,
        local_rank: e.local_rank.unwrap_or(0),
        local_world_size: e.local_world_size.unwrap_or(1),
    })
}

fn from_slurm(get: &dyn Fn(&str) -> Option<String>) -> Result<Placement, EnvError> {
    let s = Source::Slurm;
    let list = get("SLURM_JOB_NODELIST").unwrap_or_default();
    let hosts = expand_hostlist(&list)?;
    let node_id = number(get, s, "SLURM_NODEID")? as usize;
    let local_rank = to_u32("SLURM_LOCALID", number(get, s, "SLURM_LOCALID")?)?;
    if let Some(n) = optional_number(get, "SLURM_NNODES")?
        && n as usize != hosts.len()
    {
        return Err(EnvError::Inconsistent(format!(
            "SLURM_NNODES={n} but SLURM_JOB_NODELIST={list:?} names {} hosts",
            hosts.len()
        )));
    }
    if let Some(proc_id) = optional_number(get, "SLURM_PROCID")?
        && u64::from(local_rank) > proc_id
    {
        return Err(EnvError::Inconsistent(format!(
            "SLURM_LOCALID={local_rank} is above SLURM_PROCID={proc_id}"
        )));
    }
    // The step's layout, else the job's; "2(x3),1" lists ranks per host.
    let per_node = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]
        .into_iter()
        .find_map(|v| get(v).map(|value| (v, value)));
    let local_world_size = match per_node {
        Some((var, value)) => {
            let counts = expand_tasks_per_node(var, &value)?;
            if counts.len() != hosts.len() {
                return Err(EnvError::Inconsistent(format!(
                    "{var}={value:?} lists {} hosts, SLURM_JOB_NODELIST={list:?} {}",
                    counts.len(),
                    hosts.len()
                )));
            }
            counts.get(node_id).copied().unwrap_or(1)
        }
        None => 1,
    };
    let job = get("SLURM_JOB_ID").unwrap_or_else(|| "0".to_string());
    let step = get("SLURM_STEP_ID").unwrap_or_else(|| "0".to_string());
    Ok(Placement {
        source: s,
        hosts: Hosts::Named(hosts),
        host_index: node_id,
        local_rank,
        local_world_size,
        job_key: format!("slurm-{job}.{step}"),
    })
}

fn from_torchrun(get: &dyn Fn(&str) -> Option<String>) -> Result<Placement, EnvError> {
    let s = Source::Torchrun;
    let master = get("MASTER_ADDR").unwrap_or_default();
    let port = number(get, s, "MASTER_PORT")?;
    let world = number(get, s, "WORLD_SIZE")?;
    let rank = number(get, s, "RANK")?;
    // A Kubeflow PyTorchJob runs one process per pod and sets no LOCAL_*.
    let local_rank = optional_number(get, "LOCAL_RANK")?.unwrap_or(0);
    let local_world = optional_number(get, "LOCAL_WORLD_SIZE")?.unwrap_or(1);
    if world == 0 || rank >= world {
        return Err(EnvError::Inconsistent(format!(
            "RANK={rank} is not below WORLD_SIZE={world}"
        )));
    }
    if local_world == 0 || !world.is_multiple_of(local_world) {
        return Err(EnvError::Inconsistent(format!(
            "WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}"
        )));
    }
    let count = (world / local_world) as usize;
    let group = match optional_number(get, "GROUP_RANK")? {
        Some(g) => g,
        None => rank / local_world,
    };
    if rank / local_world != group || rank % local_world != local_rank {
        return Err(EnvError::Inconsistent(format!(
            "RANK={rank} is not rank {local_rank} of host {group} with LOCAL_WORLD_SIZE={local_world}"
        )));
    }
    Ok(Placement {
        source: s,
        hosts: Hosts::Count {
            count,
            first: master.clone(),
        },
        host_index: group as usize,
        local_rank: to_u32("LOCAL_RANK", local_rank)?,
        local_world_size: to_u32("LOCAL_WORLD_SIZE", local_world)?,
        job_key: format!("torch-{master}-{port}"),
    })
}

fn from_lws(get: &dyn Fn(&str) -> Option<String>) -> Result<Placement, EnvError> {
    let s = Source::LeaderWorkerSet;
    let leader = get("LWS_LEADER_ADDRESS").unwrap_or_default();
    let size = number(get, s, "LWS_GROUP_SIZE")? as usize;
    let index = number(get, s, "LWS_WORKER_INDEX")? as usize;
    Ok(Placement {
        source: s,
        hosts: Hosts::Count {
            count: size,
            first: leader.clone(),
        },
        host_index: index,
        local_rank: 0,
        local_world_size: 1,
        job_key: format!("lws-{leader}"),
    })
}

/// FNV-1a, 64 bits: a stable short name for a host list.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// `SLURM_TASKS_PER_NODE`'s syntax: `2(x3),1` is 2, 2, 2, 1.
pub fn expand_tasks_per_node(var: &'static str, value: &str) -> Result<Vec<u32>, EnvError> {
    let bad = || EnvError::NotANumber {
        var,
        value: value.to_string(),
    };
    let mut out = Vec::new();
    for part in value.split(',') {
        let (count, repeat) = match part.split_once("(x") {
            Some((c, r)) => (c, r.strip_suffix(')').ok_or_else(bad)?),
            None => (part, "1"),
        };
        let count: u32 = count.trim().parse().map_err(|_| bad())?;
        let repeat: usize = repeat.trim().parse().map_err(|_| bad())?;
        if out.len() + repeat > HOSTS_MAX {
            return Err(bad());
        }
        out.extend(std::iter::repeat_n(count, repeat));
    }
    Ok(out)
}

/// Expands a Slurm hostlist: `gpu[01-04,07]`, `a[1-2]-b[3,5]`, `n1,n2`, `10.77.0.[1-4]`.
/// Zero padding is kept (`[08-10]` is `08 09 10`); several brackets in one name give
/// their product, leftmost varying slowest, as Slurm does.
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, EnvError> {
    let err = |problem: &str| EnvError::Hostlist {
        list: list.to_string(),
        problem: problem.to_string(),
    };
    let mut hosts = Vec::new();
    for item in split_top_level(list).map_err(|p| err(&p))? {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        let mut names = vec![String::new()];
        let mut rest = item;
        while let Some(open) = rest.find('[') {
            let close = rest[open..]
                .find(']')
                .map(|c| open + c)
                .ok_or_else(|| err("a '[' is not closed"))?;
            let prefix = &rest[..open];
            let ranges = expand_ranges(&rest[open + 1..close]).map_err(|p| err(&p))?;
            if names.len().saturating_mul(ranges.len()) + hosts.len() > HOSTS_MAX {
                return Err(err(&format!("expands to more than {HOSTS_MAX} hosts")));
            }
            names = names
                .iter()
                .flat_map(|n| ranges.iter().map(move |r| format!("{n}{prefix}{r}")))
                .collect();
            rest = &rest[close + 1..];
        }
        if rest.contains(']') {
            return Err(err("a ']' has no '['"));
        }
        hosts.extend(names.into_iter().map(|n| n + rest));
    }
    if hosts.is_empty() {
        return Err(err("names no host"));
    }
    Ok(hosts)
}

/// Splits at commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let (mut depth, mut start, mut items) = (0u32, 0, Vec::new());
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth > 0 => return Err("nested '['".to_string()),
            '[' => depth = 1,
            ']' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&list[start..]);
    Ok(items)
}

/// `01-04,07` as `["01", "02", "03", "04", "07"]`.
fn expand_ranges(spec: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for part in spec.split(',') {
        let part = part.trim();
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let width = lo.len();
        let (a, b): (u64, u64) = match (lo.parse(), hi.parse()) {
            (Ok(a), Ok(b)) if a <= b => (a, b),
            _ => return Err(format!("{part:?} is not a number or a rising range")),
        };
        if b - a >= HOSTS_MAX as u64 || out.len() + (b - a) as usize >= HOSTS_MAX {
            return Err(format!("expands to more than {HOSTS_MAX} hosts"));
        }
        out.extend((a..=b).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    /// [`detect`] with nothing explicit and only the variables `pairs`.
    fn detect_in(pairs: &[(&str, &str)]) -> Result<Placement, EnvError> {
        detect(&Explicit::default(), &env(pairs))
    }

    fn named(p: &Placement) -> Vec<String> {
        match &p.hosts {
            Hosts::Named(h) => h.clone(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn hostlists_expand_like_slurm() {
        assert_eq!(
            expand_hostlist("gpu[01-04,07]").unwrap(),
            ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]
        );
        assert_eq!(
            expand_hostlist("a[1-2]-b[3,5]").unwrap(),
            ["a1-b3", "a1-b5", "a2-b3", "a2-b5"]
        );
        assert_eq!(
            expand_hostlist("n1,n2,gpu[8-10]x").unwrap(),
            ["n1", "n2", "gpu8x", "gpu9x", "gpu10x"]
        );
        assert_eq!(
            expand_hostlist("node[08-10]").unwrap(),
            ["node08", "node09", "node10"]
        );
        assert_eq!(
            expand_hostlist("10.77.0.[1-3],10.77.0.9").unwrap(),
            ["10.77.0.1", "10.77.0.2", "10.77.0.3", "10.77.0.9"]
        );
        assert_eq!(expand_hostlist("solo").unwrap(), ["solo"]);
    }

    #[test]
    fn bad_hostlists_are_refused() {
        for bad in [
            "gpu[1-",
            "gpu[3-1]",
            "gpu[a-b]",
            "x]",
            "",
            "a[[1]]",
            "n[0-99999999]",
        ] {
            let e = expand_hostlist(bad).unwrap_err();
            assert!(matches!(e, EnvError::Hostlist { .. }), "{bad}: {e}");
        }
    }

    #[test]
    fn tasks_per_node_expands_repeats() {
        let v = expand_tasks_per_node("SLURM_TASKS_PER_NODE", "2(x3),1").unwrap();
        assert_eq!(v, [2, 2, 2, 1]);
        assert!(expand_tasks_per_node("V", "2(x3").is_err());
    }

    #[test]
    fn slurm_step_is_detected() {
        let p = detect_in(&[
            ("SLURM_JOB_NODELIST", "gpu[01-03]"),
            ("SLURM_NNODES", "3"),
            ("SLURM_NODEID", "1"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_PROCID", "3"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x3)"),
            ("SLURM_JOB_ID", "42"),
            ("SLURM_STEP_ID", "0"),
            // torchrun inside srun: Slurm wins.
            ("MASTER_ADDR", "gpu01"),
            ("WORLD_SIZE", "6"),
        ])
        .unwrap();
        assert_eq!(p.source, Source::Slurm);
        assert_eq!(named(&p), ["gpu01", "gpu02", "gpu03"]);
        assert_eq!((p.host_index, p.local_rank, p.local_world_size), (1, 1, 2));
        assert_eq!(p.job_key, "slurm-42.0");
    }

    #[test]
    fn inconsistent_slurm_is_refused() {
        let base = [
            ("SLURM_JOB_NODELIST", "gpu[01-03]"),
            ("SLURM_NODEID", "0"),
            ("SLURM_LOCALID", "0"),
        ];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            detect_in(&v)
        };
        assert!(matches!(
            with(&[("SLURM_NNODES", "4")]),
            Err(EnvError::Inconsistent(_))
        ));
        assert!(matches!(
            with(&[("SLURM_TASKS_PER_NODE", "1(x2)")]),
            Err(EnvError::Inconsistent(_))
        ));
        let e = detect_in(&[("SLURM_JOB_NODELIST", "a"), ("SLURM_NODEID", "0")]).unwrap_err();
        assert_eq!(
            e,
            EnvError::Missing {
                launcher: Source::Slurm,
                var: "SLURM_LOCALID"
            }
        );
        let e = detect_in(&[
            ("SLURM_JOB_NODELIST", "a[1-2]"),
            ("SLURM_NODEID", "2"),
            ("SLURM_LOCALID", "0"),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("host index 2"), "{e}");
        let e = with(&[("SLURM_PROCID", "x")]).unwrap_err();
        assert!(
            matches!(
                e,
                EnvError::NotANumber {
                    var: "SLURM_PROCID",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn torchrun_is_detected() {
        let p = detect_in(&[
            ("MASTER_ADDR", "10.77.0.1"),
            ("MASTER_PORT", "29500"),
            ("WORLD_SIZE", "8"),
            ("RANK", "5"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("GROUP_RANK", "2"),
        ])
        .unwrap();
        assert_eq!(p.source, Source::Torchrun);
        assert_eq!(
            p.hosts,
            Hosts::Count {
                count: 4,
                first: "10.77.0.1".into()
            }
        );
        assert_eq!((p.host_index, p.local_rank, p.local_world_size), (2, 1, 2));
        assert_eq!(p.job_key, "torch-10.77.0.1-29500");
    }

    #[test]
    fn kubeflow_pytorchjob_is_one_rank_per_host() {
        let p = detect_in(&[
            ("MASTER_ADDR", "job-master-0"),
            ("MASTER_PORT", "23456"),
            ("WORLD_SIZE", "3"),
            ("RANK", "2"),
        ])
        .unwrap();
        assert_eq!((p.host_index, p.local_rank, p.local_world_size), (2, 0, 1));
        assert_eq!(p.hosts.len(), 3);
    }

    #[test]
    fn inconsistent_torchrun_is_refused() {
        let t = |world: &'static str, rank: &'static str, group: &'static str| {
            detect_in(&[
                ("MASTER_ADDR", "m"),
                ("MASTER_PORT", "1"),
                ("WORLD_SIZE", world),
                ("RANK", rank),
                ("LOCAL_RANK", "1"),
                ("LOCAL_WORLD_SIZE", "2"),
                ("GROUP_RANK", group),
            ])
        };
        assert!(t("8", "3", "1").is_ok());
        assert!(matches!(t("7", "3", "1"), Err(EnvError::Inconsistent(_))));
        assert!(matches!(t("8", "8", "4"), Err(EnvError::Inconsistent(_))));
        assert!(matches!(t("8", "3", "2"), Err(EnvError::Inconsistent(_))));
        assert!(matches!(t("8", "2", "1"), Err(EnvError::Inconsistent(_))));
        let e = detect_in(&[("MASTER_ADDR", "m"), ("WORLD_SIZE", "2"), ("RANK", "0")]).unwrap_err();
        assert_eq!(
            e,
            EnvError::Missing {
                launcher: Source::Torchrun,
                var: "MASTER_PORT"
            }
        );
    }

    #[test]
    fn leaderworkerset_is_detected() {
        let p = detect_in(&[
            ("LWS_LEADER_ADDRESS", "pool-0.pool.default"),
            ("LWS_GROUP_SIZE", "4"),
            ("LWS_WORKER_INDEX", "3"),
        ])
        .unwrap();
        assert_eq!(p.source, Source::LeaderWorkerSet);
        assert_eq!((p.host_index, p.hosts.len()), (3, 4));
        let e = detect_in(&[
            ("LWS_LEADER_ADDRESS", "l"),
            ("LWS_GROUP_SIZE", "4"),
            ("LWS_WORKER_INDEX", "4"),
        ])
        .unwrap_err();
        assert!(matches!(e, EnvError::Inconsistent(_)), "{e}");
    }

    #[test]
    fn explicit_hosts_come_first() {
        let explicit = Explicit {
            hosts: Some("10.77.0.[1-4]".into()),
            host_index: Some(3),
            local_rank: Some(1),
            local_world_size: Some(2),
            job_key: Some("t1".into()),
        };
        let p = detect(&explicit, &env(&[("SLURM_JOB_NODELIST", "x")])).unwrap();
        assert_eq!(p.source, Source::Explicit);
        assert_eq!(named(&p)[3], "10.77.0.4");
        assert_eq!((p.host_index, p.local_rank, p.local_world_size), (3, 1, 2));
        assert_eq!(p.job_key, "t1");
        let half = Explicit {
            hosts: Some("a,b".into()),
            ..Explicit::default()
        };
        assert!(matches!(
            detect(&half, &env(&[])),
            Err(EnvError::Inconsistent(_))
        ));
    }

    #[test]
    fn nothing_detected_is_one_host() {
        let p = detect_in(&[]).unwrap();
        assert_eq!(p.source, Source::Single);
        assert_eq!(named(&p), ["127.0.0.1"]);
        assert_eq!((p.host_index, p.local_rank, p.local_world_size), (0, 0, 1));
    }
}
