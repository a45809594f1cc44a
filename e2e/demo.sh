#!/usr/bin/env bash
# The README demo: a job that runs out of memory on its first attempt and is
# retried with stricter settings by the operator, shown with `kubectl get`.
#
# Uses the cluster in $KUBECONFIG, or starts the local control plane. Until the
# local node (kubelet + containerd) exists, pods are created but nobody runs
# them, so this script plays the kubelet's part: it writes the pod statuses a
# real OOM kill and a real success produce. Everything else is real: the
# API server, the CRD, the operator, its planning, retry ladder and status.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "${ROOT}"
: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
: "${CARGO_TARGET_DIR:=${HEADROOM_CACHE}/target}"
export CARGO_TARGET_DIR
NS=${DEMO_NAMESPACE:-headroom-demo}
JOB=oom-then-fit

if [[ -z ${KUBECONFIG:-} ]]; then
  e2e/cluster/build-binaries.sh
  e2e/cluster/controlplane.sh up
  eval "$(e2e/cluster/controlplane.sh env)"
fi
# shellcheck source=cluster/lib/common.sh
source e2e/cluster/lib/common.sh
KUBECTL=${KUBECTL:-${HEADROOM_BIN_DIR}/kubectl}
k() { "${KUBECTL}" "$@"; }
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

cargo build -q -p headroom-operator --bins
k apply --server-side -f crds/ >/dev/null
k wait --for condition=established --timeout=60s crd/memoryawaretrainingjobs.headroom.dev >/dev/null
k create namespace "${NS}" --dry-run=client -o yaml | k apply -f - >/dev/null
k delete -n "${NS}" matj "${JOB}" --ignore-not-found --wait=true >/dev/null

LOG="${HEADROOM_CACHE}/demo-operator.log"
"${CARGO_TARGET_DIR}/debug/headroom-operator" --no-leader-election --watch-namespace "${NS}" --metrics-addr 127.0.0.1:18081 >"${LOG}" 2>&1 &
OPERATOR=$!
trap 'kill ${OPERATOR} 2>/dev/null || true' EXIT

wait_for() { # wait_for DESCRIPTION COMMAND...
  local what=$1 i
  shift
  for ((i = 0; i < 300; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  echo "timed out waiting for ${what}; operator log: ${LOG}" >&2
  tail -20 "${LOG}" >&2
  return 1
}
pod_exists() { k get pod -n "${NS}" "$1"; }
attempts_are() { [[ $(k get matj -n "${NS}" "${JOB}" -o jsonpath='{.status.attempt}') == "$1" ]]; }
phase_is() { [[ $(k get matj -n "${NS}" "${JOB}" -o jsonpath='{.status.phase}') == "$1" ]]; }
set_status() { k patch pod -n "${NS}" "$1" --subresource=status --type=merge -p "$2" >/dev/null; }
terminated() { printf '{"status":{"phase":"%s","containerStatuses":[{"name":"worker","image":"headroom-worker:dev","imageID":"","ready":false,"restartCount":0,"state":{"terminated":{"exitCode":%s,"reason":"%s"}}}]}}' "$1" "$2" "$3"; }

say "What Headroom plans before anything runs (kubectl headroom plan)"
"${CARGO_TARGET_DIR}/debug/kubectl-headroom" plan -f samples/cpu-oom-first.yaml || true

say "kubectl apply -f samples/cpu-oom-first.yaml  (pinned micro-batch 64, no checkpointing, 768Mi limit)"
k apply -n "${NS}" -f samples/cpu-oom-first.yaml
wait_for "attempt 1 pod" pod_exists "${JOB}-a1-s0"
set_status "${JOB}-a1-s0" '{"status":{"phase":"Running"}}'
wait_for "Running" phase_is Running
k get matj -n "${NS}"

say "attempt 1 exceeds its memory limit: the kernel OOM-kills it (status written as the kubelet reports it)"
set_status "${JOB}-a1-s0" "$(terminated Failed 137 OOMKilled)"
wait_for "attempt 2" attempts_are 2
k get matj -n "${NS}"
k get pods -n "${NS}" -L headroom.dev/attempt

say "attempt 2 runs with stricter settings and finishes"
wait_for "attempt 2 pod" pod_exists "${JOB}-a2-s0"
set_status "${JOB}-a2-s0" '{"status":{"phase":"Running"}}'
wait_for "Running" phase_is Running
k get matj -n "${NS}"
set_status "${JOB}-a2-s0" "$(terminated Succeeded 0 Completed)"
wait_for "Succeeded" phase_is Succeeded
k get matj -n "${NS}"

say "status.attempts: the history Headroom keeps"
k get matj -n "${NS}" "${JOB}" -o jsonpath='{range .status.attempts[*]}attempt {.number}: {.outcome} — micro-batch {.plan.settings.microBatch} × {.plan.settings.gradientAccumulation}, checkpointing {.plan.settings.activationCheckpointing}, predicted {.plan.fit}{"\n"}{end}'

say "events"
k get events -n "${NS}" --field-selector involvedObject.name="${JOB}" -o custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message --sort-by=.metadata.creationTimestamp
