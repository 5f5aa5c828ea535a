//! Who is in the pool: hosts join with a token, learners become voters, leaving hosts
//! drain and are removed. Every change goes through Raft (`MembershipChange`).
//!
//! - **Joining** ([`join_pool`]): a host that has no certificate yet runs
//!   `spillway_net::join::join` against the bootstrap endpoint of the node holding the
//!   pool's CA ([`NodeHandle::serve_joins`]): its key is made here, the CA signs its
//!   request, and the endpoint proposes `AddLearner` for it (taking the lead first when it
//!   follows: a follower's leadership transfer to itself, which raft-rs forwards to the
//!   leader). The host writes its pool directory and a marker, `<data_dir>/joined`, so
//!   its Raft log starts empty and waits for the leader's snapshot instead of founding a
//!   pool of its own, now and after any restart.
//! - **Promotion and removal** ([`next_change`], sans-IO; run by the leader's Raft thread
//!   every [`RECONCILE_EVERY`]): a caught-up, up learner (the lowest id first, so the
//!   first hosts of a launched job vote) is promoted while the voters
//!   (leaving ones not counted) are fewer than [`voters_wanted`] (3, or 5 in pools of 5
//!   or more members); a leaving member that holds no pages and no reservations is
//!   removed (a leaving leader first hands leadership over). One change at a time.
//! - **Leaving** ([`NodeHandle::leave`]): the node declares itself `Leaving`; it takes no
//!   new pages, the origins of the pages it holds copy them to other holders (their
//!   repair treats a leaving holder's copy as one to replace), and once it holds nothing
//!   the leader removes it. It then disappears from every member's status.
//! - **Removal** (`spillway cluster remove`, [`spillway_net::join::remove`]): an
//!   operator holding the CA key removes a host that died for good, through the
//!   bootstrap endpoint with a token. The node serving joins refuses itself, the leader,
//!   and a member it sees up (unless forced: it should leave, so its pages move first).
//!   The removal drops the member's copies from the directory (they died with it); the
//!   pages' origins re-replicate them from their other copies, and a learner takes its
//!   vote.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use spillway_meta::{MemberInfo, MemberState, MembershipChange, MetaNode, MetaState, Update};
use spillway_meta::{PeerProgress, ProposeError};
use spillway_net::certs::{self, CertError, NodeIdentity, PoolCa};
use spillway_net::join::{
    Admission, BootstrapServer, JoinError, JoinHandler, JoinParams, JoinRefusal, JoinReply,
    JoinRequest, JoinToken, RemoveReply, RemoveRequest, TokenError, TokenStore,
};
use spillway_types::NodeId;

use crate::config::{MemberAddr, NodeConfig};
use crate::meta::{MetaDriver, ProposeFailure, now_ms};
use crate::node::NodeHandle;

/// Voters wanted in a pool of fewer than [`LARGE_POOL_MEMBERS`] members: 3.
pub const VOTERS_SMALL: usize = 3;
/// Voters wanted in a pool of at least [`LARGE_POOL_MEMBERS`] members: 5.
pub const VOTERS_LARGE: usize = 5;
/// Members from which a pool wants [`VOTERS_LARGE`] voters: 5.
pub const LARGE_POOL_MEMBERS: usize = 5;
/// How often the leader looks for a membership change to make: 500 ms.
pub const RECONCILE_EVERY: Duration = Duration::from_millis(500);
/// A learner is promoted only when its log is within this many entries of the commit
/// index: 64 (it then votes with a log that is nearly current).
pub const PROMOTE_LAG_ENTRIES_MAX: u64 = 64;
/// The marker a joined node keeps in its data directory.
pub const JOINED_MARKER: &str = "joined";
/// Time a leaving node waits, by default, for its pages to be copied away and its
/// removal: 120 s.
pub const LEAVE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(120);

/// Voters a pool of `members` members (leaving ones not counted) wants.
pub fn voters_wanted(members: usize) -> usize {
    if members >= LARGE_POOL_MEMBERS {
        VOTERS_LARGE
    } else {
        VOTERS_SMALL
    }
}

/// What the leader should do about membership now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// Nothing.
    Nothing,
    /// Propose this change.
    Propose(MembershipChange),
    /// The leader itself is leaving and drained: hand leadership to this voter first.
    HandOver(NodeId),
}

