#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Proves that the node of cluster.sh really runs pods, with an image built
# without Docker (e2e/images/build.sh) from hr-probe (tools/hr-probe):
#
#   1. memory limit 64Mi + a process that keeps allocating -> the kernel
#      OOM-kills it: container reason OOMKilled, exit code 137, pod Failed;
#   2. a process that exits 0 -> pod Succeeded; read-only root filesystem,
#      /tmp writable through an emptyDir, runs as 65532;
#   3. a pod reaches the API server through the `kubernetes` Service
#      (KUBERNETES_SERVICE_HOST, the service-account token and CA), and is
#      authenticated as its service account;
#   4. a PVC of the default StorageClass binds and is writable by 65532
#      (fsGroup), as the operator's checkpoint volumes must be.
#
#   e2e/cluster/cluster.sh up && e2e/cluster/node-test.sh
#
# Runs in a fresh namespace, deleted afterwards; pods are dumped on failure.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "${HERE}/lib/cluster-env.sh"
source "${HERE}/lib/common.sh"

: "${NODE_TEST_TIMEOUT:=120}"
KUBECTL="${HEADROOM_BIN_DIR}/kubectl"
kubectl() { "${KUBECTL}" --kubeconfig "${KUBECONFIG_ADMIN}" --request-timeout=10s "$@"; }
NS="headroom-node-test-$(date +%s)"
IMAGE=localhost/hr-probe:test
T0=$(now)

"${HERE}/cluster.sh" status >/dev/null || die "cluster is not up (e2e/cluster/cluster.sh up)"
BUILD_ETCD=0 "${HERE}/build-binaries.sh" hr-probe 2>/dev/null
IMAGE_IMPORT=1 "${HERE}/../images/build.sh" "${IMAGE}" "${HEADROOM_BIN_DIR}/hr-probe" >/dev/null

ok=0
cleanup() {
  if ((ok == 0)); then
    log "FAILED; pods in ${NS}:"
    kubectl -n "${NS}" get pods -o wide >&2 || true
    kubectl -n "${NS}" describe pods >&2 2>&1 | tail -n 60 || true
    for p in oom ok api pvc; do
      log "logs of ${p}:"
      kubectl -n "${NS}" logs "${p}" 2>&1 | tail -n 10 >&2 || true
    done
  fi
  kubectl delete namespace "${NS}" --wait=false >/dev/null 2>&1 || true
}
trap cleanup EXIT

kubectl create namespace "${NS}" >/dev/null
# Pods are rejected until the namespace's default ServiceAccount exists.
for _ in $(seq 1 50); do kubectl -n "${NS}" get serviceaccount default >/dev/null 2>&1 && break; sleep 0.2; done

pod() { # NAME ARGS_JSON MEMORY_LIMIT [TMP_VOLUME_SOURCE]
  cat <<YAML
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: ${NS}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  securityContext: {runAsNonRoot: true, runAsUser: 65532, runAsGroup: 65532, fsGroup: 65532, seccompProfile: {type: RuntimeDefault}}
  containers:
  - name: probe
    image: ${IMAGE}
    imagePullPolicy: Never
    args: $2
    resources: {limits: {memory: $3, cpu: 500m}}
    securityContext: {readOnlyRootFilesystem: true, allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
    volumeMounts: [{name: tmp, mountPath: /tmp}]
  volumes: [{name: tmp, ${4:-"emptyDir: {}"}}]
---
YAML
}
{
  pod oom '[alloc, "8"]' 64Mi
  pod ok '[hello, "1"]' 64Mi
  pod api '[api]' 64Mi
  cat <<YAML
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: data, namespace: ${NS}}
spec:
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 1Gi}}
---
YAML
  pod pvc '[hello, "0"]' 64Mi 'persistentVolumeClaim: {claimName: data}'
} | kubectl apply -f - >/dev/null

deadline=$(($(now) + NODE_TEST_TIMEOUT))
for p in oom ok api pvc; do
  until [[ $(kubectl -n "${NS}" get pod "${p}" -o jsonpath='{.status.phase}') =~ ^(Succeeded|Failed)$ ]]; do
    (($(now) < deadline)) || die "pod ${p} did not finish in ${NODE_TEST_TIMEOUT}s"
    sleep 1
  done
done

field() { kubectl -n "${NS}" get pod "$1" -o jsonpath="$2"; }
term='{.status.phase} {.status.containerStatuses[0].state.terminated.reason} {.status.containerStatuses[0].state.terminated.exitCode}'

got=$(field oom "${term}")
[[ ${got} == "Failed OOMKilled 137" ]] || die "oom pod: want 'Failed OOMKilled 137', got '${got}'"
log "1. oom: ${got} after $(kubectl -n "${NS}" logs oom | tail -n1) (limit 64Mi)"
kubectl -n "${NS}" get pod oom -o yaml | sed -n '/^  containerStatuses:/,/^  hostIP:/p' | grep -E 'state:|terminated:|exitCode|reason|memory' >&2

got=$(field ok "${term}")
[[ ${got} == "Succeeded Completed 0" ]] || die "ok pod: want 'Succeeded Completed 0', got '${got}'"
logs=$(kubectl -n "${NS}" logs ok)
[[ ${logs} == *"uid=65532"* && ${logs} == *"wrote /tmp/hr-probe"* && ${logs} == *"read-only file system"* ]] ||
  die "ok pod: unexpected output: ${logs}"
log "2. ok: ${got}; ran as 65532, /tmp writable, root filesystem read-only"

got=$(field api "${term}")
logs=$(kubectl -n "${NS}" logs api)
[[ ${got} == "Succeeded Completed 0" && ${logs} == *"\"username\":\"system:serviceaccount:${NS}:default\""* ]] ||
  die "api pod: ${got}: ${logs}"
log "3. api: ${got}; $(grep -m1 '^API server' <<<"${logs}"), authenticated as system:serviceaccount:${NS}:default"

got=$(field pvc "${term}")
logs=$(kubectl -n "${NS}" logs pvc)
[[ ${got} == "Succeeded Completed 0" && ${logs} == *"wrote /tmp/hr-probe"* ]] || die "pvc pod: ${got}: ${logs}"
log "4. pvc: ${got}; claim bound to $(kubectl -n "${NS}" get pvc data -o jsonpath='{.spec.volumeName}') ($(kubectl -n "${NS}" get pvc data -o jsonpath='{.spec.storageClassName}')), written by 65532"

ok=1
log "node test passed in $(($(now) - T0))s"
