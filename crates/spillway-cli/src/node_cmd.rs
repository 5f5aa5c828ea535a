//! `spillway node --config node.toml`: one node daemon ([`spillway_node::Node`]) in a
//! tokio runtime until SIGINT or SIGTERM, then a graceful [`NodeHandle::shutdown`]; or
//! until its Raft thread stops on a failure it cannot recover from
//! ([`NodeHandle::raft_failed`]), then the same shutdown and exit code 1 with the cause.
//!
//! The help lists every field of the node config with its doc and default, from
//! [`NodeConfig::field_docs`]; a field that table lacks is still listed, with the default
//! of a serialized [`NodeConfig`], so the help never omits one.
//!
//! [`NodeHandle::shutdown`]: spillway_node::NodeHandle::shutdown
//! [`NodeHandle::raft_failed`]: spillway_node::NodeHandle::raft_failed

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use spillway_node::{Node, NodeConfig};
use spillway_types::NodeId;

/// Arguments of `spillway node`.
#[derive(Debug, Args)]
#[command(after_help = config_help())]
pub struct NodeArgs {
    /// The node's configuration file (TOML; fields below).
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Check the configuration, print it with every default filled in, and exit.
    #[arg(long)]
    check: bool,
    /// Join a running pool through its bootstrap endpoint (HOST:PORT, a node started with
    /// --bootstrap-addr) with --token: this host makes its own key, the pool's CA signs
    /// it, and the node starts as a learner. Ignored once the node has its certificate.
    #[arg(long, value_name = "HOST:PORT", requires = "token")]
    join: Option<String>,
    /// The one-time join token (`spillway cluster token create`).
    #[arg(
        long,
        value_name = "TOKEN",
        env = "SPILLWAY_JOIN_TOKEN",
        hide_env_values = true
    )]
    token: Option<String>,
    /// Serve joins with the CA in this directory (its key and its join-tokens/) on
    /// --bootstrap-addr.
    #[arg(long = "ca", value_name = "DIR", requires = "bootstrap_addr")]
    ca_dir: Option<PathBuf>,
    /// Where to serve joins (UDP, QUIC), e.g. 0.0.0.0:7400.
    #[arg(long, value_name = "ADDR", requires = "ca_dir")]
    bootstrap_addr: Option<std::net::SocketAddr>,
    /// On SIGINT or SIGTERM, leave the pool before stopping: declare this node leaving,
    /// wait until its pages were copied to other nodes and the pool removed it (at most
    /// --leave-timeout-s), then stop. Without it the node stops and stays a member (down).
    #[arg(long)]
    leave_on_stop: bool,
    /// Seconds --leave-on-stop waits for the pages to move and the removal.
    #[arg(long, default_value_t = spillway_node::membership::LEAVE_TIMEOUT_DEFAULT.as_secs())]
    leave_timeout_s: u64,
}

/// Every field of [`NodeConfig`] as (TOML key, default as TOML), by key. Required
/// fields carry a placeholder.
pub(crate) fn config_fields() -> Vec<(String, String)> {
    let config = NodeConfig::new(NodeId(1), "POOL_DIR".into(), "DATA_DIR".into(), 1 << 30);
    let value = toml::Value::try_from(&config).expect("a node config serializes");
    let mut fields = Vec::new();
    flatten("", &value, &mut fields);
    fields
}

fn flatten(prefix: &str, value: &toml::Value, out: &mut Vec<(String, String)>) {
    match value {
        toml::Value::Table(table) => {
            for (k, v) in table {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                if v.is_table() {
                    flatten(&key, v, out);
                } else {
                    out.push((key, v.to_string()));
                }
            }
        }
        v => out.push((prefix.to_string(), v.to_string())),
    }
}