/// The next membership change, from the applied `state`, the configuration (`voters`,
/// `learners`), the leader's view of its peers' logs (`progress`) and the commit index.
/// Sans-IO: the leader's Raft thread acts on it.
pub fn next_change(
    me: NodeId,
    state: &MetaState,
    voters: &[NodeId],
    learners: &[NodeId],
    progress: &[PeerProgress],
    commit_index: u64,
) -> Next {
    let in_group = |n: NodeId| voters.contains(&n) || learners.contains(&n);
    let leaving = |n: NodeId| {
        state
            .member(n)
            .is_some_and(|m| m.state == MemberState::Leaving)
    };
    let caught_up = |n: NodeId| {
        progress.iter().any(|p| {
            p.id == n
                && p.recently_active
                && p.matched_index + PROMOTE_LAG_ENTRIES_MAX >= commit_index
        })
    };
    for m in state.members() {
        if m.state != MemberState::Leaving || !in_group(m.id) {
            continue;
        }
        let usage = state.usage(m.id).unwrap_or_default();
        if usage.used_bytes != 0 || usage.reserved_bytes != 0 {
            continue;
        }
        if m.id != me {
            return Next::Propose(MembershipChange::Remove { node: m.id });
        }
        if let Some(to) = voters
            .iter()
            .copied()
            .filter(|&v| v != me && !leaving(v) && caught_up(v))
            .max_by_key(|v| {
                progress
                    .iter()
                    .find(|p| p.id == *v)
                    .map(|p| p.matched_index)
            })
        {
            return Next::HandOver(to);
        }
    }
    let staying = state
        .members()
        .filter(|m| m.state != MemberState::Leaving)
        .count();
    let voting = voters.iter().filter(|&&v| !leaving(v)).count();
    if voting < voters_wanted(staying)
        && let Some(node) = learners
            .iter()
            .copied()
            .filter(|&l| {
                state.member(l).is_some_and(|m| m.state == MemberState::Up) && caught_up(l)
            })
            .min()
    {
        return Next::Propose(MembershipChange::Promote { node });
    }
    Next::Nothing
}

/// Acts on [`next_change`] on the leader's Raft thread.
pub(crate) fn reconcile(node: &mut MetaNode) {
    let status = node.status();
    let progress = node.peers();
    let next = next_change(
        status.id,
        node.state(),
        &status.voters,
        &status.learners,
        &progress,
        status.commit_index,
    );
    match next {
        Next::Nothing => {}
        Next::HandOver(to) => {
            tracing::info!(node = %status.id, %to, "leaving and drained: handing leadership over");
            node.transfer_leader(to);
        }
        Next::Propose(change) => match node.propose_membership(&change) {
            Ok(_) => tracing::info!(node = %status.id, ?change, "membership change proposed"),
            Err(ProposeError::ConfChangePending) => {}
            Err(e) => {
                tracing::warn!(node = %status.id, ?change, error = %e, "membership change refused")
            }
        },
    }
}

