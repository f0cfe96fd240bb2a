//! `DLOCK_SERVICE_ADDRESSES`: an address map for reaching the services from outside the cluster,
//! the way `curl --resolve` works.
//!
//! The variable is a comma-separated list of `host:port=host:port` entries, e.g.
//! `lock-server.ns1.svc:8080=127.0.0.1:40123,payment-resource.ns1.svc:8080=127.0.0.1:40124`.
//! Every base URL a contract client is given (LockClient, PaymentClient, RailClient,
//! [`crate::rail::read_statement`]) is rewritten through it when its authority matches an entry's
//! left side exactly (host compared case-insensitively; a URL without a port matches with its
//! scheme's default port, 80 or 443). Scheme, user info, path and query are kept. The variable is
//! parsed once per process; a malformed entry is an error that names the variable and the entry.
//!
//! The request then goes to the right side's authority as written: for HTTPS the certificate is
//! verified against that name, so map to a name the target's certificate carries.

use std::sync::OnceLock;

/// The environment variable.
pub const ENV: &str = "DLOCK_SERVICE_ADDRESSES";

/// A malformed entry of [`ENV`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{ENV}: malformed entry {entry:?}: {message} (expected host:port=host:port)")]
pub struct AddressMapError {
    pub entry: String,
    pub message: String,
}

/// One `host:port`, the host lower-cased.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Authority {
    host: String,
    port: u16,
}

impl Authority {
    fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.is_empty() {
            return Err("an empty side".into());
        }
        if text.contains(['/', '@', '?', '#', ' ', '\t', ',', '=']) {
            return Err(format!("{text:?} is not a bare host:port"));
        }
        let (host, port) = if let Some(rest) = text.strip_prefix('[') {
            // [v6]:port
            let (host, after) = rest
                .split_once(']')
                .ok_or_else(|| format!("{text:?} opens an IPv6 bracket it never closes"))?;
            let port = after
                .strip_prefix(':')
                .ok_or_else(|| format!("{text:?} has no :port"))?;
            (format!("[{host}]"), port)
        } else {
            let (host, port) = text
                .rsplit_once(':')
                .ok_or_else(|| format!("{text:?} has no :port"))?;
            if host.contains(':') {
                return Err(format!("{text:?}: write an IPv6 host in brackets"));
            }
            (host.to_owned(), port)
        };
        if host.is_empty() || host == "[]" {
            return Err(format!("{text:?} has no host"));
        }
        let port = port
            .parse::<u16>()
            .ok()
            .filter(|p| *p > 0 && port.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| format!("{text:?}: the port must be 1 to 65535"))?;
        Ok(Self {
            host: host.to_ascii_lowercase(),
            port,
        })
    }

    fn render(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }
}

/// The parsed map; empty when the variable is unset or blank.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddressMap {
    entries: Vec<(Authority, Authority)>,
}

