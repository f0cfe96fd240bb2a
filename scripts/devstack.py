"""What the benchmark scripts (scripts/bench-registrations, scripts/paydb-statements,
scripts/run-processes) share: a durable `dlock dev up` of their own for one run, the PayoutBatch
they fund and run, and the timed run."""
import contextlib
import os
import subprocess
import time


@contextlib.contextmanager
def durable_stack(dlock, *up_args):
    """A durable `dlock dev up --detach` of `dlock` (with `up_args`) for the `with` block: the
    environment a shell gets from its exports (DLOCK_DEV_DIR, DLOCK_PAYDB, the URLs and
    credentials). `dlock dev down` stops it on the way out, whatever happened."""
    env = dict(os.environ)
    # `dlock dev up` makes the stack's directory and prints the exports that name it.
    script = subprocess.run([dlock, "dev", "up", "--detach", "--durable", *up_args], env=env,
                            check=True, capture_output=True, text=True).stdout
    for line in script.splitlines():
        if line.startswith("export ") and "=" in line:
            key, value = line[len("export "):].split("=", 1)
            env[key] = value.strip("'")
    try:
        yield env
    finally:
        subprocess.run([dlock, "dev", "down"], env=env, capture_output=True)


def write_batch(path, name, accounts, workers=None):
    """A PayoutBatch `name` at `path`: one payout of 1 000 EUR minor units per entry of
    `accounts` (keys p-00000, p-00001, …), with `workers` when given."""
    with open(path, "w") as f:
        f.write(f"apiVersion: dlock.io/v1alpha1\nkind: PayoutBatch\nmetadata:\n  name: {name}\n"
                "spec:\n")
        if workers is not None:
            f.write(f"  workers: {workers}\n")
        f.write("  payouts:\n")
        for n, account in enumerate(accounts):
            f.write(f"    - key: p-{n:05d}\n      accountId: {account}\n"
                    f"      amountMinor: 1000\n      currency: EUR\n"
                    f"      beneficiaryRef: ben-{n:05d}\n")


def add_run_arguments(parser, runs=1):
    """The arguments of a script that times new users' runs: the binaries to alternate, how many
    runs of each, and the batch (payouts over accounts, at workers)."""
    parser.add_argument("--dlock", action="append", required=True, help="a dlock binary")
    parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--payouts", type=int, default=1500)
    parser.add_argument("--accounts", type=int, default=100)
    parser.add_argument("--workers", type=int, default=32)


def batch_for(args, work, name):
    """The PayoutBatch `name` of `add_run_arguments`' arguments, written in the folder `work`:
    payout n on account acct-(n modulo accounts). Returns its path."""
    path = os.path.join(work, f"{name}.yaml")
    write_batch(path, name, [f"acct-{n % args.accounts:03d}" for n in range(args.payouts)],
                args.workers)
    return path


def run_batch(dlock, batch, env):
    """Runs `dlock run -f batch` in the stack of `env`: (wall seconds, the run's resource
    usage). A run that fails stops the script with the end of what it said."""
    start = time.monotonic()
    run = subprocess.Popen([dlock, "run", "-f", batch], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    with run.stderr:
        stderr = run.stderr.read()
    _, status, rusage = os.wait4(run.pid, 0)
    wall = time.monotonic() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"dlock run -f failed ({code}): {stderr[-2000:]}")
    return wall, rusage
