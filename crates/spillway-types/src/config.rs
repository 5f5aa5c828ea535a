//! The pool's configuration, in two layers: [`PoolConfig`] holds plain fields with
//! defaults (read from TOML or built in code), [`PoolConfig::validate`] checks them and
//! names the field that is wrong.

use serde::{Deserialize, Serialize};

use crate::{PageSize, limits};

/// How the pool decides what to bring to the GPU and what to evict.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Learned prefetch: predicts upcoming accesses from earlier steps, copies pages in
    /// ahead of use, evicts the page whose next use is furthest away.
    #[default]
    Learned,
    /// No prediction: pages come in when acquired and stay cached; CLOCK picks victims.
    Clock,
    /// No prediction and no caching: pages come in when acquired and leave as soon as
    /// they are released (what simple hand-written offload code does).
    OnDemand,
}

impl Policy {
    /// All policies, in the order benchmarks report them.
    pub const ALL: [Policy; 3] = [Policy::OnDemand, Policy::Clock, Policy::Learned];

    /// The name used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Learned => "learned",
            Policy::Clock => "clock",
            Policy::OnDemand => "on_demand",
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "learned" => Ok(Policy::Learned),
            "clock" => Ok(Policy::Clock),
            "on_demand" | "on-demand" => Ok(Policy::OnDemand),
            other => Err(format!(
                "unknown policy {other:?}: expected learned, clock or on_demand"
            )),
        }
    }
}

/// Configuration of one pool (the GPU tier of one client and its host tier).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Bytes of GPU memory the pool may use. Required. More budget means fewer copies.
    pub gpu_budget_bytes: u64,
    /// Bytes of host memory for the host tier. Required. Without a remote tier it must
    /// hold every page of every buffer (the host tier keeps a copy of each page, so
    /// evicting a clean page from the GPU is free); with one, it must hold more pages than
    /// the GPU budget (it keeps a copy of every page on the GPU and stages the rest).
    pub host_budget_bytes: u64,
    /// Bytes of the remote tier (other machines' RAM) this pool may use; 0: none. Pages
    /// beyond the host tier go there and come back on demand and by prefetch.
    #[serde(default)]
    pub remote_budget_bytes: u64,
    /// Bound on bytes moving between the host and remote tiers at once, each way.
    #[serde(default = "default_remote_in_flight")]
    pub remote_bytes_in_flight_max: u64,
    /// Page size: the unit of placement and copy. Larger pages copy faster per byte but
    /// waste memory at the end of each buffer.
    #[serde(default)]
    pub page_size: PageSize,
    /// How pages are brought in and evicted.
    #[serde(default)]
    pub policy: Policy,
    /// Bound on host-to-device bytes in flight. Higher keeps the copy engine busier; lower
    /// lets a demand load overtake queued prefetches sooner.
    #[serde(default = "default_h2d")]
    pub h2d_bytes_in_flight_max: u64,
    /// Bound on device-to-host bytes (evictions of dirty pages) in flight.
    #[serde(default = "default_d2h")]
    pub d2h_bytes_in_flight_max: u64,
    /// How many upcoming accesses the prefetcher considers. Planning costs O(this).
    #[serde(default = "default_lookahead")]
    pub lookahead_accesses_max: usize,
    /// How many earlier steps' traces the predictor keeps and matches against.
    #[serde(default = "default_history")]
    pub history_steps: usize,
}

fn default_h2d() -> u64 {
    limits::H2D_BYTES_IN_FLIGHT_DEFAULT
}
fn default_d2h() -> u64 {
    limits::D2H_BYTES_IN_FLIGHT_DEFAULT
}
fn default_remote_in_flight() -> u64 {
    limits::REMOTE_BYTES_IN_FLIGHT_DEFAULT
}
fn default_lookahead() -> usize {
    limits::LOOKAHEAD_ACCESSES_DEFAULT
}
fn default_history() -> usize {
    limits::HISTORY_STEPS_DEFAULT
}

/// A configuration field that is out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid pool configuration: `{field}` {problem}")]
pub struct ConfigError {
    /// The name of the field, as in TOML.
    pub field: &'static str,
    /// What is wrong with it.
    pub problem: String,
}

impl PoolConfig {
    /// A configuration with the two required budgets and every other field at its default.
    pub fn new(gpu_budget_bytes: u64, host_budget_bytes: u64) -> Self {
        PoolConfig {
            gpu_budget_bytes,
            host_budget_bytes,
            remote_budget_bytes: 0,
            remote_bytes_in_flight_max: default_remote_in_flight(),
            page_size: PageSize::default(),
            policy: Policy::default(),
            h2d_bytes_in_flight_max: default_h2d(),
            d2h_bytes_in_flight_max: default_d2h(),
            lookahead_accesses_max: default_lookahead(),
            history_steps: default_history(),
        }
    }

    /// Number of GPU frames (whole pages) the GPU budget holds.
    pub fn gpu_frames(&self) -> u64 {
        self.page_size.pages_in(self.gpu_budget_bytes)
    }

    /// Number of host slots (whole pages) the host budget holds.
    pub fn host_slots(&self) -> u64 {
        self.page_size.pages_in(self.host_budget_bytes)
    }

    /// Number of remote pages the remote budget holds.
    pub fn remote_pages(&self) -> u64 {
        self.page_size.pages_in(self.remote_budget_bytes)
    }

