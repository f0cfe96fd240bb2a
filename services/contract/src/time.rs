//! Wall-clock fields: RFC 3339, UTC, milliseconds (`2026-12-02T16:20:00.123Z`).
//!
//! They are for humans. Expiry is decided by the backend's clock, and a client's lease arithmetic
//! runs on its own monotonic clock, never on these strings.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Deserializer, Serializer};

pub fn format(t: &DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

pub fn now() -> DateTime<Utc> {
    Utc::now()
}

/// `#[serde(with = "dlock_contract::time::millis")]` for a `DateTime<Utc>` field.
pub mod millis {
    use super::*;

    pub fn serialize<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format(t))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DateTime<Utc>, D::Error> {
        let text = String::deserialize(d)?;
        DateTime::parse_from_rfc3339(&text)
            .map(|t| t.with_timezone(&Utc))
            .map_err(serde::de::Error::custom)
    }
}

/// The same for an `Option<DateTime<Utc>>` field; pair it with `skip_serializing_if`.
pub mod millis_option {
    use super::*;

    pub fn serialize<S: Serializer>(t: &Option<DateTime<Utc>>, s: S) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => s.serialize_str(&format(t)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<DateTime<Utc>>, D::Error> {
        let text = Option::<String>::deserialize(d)?;
        text.map(|text| {
            DateTime::parse_from_rfc3339(&text)
                .map(|t| t.with_timezone(&Utc))
                .map_err(serde::de::Error::custom)
        })
        .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn formats_utc_with_milliseconds_and_z() {
        let t = Utc
            .timestamp_millis_opt(1_764_692_400_007)
            .single()
            .unwrap_or_default();
        assert_eq!(format(&t), "2025-12-02T16:20:00.007Z");
    }
}
