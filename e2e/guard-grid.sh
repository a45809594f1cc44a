#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# The near-OOM guard's grid on real pods (docs/benchmarks.md, "The near-OOM
# guard on real pods"): twelve CPU jobs pinned to settings whose predicted
# peak is over their budget, every one with `memoryPolicy.guard.enabled`,
# half stepping down in place and half through the operator's stricter
# attempt. For each job it prints the attempts, the kernel's OOM kills (an
# attempt recorded as HostOutOfMemory, or a container whose last state is
# OOMKilled), the guard's trips and how many completed steps were computed
# again (from the workers' logs: the step a trip kept against the step the
# next process resumed from), and fails unless every job Succeeded with 0
# kills and 0 steps recomputed.
#
#   e2e/guard-grid.sh            # on the local single-node cluster (root), started if needed
#
# Jobs run GRID_PARALLEL (3) at a time, so each gets its CPU share and the
# scheduler never holds one back long enough to be planned again.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "${ROOT}"
: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
: "${CARGO_TARGET_DIR:=${HEADROOM_CACHE}/target}"
export HEADROOM_CACHE CARGO_TARGET_DIR
NS=${GRID_NAMESPACE:-headroom-guard-grid}
PARALLEL=${GRID_PARALLEL:-3}
TIMEOUT=${GRID_TIMEOUT_SECONDS:-1200}

if [[ -z ${KUBECONFIG:-} ]]; then
  env=$(HEADROOM_INSTALL_KUEUE=0 e2e/install.sh)
  eval "${env}"
fi
# shellcheck source=cluster/lib/common.sh
source e2e/cluster/lib/common.sh
KUBECTL=${KUBECTL:-${HEADROOM_BIN_DIR}/kubectl}
k() { "${KUBECTL}" "$@"; }

# name hidden sequence micro-batch limit step-down-in-place: each pinned
# without checkpointing, global batch 32, 12 steps, a checkpoint every 4.
GRID=(
  "g01 256 128 32 320Mi true"
  "g02 256 128 32 320Mi false"
  "g03 256 128 32 288Mi true"
  "g04 256 128 32 288Mi false"
  "g05 256 192 32 384Mi true"
  "g06 256 192 32 384Mi false"
  "g07 320 128 32 384Mi true"
  "g08 320 128 32 384Mi false"
  "g09 256 256 16 320Mi true"
  "g10 256 256 16 320Mi false"
  "g11 192 256 32 320Mi true"
  "g12 192 256 32 320Mi false"
)

manifest() { # name hidden sequence micro limit in-place
  cat <<EOF
apiVersion: headroom.dev/v1alpha1
kind: MemoryAwareTrainingJob
metadata:
  name: $1
spec:
  model:
    transformer: {layers: 4, hidden: $2, heads: 4, sequenceLength: $3, vocabulary: 2048}
  training:
    globalBatch: 32
    steps: 12
    microBatch: $4
    activationCheckpointing: false
    checkpointEverySteps: 4
  resources:
    cpu: {memoryLimit: $5, cores: 500m, maxWorkers: 2}
    headroomFraction: 0.1
  memoryPolicy:
    maxAttempts: 6
    guard: {enabled: true, marginPercent: 3, stepDownInPlace: $6}
  worker:
    image: localhost/headroom-worker:dev
EOF
}

phase() { k get matj -n "${NS}" "$1" -o jsonpath='{.status.phase}' 2>/dev/null || true; }

wait_done() { # name
  local deadline=$((SECONDS + TIMEOUT))
  while ((SECONDS < deadline)); do
    case $(phase "$1") in Succeeded | Failed) return 0 ;; esac
    sleep 2
  done
  echo "guard-grid: $1 did not finish in ${TIMEOUT} s" >&2
}

