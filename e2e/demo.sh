#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# The README demo, on a real node: a job that runs out of memory on its first
# attempt (the kernel OOM-kills the container) and succeeds on its second,
# stricter attempt, shown with `kubectl get` as it happens.
#
# With KUBECONFIG unset it starts the local single-node cluster (root; see
# e2e/cluster/README.md), builds the operator and worker images without
# Docker, installs Headroom with Helm, and applies samples/cpu-oom-first.yaml.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "${ROOT}"
: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
: "${CARGO_TARGET_DIR:=${HEADROOM_CACHE}/target}"
export HEADROOM_CACHE CARGO_TARGET_DIR
NS=${DEMO_NAMESPACE:-headroom-demo}
JOB=oom-then-fit
TIMEOUT=${DEMO_TIMEOUT_SECONDS:-900}

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

env=$(e2e/install.sh)
eval "${env}"
# shellcheck source=cluster/lib/common.sh
source e2e/cluster/lib/common.sh
KUBECTL=${KUBECTL:-${HEADROOM_BIN_DIR}/kubectl}
k() { "${KUBECTL}" "$@"; }

k create namespace "${NS}" --dry-run=client -o yaml | k apply -f - >/dev/null
k delete -n "${NS}" matj "${JOB}" --ignore-not-found --wait=true >/dev/null

say "what Headroom plans before anything runs: kubectl headroom plan -f samples/cpu-oom-first.yaml"
"${CARGO_TARGET_DIR}/release/kubectl-headroom" plan -f samples/cpu-oom-first.yaml || true

say "kubectl apply -f samples/cpu-oom-first.yaml   (pinned micro-batch 32, no checkpointing, 320Mi limit)"
k apply -n "${NS}" -f samples/cpu-oom-first.yaml
last=""
deadline=$((SECONDS + TIMEOUT))
while ((SECONDS < deadline)); do
  now=$(k get matj -n "${NS}" "${JOB}" --no-headers 2>/dev/null | awk '{print $2, $3}')
  if [[ ${now} != "${last}" ]]; then
    k get matj -n "${NS}" "${JOB}"
    k get pods -n "${NS}" -L headroom.dev/attempt --no-headers 2>/dev/null | sed 's/^/    pod: /'
    last=${now}
  fi
  case ${now} in Succeeded* | Failed*) break ;; esac
  sleep 1
done

say "status.attempts: the history Headroom keeps"
k get matj -n "${NS}" "${JOB}" -o go-template='{{range .status.attempts}}attempt {{.number}}: {{.outcome}} ({{.reason}}) — micro-batch {{.plan.settings.microBatch}} × {{.plan.settings.gradientAccumulation}}, checkpointing {{.plan.settings.activationCheckpointing}}, predicted {{.plan.fit}}, observed peak {{if .observedPeakBytes}}{{.observedPeakBytes}} B{{else}}none reported (killed before its first report){{end}}{{"\n"}}{{end}}'
say "status.workers: live telemetry the workers wrote"
k get matj -n "${NS}" "${JOB}" -o jsonpath='{range .status.workers[*]}{.name}: step {.step}, loss {.loss}, peak {.memory.peakBytes} B, {.tokensPerSecond} tokens/s{"\n"}{end}'
say "events"
# By UID: events of an earlier run's job of the same name outlive it (1 h).
uid=$(k get matj -n "${NS}" "${JOB}" -o jsonpath='{.metadata.uid}')
k get events -n "${NS}" --field-selector involvedObject.uid="${uid}" -o custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message --sort-by=.metadata.creationTimestamp
[[ $(k get matj -n "${NS}" "${JOB}" -o jsonpath='{.status.phase}') == Succeeded ]]
