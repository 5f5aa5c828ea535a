//! The faults a simulation injects, and the schedule a seed draws.
//!
//! Each fault carries its own length: the world applies it at `at_ms` and heals it
//! after `ms` (a crashed node restarts, a paused one resumes, a cut link comes back, the
//! network's loss, delay or duplication returns to normal). Link faults (partitions and
//! pauses) never overlap one another, nor do network conditions; crashes run on their
//! own timeline, so a crash can meet a partition. What each models:
//!
//! | fault | models |
//! |---|---|
//! | `Crash` | a process killed (`SIGKILL`, power loss): its RAM (host tier, brain, client) is gone, its log stays; with `torn`, the write it was doing is half on disk (garbage after the log's last record) |
//! | `Pause` | a process stopped (`SIGSTOP`, a long GC or swap storm, a VM migration): page messages to and from it wait until it resumes, its Raft peers hear nothing |
//! | `Isolate` | a node's links all cut, both ways |
//! | `CutIn` / `CutOut` | one-way: the node hears nobody / nobody hears it |
//! | `CutFromLeader` | the node and the leader of the moment cannot reach each other; the rest can |
//! | `Split` | a minority of the nodes cut from the majority |
//! | `Loss` | every message (Raft and pages) lost with this probability |
//! | `Delay` | every message delayed up to this long (so reordered) |
//! | `Duplicate` | page messages delivered twice with this probability |

use serde::Serialize;
use spillway_meta::rng::SimRng;
use spillway_types::NodeId;

/// One fault with its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "fault", rename_all = "snake_case")]
pub enum Fault {
    /// Node `node` crashes, and restarts after `ms`.
    Crash {
        /// The node.
        node: u64,
        /// Whether its last log write is torn.
        torn: bool,
        /// How long it stays down.
        ms: u64,
    },
    /// Node `node` stops for `ms`.
    Pause {
        /// The node.
        node: u64,
        /// How long.
        ms: u64,
    },
    /// Node `node` cut off both ways for `ms`.
    Isolate {
        /// The node.
        node: u64,
        /// How long.
        ms: u64,
    },
    /// Node `node` receives nothing for `ms`.
    CutIn {
        /// The node.
        node: u64,
        /// How long.
        ms: u64,
    },
    /// Nothing node `node` sends arrives for `ms`.
    CutOut {
        /// The node.
        node: u64,
        /// How long.
        ms: u64,
    },
    /// Node `node` and the leader (when the fault starts) cut from each other for `ms`.
    CutFromLeader {
        /// The node.
        node: u64,
        /// How long.
        ms: u64,
    },
    /// Nodes `1..=minority` cut from the others for `ms`.
    Split {
        /// The minority's size.
        minority: u64,
        /// How long.
        ms: u64,
    },
    /// Every message lost with probability `permille / 1000` for `ms`.
    Loss {
        /// Per mille.
        permille: u64,
        /// How long.
        ms: u64,
    },
    /// Every message delayed by up to `max_ms` for `ms`.
    Delay {
        /// Largest delay.
        max_ms: u64,
        /// How long.
        ms: u64,
    },
    /// Page messages delivered twice with probability `permille / 1000` for `ms`.
    Duplicate {
        /// Per mille.
        permille: u64,
        /// How long.
        ms: u64,
    },
    /// Node `node`'s clock reads `skew_ms` off (ahead when positive) for `ms`: what it
    /// stamps on its proposals (the group's clock, which reservations expire by) and what
    /// its brain spends reservations by.
    ClockSkew {
        /// The node.
        node: u64,
        /// Off by, ms.
        skew_ms: i64,
        /// How long.
        ms: u64,
    },
    /// Node `node`'s clock stands still for `ms`, then jumps to the time (a VM paused
    /// with its clock, a clock stepped back by NTP and held monotonic).
    ClockStop {
        /// The node.
        node: u64,
        /// How long.
        ms: u64,
    },
    /// Node `node`'s log disk is slow for `ms`: each write takes `write_ms`, so every
    /// Raft message it sends leaves that much later.
    SlowDisk {
        /// The node.
        node: u64,
        /// Per write.
        write_ms: u64,
        /// How long.
        ms: u64,
    },
}

impl Fault {
    /// How long it lasts.
    pub fn ms(&self) -> u64 {
        match *self {
            Fault::Crash { ms, .. }
            | Fault::Pause { ms, .. }
            | Fault::Isolate { ms, .. }
            | Fault::CutIn { ms, .. }
            | Fault::CutOut { ms, .. }
            | Fault::CutFromLeader { ms, .. }
            | Fault::Split { ms, .. }
            | Fault::Loss { ms, .. }
            | Fault::Delay { ms, .. }
            | Fault::Duplicate { ms, .. }
            | Fault::ClockSkew { ms, .. }
            | Fault::ClockStop { ms, .. }
            | Fault::SlowDisk { ms, .. } => ms,
        }
    }

    /// The node it is about, if one.
    pub fn node(&self) -> Option<NodeId> {
        match *self {
            Fault::Crash { node, .. }
            | Fault::Pause { node, .. }
            | Fault::Isolate { node, .. }
            | Fault::CutIn { node, .. }
            | Fault::CutOut { node, .. }
            | Fault::CutFromLeader { node, .. }
            | Fault::ClockSkew { node, .. }
            | Fault::ClockStop { node, .. }
            | Fault::SlowDisk { node, .. } => Some(NodeId(node)),
            _ => None,
        }
    }
}

