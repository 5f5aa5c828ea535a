//! The launcher's errors: one enum, named fields, the path or node to blame in each.

use std::path::PathBuf;
use std::time::Duration;

use spillway_net::certs::CertError;
use spillway_node::NodeConfigError;

/// Why a pool could not be initialized, started or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A file or directory could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// `init` found a pool in the directory and was not told to replace it.
    #[error("{} already holds a pool ({}); pass --force to replace it", dir.display(), found.display())]
    Exists {
        /// The pool directory.
        dir: PathBuf,
        /// The file that shows it.
        found: PathBuf,
    },
    /// `init --force` would replace a pool whose nodes still run.
    #[error("node {node} of the pool in {} still runs (pid {pid}); run `spillway cluster down` first", dir.display())]
    Running {
        /// The pool directory.
        dir: PathBuf,
        /// The node.
        node: u64,
        /// Its process.
        pid: u32,
    },
    /// No pool in the directory.
    #[error("no pool in {} (no cluster.json); run `spillway cluster init` or `cluster up`", dir.display())]
    NoPool {
        /// The directory.
        dir: PathBuf,
    },
    /// The pool's certificates could not be made.
    #[error("certificates in {}: {source}", dir.display())]
    Certs {
        /// The certificate directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: CertError,
    },
    /// A generated node configuration does not validate.
    #[error(transparent)]
    NodeConfig(#[from] NodeConfigError),
    /// `cluster.json` is not what `init` writes.
    #[error("{}: {problem}", path.display())]
    Spec {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// An option is out of range.
    #[error("`{option}` {problem}")]
    Option {
        /// The option, as on the command line.
        option: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// A node process could not be started.
    #[error("cannot start node {node} ({}): {source}", exe.display())]
    Spawn {
        /// The node.
        node: u64,
        /// The program.
        exe: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A node process exited while the pool was starting.
    #[error("node {node} exited while starting ({status}); the end of {}:\n{log_tail}", log.display())]
    Exited {
        /// The node.
        node: u64,
        /// How it exited.
        status: String,
        /// Its log.
        log: PathBuf,
        /// The last lines of its log.
        log_tail: String,
    },
    /// The pool did not become ready in time.
    #[error("the pool was not ready after {waited:?}: {problem}; the end of {}:\n{log_tail}", log.display())]
    NotReady {
        /// How long `up` waited.
        waited: Duration,
        /// What was missing (which node did not answer, or no leader).
        problem: String,
        /// The log of the node to blame.
        log: PathBuf,
        /// The last lines of that log.
        log_tail: String,
    },
    /// A signal could not be sent.
    #[error("cannot signal node {node} (pid {pid}): {source}")]
    Signal {
        /// The node.
        node: u64,
        /// Its process.
        pid: u32,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// A closure for `map_err` that names `path`.
pub(crate) fn io_at(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> ClusterError {
    let path = path.into();
    move |source| ClusterError::Io { path, source }
}
