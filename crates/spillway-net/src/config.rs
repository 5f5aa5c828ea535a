//! Tuning of the QUIC transport, in two layers like the pool's config: [`QuicConfig`]
//! holds plain fields with defaults (serde, for the node's TOML), [`QuicConfig::validate`]
//! names the first field that is wrong.
//!
//! The defaults are what `FACTS.md` measured on loopback: quinn's own defaults moved
//! 0.4–0.5 GB/s there, these 1.2–1.5 GB/s. What mattered: a 6000-byte MTU with no MTU
//! discovery (loopback only: on a real network an MTU above the path's drops every
//! full-size packet), 4 MiB socket buffers (the default 208 KB dropped thousands of
//! packets per GiB), and GSO. Flow-control windows made no difference at loopback RTT;
//! on real links they bound throughput to window / RTT.

use serde::{Deserialize, Serialize};
use spillway_types::config::ConfigError;
use spillway_types::wire;

/// Default MTU on loopback: 6000 bytes, the largest round figure below
/// [`MTU_BYTES_MAX`].
pub const LOOPBACK_MTU_BYTES_DEFAULT: u16 = 6000;
/// QUIC's minimum MTU, safe on any path: 1200 bytes.
pub const MTU_BYTES_MIN: u16 = 1200;
/// Largest MTU we allow: 6500 bytes. With GSO, quinn sends up to 10 packets as one UDP
/// datagram of at most 64 KiB; above about 6500 bytes ten no longer fit, and throughput
/// collapses to a few MB/s (measured here: 6500 moves 1.1 GB/s, 7000 and 8000 about
/// 0.01; `FACTS.md` saw the same at 9000).
pub const MTU_BYTES_MAX: u16 = 6500;
/// Default socket send and receive buffers: 4 MiB each (`net.core.rmem_max` is 4 MiB on
/// the test machines; the kernel caps larger requests there). Costs that much kernel
/// memory per endpoint, not per peer.
pub const SOCKET_BUFFER_BYTES_DEFAULT: usize = 4 << 20;
/// Default payload bytes in flight per peer and direction: 64 MiB (32 pages of 2 MiB).
/// Worst-case memory for received payloads is this times the peers talking to a node.
pub const PEER_BYTES_IN_FLIGHT_DEFAULT: u64 = 64 << 20;
/// Largest in-flight budget: 1 GiB (permits are counted in a `u32`).
pub const PEER_BYTES_IN_FLIGHT_MAX: u64 = 1 << 30;
/// Default streams (requests) a peer may have open on one connection: 64. Each open
/// stream may hold a body buffer ([`wire::FRAME_BODY_BYTES_MAX`], 64 KiB): 4 MiB per
/// connection at most.
pub const STREAMS_PER_CONNECTION_DEFAULT: u32 = 64;
/// Most streams per connection we allow: 1024.
pub const STREAMS_PER_CONNECTION_MAX: u32 = 1024;
/// Default QUIC connections ("lanes") to each peer: 4. quinn processes each connection's
/// packets (encryption, acknowledgements) in one task, so one connection keeps about one
/// core busy; several lanes spread one peer's traffic over the cores. Measured here
/// (2 cores, loopback, 2 MiB pages, 4 in flight): 1 lane 1.7 GB/s, 2 lanes 2.1, 4 lanes 2.15.
pub const CONNECTIONS_PER_PEER_DEFAULT: u32 = 4;
/// Most lanes per peer: 16.
pub const CONNECTIONS_PER_PEER_MAX: u32 = 16;
/// Default connections a node accepts at once: 256 (64 peers at 4 lanes each; each
/// connection costs its receive window of buffering at most, 16 MiB by default).
pub const CONNECTIONS_DEFAULT: usize = 256;

/// Default idle timeout: 3 s. A peer process that restarts at the same address is a new
/// endpoint: packets of the old connections reach it with unknown connection ids and are
/// dropped (it cannot send a stateless reset the old peers accept), so until the old
/// connections time out, what the peers send it there is lost. With 10 s a node killed
/// and restarted took 9.7 s to rejoin its Raft group (measured with `spillway cluster
/// up`, kill -9, restart); with 3 s, about 3 s. Three keep-alive intervals: a live
/// connection is closed only after three keep-alives in a row are lost.
pub const IDLE_TIMEOUT_MS_DEFAULT: u64 = 3_000;
/// Default keep-alive interval: 1 s (a ping of a few dozen bytes per connection and
/// second).
pub const KEEP_ALIVE_INTERVAL_MS_DEFAULT: u64 = 1_000;