/// Why a host could not join.
#[derive(Debug, thiserror::Error)]
pub enum JoinNodeError {
    /// The token is not a token.
    #[error(transparent)]
    Token(#[from] TokenError),
    /// The join itself failed (the typed reason inside).
    #[error(transparent)]
    Join(#[from] JoinError),
    /// The node's files could not be written.
    #[error(transparent)]
    Cert(#[from] CertError),
    /// The marker could not be written.
    #[error("cannot write {}: {source}", path.display())]
    Marker {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Peers could not reach this node at its `listen_addr`.
    #[error(
        "listen_addr {addr} is not an address peers can reach: set it to this host's IP and a fixed port to join"
    )]
    Unreachable {
        /// The address.
        addr: SocketAddr,
    },
}

/// Whether `config`'s node joined a pool (its data directory has the marker).
pub fn joined(config: &NodeConfig) -> bool {
    config.data_dir.join(JOINED_MARKER).exists()
}

/// Joins the pool at `server` (`HOST:PORT`, a bootstrap endpoint) with `token`, unless
/// this node has its certificate already (a restart): then it only makes sure the marker
/// is there. On a join, writes the pool directory (`pool_id`, `ca.pem`, the node's
/// certificate and key) and the marker, and sets `config.members` to the members the
/// pool named (and this node), whom the node reaches first. Call before `Node::start`.
pub async fn join_pool(
    config: &mut NodeConfig,
    server: &str,
    token: &str,
) -> Result<(), JoinNodeError> {
    let has_identity = NodeIdentity::load(&config.pool_dir, config.node_id).is_ok();
    if !has_identity {
        let addr = config.listen_addr;
        if addr.port() == 0 || addr.ip().is_unspecified() {
            return Err(JoinNodeError::Unreachable { addr });
        }
        let token: JoinToken = token.parse()?;
        let params = JoinParams {
            node: config.node_id,
            addr,
            zone: None,
        };
        let joined = spillway_net::join::join(server, &token, &params).await?;
        certs::write_pool_public(&config.pool_dir, joined.identity.pool_id, &joined.ca_pem)?;
        joined.identity.write(&config.pool_dir)?;
        let mut members: Vec<MemberAddr> = joined
            .members
            .iter()
            .filter(|(id, _)| *id != config.node_id)
            .map(|&(id, addr)| MemberAddr { id, addr })
            .collect();
        members.push(MemberAddr {
            id: config.node_id,
            addr,
        });
        config.members = members;
        tracing::info!(node = %config.node_id, pool = %joined.identity.pool_id, server, "joined the pool as a learner");
    }
    std::fs::create_dir_all(&config.data_dir).map_err(|source| JoinNodeError::Marker {
        path: config.data_dir.clone(),
        source,
    })?;
    let marker = config.data_dir.join(JOINED_MARKER);
    std::fs::write(
        &marker,
        b"joined with a token; the Raft log starts from the leader's snapshot\n",
    )
    .map_err(|source| JoinNodeError::Marker {
        path: marker,
        source,
    })?;
    Ok(())
}

/// Decides joins on the node holding the CA key (see the module docs).
struct JoinAuthority {
    ca: PoolCa,
    tokens: TokenStore,
    meta: Arc<MetaDriver>,
    me: (NodeId, SocketAddr),
}

impl JoinHandler for JoinAuthority {
    async fn admit(&self, r: JoinRequest) -> JoinReply {
        match self.admit_inner(r).await {
            Ok(a) => JoinReply::Accepted(a),
            Err(e) => JoinReply::Refused(e),
        }
    }

    async fn remove(&self, r: RemoveRequest) -> RemoveReply {
        match self.remove_inner(r).await {
            Ok(()) => RemoveReply::Removed,
            Err(e) => RemoveReply::Refused(e),
        }
    }
}

impl JoinAuthority {
    /// Removes a member for an operator (see [`spillway_net::join::remove`]): not this
    /// node, not the leader, not one that is up unless forced; the token is used up only
    /// for a removal that goes ahead.
    async fn remove_inner(&self, r: RemoveRequest) -> Result<(), JoinRefusal> {
        let node = NodeId(r.node);
        self.tokens.check(r.token_id, &r.secret, now_ms())?;
        let view = self.meta.view();
        let member = view
            .members
            .iter()
            .find(|m| m.id == node)
            .ok_or(JoinRefusal::NotAMember { node: r.node })?;
        let busy = |role: &str| JoinRefusal::Busy {
            node: r.node,
            role: role.to_string(),
        };
        if node == self.me.0 {
            return Err(busy("serves joins"));
        }
        if view.leader == Some(node) {
            return Err(busy("leads the pool"));
        }
        if member.state == MemberState::Up && !r.force {
            return Err(JoinRefusal::NodeUp { node: r.node });
        }
        self.tokens.consume(r.token_id, &r.secret, now_ms())?;
        tracing::info!(%node, state = ?member.state, force = r.force, "removing a member for an operator");
        self.meta
            .change_membership(MembershipChange::Remove { node })
            .await
            .map_err(|e| JoinRefusal::Membership {
                reason: e.to_string(),
            })
    }

    async fn admit_inner(&self, r: JoinRequest) -> Result<Admission, JoinRefusal> {
        let node = NodeId(r.node);
        self.tokens.check(r.token_id, &r.secret, now_ms())?;
        if node.0 > crate::config::NODE_ID_MAX {
            return Err(JoinRefusal::BadRequest {
                reason: format!("node ids end at {}", crate::config::NODE_ID_MAX),
            });
        }
        if self.meta.view().members.iter().any(|m| m.id == node) {
            return Err(JoinRefusal::NodeTaken { node: r.node });
        }
        // Signing checks the request; the token is used up only for a good one.
        let cert_pem =
            self.ca
                .sign_node_csr(node, &r.csr_der)
                .map_err(|e| JoinRefusal::BadCsr {
                    reason: e.to_string(),
                })?;
        self.tokens.consume(r.token_id, &r.secret, now_ms())?;
        let member = MemberInfo {
            id: node,
            addresses: vec![r.addr.clone()],
            capacity_bytes: 0,
            zone: r.zone.clone(),
        };
        self.meta
            .change_membership(MembershipChange::AddLearner { member })
            .await
            .map_err(|e| JoinRefusal::Membership {
                reason: e.to_string(),
            })?;
        let mut members: Vec<(u64, String)> = self
            .meta
            .view()
            .members
            .iter()
            .filter(|m| m.id != node)
            .map(|m| (m.id.0, m.addr.clone()))
            .take(spillway_net::join::JOIN_MEMBERS_MAX)
            .collect();
        if !members.iter().any(|(id, _)| *id == self.me.0.0) {
            members.push((self.me.0.0, self.me.1.to_string()));
        }
        Ok(Admission {
            pool_id: self.ca.pool_id().0,
            ca_pem: self.ca.cert_pem().to_string(),
            cert_pem,
            members,
        })
    }
}

/// Why joins cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum ServeJoinsError {
    /// The CA or this node's identity could not be read, or the endpoint not bound.
    #[error("cannot serve joins: {0}")]
    Cert(#[from] CertError),
    /// The CA directory holds another pool's CA.
    #[error("the CA in {} is pool {found}'s, not this node's pool {expected}", dir.display())]
    OtherPool {
        /// The directory.
        dir: PathBuf,
        /// Its pool.
        found: spillway_types::PoolId,
        /// This node's.
        expected: spillway_types::PoolId,
    },
}

/// Why leaving failed.
#[derive(Debug, thiserror::Error)]
pub enum LeaveError {
    /// The group did not take the `Leaving` state.
    #[error("cannot declare this node leaving: {0}")]
    Propose(#[from] ProposeFailure),
    /// The group refused it.
    #[error("the pool refused this node's leaving: {reason}")]
    Refused {
        /// Why.
        reason: String,
    },
    /// The node still held pages, or was not removed, when the time was up.
    #[error("not removed within {} s: {used_bytes} bytes still held here", timeout.as_secs())]
    Timeout {
        /// The bound.
        timeout: Duration,
        /// What it still held.
        used_bytes: u64,
    },
}

impl NodeHandle {
    /// Serves joins on `addr` (port 0: a free one) with the CA in `ca_dir` (its key and
    /// the `join-tokens` it records): see the module docs. The caller keeps the server
    /// and shuts it down before the node.
    pub fn serve_joins(
        &self,
        ca_dir: &Path,
        addr: SocketAddr,
    ) -> Result<BootstrapServer, ServeJoinsError> {
        let ca = PoolCa::load(ca_dir)?;
        let config = self.config();
        let identity = NodeIdentity::load(&config.pool_dir, config.node_id)?;
        if ca.pool_id() != identity.pool_id {
            return Err(ServeJoinsError::OtherPool {
                dir: ca_dir.to_path_buf(),
                found: ca.pool_id(),
                expected: identity.pool_id,
            });
        }
        let authority = JoinAuthority {
            ca,
            tokens: TokenStore::in_ca_dir(ca_dir),
            meta: self.meta().clone(),
            me: (self.node_id(), self.local_addr()),
        };
        Ok(BootstrapServer::start(
            addr,
            &identity,
            Arc::new(authority),
        )?)
    }

    /// Leaves the pool gracefully (see the module docs): declares this node `Leaving`,
    /// waits (at most `timeout`) until its pages were copied away and the leader removed
    /// it. Then shut the node down.
    pub async fn leave(&self, timeout: Duration) -> Result<(), LeaveError> {
        let me = self.node_id();
        let outcomes = self
            .propose(vec![Update::SetMemberState {
                node: me,
                state: MemberState::Leaving,
            }])
            .await?;
        if let Some(crate::meta::Outcome::Rejected { reason }) = outcomes.first() {
            return Err(LeaveError::Refused {
                reason: reason.clone(),
            });
        }
        tracing::info!(node = %me, "leaving the pool: draining its pages");
        let deadline = Instant::now() + timeout;
        // Removed: gone from the members applied here; or, drained, cut off from the
        // leader (a removed node may not learn the commit of its own removal).
        let mut leaderless_since: Option<Instant> = None;
        loop {
            let view = self.meta_view();
            let mine = view.members.iter().find(|m| m.id == me);
            let used_bytes = mine.map_or(0, |m| m.used_bytes + m.reserved_bytes);
            if mine.is_none() {
                tracing::info!(node = %me, "left the pool");
                return Ok(());
            }
            if used_bytes == 0 && view.leader.is_none() {
                let since = *leaderless_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= Duration::from_secs(3) {
                    tracing::info!(node = %me, "drained and removed (no leader reaches it any more)");
                    return Ok(());
                }
            } else {
                leaderless_since = None;
            }
            if Instant::now() >= deadline {
                return Err(LeaveError::Timeout {
                    timeout,
                    used_bytes,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[cfg(test)]
mod tests;