# One row: the job's figures from its status, its pods and their logs.
report() { # name spec...
  local name=$1 hidden=$2 seq=$3 micro=$4 limit=$5 inplace=$6
  local attempts outcomes first_pred first_budget kills=0 trips=0 recomputed=0 kept="" pod log
  attempts=$(k get matj -n "${NS}" "${name}" -o jsonpath='{.status.attempts[*].number}' | wc -w)
  outcomes=$(k get matj -n "${NS}" "${name}" -o jsonpath='{.status.attempts[*].outcome}' | tr ' ' ',')
  first_pred=$(k get matj -n "${NS}" "${name}" -o jsonpath='{.status.attempts[0].predictedPeakBytes}')
  first_budget=$(k get matj -n "${NS}" "${name}" -o jsonpath='{.status.attempts[0].budgetBytes}')
  kills=$(grep -o -c 'hostOutOfMemory' <<<"${outcomes}" || true)
  # Pods in attempt order; a container the kernel killed says OOMKilled.
  for pod in $(k get pods -n "${NS}" -l headroom.dev/job="${name}",app.kubernetes.io/component=worker \
    --sort-by=.metadata.creationTimestamp -o name); do
    if k get -n "${NS}" "${pod}" -o jsonpath='{.status.containerStatuses[*].state.terminated.reason} {.status.containerStatuses[*].lastState.terminated.reason}' | grep -q OOMKilled; then
      kills=$((kills + 1))
    fi
    log=$(k logs -n "${NS}" "${pod}" --all-containers 2>/dev/null || true)
    # Each trip keeps a step; the next process (the same pod after a step
    # down in place, or the next attempt's pod) resumes from one.
    while IFS= read -r line; do
      case ${line} in
        *"memory guard: step "*" stopped before "*)
          trips=$((trips + 1))
          kept=$(sed -nE 's/.*; step ([0-9]+) checkpointed.*/\1/p; s/.*the last checkpoint is at step ([0-9]+).*/\1/p; s/.*no step was completed.*/0/p' <<<"${line}" | head -n 1)
          ;;
        *"resumed ("*)
          if [[ -n ${kept} ]]; then
            recomputed=$((recomputed + kept - $(sed -nE 's/.* step=([0-9]+).*/\1/p' <<<"${line}")))
            kept=""
          fi
          ;;
        *"no checkpoint; starting at step 0"*)
          if [[ -n ${kept} ]]; then
            recomputed=$((recomputed + kept))
            kept=""
          fi
          ;;
      esac
    done < <(grep -E 'memory guard: step|resumed \(|no checkpoint; starting' <<<"${log}" || true)
  done
  printf '| %s | h%s s%s mb%s %s, in place %s | %s / %s MiB | %s | %s | %s | %s | %s |\n' \
    "${name}" "${hidden}" "${seq}" "${micro}" "${limit}" "${inplace}" \
    "$((first_pred >> 20))" "$((first_budget >> 20))" "${attempts}" "${outcomes}" "${trips}" "${kills}" "${recomputed}" \
    | tee -a "${ROWS}"
  [[ $(phase "${name}") == Succeeded && ${kills} == 0 && ${recomputed} == 0 ]] || echo "${name}" >>"${BAD}"
}

k create namespace "${NS}" --dry-run=client -o yaml | k apply -f - >/dev/null
ROWS=$(mktemp)
BAD=$(mktemp)
trap 'rm -f "${ROWS}" "${BAD}"' EXIT
start=${SECONDS}
echo "| job | shape, pinned settings, limit | attempt 1 predicted / budget | attempts | outcomes | guard trips | kernel OOM kills | steps recomputed |"
echo "|---|---|---|---|---|---|---|---|"
for ((i = 0; i < ${#GRID[@]}; i += PARALLEL)); do
  wave=("${GRID[@]:i:PARALLEL}")
  for row in "${wave[@]}"; do
    # shellcheck disable=SC2086
    set -- ${row}
    k delete -n "${NS}" matj "$1" --ignore-not-found --wait=true >/dev/null
    manifest "$@" | k apply -n "${NS}" -f - >/dev/null
  done
  for row in "${wave[@]}"; do
    # shellcheck disable=SC2086
    set -- ${row}
    wait_done "$1"
    report "$@"
  done
done
echo
echo "guard-grid: ${#GRID[@]} jobs in $((SECONDS - start)) s; $(wc -l <"${BAD}") not Succeeded with 0 kills and 0 steps recomputed: $(tr '\n' ' ' <"${BAD}")"
[[ ! -s ${BAD} ]]