/// Tuning of the QUIC transport. Every field has a default; see the module docs for what
/// was measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuicConfig {
    /// MTU (UDP payload bytes) when the endpoint is bound to a loopback address: used as
    /// initial and minimum MTU, with MTU discovery off, and as the endpoint's largest UDP
    /// payload. Larger packets mean fewer per-packet costs (the bottleneck is CPU).
    pub loopback_mtu_bytes: u16,
    /// Initial MTU on other addresses; MTU discovery raises it from there if
    /// [`QuicConfig::mtu_discovery`] is on. 1200 works on every path.
    pub initial_mtu_bytes: u16,
    /// Probe for a larger MTU on non-loopback addresses (costs a few probe packets).
    pub mtu_discovery: bool,
    /// `SO_SNDBUF` and `SO_RCVBUF` of the UDP socket. Too small drops packets under load;
    /// each byte is kernel memory.
    pub socket_buffer_bytes: usize,
    /// Generic segmentation offload: hands the kernel many packets per system call. Turn
    /// off only to debug packet-level problems.
    pub gso: bool,
    /// Payload bytes in flight per peer and direction (requests sent but not answered, and
    /// received payloads not yet handled). Higher keeps more pages moving; each byte may
    /// be memory held for a peer.
    pub peer_bytes_in_flight_max: u64,
    /// Flow-control window of one stream (one request). Bounds throughput per request to
    /// window / RTT on real links; costs receive buffer per open stream at most.
    pub stream_receive_window_bytes: u32,
    /// Flow-control window of one connection (all its streams). Memory a peer can make us
    /// buffer before we read.
    pub connection_receive_window_bytes: u32,
    /// Bytes a connection may have sent but not acknowledged.
    pub send_window_bytes: u64,
    /// Requests a peer may have open at once on one connection.
    pub streams_per_connection_max: u32,
    /// QUIC connections opened to each peer, used in turn. More spread one peer's traffic
    /// over more cores; each costs a handshake, a slot of the peer's `connections_max` and
    /// its own flow-control windows of buffering.
    pub connections_per_peer: u32,
    /// Connections accepted at once; more are refused at the QUIC handshake.
    pub connections_max: usize,
    /// A connection with no traffic for this long is closed. Shorter notices dead peers
    /// sooner; keep-alives keep live idle connections open.
    pub idle_timeout_ms: u64,
    /// Keep-alive ping interval (must be below `idle_timeout_ms`).
    pub keep_alive_interval_ms: u64,
    /// How long a new connection has to complete the TLS handshake and the hello exchange.
    pub hello_timeout_ms: u64,
}

impl Default for QuicConfig {
    fn default() -> Self {
        QuicConfig {
            loopback_mtu_bytes: LOOPBACK_MTU_BYTES_DEFAULT,
            initial_mtu_bytes: MTU_BYTES_MIN,
            mtu_discovery: true,
            socket_buffer_bytes: SOCKET_BUFFER_BYTES_DEFAULT,
            gso: true,
            peer_bytes_in_flight_max: PEER_BYTES_IN_FLIGHT_DEFAULT,
            stream_receive_window_bytes: 4 << 20,
            connection_receive_window_bytes: 16 << 20,
            send_window_bytes: 16 << 20,
            streams_per_connection_max: STREAMS_PER_CONNECTION_DEFAULT,
            connections_per_peer: CONNECTIONS_PER_PEER_DEFAULT,
            connections_max: CONNECTIONS_DEFAULT,
            idle_timeout_ms: IDLE_TIMEOUT_MS_DEFAULT,
            keep_alive_interval_ms: KEEP_ALIVE_INTERVAL_MS_DEFAULT,
            hello_timeout_ms: 5_000,
        }
    }
}

