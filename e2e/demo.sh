#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# The README demo, on a real node: a job pinned to settings that do not fit
# its memory limit, whose worker's near-OOM guard stops the step before the
# kernel would kill it, checkpoints and steps down in place (half the
# micro-batch, twice the accumulation) in one attempt, shown with `kubectl
# get` and the job's events as it happens; then a real (tiny)
# Hugging Face checkpoint fine-tuned on real text (samples/cpu-finetune-tiny-llama.yaml):
# initialized, planned from its config.json, trained, written out.
#
# With KUBECONFIG unset it starts the local single-node cluster (root; see
# e2e/cluster/README.md), builds the operator and worker images without
# Docker, installs Headroom with Helm, and applies samples/cpu-near-oom-guard.yaml.
# (The kernel-kill path without the guard, samples/cpu-oom-first.yaml, is
# make e2e's `oom_killed_and_succeeds_stricter`.)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "${ROOT}"
: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
: "${CARGO_TARGET_DIR:=${HEADROOM_CACHE}/target}"
export HEADROOM_CACHE CARGO_TARGET_DIR
NS=${DEMO_NAMESPACE:-headroom-demo}
JOB=near-oom-guarded
TIMEOUT=${DEMO_TIMEOUT_SECONDS:-900}

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

# The demo builds images, installs a chart and runs jobs: only on the
# cluster it starts itself, unless told otherwise, so an exported KUBECONFIG
# of the user's own cluster is not written to by surprise.
if [[ -n ${KUBECONFIG:-} && ${HEADROOM_DEMO_ON_MY_CLUSTER:-0} != 1 ]]; then
  echo "make demo: KUBECONFIG is set (${KUBECONFIG}); the demo installs Headroom and runs jobs on the local single-node cluster it starts itself. Unset KUBECONFIG, or set HEADROOM_DEMO_ON_MY_CLUSTER=1 to install into that cluster." >&2
  exit 2
fi
# No job of the demo names a Kueue queue: Kueue is left out (make kueue adds it).
env=$(HEADROOM_INSTALL_KUEUE=0 e2e/install.sh)
eval "${env}"
# shellcheck source=cluster/lib/common.sh
source e2e/cluster/lib/common.sh
KUBECTL=${KUBECTL:-${HEADROOM_BIN_DIR}/kubectl}
k() { "${KUBECTL}" "$@"; }

k create namespace "${NS}" --dry-run=client -o yaml | k apply -f - >/dev/null
k delete -n "${NS}" matj "${JOB}" --ignore-not-found --wait=true >/dev/null

say "what Headroom plans before anything runs: kubectl headroom plan -f samples/cpu-near-oom-guard.yaml"
"${CARGO_TARGET_DIR}/release/kubectl-headroom" plan -f samples/cpu-near-oom-guard.yaml || true

say "kubectl apply -f samples/cpu-near-oom-guard.yaml   (pinned micro-batch 32, no checkpointing, 320Mi limit, memoryPolicy.guard on)"
k apply -n "${NS}" -f samples/cpu-near-oom-guard.yaml
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
k get matj -n "${NS}" "${JOB}" -o go-template='{{range .status.attempts}}attempt {{.number}}: {{.outcome}} ({{.reason}}) — micro-batch {{.settings.microBatch}} × {{.settings.gradientAccumulation}}, checkpointing {{.settings.activationCheckpointing}}, predicted {{.predictedPeakBytes}} B of a {{.budgetBytes}} B budget, observed peak {{if .observedPeakBytes}}{{.observedPeakBytes}} B{{else}}none reported (killed before its first report){{end}}{{"\n"}}{{end}}'
say "status.workers: live telemetry the workers wrote"
k get matj -n "${NS}" "${JOB}" -o jsonpath='{range .status.workers[*]}{.name}: step {.step}, loss {.loss}, peak {.memory.peakBytes} B, {.tokensPerSecond} tokens/s{"\n"}{end}'
say "status.progress: where the run stood at its last report (the Step and Loss columns)"
k get matj -n "${NS}" "${JOB}" -o jsonpath='attempt {.status.progress.attempt}: step {.status.progress.stepOfTotal}, loss {.status.progress.trainLoss}, {.status.progress.tokensPerSecond} tokens/s{"\n"}'
say "events"
# By UID: events of an earlier run's job of the same name outlive it (1 h).
uid=$(k get matj -n "${NS}" "${JOB}" -o jsonpath='{.metadata.uid}')
k get events -n "${NS}" --field-selector involvedObject.uid="${uid}" -o custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message --sort-by=.metadata.creationTimestamp
say "the worker's log: where the guard stopped the step, what it kept, where the fresh process resumed"
for pod in $(k get pods -n "${NS}" -l headroom.dev/job="${JOB}",app.kubernetes.io/component=worker -o name 2>/dev/null); do
  k logs -n "${NS}" "${pod}" --all-containers 2>/dev/null | grep -E "memory guard|resumed|no checkpoint" | sed "s|^|    ${pod#pod/}: |" || true
done
[[ $(k get matj -n "${NS}" "${JOB}" -o jsonpath='{.status.phase}') == Succeeded ]]

