//! Squashed migration histories. Each database's migrations have been folded into a baseline
//! (`migrations/<database>/NNNN_baseline*.sql`, one file or a run of them) more than once.
//! `migrations/<database>/retired.tsv` lists every squash's history, one line per migration:
//! `generation<TAB>version<TAB>checksum<TAB>description`, the checksum the SHA-384 sqlx recorded.
//! Generation 1 is the oldest history, squashed into the first baseline; each later generation is
//! the previous baseline and the migrations that followed it, squashed into the next one. The last
//! generation is what this build's baseline replaces.
//!
//! A database that applied exactly the last generation has the baseline's schema already, so on
//! start its migration rows are rewritten to the baseline's, in one transaction, before sqlx looks
//! at them. A database that applied exactly an earlier generation has that generation's baseline's
//! schema, which this build's baseline does not describe, and one that carries only part of a
//! generation has no baseline's schema at all: both are refused with what to do (start the
//! releases that still carry the baselines in between, once each, then this one), and left alone.

use std::collections::BTreeSet;
use std::fmt;

use sqlx::PgPool;
use sqlx::migrate::{Migration, Migrator};

/// Where sqlx records applied migrations (its default; no service sets another).
const TABLE: &str = "_sqlx_migrations";

/// One migration of a retired history: its version, the SHA-384 checksum sqlx stored for it, and
/// its description (`baseline …` for the files of a baseline).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retired {
    pub version: i64,
    pub checksum: Vec<u8>,
    pub description: String,
}

/// The history one squash replaced, oldest migration first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generation {
    /// 1 for the oldest history.
    pub number: u32,
    pub migrations: Vec<Retired>,
}

impl Generation {
    fn versions(&self) -> Vec<i64> {
        self.migrations.iter().map(|m| m.version).collect()
    }

    fn contains(&self, version: i64) -> bool {
        self.migrations.iter().any(|m| m.version == version)
    }

    /// The versions of the baseline this generation begins with (none for the first).
    fn baseline(&self) -> Vec<i64> {
        self.migrations
            .iter()
            .take_while(|m| m.description.starts_with("baseline"))
            .map(|m| m.version)
            .collect()
    }
}

/// The retired histories of `database` (`lockdb`, `paydb`), oldest first; none for any other.
/// The files are compiled in, so a malformed line is a build defect (the unit test below reads
/// both), not input: it panics.
pub fn retired(database: &str) -> Vec<Generation> {
    let tsv = match database {
        "lockdb" => include_str!("../../../migrations/lockdb/retired.tsv"),
        "paydb" => include_str!("../../../migrations/paydb/retired.tsv"),
        _ => return Vec::new(),
    };
    let mut generations: Vec<Generation> = Vec::new();
    for line in tsv
        .lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
    {
        let fields: Vec<&str> = line.split('\t').collect();
        let [generation, version, checksum, description] = fields[..] else {
            panic!(
                "{database}/retired.tsv: `{line}` is not \
                 generation<TAB>version<TAB>checksum<TAB>description"
            );
        };
        let number: u32 = generation
            .parse()
            .unwrap_or_else(|e| panic!("{database}/retired.tsv: generation `{generation}`: {e}"));
        let retired = Retired {
            version: version
                .parse()
                .unwrap_or_else(|e| panic!("{database}/retired.tsv: version `{version}`: {e}")),
            checksum: (0..checksum.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(checksum.get(i..i + 2).unwrap_or("?"), 16))
                .collect::<Result<_, _>>()
                .unwrap_or_else(|e| panic!("{database}/retired.tsv: checksum of {version}: {e}")),
            description: description.to_owned(),
        };
        match generations.last_mut() {
            Some(last) if last.number == number => last.migrations.push(retired),
            _ => generations.push(Generation {
                number,
                migrations: vec![retired],
            }),
        }
    }
    generations
}

/// What [`adopt`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adoption {
    /// No retired version is recorded: a new database, or one adopted or built from the baseline.
    NotNeeded,
    /// The whole last retired history was recorded and is now the baseline's rows.
    Adopted { retired: usize, baseline: Vec<i64> },
}

/// The releases to start against a refused database, once each and in order, before this one:
/// each is the last release before a squash into the versions named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Steps(pub Vec<Vec<i64>>);

impl fmt::Display for Steps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, into) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", then ")?;
            }
            write!(
                f,
                "the last release before the squash into versions {into:?}"
            )?;
        }
        Ok(())
    }
}

