//! The Argo CD health scripts, one per kind, from one source: `argocd/health.lua` here is the
//! body every kind shares; `dlock crdgen --argocd DIR` writes `DIR/<Kind>/health.lua` with a
//! header naming the kind, and `scripts/check-crds` fails when the committed copies under
//! `argocd/dlock.io/` differ from what this writes (as it does for `crds/`).

use anyhow::Context as _;

/// Every dlock.io kind Argo CD shows, in the order the docs list them.
pub const KINDS: [&str; 7] = [
    "LockServer",
    "PaymentResource",
    "RailProxy",
    "PayoutBatch",
    "Lock",
    "LockRevocation",
    "Reconciliation",
];

/// The shared body: conditions and observedGeneration, never phase strings.
pub const HEALTH_BODY: &str = include_str!("argocd/health.lua");

/// The health script of `kind`, as Argo CD's `resource.customizations` takes it.
pub fn health_script(kind: &str) -> String {
    format!(
        "-- Argo CD health for dlock.io/{kind}, driven by the operator's conditions (never by phase\n\
         -- strings): Degraded when Degraded=True, Healthy when Ready=True, Suspended while the\n\
         -- dlock.io/reconcile: paused annotation is set, Progressing otherwise.\n{HEALTH_BODY}"
    )
}

/// Writes `<dir>/<Kind>/health.lua` for every kind; returns the paths written.
pub fn write_health_scripts(dir: &std::path::Path) -> anyhow::Result<Vec<std::path::PathBuf>> {
    let mut written = Vec::new();
    for kind in KINDS {
        let kind_dir = dir.join(kind);
        std::fs::create_dir_all(&kind_dir)
            .with_context(|| format!("creating {}", kind_dir.display()))?;
        let path = kind_dir.join("health.lua");
        std::fs::write(&path, health_script(kind))
            .with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}