/// A fault and when it starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ScheduledFault {
    /// Simulated time it starts at, ms.
    pub at_ms: u64,
    /// The fault.
    #[serde(flatten)]
    pub fault: Fault,
}

/// Which kinds of fault a run injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultMix {
    /// Crashes and restarts (with torn writes).
    pub crashes: bool,
    /// Pauses.
    pub pauses: bool,
    /// Partitions of every kind.
    pub partitions: bool,
    /// Loss, delay and duplication.
    pub network: bool,
    /// Clocks skewed or stopped.
    pub clocks: bool,
    /// Slow log disks.
    pub disks: bool,
}

impl FaultMix {
    /// Every kind.
    pub fn all() -> Self {
        FaultMix {
            crashes: true,
            pauses: true,
            partitions: true,
            network: true,
            clocks: true,
            disks: true,
        }
    }

    /// None: the workload alone.
    pub fn none() -> Self {
        FaultMix {
            crashes: false,
            pauses: false,
            partitions: false,
            network: false,
            clocks: false,
            disks: false,
        }
    }
}

/// The faults of a run of `length_ms` over `nodes` nodes, drawn from `rng`: a link fault
/// or a network condition every 2 to 8 s (one at a time of each), a crash every 5 to
/// 15 s (a node down 1 to 8 s), and a node's clock or disk fault every 4 to 12 s (one at
/// a time; drawn last, so the other faults of a seed are those drawn without it).
/// Nothing starts in the first 3 s (the pool forms) or in the last 5 s before
/// `length_ms`.
pub fn schedule(
    rng: &mut SimRng,
    mix: FaultMix,
    nodes: u64,
    length_ms: u64,
) -> Vec<ScheduledFault> {
    let mut out = Vec::new();
    let end = length_ms.saturating_sub(5_000);
    let node = |rng: &mut SimRng| 1 + rng.below(nodes);
    // Links and network conditions: one timeline each.
    let mut t = 3_000;
    let mut t_net = 3_000;
    loop {
        t += rng.between(2_000, 8_000);
        if t >= end {
            break;
        }
        let ms = rng.between(500, 6_000);
        let pick = rng.below(10);
        let fault = match pick {
            0..=4 if mix.partitions => match pick {
                0 => Fault::Isolate {
                    node: node(rng),
                    ms,
                },
                1 => Fault::CutIn {
                    node: node(rng),
                    ms,
                },
                2 => Fault::CutOut {
                    node: node(rng),
                    ms,
                },
                3 => Fault::CutFromLeader {
                    node: node(rng),
                    ms,
                },
                _ => Fault::Split {
                    minority: 1 + rng.below((nodes - 1) / 2),
                    ms,
                },
            },
            5 | 6 if mix.pauses => Fault::Pause {
                node: node(rng),
                ms: rng.between(500, 10_000),
            },
            7..=9 if mix.network && t_net <= t => {
                let f = match rng.below(3) {
                    0 => Fault::Loss {
                        permille: rng.between(10, 300),
                        ms,
                    },
                    1 => Fault::Delay {
                        max_ms: rng.between(5, 400),
                        ms,
                    },
                    _ => Fault::Duplicate {
                        permille: rng.between(50, 500),
                        ms,
                    },
                };
                t_net = t + ms;
                out.push(ScheduledFault { at_ms: t, fault: f });
                continue;
            }
            _ => continue,
        };
        out.push(ScheduledFault { at_ms: t, fault });
        t += fault.ms();
    }
    if mix.crashes {
        let mut t = 3_000;
        loop {
            t += rng.between(5_000, 15_000);
            if t >= end {
                break;
            }
            let fault = Fault::Crash {
                node: node(rng),
                torn: rng.chance(0.5),
                ms: rng.between(1_000, 8_000),
            };
            out.push(ScheduledFault { at_ms: t, fault });
        }
    }
    if mix.clocks || mix.disks {
        let mut t = 3_000;
        loop {
            t += rng.between(4_000, 12_000);
            if t >= end {
                break;
            }
            let node = node(rng);
            let ms = rng.between(1_000, 10_000);
            let disk = !mix.clocks || (mix.disks && rng.below(3) == 0);
            let fault = if disk {
                Fault::SlowDisk {
                    node,
                    write_ms: rng.between(20, 500),
                    ms,
                }
            } else if rng.below(3) == 0 {
                Fault::ClockStop { node, ms }
            } else {
                // Seconds (as NTP leaves them) or minutes (an unsynchronised host, a
                // restored VM): past a reservation's life (10 minutes) either way.
                let by = if rng.below(2) == 0 {
                    rng.between(1_000, 60_000)
                } else {
                    rng.between(60_000, 1_200_000)
                } as i64;
                Fault::ClockSkew {
                    node,
                    skew_ms: if rng.below(2) == 0 { by } else { -by },
                    ms,
                }
            };
            out.push(ScheduledFault { at_ms: t, fault });
            t += ms;
        }
    }
    out.sort_by_key(|f| f.at_ms);
    out
}