/// Why [`adopt`] changed nothing and the service must not start.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error(
        "{database} carries migrations {found:?} of the history squashed into versions \
         {squashed_into:?}, but not exactly the versions {expected:?} with their recorded \
         checksums, all applied: its schema is not that baseline's. Start {steps} against it \
         once, so it applies the rest, then this one. Nothing was changed."
    )]
    Partial {
        database: String,
        found: Vec<i64>,
        expected: Vec<i64>,
        squashed_into: Vec<i64>,
        steps: Steps,
    },
    #[error(
        "{database}'s migration rows are exactly the history squashed into versions \
         {squashed_into:?}, a baseline that a later squash retired in turn: its schema is that \
         baseline's, which this release's baseline (versions {baseline:?}) does not describe. \
         Start {steps} against it once: a dlock release that still carries versions \
         {squashed_into:?} adopts the database and applies the migrations after that baseline. \
         Then start this one. Nothing was changed."
    )]
    Superseded {
        database: String,
        squashed_into: Vec<i64>,
        baseline: Vec<i64>,
        steps: Steps,
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

/// The migrations that together replace the last retired history: those whose file is named
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

/// What is wrong with `recorded` (version, checksum, success) when it touches `generation`, the
/// newest generation it touches: `None` when it is exactly the last generation (adopt it).
fn refusal(
    database: &str,
    generations: &[Generation],
    generation: &Generation,
    recorded: &[(i64, Vec<u8>, bool)],
    baseline: &[i64],
) -> Option<AdoptError> {
    let exact = recorded.len() == generation.migrations.len()
        && recorded
            .iter()
            .zip(&generation.migrations)
            .all(|((version, checksum, success), r)| {
                *success && *version == r.version && *checksum == r.checksum
            });
    // The baseline each generation was squashed into: the next generation's first versions, or
    // this build's for the last.
    let squashed_into = |g: &Generation| {
        generations
            .iter()
            .find(|next| next.number == g.number + 1)
            .map_or_else(|| baseline.to_vec(), Generation::baseline)
    };
    // The releases that each carry one of the baselines from `generation`'s up to this build's.
    let later: Vec<Vec<i64>> = generations
        .iter()
        .filter(|g| g.number > generation.number)
        .map(squashed_into)
        .collect();
    let is_last = generations.last().map(|g| g.number) == Some(generation.number);
    if exact && is_last {
        return None;
    }
    if exact {
        return Some(AdoptError::Superseded {
            database: database.to_owned(),
            squashed_into: squashed_into(generation),
            baseline: baseline.to_vec(),
            steps: Steps(later),
        });
    }
    let versions = generation.versions();
    Some(AdoptError::Partial {
        database: database.to_owned(),
        found: recorded
            .iter()
            .map(|(version, _, _)| *version)
            .filter(|v| versions.contains(v))
            .collect(),
        expected: versions,
        squashed_into: squashed_into(generation),
        steps: Steps(
            std::iter::once(squashed_into(generation))
                .chain(later)
                .collect(),
        ),
    })
}

/// Rewrites `database`'s migration rows from its last retired history to `migrator`'s baseline,
/// when exactly that history is recorded. Safe to race: the rows are read and rewritten under a
/// lock on the migrations table that excludes a second adopter, so a service starting at the same
/// time finds them adopted.
pub async fn adopt(
    pool: &PgPool,
    migrator: &Migrator,
    database: &str,
) -> Result<Adoption, AdoptError> {
    let generations = retired(database);
    let Some(last) = generations.last().and_then(|g| g.migrations.last()) else {
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
    // The newest generation any recorded row belongs to (versions never repeat across them).
    let Some(generation) = generations
        .iter()
        .rev()
        .find(|g| rows.iter().any(|(version, _, _)| g.contains(*version)))
    else {
        return Ok(Adoption::NotNeeded);
    };
    if let Some(refused) = refusal(
        database,
        &generations,
        generation,
        &rows,
        &baseline_versions,
    ) {
        return Err(refused);
    }
    let versions: BTreeSet<i64> = generation.versions().into_iter().collect();
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

    fn migrators() -> [(&'static str, Migrator, Vec<i64>); 2] {
        [
            (
                "lockdb",
                sqlx::migrate!("../../migrations/lockdb"),
                vec![16],
            ),
            (
                "paydb",
                sqlx::migrate!("../../migrations/paydb"),
                vec![37, 38, 39, 40],
            ),
        ]
    }

    #[test]
    fn the_histories_run_from_version_one_each_generation_after_the_last_from_its_baseline() {
        for (database, migrator, versions) in migrators() {
            let generations = retired(database);
            assert_eq!(generations.len(), 3, "{database}: three squashes so far");
            let mut last = 0;
            for (g, generation) in generations.iter().enumerate() {
                assert_eq!(generation.number, g as u32 + 1, "{database}");
                // Each generation starts right after the one before, its versions rising (a
                // version never applied, as paydb's 29, leaves a gap).
                assert_eq!(
                    generation.migrations.first().map(|m| m.version),
                    Some(last + 1),
                    "{database} generation {}: right after the one before",
                    generation.number
                );
                for r in &generation.migrations {
                    assert!(r.version > last, "{database} {}: rising", r.version);
                    assert_eq!(r.checksum.len(), 48, "{database} {}: SHA-384", r.version);
                    last = r.version;
                }
                // The first history has no baseline; every later one starts with the baseline
                // the one before was squashed into.
                assert_eq!(
                    generation.baseline().is_empty(),
                    generation.number == 1,
                    "{database} generation {}",
                    generation.number
                );
            }
            let found: Vec<i64> = baseline(&migrator, database, last)
                .unwrap_or_else(|e| panic!("{e}"))
                .iter()
                .map(|m| m.version)
                .collect();
            assert_eq!(found, versions, "{database}: this build's baseline");
        }
        assert!(retired("elsewhere").is_empty());
    }

    fn rows(generation: &Generation) -> Vec<(i64, Vec<u8>, bool)> {
        generation
            .migrations
            .iter()
            .map(|m| (m.version, m.checksum.clone(), true))
            .collect()
    }

    #[test]
    fn only_the_last_generation_whole_is_adopted_and_the_refusals_name_the_releases_in_between() {
        for (database, _, baseline) in migrators() {
            let generations = retired(database);
            let Some((last, earlier)) = generations.split_last() else {
                panic!("{database}: no generation");
            };
            assert!(
                refusal(database, &generations, last, &rows(last), &baseline).is_none(),
                "{database}: the last generation, whole, is adopted"
            );
            let release =
                |into: &[i64]| format!("the last release before the squash into versions {into:?}");

            // Each earlier generation, whole, has the schema of the baseline it was squashed
            // into (the next generation's first versions): refused, naming the release of each
            // later squash, oldest first, and the one that still carries that baseline.
            for (g, generation) in earlier.iter().enumerate() {
                let later: Vec<String> = generations[g + 2..]
                    .iter()
                    .map(|next| release(&next.baseline()))
                    .chain([release(&baseline)])
                    .collect();
                let carried = generations[g + 1].baseline();
                let whole = refusal(
                    database,
                    &generations,
                    generation,
                    &rows(generation),
                    &baseline,
                )
                .map(|e| e.to_string())
                .unwrap_or_default();
                assert!(
                    whole.contains(&format!("Start {} against it once", later.join(", then ")))
                        && whole.contains(&format!("still carries versions {carried:?}"))
                        && whole.contains("Then start this one"),
                    "{database}: generation {}, whole: {whole}",
                    generation.number
                );

                let mut part = rows(generation);
                part.pop();
                let partial = refusal(database, &generations, generation, &part, &baseline)
                    .map(|e| e.to_string())
                    .unwrap_or_default();
                assert!(
                    partial.contains(&format!(
                        "Start {}, then {} against it once",
                        release(&carried),
                        later.join(", then ")
                    )),
                    "{database}: part of generation {}: {partial}",
                    generation.number
                );
            }

            for changed in [
                {
                    let mut r = rows(last);
                    r.pop();
                    r
                },
                {
                    let mut r = rows(last);
                    r[0].1[0] ^= 1;
                    r
                },
                {
                    let mut r = rows(last);
                    r[0].2 = false;
                    r
                },
                {
                    let mut r = rows(last);
                    r.push((1000, vec![0; 48], true));
                    r
                },
            ] {
                let refused = refusal(database, &generations, last, &changed, &baseline)
                    .map(|e| e.to_string())
                    .unwrap_or_default();
                assert!(
                    refused.contains(&format!("Start {} against it once", release(&baseline))),
                    "{database}: part of the last generation: {refused}"
                );
            }
        }
    }
}
