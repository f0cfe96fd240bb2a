//! A value loaded from files and loaded again when they change on disk: the tokens file, the
//! proof keys file, a listener's certificate and key. A mounted Kubernetes Secret is updated in
//! place, so a rotation reaches a running service without a restart.
//!
//! The files' modification times are looked at no more often than every `recheck_every`, on
//! use; when one changed, the files are loaded again. A load that fails keeps the previous value
//! in force (the caller logs why), and the files are looked at again after the next interval.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant, SystemTime};

type Stamp = Vec<Option<SystemTime>>;

/// What [`Watched::maybe_reload`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Reload {
    /// Not yet time to look, or the files did not change.
    Unchanged,
    /// The files changed and the new value is in force.
    Reloaded,
    /// The files changed but do not load (why); the previous value stays in force.
    Failed(String),
}

/// A value kept in step with `paths`.
pub struct Watched<T> {
    paths: Vec<PathBuf>,
    recheck_every: Duration,
    load: fn(&[PathBuf]) -> Result<T, String>,
    current: RwLock<(Stamp, T)>,
    checked: Mutex<Instant>,
}

fn stamp(paths: &[PathBuf]) -> Stamp {
    paths
        .iter()
        .map(|path| std::fs::metadata(path).and_then(|m| m.modified()).ok())
        .collect()
}

impl<T> Watched<T> {
    /// Loads now (so a wrong file fails at start); `load` is called again on every change.
    pub fn new(
        paths: Vec<PathBuf>,
        recheck_every: Duration,
        load: fn(&[PathBuf]) -> Result<T, String>,
    ) -> Result<Self, String> {
        let stamp = stamp(&paths);
        let value = load(&paths)?;
        Ok(Self {
            paths,
            recheck_every,
            load,
            current: RwLock::new((stamp, value)),
            checked: Mutex::new(Instant::now()),
        })
    }

    /// The first watched file, for messages.
    pub fn path(&self) -> &Path {
        self.paths.first().map_or(Path::new(""), PathBuf::as_path)
    }

    /// Loads the files again if it is time to look and they changed.
    pub fn maybe_reload(&self) -> Reload {
        {
            let Ok(mut checked) = self.checked.lock() else {
                return Reload::Unchanged;
            };
            if checked.elapsed() < self.recheck_every {
                return Reload::Unchanged;
            }
            *checked = Instant::now();
        }
        let stamp = stamp(&self.paths);
        let unchanged = self
            .current
            .read()
            .map(|current| current.0 == stamp)
            .unwrap_or(true);
        if unchanged {
            return Reload::Unchanged;
        }
        match (self.load)(&self.paths) {
            Ok(value) => {
                if let Ok(mut current) = self.current.write() {
                    *current = (stamp, value);
                }
                Reload::Reloaded
            }
            Err(error) => Reload::Failed(error),
        }
    }

    /// The value in force (without looking at the files).
    pub fn read(&self) -> Option<ValueGuard<'_, T>> {
        self.current.read().ok().map(ValueGuard)
    }

    /// Makes the next [`Watched::maybe_reload`] look at the files at once.
    #[cfg(test)]
    pub(crate) fn look_now(&self) {
        if let Ok(mut checked) = self.checked.lock() {
            *checked = Instant::now() - self.recheck_every - Duration::from_secs(1);
        }
    }
}

/// A read of the value in force.
pub struct ValueGuard<'a, T>(RwLockReadGuard<'a, (Stamp, T)>);

impl<T> std::ops::Deref for ValueGuard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0.1
    }
}

/// Parses a file of `<name> <secret>` lines; `#` starts a comment, blank lines are skipped.
/// `what` names the two words in the message of a line that is not two words. Each pair comes
/// with its line number (from 1).
pub fn pairs<'a>(text: &'a str, what: &str) -> Result<Vec<(usize, &'a str, &'a str)>, String> {
    let mut pairs = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let mut parts = line.split_whitespace();
        let (Some(name), Some(secret), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(format!("line {}: expected `{what}`, two words", number + 1));
        };
        pairs.push((number + 1, name, secret));
    }
    Ok(pairs)
}

/// Refuses a secret of line `number` shorter than `min` or with other than printable ASCII;
/// `whose` names it in the message ("the token of `ops`").
pub fn check_secret(number: usize, whose: &str, secret: &str, min: usize) -> Result<(), String> {
    if secret.len() < min || !secret.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "line {number}: {whose} must be at least {min} printable characters (e.g. `openssl \
             rand -hex 32`)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_number(paths: &[PathBuf]) -> Result<u32, String> {
        let path = paths.first().ok_or("no path")?;
        let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
        text.trim()
            .parse()
            .map_err(|_| format!("not a number: {text:?}"))
    }

    fn touch_later(path: &Path, seconds: u64) {
        std::fs::File::options()
            .write(true)
            .open(path)
            .and_then(|f| f.set_modified(SystemTime::now() + Duration::from_secs(seconds)))
            .unwrap_or_else(|e| panic!("{e}"));
    }

    #[test]
    fn a_change_is_loaded_after_the_interval_and_a_broken_one_keeps_the_value() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let file = dir.path().join("n");
        std::fs::write(&file, "1").unwrap_or_else(|e| panic!("{e}"));
        let watched = Watched::new(vec![file.clone()], Duration::from_secs(60), read_number)
            .unwrap_or_else(|e| panic!("{e}"));
        let value = || watched.read().map(|v| *v);
        std::fs::write(&file, "2").unwrap_or_else(|e| panic!("{e}"));
        touch_later(&file, 5);
        // Not yet time to look.
        assert_eq!(watched.maybe_reload(), Reload::Unchanged);
        assert_eq!(value(), Some(1));
        watched.look_now();
        assert_eq!(watched.maybe_reload(), Reload::Reloaded);
        assert_eq!(value(), Some(2));
        std::fs::write(&file, "two").unwrap_or_else(|e| panic!("{e}"));
        touch_later(&file, 10);
        watched.look_now();
        assert!(matches!(watched.maybe_reload(), Reload::Failed(_)));
        assert_eq!(value(), Some(2));
    }

    #[test]
    fn pairs_skip_comments_and_refuse_a_line_of_other_than_two_words() {
        let parsed = pairs("# c\n\na b # x\nc d\n", "<x> <y>").unwrap_or_default();
        assert_eq!(parsed, vec![(3, "a", "b"), (4, "c", "d")]);
        let error = pairs("a b\nc\n", "<x> <y>").err().unwrap_or_default();
        assert_eq!(error, "line 2: expected `<x> <y>`, two words");
    }
}
