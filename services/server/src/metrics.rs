//! What every service's `/metrics` shares.

use prometheus_client::registry::Registry;

/// The registry in the OpenMetrics text format (empty if it cannot be encoded).
pub fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    if prometheus_client::encoding::text::encode(&mut text, registry).is_err() {
        text.clear();
    }
    text
}
