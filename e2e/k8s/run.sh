#!/usr/bin/env bash
# End to end on a real cluster (kind or k3d): builds the image, installs the chart, deploys the
# stack from examples/, runs the sample PayoutBatch, re-applies it and re-creates it, and checks
# that nobody was paid twice. Every wait is `kubectl wait` on a condition, never a sleep.
#
# Not part of CI (no cluster runs there). Needs docker, kubectl, helm and kind or k3d:
#   e2e/k8s/run.sh                  # creates a kind cluster named dlock-e2e
#   CLUSTER=k3d e2e/k8s/run.sh      # or a k3d one
#   KEEP=1 e2e/k8s/run.sh           # leaves the cluster up afterwards
set -euo pipefail
cd "$(dirname "$0")/../.."

cluster="${CLUSTER:-kind}"
name="${CLUSTER_NAME:-dlock-e2e}"
image="dlock:e2e"
ns="dlock-e2e"
timeout="${TIMEOUT:-300s}"

step() { printf '\n== %s\n' "$*"; }
cleanup() {
  if [ -z "${KEEP:-}" ]; then
    case "$cluster" in
      kind) kind delete cluster --name "$name" >/dev/null 2>&1 || true ;;
      k3d) k3d cluster delete "$name" >/dev/null 2>&1 || true ;;
    esac
  fi
}
trap cleanup EXIT

step "cluster ($cluster) and image"
case "$cluster" in
  kind)
    kind get clusters | grep -qx "$name" || kind create cluster --name "$name" --wait "$timeout"
    docker build -t "$image" .
    kind load docker-image "$image" --name "$name"
    ;;
  k3d)
    k3d cluster list "$name" >/dev/null 2>&1 || k3d cluster create "$name" --wait
    docker build -t "$image" .
    k3d image import "$image" --cluster "$name"
    ;;
  *) echo "CLUSTER must be kind or k3d" >&2; exit 2 ;;
esac

step "operator (chart)"
kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f -
kubectl -n "$ns" apply -f examples/stack.yaml --dry-run=client -o yaml >/dev/null
# The example's spec.tls left out: the in-cluster curl pods below call plain HTTP. TLS between the
# pods is tried by dlock/tests/k8s/tls_pods.rs.
stack="$(sed '/tls: {secretName:/d' examples/stack.yaml)"
# The operator authenticates with its ServiceAccount's projected token; the services of "$ns"
# check callers with TokenReview (serviceAuth.namespaces).
helm upgrade --install dlock charts/dlock -n "$ns" \
  --set image.repository=dlock --set image.tag=e2e --set image.pullPolicy=Never \
  --set "serviceAuth.namespaces={$ns}" \
  --set "serviceAuth.roles={$ns/dlock-executor=executor}" --wait --timeout "$timeout"
kubectl wait --for=condition=Established crd --all --timeout="$timeout"
kubectl -n "$ns" rollout status deployment/dlock-operator --timeout="$timeout"

step "PostgreSQL and the dlock stack"
kubectl -n "$ns" apply -f e2e/k8s/postgres.yaml
kubectl -n "$ns" wait --for=condition=Available deployment/postgres --timeout="$timeout"
printf '%s\n' "$stack" | kubectl -n "$ns" apply -f -
kubectl -n "$ns" wait --for=condition=Ready \
  lockserver/lock-server paymentresource/payment-resource railproxy/rail-proxy --timeout="$timeout"

step "accounts for the sample batch, opened and funded by the treasury"
# Only the ServiceAccount examples/stack.yaml names as the treasury may create money.
treasury_token="$(kubectl -n "$ns" create token treasury --audience dlock)"
kubectl -n "$ns" delete pod e2e-setup --ignore-not-found --wait
kubectl -n "$ns" run e2e-setup --restart=Never --image=curlimages/curl:8.10.1 \
  --env="TOKEN=$treasury_token" --command -- sh -c '
  set -e
  pr=http://payment-resource:8080
  for account in acct-17 acct-18; do
    curl -fsS -X POST "$pr/v1/accounts" -H "Content-Type: application/json" \
      -H "Authorization: Bearer $TOKEN" \
      -H "X-Owner-Id: system:serviceaccount:'"$ns"':treasury/e2e" -H "X-Idempotency-Key: open-$account" \
      -d "{\"accountId\":\"$account\",\"currency\":\"EUR\"}" || true
    curl -fsS -X POST "$pr/v1/accounts/$account/fund" -H "Content-Type: application/json" \
      -H "Authorization: Bearer $TOKEN" \
      -H "X-Owner-Id: system:serviceaccount:'"$ns"':treasury/e2e" -H "X-Idempotency-Key: fund-$account" \
      -d "{\"amountMinor\":1000000,\"reference\":\"e2e-$account\"}"
  done'
kubectl -n "$ns" wait --for=jsonpath='{.status.phase}'=Succeeded pod/e2e-setup --timeout="$timeout"

payouts_posted() {
  kubectl -n "$ns" delete pod e2e-count --ignore-not-found --wait >/dev/null
  kubectl -n "$ns" run e2e-count --restart=Never --image=curlimages/curl:8.10.1 --command -- \
    sh -c 'curl -fsS "http://payment-resource:8080/v1/payouts?limit=1000"' >/dev/null
  kubectl -n "$ns" wait --for=jsonpath='{.status.phase}'=Succeeded pod/e2e-count --timeout="$timeout" >/dev/null
  kubectl -n "$ns" logs e2e-count | grep -o '"payoutId"' | wc -l
}

step "the sample PayoutBatch"
kubectl -n "$ns" apply -f examples/payoutbatch.yaml
kubectl -n "$ns" wait --for=condition=Ready payoutbatch/payroll-2026-12 --timeout="$timeout"
kubectl -n "$ns" get payoutbatches,locks
first="$(payouts_posted)"
[ "$first" -eq 4 ] || { echo "expected 4 payouts, found $first" >&2; exit 1; }

step "re-applied, then deleted and re-created: nobody is paid twice"
kubectl -n "$ns" apply -f examples/payoutbatch.yaml
kubectl -n "$ns" delete -f examples/payoutbatch.yaml --wait
kubectl -n "$ns" apply -f examples/payoutbatch.yaml
kubectl -n "$ns" wait --for=condition=Ready payoutbatch/payroll-2026-12 --timeout="$timeout"
again="$(payouts_posted)"
[ "$again" -eq 4 ] || { echo "expected still 4 payouts, found $again" >&2; exit 1; }

step "paused: the operator leaves the object alone"
kubectl -n "$ns" annotate lockserver lock-server dlock.io/reconcile=paused --overwrite
kubectl -n "$ns" patch lockserver lock-server --type merge -p '{"spec":{"replicas":3}}'
kubectl -n "$ns" wait --for=jsonpath='{.spec.replicas}'=2 deployment/lock-server --timeout=10s
kubectl -n "$ns" annotate lockserver lock-server dlock.io/reconcile-
kubectl -n "$ns" wait --for=jsonpath='{.spec.replicas}'=3 deployment/lock-server --timeout="$timeout"

echo
echo "e2e: passed"
