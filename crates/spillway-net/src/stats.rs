//! Counters of a transport, per peer: what the node's `/metrics` will export.
//!
//! Peers are keyed by node id: over QUIC, the node their certificate names, which their
//! hello must repeat. Frames rejected before a peer has said who it is (a bad hello, or
//! garbage on a fresh connection) are counted under [`NetStats::unidentified`]. The map
//! grows only with nodes that passed mutual TLS with the pool's CA, so it is bounded by
//! the pool's membership.
//!
//! Lock order: the map's mutex is held only to find or insert an entry, never across an
//! await; the counters themselves are atomics.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use spillway_types::NodeId;
use tokio::sync::Semaphore;

/// A snapshot of one peer's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerCounters {
    /// Frames from this peer that failed the wire checks (each closed its connection).
    pub frames_rejected: u64,
    /// Frame bytes (header, body, payload) received from this peer.
    pub bytes_in: u64,
    /// Frame bytes sent to this peer.
    pub bytes_out: u64,
}

/// One peer's live counters and in-flight budgets.
#[derive(Debug)]
pub(crate) struct PeerState {
    frames_rejected: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    /// Budget of payload bytes we send to this peer and await replies for.
    pub(crate) outbound: Arc<Semaphore>,
    /// Budget of payload bytes received from this peer and not yet handled.
    pub(crate) inbound: Arc<Semaphore>,
}

impl PeerState {
    fn new(budget_permits: u32) -> Self {
        PeerState {
            frames_rejected: AtomicU64::new(0),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            outbound: Arc::new(Semaphore::new(budget_permits as usize)),
            inbound: Arc::new(Semaphore::new(budget_permits as usize)),
        }
    }

    pub(crate) fn add_in(&self, bytes: u64) {
        self.bytes_in.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn add_out(&self, bytes: u64) {
        self.bytes_out.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn reject(&self) {
        self.frames_rejected.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> PeerCounters {
        PeerCounters {
            frames_rejected: self.frames_rejected.load(Ordering::Relaxed),
            bytes_in: self.bytes_in.load(Ordering::Relaxed),
            bytes_out: self.bytes_out.load(Ordering::Relaxed),
        }
    }
}

/// Counters of one transport.
#[derive(Debug)]
pub struct NetStats {
    budget_permits: u32,
    peers: Mutex<BTreeMap<NodeId, Arc<PeerState>>>,
    unidentified: Arc<PeerState>,
    handshakes_refused: AtomicU64,
    connections_accepted: AtomicU64,
}

impl NetStats {
    pub(crate) fn new(budget_permits: u32) -> Self {
        NetStats {
            budget_permits,
            peers: Mutex::new(BTreeMap::new()),
            unidentified: Arc::new(PeerState::new(budget_permits)),
            handshakes_refused: AtomicU64::new(0),
            connections_accepted: AtomicU64::new(0),
        }
    }

    /// The live state of `peer`, created on first use.
    pub(crate) fn peer_state(&self, peer: NodeId) -> Arc<PeerState> {
        let mut peers = self.peers.lock().expect("stats lock poisoned");
        peers
            .entry(peer)
            .or_insert_with(|| Arc::new(PeerState::new(self.budget_permits)))
            .clone()
    }

    pub(crate) fn unidentified_state(&self) -> &Arc<PeerState> {
        &self.unidentified
    }

    pub(crate) fn handshake_refused(&self) {
        self.handshakes_refused.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn connection_accepted(&self) {
        self.connections_accepted.fetch_add(1, Ordering::Relaxed);
    }

    /// Counters of `peer`, if it ever said hello.
    pub fn peer(&self, peer: NodeId) -> Option<PeerCounters> {
        let peers = self.peers.lock().expect("stats lock poisoned");
        peers.get(&peer).map(|s| s.snapshot())
    }

    /// Counters of every peer that said hello, by node id.
    pub fn peers(&self) -> BTreeMap<NodeId, PeerCounters> {
        let peers = self.peers.lock().expect("stats lock poisoned");
        peers.iter().map(|(id, s)| (*id, s.snapshot())).collect()
    }

    /// Counters of connections that never identified themselves (bad or missing hello).
    pub fn unidentified(&self) -> PeerCounters {
        self.unidentified.snapshot()
    }

    /// Sum over all peers, identified or not.
    pub fn total(&self) -> PeerCounters {
        let mut total = self.unidentified();
        for c in self.peers().values() {
            total.frames_rejected += c.frames_rejected;
            total.bytes_in += c.bytes_in;
            total.bytes_out += c.bytes_out;
        }
        total
    }

    /// Incoming connections that failed the TLS handshake (no certificate of the pool's CA)
    /// or the hello (another pool or version, or a node id its certificate does not name).
    pub fn handshakes_refused(&self) -> u64 {
        self.handshakes_refused.load(Ordering::Relaxed)
    }

    /// Incoming connections that completed TLS and hello.
    pub fn connections_accepted(&self) -> u64 {
        self.connections_accepted.load(Ordering::Relaxed)
    }
}
