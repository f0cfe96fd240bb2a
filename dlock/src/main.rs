//! `dlock`: one binary for every part of dlock.

mod demo;
mod dev;
mod jobs;
mod kubectl;
mod recover;
mod telemetry;

use std::path::PathBuf;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// Every service answers a request with many small, short-lived allocations (HTTP, JSON, SQL
/// rows). mimalloc serves them from per-thread pages; glibc's malloc spent about a fifth of the
/// services' CPU in a payouts run (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "dlock",
    version,
    about = "Fenced payouts: the lock server, the payout services and their local stack"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs one service in the foreground.
    Serve {
        #[command(subcommand)]
        service: Service,
    },
    /// The local stack for people and tests.
    Dev {
        #[command(subcommand)]
        command: DevCommand,
    },
    /// Starts the local stack, runs a thousand-payout demo batch with the rail's faults on,
    /// prints the result and the reconciler's findings, and stops everything.
    Demo(demo::DemoArgs),
    /// Registers and executes a PayoutBatch against a running stack.
    Run(jobs::RunArgs),
    /// Opens and funds the accounts a PayoutBatch pays from, and sets their limits.
    Accounts {
        #[command(subcommand)]
        command: jobs::AccountsCommand,
    },
    /// Approves a funding that waits for a second treasury identity.
    Fundings {
        #[command(subcommand)]
        command: jobs::FundingsCommand,
    },
    /// Compares paydb, the ledger and the rail's statement; reports, never repairs.
    Reconcile(jobs::ReconcileArgs),
    /// Resolves a RAIL_AMBIGUOUS payout out of band (attributed, audited).
    Resolve(jobs::ResolveArgs),
    /// Force-revokes a lock and pushes the new token floor to both enforcement points.
    Revoke(jobs::RevokeArgs),
    /// Confirms a recovery after a store went back in time (docs/design.md#d-12), audited.
    Recover {
        #[command(subcommand)]
        command: recover::RecoverCommand,
    },
    /// Runs the Kubernetes operator (leader-elected controllers, /healthz, /metrics).
    Operator(dlock_operator::OperatorArgs),
    /// The kubectl plugin on the current kubeconfig context: status, revoke, resolve, batch
    /// (installed as `kubectl-dlock`, it runs as `kubectl dlock …`).
    Kubectl(kubectl::KubectlArgs),
    /// Prints a service's OpenAPI document (the one it serves at GET /v1/openapi.json).
    Openapi {
        #[arg(value_enum)]
        service: OpenapiService,
    },
    /// Writes the CustomResourceDefinitions as `<dir>/<plural>.yaml`.
    Crdgen {
        /// The directory to write into.
        #[arg(long, default_value = "crds")]
        out: PathBuf,
    },
}

