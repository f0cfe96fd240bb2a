//! Filling a metrics registry: a metric is made and registered in one step, so each one's name
//! and help stand once, where the service lists its metrics, and the handle it keeps is the one
//! registered. The services and the operator build their registries this way.

use prometheus_client::registry::{Metric, Registry};

pub trait Register {
    /// A new metric (zero, or a family with no series yet), registered as `name` with `help`.
    fn add<M: Metric + Clone + Default>(&mut self, name: &str, help: &str) -> M {
        self.add_made(name, help, M::default())
    }

    /// [`Register::add`] for a metric that is not made by default (a histogram's buckets).
    fn add_made<M: Metric + Clone>(&mut self, name: &str, help: &str, metric: M) -> M;
}

impl Register for Registry {
    fn add_made<M: Metric + Clone>(&mut self, name: &str, help: &str, metric: M) -> M {
        self.register(name, help, metric.clone());
        metric
    }
}
