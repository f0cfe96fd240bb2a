//! Squashed migration histories. Each database's early migrations were folded into a baseline
//! (`migrations/<database>/NNNN_baseline*.sql`, one file or a run of them);
//! `migrations/<database>/retired.tsv` lists the versions it replaces with the checksums sqlx
//! recorded for them. A database that applied exactly that history has the baseline's schema
//! already, so on start its migration rows are rewritten to the baseline's, in one transaction,
//! before sqlx looks at them. A database that carries only part of the retired history is refused
//! with what to do, and left alone.

use std::collections::BTreeSet;

use sqlx::PgPool;
use sqlx::migrate::{Migration, Migrator};

/// Where sqlx records applied migrations (its default; no service sets another).
const TABLE: &str = "_sqlx_migrations";

/// One migration of a retired history: its version and the SHA-384 checksum sqlx stored for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retired {
    pub version: i64,
    pub checksum: Vec<u8>,
}

/// The retired history of `database` (`lockdb`, `paydb`), oldest first; empty for any other.
/// The files are compiled in, so a malformed line is a build defect (the unit test below reads
/// both), not input: it panics.
pub fn retired(database: &str) -> Vec<Retired> {
    let tsv = match database {
        "lockdb" => include_str!("../../../migrations/lockdb/retired.tsv"),
        "paydb" => include_str!("../../../migrations/paydb/retired.tsv"),
        _ => return Vec::new(),
    };
    tsv.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .map(|line| {
            let mut fields = line.split('\t');
            let (Some(version), Some(checksum)) = (fields.next(), fields.next()) else {
                panic!("{database}/retired.tsv: `{line}` is not version<TAB>checksum<TAB>…");
            };
            Retired {
                version: version
                    .parse()
                    .unwrap_or_else(|e| panic!("{database}/retired.tsv: version `{version}`: {e}")),
                checksum: (0..checksum.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(checksum.get(i..i + 2).unwrap_or("?"), 16))
                    .collect::<Result<_, _>>()
                    .unwrap_or_else(|e| {
                        panic!("{database}/retired.tsv: checksum of {version}: {e}")
                    }),
            }
        })
        .collect()
}

/// What [`adopt`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adoption {
    /// No retired version is recorded: a new database, or one adopted or built from the baseline.
    NotNeeded,
    /// The whole retired history was recorded and is now the baseline's rows.
    Adopted { retired: usize, baseline: Vec<i64> },
}

/// Why [`adopt`] changed nothing and the service must not start.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error(
        "{database} carries migrations {found:?} of the history squashed into versions \
         {baseline:?}, but not exactly the versions {expected:?} with their recorded checksums, \
         all applied: its schema is not the baseline's. Start the last release before the squash \
         against it once so it applies the rest, then this one. Nothing was changed."
    )]
    Partial {
        database: String,
        found: Vec<i64>,
        expected: Vec<i64>,
        baseline: Vec<i64>,
    },
    #[error(
        "the {database} migrations named `baseline` are versions {found:?}, not a run from \
         {expected} right after the retired history: the build is inconsistent"
    )]
    Baseline {
        database: String,
        found: Vec<i64>,
        expected: i64,
    },
    #[error("reading or rewriting the {database} migration rows failed: {source}")]
    Database {
        database: String,
        source: sqlx::Error,
    },
}

/// The migrations that together replace the retired history: those whose file is named
/// `NNNN_baseline…`, which must follow it version by version.
fn baseline<'m>(
    migrator: &'m Migrator,
    database: &str,
    last_retired: i64,
) -> Result<Vec<&'m Migration>, AdoptError> {
    let baseline: Vec<&Migration> = migrator
        .iter()
        .filter(|m| !m.migration_type.is_down_migration() && m.description.starts_with("baseline"))
        .collect();
    let consecutive = (last_retired + 1..)
        .zip(&baseline)
        .all(|(v, m)| m.version == v);
    if baseline.is_empty() || !consecutive {
        return Err(AdoptError::Baseline {
            database: database.to_owned(),
            found: baseline.iter().map(|m| m.version).collect(),
            expected: last_retired + 1,
        });
    }
    Ok(baseline)
}

