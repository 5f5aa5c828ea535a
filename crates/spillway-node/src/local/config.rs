//! The local socket server's settings, their bounds, and why it may not start.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use spillway_types::PageSize;
use spillway_types::local::CLIENTS_MAX;

use crate::memory::HostBudget;

/// Default bound on one client's ops in flight: 64 (128 MiB of page copies at 2 MiB).
pub const OPS_IN_FLIGHT_PER_CLIENT_DEFAULT: usize = 64;
/// Most ops in flight one client may be allowed: 1024.
pub const OPS_IN_FLIGHT_PER_CLIENT_MAX: usize = 1024;
/// Connections between accept and the answer to their `Hello`: 16. More wait in the
/// socket's backlog, so a flood of silent connections cannot use up memory or tasks.
pub const HANDSHAKES_IN_FLIGHT_MAX: usize = 16;
/// How long a new connection has to send its `Hello`: 5 s.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Settings of the local socket server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalServerConfig {
    /// The socket's path. Its parent directory is created (0700) when missing.
    pub socket_path: PathBuf,
    /// The page size clients must use (the node's).
    pub page_size: PageSize,
    /// Most host memory one client may ask for. This much shared memory may be touched
    /// per client, charged to whoever touches it first.
    pub client_host_bytes_max: u64,
    /// Most clients at once (at most [`CLIENTS_MAX`]).
    pub clients_max: usize,
    /// Most ops in flight per client (1 to [`OPS_IN_FLIGHT_PER_CLIENT_MAX`]); each holds
    /// one page copy. More keeps a slow remote tier busier.
    pub ops_in_flight_per_client_max: usize,
    /// The budget the clients' host tiers take from together (each its `host_bytes`, from
    /// its welcome until it goes): the room the node's cgroup limit leaves after the
    /// node's own plan ([`crate::memory`]); `None`: clients are bounded only by
    /// `client_host_bytes_max` each.
    pub host_budget: Option<Arc<HostBudget>>,
}

impl LocalServerConfig {
    /// Settings with every bound at its default.
    pub fn new(
        socket_path: PathBuf,
        page_size: PageSize,
        client_host_bytes_max: u64,
    ) -> LocalServerConfig {
        LocalServerConfig {
            socket_path,
            page_size,
            client_host_bytes_max,
            clients_max: CLIENTS_MAX,
            ops_in_flight_per_client_max: OPS_IN_FLIGHT_PER_CLIENT_DEFAULT,
            host_budget: None,
        }
    }

    /// These settings, the clients' host tiers taken from `budget`.
    pub fn sharing(mut self, budget: Arc<HostBudget>) -> LocalServerConfig {
        self.host_budget = Some(budget);
        self
    }

    /// Checks the ranges; the error names the field.
    pub fn validate(&self) -> Result<(), LocalServerError> {
        let bad =
            |field: &'static str, problem: String| Err(LocalServerError::Config { field, problem });
        if self.clients_max == 0 || self.clients_max > CLIENTS_MAX {
            return bad(
                "clients_max",
                format!("is {} but must be 1 to {CLIENTS_MAX}", self.clients_max),
            );
        }
        if self.ops_in_flight_per_client_max == 0
            || self.ops_in_flight_per_client_max > OPS_IN_FLIGHT_PER_CLIENT_MAX
        {
            return bad(
                "ops_in_flight_per_client_max",
                format!(
                    "is {} but must be 1 to {OPS_IN_FLIGHT_PER_CLIENT_MAX}",
                    self.ops_in_flight_per_client_max
                ),
            );
        }
        if self.client_host_bytes_max < self.page_size.bytes() {
            return bad(
                "client_host_bytes_max",
                format!(
                    "is {} but must hold at least one page of {} bytes",
                    self.client_host_bytes_max,
                    self.page_size.bytes()
                ),
            );
        }
        if self.socket_path.file_name().is_none() {
            return bad(
                "socket_path",
                format!("{} names no file", self.socket_path.display()),
            );
        }
        Ok(())
    }
}

/// Why the local socket server could not start.
#[derive(Debug, thiserror::Error)]
pub enum LocalServerError {
    /// A setting is out of range.
    #[error("invalid local socket setting `{field}`: {problem}")]
    Config {
        /// The field.
        field: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// The socket's directory could not be created.
    #[error("cannot create the socket directory {}: {source}", path.display())]
    SocketDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Another node listens on the socket.
    #[error("the client socket {} is in use by a running node", path.display())]
    InUse {
        /// The socket.
        path: PathBuf,
    },
    /// Something that is not a socket is in the way.
    #[error("{} exists and is not a socket; remove it or choose another client_socket", path.display())]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// Binding, chmod or renaming failed.
    #[error("cannot {step} the client socket {}: {source}", path.display())]
    Bind {
        /// `remove the stale`, `bind`, `chmod`, `rename into place` or `stat`.
        step: &'static str,
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}
