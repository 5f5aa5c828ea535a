//! Building a pool: [`PoolBuilder`] checks the settings, and [`DeviceChoice`] picks the
//! GPU tier's backend.

use spillway_device::HostMemory;
use spillway_types::PageSize;
use spillway_types::config::{Policy, PoolConfig};

use crate::pool::{Pool, PoolError};
use crate::remote::RemoteFactory;

/// Which GPU tier backend to use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceChoice {
    /// A GPU when there is one (and the `cuda` feature is built), else `sim`.
    #[default]
    Auto,
    /// Host memory standing in for a GPU.
    Sim,
    /// An NVIDIA GPU; an error names what is missing if there is none.
    Cuda,
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "sim" => Ok(DeviceChoice::Sim),
            "cuda" => Ok(DeviceChoice::Cuda),
            other => Err(format!(
                "unknown device {other:?}: expected auto, sim or cuda"
            )),
        }
    }
}

/// Builds a [`Pool`]. The two budgets are required.
#[derive(Default)]
pub struct PoolBuilder {
    gpu_budget_bytes: Option<u64>,
    host_budget_bytes: Option<u64>,
    remote_budget_bytes: Option<u64>,
    page_size: Option<PageSize>,
    policy: Option<Policy>,
    device: DeviceChoice,
    config: Option<PoolConfig>,
    host_memory: Option<HostMemory>,
    remote: Option<RemoteFactory>,
    lendable_gpu_bytes: Option<u64>,
    copy_bytes_in_flight: Option<u64>,
}

impl std::fmt::Debug for PoolBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolBuilder")
            .field("gpu_budget_bytes", &self.gpu_budget_bytes)
            .field("host_budget_bytes", &self.host_budget_bytes)
            .field("remote_budget_bytes", &self.remote_budget_bytes)
            .field("device", &self.device)
            .field("remote", &self.remote.is_some())
            .finish_non_exhaustive()
    }
}

/// Builder methods that set an optional field: `name(value)` sets `self.name` to
/// `Some(value)`.
macro_rules! optional_settings {
    ($($(#[$doc:meta])* $name:ident: $ty:ty,)*) => {
        $(
            $(#[$doc])*
            pub fn $name(mut self, value: $ty) -> Self {
                self.$name = Some(value);
                self
            }
        )*
    };
}

impl PoolBuilder {
    /// A builder with nothing set.
    pub fn new() -> Self {
        Self::default()
    }
    optional_settings! {
        /// Bytes of GPU memory the pool may use (required).
        gpu_budget_bytes: u64,
        /// Bytes of host memory for the host tier (required); it must hold every buffer.
        host_budget_bytes: u64,
        /// Bytes of the remote tier the pool may use (required with [`PoolBuilder::remote`]).
        remote_budget_bytes: u64,
        /// The remote tier below the host tier, made once the device exists.
        remote: RemoteFactory,
        /// Host slots in memory made elsewhere (shared with the node daemon) instead of the
        /// device's own; it must hold the host budget's pages.
        host_memory: HostMemory,
        /// The page size (default 2 MiB).
        page_size: PageSize,
        /// The prefetch and eviction policy (default learned).
        policy: Policy,
        /// GPU memory beyond the budget that the pool may lend to a neighbour
        /// ([`Pool::lend`]), whole pages; the sim device only (`auto` picks it).
        lendable_gpu_bytes: u64,
        /// Bytes of copies in flight each way between the GPU and the host tier (default
        /// 64 MiB each, [`spillway_types::limits::H2D_BYTES_IN_FLIGHT_DEFAULT`]); at
        /// least a page.
        copy_bytes_in_flight: u64,
    }
    /// The backend (default auto).
    pub fn device(mut self, device: DeviceChoice) -> Self {
        self.device = device;
        self
    }
    /// Every other setting, from a full configuration (budgets, page size and policy set
    /// on the builder take precedence).
    pub fn config(mut self, config: PoolConfig) -> Self {
        self.gpu_budget_bytes.get_or_insert(config.gpu_budget_bytes);
        self.host_budget_bytes
            .get_or_insert(config.host_budget_bytes);
        self.config = Some(config);
        self
    }

    /// Checks the settings, creates the device and the pool.
    pub fn build(self) -> Result<Pool, PoolError> {
        let gpu = self
            .gpu_budget_bytes
            .ok_or(PoolError::Missing("gpu_budget_bytes"))?;
        let host = self
            .host_budget_bytes
            .ok_or(PoolError::Missing("host_budget_bytes"))?;
        let mut cfg = self.config.unwrap_or_else(|| PoolConfig::new(gpu, host));
        cfg.gpu_budget_bytes = gpu;
        cfg.host_budget_bytes = host;
        if let Some(r) = self.remote_budget_bytes {
            cfg.remote_budget_bytes = r;
        }
        match (&self.remote, cfg.remote_budget_bytes) {
            (Some(_), 0) => return Err(PoolError::Missing("remote_budget_bytes")),
            (None, r) if r > 0 => return Err(PoolError::Missing("remote")),
            _ => {}
        }
        if let Some(p) = self.page_size {
            cfg.page_size = p;
        }
        if let Some(p) = self.policy {
            cfg.policy = p;
        }
        if let Some(b) = self.copy_bytes_in_flight {
            cfg.h2d_bytes_in_flight_max = b;
            cfg.d2h_bytes_in_flight_max = b;
        }
        cfg.validate()?;
        let lendable = self.lendable_gpu_bytes.unwrap_or(0) / cfg.page_size.bytes();
        // More than 2^32 pages cannot be had anyway: the device's allocation says so.
        let lendable = u32::try_from(lendable).unwrap_or(u32::MAX);
        Pool::new(cfg, self.device, self.host_memory, self.remote, lendable)
    }
}
