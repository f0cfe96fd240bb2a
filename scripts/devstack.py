"""What the benchmark scripts (scripts/bench-registrations, scripts/paydb-statements) share: a
durable `dlock dev up` of their own for one run, and the PayoutBatch they fund and run."""
import contextlib
import os
import subprocess


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