# --- a real checkpoint, fine-tuned -------------------------------------------
FT=finetune-tiny-llama
FIXTURE=worker/tests/fixtures/llama/tiny-llama
TOOLS=${DEMO_TOOLS_IMAGE:-localhost/headroom-volume-helper:dev}
watch_job() { # name: print each change of the job's columns until it ends
  local job=$1 last="" now deadline=$((SECONDS + TIMEOUT))
  while ((SECONDS < deadline)); do
    now=$(k get matj -n "${NS}" "${job}" --no-headers 2>/dev/null | awk '{print $2, $3}')
    if [[ ${now} != "${last}" ]]; then
      k get matj -n "${NS}" "${job}"
      k get pods -n "${NS}" -l headroom.dev/job="${job}" --no-headers 2>/dev/null | sed 's/^/    pod: /'
      last=${now}
    fi
    case ${now} in Succeeded* | Failed*) return 0 ;; esac
    sleep 1
  done
}

say "a real checkpoint: tiny-llama (made by Hugging Face transformers) and public-domain text, put on claims"
k delete -n "${NS}" matj "${FT}" --ignore-not-found --wait=true >/dev/null
# A kept claim of an earlier demo run would make the new job wait for it.
k delete -n "${NS}" pod loader --ignore-not-found --wait=true >/dev/null
k delete -n "${NS}" pvc "${FT}-checkpoints" models datasets --ignore-not-found --wait=true >/dev/null
k delete -n "${NS}" configmap tiny-llama text --ignore-not-found >/dev/null
k create -n "${NS}" configmap tiny-llama --from-file="${FIXTURE}/config.json" \
  --from-file="${FIXTURE}/model.safetensors" --from-file="${FIXTURE}/tokenizer.json" \
  --from-file="${FIXTURE}/tokenizer_config.json" >/dev/null
k create -n "${NS}" configmap text --from-file=samples/data/declaration-of-independence.jsonl >/dev/null
k apply -n "${NS}" -f - >/dev/null <<YAML
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: models}
spec: {accessModes: [ReadWriteOnce], resources: {requests: {storage: 16Mi}}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: datasets}
spec: {accessModes: [ReadWriteOnce], resources: {requests: {storage: 16Mi}}}
---
apiVersion: v1
kind: Pod
metadata: {name: loader}
spec:
  restartPolicy: Never
  automountServiceAccountToken: false
  securityContext: {runAsNonRoot: true, runAsUser: 65532, seccompProfile: {type: RuntimeDefault}}
  containers:
  - name: load
    image: ${TOOLS}
    imagePullPolicy: IfNotPresent
    command: [/bin/sh, -c, "mkdir -p /models/tiny-llama && cp /checkpoint/* /models/tiny-llama/ && cp /text/* /datasets/"]
    securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}, readOnlyRootFilesystem: true}
    volumeMounts:
    - {name: checkpoint, mountPath: /checkpoint}
    - {name: text, mountPath: /text}
    - {name: models, mountPath: /models}
    - {name: datasets, mountPath: /datasets}
  volumes:
  - {name: checkpoint, configMap: {name: tiny-llama}}
  - {name: text, configMap: {name: text}}
  - {name: models, persistentVolumeClaim: {claimName: models}}
  - {name: datasets, persistentVolumeClaim: {claimName: datasets}}
YAML
k wait -n "${NS}" pod/loader --for=jsonpath='{.status.phase}'=Succeeded --timeout=180s >/dev/null

say "what Headroom plans from the checkpoint's config.json: kubectl headroom plan -f samples/cpu-finetune-tiny-llama.yaml --model-dir ${FIXTURE}"
"${CARGO_TARGET_DIR}/release/kubectl-headroom" plan -f samples/cpu-finetune-tiny-llama.yaml --model-dir "${FIXTURE}" || true

say "kubectl apply -f samples/cpu-finetune-tiny-llama.yaml   (initializer, then training, then the model written out)"
k apply -n "${NS}" -f samples/cpu-finetune-tiny-llama.yaml
watch_job "${FT}"
say "status.model / status.data: what the initializer read"
k get matj -n "${NS}" "${FT}" -o jsonpath='{.status.model.shape.architecture}: {.status.model.parameters} parameters ({.status.model.dtype}, {.status.model.bytes} B), {.status.model.shape.layers} layers, {.status.model.shape.attentionHeads} heads / {.status.model.shape.keyValueHeads} key-value heads{"\n"}data: {.status.data.documents} documents, {.status.data.tokens} tokens, {.status.data.samples} samples{"\n"}output: {.status.output}{"\n"}'
say "loss, as the worker reported it"
k get matj -n "${NS}" "${FT}" -o jsonpath='{range .status.workers[*]}{.name}: step {.step}, loss {.loss}{"\n"}{end}'
say "events"
uid=$(k get matj -n "${NS}" "${FT}" -o jsonpath='{.metadata.uid}')
k get events -n "${NS}" --field-selector involvedObject.uid="${uid}" -o custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message --sort-by=.metadata.creationTimestamp
[[ $(k get matj -n "${NS}" "${FT}" -o jsonpath='{.status.phase}') == Succeeded ]]