#[derive(Subcommand)]
enum Service {
    /// The lock server (sessions, leases, fencing tokens).
    LockServer {
        /// The configuration file (TOML); every key may be overridden from the environment.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// The payment resource (payouts, accounts, the ledger; fenced writes).
    PaymentResource {
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// The rail proxy (the only caller of the rail).
    RailProxy {
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// The rail stub (a hostile stand-in for the payment rail).
    RailStub {
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum OpenapiService {
    LockServer,
    PaymentResource,
    RailProxy,
    RailStub,
}

#[derive(Subcommand)]
enum DevCommand {
    /// Starts PostgreSQL (and etcd), runs the migrations, starts the services, prints one JSON
    /// line with their addresses and runs until SIGINT or SIGTERM.
    Up(dev::UpArgs),
    /// Stops the stack `dev up` runs in a data directory (DLOCK_DEV_DIR) and waits for it.
    Down(dev::DownArgs),
}

/// Words in an environment variable's name that mark its value as a secret (a token, a
/// database URL with its password, a credential or a key).
const SECRET_ENV_WORDS: [&str; 7] = [
    "TOKEN",
    "PAYDB",
    "PASSWORD",
    "SECRET",
    "CREDENTIAL",
    "KEY",
    "DSN",
];

/// Whether `--help` must not print the value of the environment variable `name`: a secret by
/// its name, or any value that carries one (`user:password@` in a URL, `password=` in a DSN).
fn is_secret_env(name: &str, value: Option<&std::ffi::OsStr>) -> bool {
    let name = name.to_ascii_uppercase();
    let value = value.map(|v| v.to_string_lossy().to_ascii_lowercase());
    SECRET_ENV_WORDS.iter().any(|word| name.contains(word))
        || value.is_some_and(|v| v.contains('@') || v.contains("password"))
}

/// Sets `hide_env_values` on every argument, in every subcommand (the operator's too), whose
/// environment variable is secret: `--help` then names the variable and never its value.
fn hide_secret_env_values(command: clap::Command) -> clap::Command {
    let command = command.mut_args(|arg| {
        let secret = arg.get_env().is_some_and(|env| {
            is_secret_env(&env.to_string_lossy(), std::env::var_os(env).as_deref())
        });
        if secret {
            arg.hide_env_values(true)
        } else {
            arg
        }
    });
    let names: Vec<String> = command
        .get_subcommands()
        .map(|sub| sub.get_name().to_owned())
        .collect();
    names.into_iter().fold(command, |command, name| {
        command.mut_subcommand(name, hide_secret_env_values)
    })
}

/// The command line, parsed with the secret environment values hidden from `--help`.
fn parse_cli() -> Cli {
    // kubectl runs plugins as `kubectl-<name>` with the arguments after the name.
    if kubectl::invoked_as_plugin() {
        let matches = hide_secret_env_values(kubectl::Plugin::command()).get_matches();
        let plugin = kubectl::Plugin::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
        return Cli {
            command: Command::Kubectl(plugin.args),
        };
    }
    let matches = hide_secret_env_values(Cli::command()).get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|error| error.exit())
}

fn main() -> std::process::ExitCode {
    let cli = parse_cli();
    // Services log their events; the commands people run stay quiet unless something is wrong.
    let (default_filter, json) = match cli.command {
        Command::Serve { .. } | Command::Dev { .. } => {
            ("info,sqlx=warn,h2=warn,tower=warn,hyper=warn", true)
        }
        Command::Operator(_) => ("info,kube=warn,hyper=warn,tower=warn", true),
        // The demo's summary names every quarantined payout; a warning per payout repeats it.
        Command::Demo(_) => ("error", false),
        _ => ("warn,sqlx=error", false),
    };
    // The exported spans name their process (OTEL_SERVICE_NAME overrides it).
    let service_name = match &cli.command {
        Command::Serve { service } => match service {
            Service::LockServer { .. } => "dlock-lock-server",
            Service::PaymentResource { .. } => "dlock-payment-resource",
            Service::RailProxy { .. } => "dlock-rail-proxy",
            Service::RailStub { .. } => "dlock-rail-stub",
        },
        Command::Run(_) | Command::Demo(_) => "dlock-executor",
        Command::Operator(_) => "dlock-operator",
        _ => "dlock",
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("dlock: cannot start the async runtime: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    // Inside the runtime: the gRPC exporter's channel lives on it. Dropped before the runtime,
    // so the last spans are flushed while it still runs.
    let _telemetry = {
        let _inside = runtime.enter();
        telemetry::init(default_filter, json, service_name)
    };
    let result = runtime.block_on(async move {
        let done: anyhow::Result<()> = match cli.command {
            Command::Serve { service } => serve(service).await,
            Command::Dev { command } => match command {
                DevCommand::Up(args) => dev::up(args).await,
                DevCommand::Down(args) => dev::down(&args),
            },
            Command::Demo(args) => return demo::demo(args).await,
            Command::Run(args) => jobs::run(args).await,
            Command::Accounts { command } => jobs::accounts(command).await,
            Command::Fundings { command } => jobs::fundings_command(command).await,
            Command::Reconcile(args) => return jobs::reconcile(args).await,
            Command::Resolve(args) => jobs::resolve(args).await,
            Command::Revoke(args) => return jobs::revoke(args).await,
            Command::Recover { command } => recover::recover(command).await,
            Command::Operator(args) => dlock_operator::run(args).await,
            Command::Kubectl(args) => return Ok(kubectl::run(args).await),
            Command::Openapi { service } => {
                let doc = match service {
                    OpenapiService::LockServer => dlock_lock_server::openapi::document(),
                    OpenapiService::PaymentResource => dlock_payment_resource::openapi::document(),
                    OpenapiService::RailProxy => dlock_rail_proxy::openapi::document(),
                    OpenapiService::RailStub => dlock_rail_stub::openapi::document(),
                };
                print!("{}", dlock_contract::openapi::pretty(&doc));
                Ok(())
            }
            Command::Crdgen { out } => dlock_operator::crd::write_all(&out).map(|written| {
                for path in written {
                    println!("{}", path.display());
                }
            }),
        };
        done.map(|()| std::process::ExitCode::SUCCESS)
    });
    match result {
        Ok(code) => code,
        Err(error) => {
            tracing::error!(
                event = "fatal",
                error = format!("{error:#}"),
                "dlock stopped"
            );
            eprintln!("dlock: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

impl Service {
    /// The configuration file given with `--config`.
    fn config_file(&self) -> Option<&std::path::Path> {
        match self {
            Service::LockServer { config }
            | Service::PaymentResource { config }
            | Service::RailProxy { config }
            | Service::RailStub { config } => config.as_deref(),
        }
    }
}

/// Loads a service's configuration (the file; a security setting in the environment stops it,
/// services/server/src/config.rs) and runs it.
async fn serve(service: Service) -> anyhow::Result<()> {
    use dlock_lock_server::LockServerConfig;
    use dlock_payment_resource::PaymentConfig;
    use dlock_rail_proxy::RailProxyConfig;
    use dlock_rail_stub::RailStubConfig;
    use dlock_server::config::load;
    let file = service.config_file();
    match &service {
        Service::LockServer { .. } => {
            dlock_lock_server::run(load(file, LockServerConfig::from_raw)?).await
        }
        Service::PaymentResource { .. } => {
            dlock_payment_resource::run(load(file, PaymentConfig::from_raw)?).await
        }
        Service::RailProxy { .. } => {
            dlock_rail_proxy::run(load(file, RailProxyConfig::from_raw)?).await
        }
        Service::RailStub { .. } => {
            dlock_rail_stub::run(load(file, RailStubConfig::from_raw)?).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_env_values_are_hidden_and_the_others_shown() {
        for name in [
            "DLOCK_PAYDB",
            "DLOCK_OPERATOR_TOKEN",
            "DLOCK_CREDENTIAL_FILE",
            "DLOCK_API_KEY",
        ] {
            assert!(is_secret_env(name, None), "{name}");
        }
        for name in ["DLOCK_LOCK_SERVER", "DLOCK_RAIL", "POD_NAME"] {
            assert!(!is_secret_env(name, None), "{name}");
        }
        let with_password = std::ffi::OsStr::new("postgres://pay:hunter2@db:5432/paydb");
        assert!(is_secret_env("DLOCK_RAIL", Some(with_password)));
        // Every argument of every subcommand that reads a secret variable hides its value.
        fn walk(command: &clap::Command, hidden: &mut Vec<String>) {
            for arg in command.get_arguments() {
                if let Some(env) = arg.get_env()
                    && is_secret_env(&env.to_string_lossy(), None)
                {
                    assert!(
                        arg.is_hide_env_values_set(),
                        "{} --{:?}",
                        command.get_name(),
                        arg.get_long()
                    );
                    hidden.push(env.to_string_lossy().into_owned());
                }
            }
            for sub in command.get_subcommands() {
                walk(sub, hidden);
            }
        }
        let mut hidden = Vec::new();
        walk(&hide_secret_env_values(Cli::command()), &mut hidden);
        for env in ["DLOCK_PAYDB", "DLOCK_OPERATOR_TOKEN"] {
            assert!(hidden.iter().any(|h| h == env), "{env} in {hidden:?}");
        }
    }
}