impl QuicConfig {
    /// Checks every field; the error names the first field that is wrong.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |field, problem: String| Err(ConfigError { field, problem });
        for (field, mtu) in [
            ("loopback_mtu_bytes", self.loopback_mtu_bytes),
            ("initial_mtu_bytes", self.initial_mtu_bytes),
        ] {
            if !(MTU_BYTES_MIN..=MTU_BYTES_MAX).contains(&mtu) {
                return err(
                    field,
                    format!("is {mtu} but must be from {MTU_BYTES_MIN} to {MTU_BYTES_MAX}"),
                );
            }
        }
        if self.socket_buffer_bytes < (64 << 10) {
            return err(
                "socket_buffer_bytes",
                format!("is {} but must be at least 65536", self.socket_buffer_bytes),
            );
        }
        if self.peer_bytes_in_flight_max < spillway_types::limits::PAGE_BYTES_MAX
            || self.peer_bytes_in_flight_max > PEER_BYTES_IN_FLIGHT_MAX
        {
            return err(
                "peer_bytes_in_flight_max",
                format!(
                    "is {} but must be from {} (one page of the largest size) to {PEER_BYTES_IN_FLIGHT_MAX}",
                    self.peer_bytes_in_flight_max,
                    spillway_types::limits::PAGE_BYTES_MAX
                ),
            );
        }
        if self.stream_receive_window_bytes < (64 << 10) {
            return err(
                "stream_receive_window_bytes",
                format!(
                    "is {} but must be at least 65536",
                    self.stream_receive_window_bytes
                ),
            );
        }
        if self.connection_receive_window_bytes < self.stream_receive_window_bytes {
            return err(
                "connection_receive_window_bytes",
                format!(
                    "is {} but must be at least stream_receive_window_bytes ({})",
                    self.connection_receive_window_bytes, self.stream_receive_window_bytes
                ),
            );
        }
        if self.send_window_bytes < (64 << 10) {
            return err(
                "send_window_bytes",
                format!("is {} but must be at least 65536", self.send_window_bytes),
            );
        }
        if self.streams_per_connection_max == 0
            || self.streams_per_connection_max > STREAMS_PER_CONNECTION_MAX
        {
            return err(
                "streams_per_connection_max",
                format!(
                    "is {} but must be from 1 to {STREAMS_PER_CONNECTION_MAX}",
                    self.streams_per_connection_max
                ),
            );
        }
        if self.connections_per_peer == 0 || self.connections_per_peer > CONNECTIONS_PER_PEER_MAX {
            return err(
                "connections_per_peer",
                format!(
                    "is {} but must be from 1 to {CONNECTIONS_PER_PEER_MAX}",
                    self.connections_per_peer
                ),
            );
        }
        if self.connections_max == 0 {
            return err("connections_max", "must be at least 1".to_string());
        }
        if self.idle_timeout_ms == 0 || self.idle_timeout_ms > 600_000 {
            return err(
                "idle_timeout_ms",
                format!("is {} but must be from 1 to 600000", self.idle_timeout_ms),
            );
        }
        if self.keep_alive_interval_ms == 0 || self.keep_alive_interval_ms >= self.idle_timeout_ms {
            return err(
                "keep_alive_interval_ms",
                format!(
                    "is {} but must be from 1 to below idle_timeout_ms ({})",
                    self.keep_alive_interval_ms, self.idle_timeout_ms
                ),
            );
        }
        if self.hello_timeout_ms == 0 {
            return err("hello_timeout_ms", "must be at least 1".to_string());
        }
        Ok(())
    }

    /// The in-flight budget as semaphore permits (validated to fit).
    pub(crate) fn peer_permits(&self) -> u32 {
        u32::try_from(self.peer_bytes_in_flight_max).unwrap_or(u32::MAX)
    }
}

/// Permits a payload of `bytes` takes from a budget of `budget` permits: all of it, or the
/// whole budget if it is larger (so one oversized request waits for an idle peer instead of
/// waiting forever).
pub(crate) fn permits_for(bytes: u64, budget: u32) -> u32 {
    u32::try_from(bytes.min(u64::from(budget))).unwrap_or(budget)
}

const _: () = assert!(wire::FRAME_PAYLOAD_BYTES_MAX <= PEER_BYTES_IN_FLIGHT_MAX);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate() {
        QuicConfig::default().validate().unwrap();
    }

    #[test]
    fn errors_name_the_field() {
        let mut c = QuicConfig {
            loopback_mtu_bytes: 7000,
            ..QuicConfig::default()
        };
        assert_eq!(c.validate().unwrap_err().field, "loopback_mtu_bytes");
        c.loopback_mtu_bytes = 6000;
        c.peer_bytes_in_flight_max = 1;
        assert_eq!(c.validate().unwrap_err().field, "peer_bytes_in_flight_max");
        c.peer_bytes_in_flight_max = 64 << 20;
        c.keep_alive_interval_ms = c.idle_timeout_ms;
        assert_eq!(c.validate().unwrap_err().field, "keep_alive_interval_ms");
        c.keep_alive_interval_ms = 1;
        c.streams_per_connection_max = 0;
        assert_eq!(
            c.validate().unwrap_err().field,
            "streams_per_connection_max"
        );
    }

    #[test]
    fn oversized_payloads_take_the_whole_budget() {
        assert_eq!(permits_for(10, 100), 10);
        assert_eq!(permits_for(1000, 100), 100);
        assert_eq!(permits_for(u64::MAX, u32::MAX), u32::MAX);
    }
}