/// Rewrites `database`'s migration rows from its retired history to `migrator`'s baseline, when
/// exactly that history is recorded. Safe to race: the rows are read and rewritten under a lock on
/// the migrations table that excludes a second adopter, so a service starting at the same time
/// finds them adopted.
pub async fn adopt(
    pool: &PgPool,
    migrator: &Migrator,
    database: &str,
) -> Result<Adoption, AdoptError> {
    let retired = retired(database);
    let Some(last) = retired.last() else {
        return Ok(Adoption::NotNeeded);
    };
    let baseline = baseline(migrator, database, last.version)?;
    let baseline_versions: Vec<i64> = baseline.iter().map(|m| m.version).collect();
    let db = |source| AdoptError::Database {
        database: database.to_owned(),
        source,
    };
    let mut tx = pool.begin().await.map_err(db)?;
    let (exists,): (bool,) = sqlx::query_as("SELECT to_regclass($1) IS NOT NULL")
        .bind(TABLE)
        .fetch_one(&mut *tx)
        .await
        .map_err(db)?;
    if !exists {
        return Ok(Adoption::NotNeeded);
    }
    sqlx::query("LOCK TABLE _sqlx_migrations IN SHARE ROW EXCLUSIVE MODE")
        .execute(&mut *tx)
        .await
        .map_err(db)?;
    let rows: Vec<(i64, Vec<u8>, bool)> =
        sqlx::query_as("SELECT version, checksum, success FROM _sqlx_migrations ORDER BY version")
            .fetch_all(&mut *tx)
            .await
            .map_err(db)?;
    let versions: BTreeSet<i64> = retired.iter().map(|r| r.version).collect();
    let found: Vec<i64> = rows
        .iter()
        .map(|(version, _, _)| *version)
        .filter(|v| versions.contains(v))
        .collect();
    if found.is_empty() {
        return Ok(Adoption::NotNeeded);
    }
    let recorded: Vec<Retired> = rows
        .iter()
        .filter(|(_, _, success)| *success)
        .map(|(version, checksum, _)| Retired {
            version: *version,
            checksum: checksum.clone(),
        })
        .collect();
    if recorded != retired || rows.len() != retired.len() {
        return Err(AdoptError::Partial {
            database: database.to_owned(),
            found,
            expected: versions.into_iter().collect(),
            baseline: baseline_versions,
        });
    }
    let versions: Vec<i64> = versions.into_iter().collect();
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = ANY($1)")
        .bind(&versions)
        .execute(&mut *tx)
        .await
        .map_err(db)?;
    // As sqlx records a migration it skipped: applied, with no execution time of its own.
    let descriptions: Vec<&str> = baseline.iter().map(|m| &*m.description).collect();
    let checksums: Vec<&[u8]> = baseline.iter().map(|m| &*m.checksum).collect();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         SELECT version, description, TRUE, checksum, -1 \
         FROM unnest($1::bigint[], $2::text[], $3::bytea[]) AS b (version, description, checksum)",
    )
    .bind(&baseline_versions)
    .bind(&descriptions)
    .bind(&checksums)
    .execute(&mut *tx)
    .await
    .map_err(db)?;
    tx.commit().await.map_err(db)?;
    Ok(Adoption::Adopted {
        retired: versions.len(),
        baseline: baseline_versions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_histories_parse_as_consecutive_versions_from_one_and_their_baselines_follow() {
        for database in ["lockdb", "paydb"] {
            let retired = retired(database);
            assert!(!retired.is_empty(), "{database}");
            for (i, r) in retired.iter().enumerate() {
                assert_eq!(r.version, i as i64 + 1, "{database}");
                assert_eq!(r.checksum.len(), 48, "{database} {}: SHA-384", r.version);
            }
        }
        assert!(retired("elsewhere").is_empty());
        let lockdb = sqlx::migrate!("../../migrations/lockdb");
        let paydb = sqlx::migrate!("../../migrations/paydb");
        for (database, migrator, versions) in [
            ("lockdb", &lockdb, vec![7]),
            ("paydb", &paydb, vec![9, 10, 11, 12]),
        ] {
            let last = retired(database).last().map_or(0, |r| r.version);
            let found: Vec<i64> = baseline(migrator, database, last)
                .unwrap_or_else(|e| panic!("{e}"))
                .iter()
                .map(|m| m.version)
                .collect();
            assert_eq!(found, versions, "{database}");
        }
    }
}