impl AddressMap {
    /// Parses `host:port=host:port[,…]`. Blank entries (a trailing comma) are skipped.
    pub fn parse(text: &str) -> Result<Self, AddressMapError> {
        let mut entries = Vec::new();
        for entry in text.split(',') {
            if entry.trim().is_empty() {
                continue;
            }
            let error = |message: String| AddressMapError {
                entry: entry.trim().to_owned(),
                message,
            };
            let (from, to) = entry
                .split_once('=')
                .ok_or_else(|| error("no `=`".into()))?;
            let from = Authority::parse(from).map_err(error)?;
            let to = Authority::parse(to).map_err(error)?;
            if entries
                .iter()
                .any(|(f, _): &(Authority, Authority)| *f == from)
            {
                return Err(error(format!("{} is mapped twice", from.render())));
            }
            entries.push((from, to));
        }
        Ok(Self { entries })
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// `url` with its authority replaced when an entry matches it exactly; otherwise unchanged.
    pub fn rewrite(&self, url: &str) -> String {
        if self.entries.is_empty() {
            return url.to_owned();
        }
        let Some((scheme, rest)) = url.split_once("://") else {
            return url.to_owned();
        };
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (userinfo, hostport) = match authority.rsplit_once('@') {
            Some((user, hostport)) => (Some(user), hostport),
            None => (None, authority),
        };
        let default_port = match scheme.to_ascii_lowercase().as_str() {
            "http" => Some(80),
            "https" => Some(443),
            _ => None,
        };
        let has_port = if hostport.starts_with('[') {
            hostport.contains("]:")
        } else {
            hostport.contains(':')
        };
        let parsed = match (has_port, default_port) {
            (true, _) => Authority::parse(hostport),
            // No port written: the scheme's default, as the connection would use.
            (false, Some(port)) => Authority::parse(&format!("{hostport}:{port}")),
            (false, None) => return url.to_owned(),
        };
        let Ok(parsed) = parsed else {
            return url.to_owned();
        };
        match self.entries.iter().find(|(from, _)| *from == parsed) {
            Some((_, to)) => match userinfo {
                Some(user) => format!("{scheme}://{user}@{}{tail}", to.render()),
                None => format!("{scheme}://{}{tail}", to.render()),
            },
            None => url.to_owned(),
        }
    }
}

static FROM_ENV: OnceLock<Result<AddressMap, AddressMapError>> = OnceLock::new();

/// The process's map from [`ENV`], parsed on first use and kept for the process's life.
pub fn from_env() -> Result<&'static AddressMap, AddressMapError> {
    FROM_ENV
        .get_or_init(|| match std::env::var(ENV) {
            Ok(text) => AddressMap::parse(&text),
            Err(_) => Ok(AddressMap::default()),
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// `url` rewritten through the process's map; an error when [`ENV`] is malformed.
pub fn rewrite(url: &str) -> Result<String, AddressMapError> {
    Ok(from_env()?.rewrite(url))
}

/// `url` rewritten through the process's map, or unchanged when the map is malformed (for the
/// infallible constructors; the fallible ones and the operator's start-up report the error).
pub fn rewrite_or_keep(url: &str) -> String {
    match from_env() {
        Ok(map) => map.rewrite(url),
        Err(_) => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(text: &str) -> AddressMap {
        AddressMap::parse(text).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn an_empty_or_blank_variable_is_an_empty_map() {
        assert!(map("").is_empty());
        assert!(map(" , ,").is_empty());
        assert_eq!(map("").rewrite("http://a:1/x"), "http://a:1/x");
    }

    #[test]
    fn entries_parse_with_spaces_trailing_commas_and_ipv6() {
        let m = map(" lock-server.ns1.svc:8080 = 127.0.0.1:40123 , [::1]:80=[::1]:8080,");
        assert_eq!(m.entries.len(), 2);
        assert_eq!(m.entries[1].0.host, "[::1]");
    }

    #[test]
    fn malformed_entries_name_the_variable_and_the_entry() {
        for (text, entry) in [
            ("a:1", "a:1"),
            ("a:1=b", "a:1=b"),
            ("a=b:2", "a=b:2"),
            ("a:1=b:0", "a:1=b:0"),
            ("a:1=b:70000", "a:1=b:70000"),
            ("a:1=b:x", "a:1=b:x"),
            ("ok:1=ok:2, http://a:1=b:2", "http://a:1=b:2"),
            ("a:1=b:2=c:3", "a:1=b:2=c:3"),
            ("::1:80=b:2", "::1:80=b:2"),
            ("a:1=b:2,A:1=c:3", "A:1=c:3"),
            (":1=b:2", ":1=b:2"),
        ] {
            let Err(error) = AddressMap::parse(text) else {
                panic!("{text} parsed");
            };
            assert_eq!(error.entry, entry, "{text}");
            let shown = error.to_string();
            assert!(shown.starts_with("DLOCK_SERVICE_ADDRESSES: "), "{shown}");
            assert!(shown.contains(entry), "{shown}");
        }
    }

    #[test]
    fn a_matching_authority_is_rewritten_and_everything_else_kept() {
        let m = map("lock-server.ns1.svc:8080=127.0.0.1:40123,rail:443=localhost:9443");
        assert_eq!(
            m.rewrite("http://lock-server.ns1.svc:8080"),
            "http://127.0.0.1:40123"
        );
        assert_eq!(
            m.rewrite("http://Lock-Server.ns1.svc:8080/v1/locks?limit=3#x"),
            "http://127.0.0.1:40123/v1/locks?limit=3#x"
        );
        assert_eq!(
            m.rewrite("https://u:p@lock-server.ns1.svc:8080/"),
            "https://u:p@127.0.0.1:40123/"
        );
        // The scheme's default port counts as written.
        assert_eq!(
            m.rewrite("https://rail/statement"),
            "https://localhost:9443/statement"
        );
        // Exact authorities only: another port, a suffix, a prefix do not match.
        for unchanged in [
            "http://lock-server.ns1.svc:8081",
            "http://lock-server.ns1.svc",
            "http://x.lock-server.ns1.svc:8080",
            "http://lock-server.ns1.svc.cluster.local:8080",
            "http://rail:80",
            "not a url",
        ] {
            assert_eq!(m.rewrite(unchanged), unchanged);
        }
    }

    #[test]
    fn ipv6_authorities_match() {
        let m = map("[fd00::1]:8080=127.0.0.1:1");
        assert_eq!(m.rewrite("http://[FD00::1]:8080/x"), "http://127.0.0.1:1/x");
        let m = map("[fd00::1]:80=127.0.0.1:1");
        assert_eq!(m.rewrite("http://[fd00::1]/x"), "http://127.0.0.1:1/x");
    }
}
