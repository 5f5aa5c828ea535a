//! raft-rs logs through `slog`; this drain forwards its records to `tracing` (target
//! `raft`), formatting them only when that level is enabled. raft-rs logs every election
//! step at `info`, which is `debug` here: the node reports what matters itself.

use std::fmt::{self, Write as _};

use slog::{Drain, KV as _, Level, OwnedKVList, Record};

struct TracingDrain;

struct KvLine(String);

impl slog::Serializer for KvLine {
    fn emit_arguments(&mut self, key: slog::Key, val: &fmt::Arguments<'_>) -> slog::Result {
        let _ = write!(self.0, " {key}={val}");
        Ok(())
    }
}

impl Drain for TracingDrain {
    type Ok = ();
    type Err = slog::Never;

    fn log(&self, record: &Record<'_>, values: &OwnedKVList) -> Result<(), slog::Never> {
        let enabled = match record.level() {
            Level::Critical | Level::Error => {
                tracing::enabled!(target: "raft", tracing::Level::ERROR)
            }
            Level::Warning => tracing::enabled!(target: "raft", tracing::Level::WARN),
            Level::Info => tracing::enabled!(target: "raft", tracing::Level::DEBUG),
            Level::Debug | Level::Trace => tracing::enabled!(target: "raft", tracing::Level::TRACE),
        };
        if !enabled {
            return Ok(());
        }
        let mut kv = KvLine(String::new());
        let _ = record.kv().serialize(record, &mut kv);
        let _ = values.serialize(record, &mut kv);
        let msg = record.msg();
        match record.level() {
            Level::Critical | Level::Error => tracing::error!(target: "raft", "{msg}{}", kv.0),
            Level::Warning => tracing::warn!(target: "raft", "{msg}{}", kv.0),
            Level::Info => tracing::debug!(target: "raft", "{msg}{}", kv.0),
            Level::Debug | Level::Trace => tracing::trace!(target: "raft", "{msg}{}", kv.0),
        }
        Ok(())
    }
}

/// The logger handed to raft-rs for node `id`.
pub(crate) fn raft_logger(id: u64) -> slog::Logger {
    slog::Logger::root(TracingDrain, slog::o!("raft_id" => id))
}