/// The help's list of config fields: [`NodeConfig::field_docs`], with each default
/// taken from a serialized [`NodeConfig`] where the doc table refers elsewhere for it, and
/// any field the table lacks listed too.
fn config_help() -> String {
    let values = config_fields();
    let value_of = |key: &str| {
        values
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    };
    let mut text = String::from("Config fields (TOML; `quic.x` is `x` in the `[quic]` table):\n");
    for f in NodeConfig::field_docs() {
        // A literal default in the table is replaced by the value the code has, so the
        // help cannot go stale; a default described in words is kept.
        let literal = |d: &str| {
            d.starts_with("see ") || d.parse::<f64>().is_ok() || d == "true" || d == "false"
        };
        let default = match (f.default, value_of(f.key)) {
            ("required", _) => "required".to_string(),
            (d, Some(v)) if literal(d) => format!("default {v}"),
            (d, _) => format!("default {d}"),
        };
        text.push_str(&format!("  {:<38} {} [{default}]\n", f.key, f.doc));
    }
    for (key, value) in &values {
        if !NodeConfig::field_docs().iter().any(|f| f.key == key) {
            text.push_str(&format!("  {key:<38} (undocumented) [default {value}]\n"));
        }
    }
    text.push_str(
        "\nA bad file exits non-zero with an error naming the file and the field. \
         SIGINT or SIGTERM shut the node down gracefully. A full disk under data_dir/raft \
         makes the node unhealthy in /status and /metrics until space returns (it retries); \
         a failure it cannot recover from (a failed fsync) shuts it down with exit code 1. \
         Logs: SPILLWAY_LOG (default info).",
    );
    text
}

impl NodeArgs {
    /// Whether the command only checks the file (`--check`) rather than running a node.
    pub fn check_only(&self) -> bool {
        self.check
    }
}

/// Runs `spillway node`.
pub fn run_node(args: NodeArgs) -> Result<()> {
    let mut config = NodeConfig::load(&args.config)?;
    if args.check {
        print!("{}", toml::to_string(&config)?);
        return Ok(());
    }
    // Freed pages go back to the system, so the node's RSS follows its host tier.
    spillway_node::memory::return_page_buffers_to_the_os(config.page_size.bytes());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("spillway-node")
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(async move {
        let config_path = args.config.display().to_string();
        if let (Some(server), Some(token)) = (&args.join, &args.token) {
            spillway_node::join_pool(&mut config, server, token)
                .await
                .with_context(|| format!("joining the pool through {server}"))?;
        }
        let node = Node::start(config)
            .await
            .with_context(|| format!("starting the node of {config_path}"))?;
        tracing::info!(
            node = %node.node_id(),
            pool = %node.pool_id(),
            addr = %node.local_addr(),
            pid = std::process::id(),
            config = %config_path,
            "node running; SIGINT or SIGTERM stops it"
        );
        let bootstrap = match (&args.ca_dir, args.bootstrap_addr) {
            (Some(dir), Some(addr)) => {
                let server = node
                    .serve_joins(dir, addr)
                    .with_context(|| format!("serving joins with the CA in {}", dir.display()))?;
                tracing::info!(addr = %server.local_addr(), "serving joins (spillway cluster token create makes tokens)");
                Some(server)
            }
            _ => None,
        };
        tokio::select! {
            signal = shutdown_signal() => {
                tracing::info!(signal = signal?, "shutting down");
                if let Some(b) = &bootstrap {
                    b.shutdown().await;
                }
                let left = if args.leave_on_stop {
                    node.leave(std::time::Duration::from_secs(args.leave_timeout_s)).await
                } else {
                    Ok(())
                };
                node.shutdown().await;
                left.context("leaving the pool")
            }
            () = node.raft_failed() => {
                let (id, cause) = (node.node_id(), node.meta_view().error.unwrap_or_default());
                tracing::error!(cause, "the metadata group stopped on this node; shutting down");
                node.shutdown().await;
                bail!("the metadata group stopped on node {id}: {cause}")
            }
        }
    })
}

/// Waits for SIGINT or SIGTERM; returns its name.
async fn shutdown_signal() -> Result<&'static str> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("listening for SIGINT")?;
    Ok(tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_config_field_is_listed_with_its_default() {
        let fields = config_fields();
        assert!(fields.len() >= 20, "{fields:?}");
        let help = config_help();
        for (key, _) in &fields {
            assert!(
                help.lines()
                    .any(|l| l.trim_start().starts_with(&format!("{key} "))),
                "help lacks {key}:\n{help}"
            );
        }
        assert!(help.contains("[default 6000]"), "{help}");
        assert!(help.contains("[required]"), "{help}");
    }
}
