//! The node's `/status` document (the node's own type, served as JSON on its `metrics_addr`) and a query of
//! every node of a pool at once.
//!
//! Every field has a default when absent, so a node of a slightly older or newer version
//! still reads; unknown fields are ignored. A node that does not answer, answers with an
//! error status or with something that is not a status document is reported down with
//! the reason; [`query_pool`] never fails as a whole.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Serialize;

use crate::http::{self, HttpError};

/// Default time a node has to answer `/status`: 1 s (a loopback answer takes well under
/// a millisecond; a node busy enough to take longer is worth calling slow).
pub const STATUS_TIMEOUT_DEFAULT: Duration = Duration::from_secs(1);

pub use spillway_node::http::{HostTierStatus, MemberStatus, NodeStatus, RemoteStatus};

/// Why a node's status could not be read.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    /// No HTTP answer.
    #[error(transparent)]
    Http(#[from] HttpError),
    /// An answer, but not 200.
    #[error("{addr} answered HTTP {status}")]
    Status {
        /// The address.
        addr: SocketAddr,
        /// The code.
        status: u16,
    },
    /// A 200 answer that is not a status document.
    #[error("{addr} sent a /status that does not parse: {problem}")]
    Json {
        /// The address.
        addr: SocketAddr,
        /// serde's message.
        problem: String,
    },
}

/// GETs and parses `/status` from `addr` within `timeout`.
pub fn fetch_status(addr: SocketAddr, timeout: Duration) -> Result<NodeStatus, StatusError> {
    let response = http::get(addr, "/status", timeout)?;
    if response.status != 200 {
        return Err(StatusError::Status {
            addr,
            status: response.status,
        });
    }
    serde_json::from_slice(&response.body).map_err(|e| StatusError::Json {
        addr,
        problem: e.to_string(),
    })
}

/// One node's answer (or why there is none).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NodeReport {
    /// The address queried, as given.
    pub target: String,
    /// The node id expected there (from `cluster.json`), if known.
    pub expected_id: Option<u64>,
    /// Whether it answered.
    pub up: bool,
    /// Why it is down.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Its status.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<NodeStatus>,
}

/// Every node's answer, and what they agree on.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PoolReport {
    /// Nodes that answered.
    pub answering: usize,
    /// Nodes that answered and take part in the metadata group (`raft_healthy`): one that
    /// answers but whose Raft log fails is counted in `answering` only.
    pub raft_healthy: usize,
    /// The leader: the node that says it leads in the highest term among those that
    /// answered (`None` if none does).
    pub leader: Option<u64>,
    /// That leader's term.
    pub term: Option<u64>,
    /// Whether every node that answered names that leader.
    pub leader_agreed: bool,
    /// The members as the leader sees them (else as the first node that answered).
    pub members: Vec<MemberStatus>,
    /// Each node, in the order queried.
    pub nodes: Vec<NodeReport>,
}

impl PoolReport {
    /// Builds the summary from each node's answer.
    pub fn from_nodes(nodes: Vec<NodeReport>) -> PoolReport {
        let answers: Vec<&NodeStatus> = nodes.iter().filter_map(|n| n.status.as_ref()).collect();
        let leader_status = answers
            .iter()
            .filter(|s| s.is_leader())
            .max_by_key(|s| s.term)
            .copied();
        let leader = leader_status.map(|s| s.node_id);
        let leader_agreed = leader.is_some()
            && answers
                .iter()
                .all(|s| s.node_id == leader.unwrap_or(0) || s.known_leader() == leader);
        let members = leader_status
            .or_else(|| answers.first().copied())
            .map(|s| s.members.clone())
            .unwrap_or_default();
        PoolReport {
            answering: answers.len(),
            raft_healthy: answers.iter().filter(|s| s.raft_healthy).count(),
            leader,
            term: leader_status.map(|s| s.term),
            leader_agreed,
            members,
            nodes,
        }
    }

    /// Whether `total` nodes answered, all healthy, agree on the leader and have committed
    /// the same index: nothing in flight that a fail-over would have to finish first.
    pub fn settled(&self, total: usize) -> bool {
        let mut commits = self
            .nodes
            .iter()
            .filter_map(|n| n.status.as_ref().map(|s| s.commit_index));
        let first = commits.next();
        self.answering == total
            && self.raft_healthy == total
            && self.leader_agreed
            && commits.all(|c| Some(c) == first)
    }

    /// The status of node `id`, if it answered.
    pub fn node(&self, id: u64) -> Option<&NodeStatus> {
        self.nodes
            .iter()
            .filter_map(|n| n.status.as_ref())
            .find(|s| s.node_id == id)
    }
}

/// Queries every target at once (one thread each), each within `timeout`.
/// `targets`: (host:port, the node id expected there if known).
pub fn query_pool(targets: &[(String, Option<u64>)], timeout: Duration) -> PoolReport {
    let nodes = std::thread::scope(|scope| {
        let handles: Vec<_> = targets
            .iter()
            .map(|(target, expected_id)| {
                scope.spawn(move || {
                    let answer = http::resolve(target)
                        .map_err(StatusError::from)
                        .and_then(|addr| fetch_status(addr, timeout));
                    match answer {
                        Ok(status) => NodeReport {
                            target: target.clone(),
                            expected_id: *expected_id,
                            up: true,
                            error: None,
                            status: Some(status),
                        },
                        Err(e) => NodeReport {
                            target: target.clone(),
                            expected_id: *expected_id,
                            up: false,
                            error: Some(e.to_string()),
                            status: None,
                        },
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("status queries do not panic"))
            .collect()
    });
    PoolReport::from_nodes(nodes)
}