    /// Checks every field; the error names the first field that is wrong.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let page = self.page_size.bytes();
        let err = |field, problem: String| Err(ConfigError { field, problem });
        if self.gpu_budget_bytes < page {
            return err(
                "gpu_budget_bytes",
                format!(
                    "is {} but must hold at least one page of {page} bytes",
                    self.gpu_budget_bytes
                ),
            );
        }
        if self.host_budget_bytes < page {
            return err(
                "host_budget_bytes",
                format!(
                    "is {} but must hold at least one page of {page} bytes",
                    self.host_budget_bytes
                ),
            );
        }
        for (field, pages) in [
            ("gpu_budget_bytes", self.gpu_frames()),
            ("host_budget_bytes", self.host_slots()),
        ] {
            if pages > limits::SLOTS_MAX {
                return err(
                    field,
                    format!(
                        "holds {pages} pages, more than the limit of {}",
                        limits::SLOTS_MAX
                    ),
                );
            }
        }
        if self.h2d_bytes_in_flight_max < page {
            return err(
                "h2d_bytes_in_flight_max",
                format!(
                    "is {} but must allow at least one page of {page} bytes",
                    self.h2d_bytes_in_flight_max
                ),
            );
        }
        if self.d2h_bytes_in_flight_max < page {
            return err(
                "d2h_bytes_in_flight_max",
                format!(
                    "is {} but must allow at least one page of {page} bytes",
                    self.d2h_bytes_in_flight_max
                ),
            );
        }
        if self.remote_budget_bytes > 0 {
            if self.remote_pages() <= limits::REMOTE_HEADROOM_PAGES {
                return err(
                    "remote_budget_bytes",
                    format!(
                        "is {} but must be 0 or hold more than {} pages of {page} bytes",
                        self.remote_budget_bytes,
                        limits::REMOTE_HEADROOM_PAGES
                    ),
                );
            }
            if self.host_slots() <= self.gpu_frames() {
                return err(
                    "host_budget_bytes",
                    format!(
                        "holds {} pages but must hold more than the GPU budget's {} when a \
                         remote tier is used",
                        self.host_slots(),
                        self.gpu_frames()
                    ),
                );
            }
            if self.remote_bytes_in_flight_max < page {
                return err(
                    "remote_bytes_in_flight_max",
                    format!(
                        "is {} but must allow at least one page of {page} bytes",
                        self.remote_bytes_in_flight_max
                    ),
                );
            }
        }
        if self.lookahead_accesses_max == 0
            || self.lookahead_accesses_max > limits::LOOKAHEAD_ACCESSES_MAX
        {
            return err(
                "lookahead_accesses_max",
                format!(
                    "is {} but must be from 1 to {}",
                    self.lookahead_accesses_max,
                    limits::LOOKAHEAD_ACCESSES_MAX
                ),
            );
        }
        if self.history_steps == 0 || self.history_steps > limits::HISTORY_STEPS_MAX {
            return err(
                "history_steps",
                format!(
                    "is {} but must be from 1 to {}",
                    self.history_steps,
                    limits::HISTORY_STEPS_MAX
                ),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate() {
        let c = PoolConfig::new(64 << 20, 256 << 20);
        c.validate().unwrap();
        assert_eq!(c.gpu_frames(), 32);
        assert_eq!(c.host_slots(), 128);
    }

    #[test]
    fn budgets_of_more_pages_than_the_limit_name_their_field() {
        let page = PageSize::default().bytes();
        let over = (limits::SLOTS_MAX + 1) * page;
        let e = PoolConfig::new(over, over + page).validate().unwrap_err();
        assert_eq!(e.field, "gpu_budget_bytes");
        assert_eq!(
            e.problem,
            format!(
                "holds {} pages, more than the limit of {}",
                limits::SLOTS_MAX + 1,
                limits::SLOTS_MAX
            )
        );
        let e = PoolConfig::new(64 << 20, over).validate().unwrap_err();
        assert_eq!(e.field, "host_budget_bytes");
    }

    #[test]
    fn errors_name_the_field() {
        let mut c = PoolConfig::new(1 << 20, 256 << 20);
        assert_eq!(c.validate().unwrap_err().field, "gpu_budget_bytes");
        c.gpu_budget_bytes = 64 << 20;
        c.host_budget_bytes = 0;
        assert_eq!(c.validate().unwrap_err().field, "host_budget_bytes");
        c.host_budget_bytes = 64 << 20;
        c.h2d_bytes_in_flight_max = 1;
        assert_eq!(c.validate().unwrap_err().field, "h2d_bytes_in_flight_max");
        c.h2d_bytes_in_flight_max = 64 << 20;
        c.lookahead_accesses_max = 0;
        assert_eq!(c.validate().unwrap_err().field, "lookahead_accesses_max");
        c.remote_budget_bytes = 1 << 20;
        assert_eq!(c.validate().unwrap_err().field, "remote_budget_bytes");
        c.remote_budget_bytes = 64 << 20;
        assert_eq!(c.validate().unwrap_err().field, "host_budget_bytes");
        c.host_budget_bytes = 128 << 20;
        c.remote_bytes_in_flight_max = 0;
        assert_eq!(
            c.validate().unwrap_err().field,
            "remote_bytes_in_flight_max"
        );
        c.remote_bytes_in_flight_max = 64 << 20;
        c.lookahead_accesses_max = 8;
        c.validate().unwrap();
        c.history_steps = 0;
        let e = c.validate().unwrap_err();
        assert_eq!(e.field, "history_steps");
        assert!(e.to_string().contains("history_steps"), "{e}");
    }

    #[test]
    fn policy_names_round_trip() {
        for p in Policy::ALL {
            assert_eq!(p.name().parse::<Policy>().unwrap(), p);
        }
        assert!("lru".parse::<Policy>().is_err());
    }
}
