#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Brings Headroom up on a cluster: with KUBECONFIG unset, the local
# single-node cluster (root; e2e/cluster/README.md); then the operator and
# worker images built without Docker, and the Helm chart. Prints the
# KUBECONFIG to use. Shared by the README demo and `make e2e`. Kueue
# (e2e/kueue/kueue.sh) is installed after Headroom unless
# HEADROOM_INSTALL_KUEUE=0.
# Workers write telemetry every HEADROOM_TELEMETRY_INTERVAL_SECONDS (default 1,
# so tests that act at a reported step act while it is current; the chart's
# default is 10).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "${ROOT}"
: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
: "${CARGO_TARGET_DIR:=${HEADROOM_CACHE}/target}"
export HEADROOM_CACHE CARGO_TARGET_DIR
say() { printf '\n\033[1m== %s\033[0m\n' "$*" >&2; }

if [[ -z ${KUBECONFIG:-} ]]; then
  say "starting the local single-node cluster (containerd + kubelet, no Docker)"
  e2e/cluster/cluster.sh up >&2
  eval "$(e2e/cluster/cluster.sh env)"
fi
# shellcheck source=cluster/lib/common.sh
source e2e/cluster/lib/common.sh
KUBECTL=${KUBECTL:-${HEADROOM_BIN_DIR}/kubectl}

# A cluster without nodes (the loopback control plane of `make test`, when
# its KUBECONFIG is still exported) would only time out in `helm --wait`.
if [[ -z $("${KUBECTL}" get nodes -o name 2>/dev/null) ]]; then
  echo "install.sh: the cluster in KUBECONFIG=${KUBECONFIG:-} has no nodes (the test control plane?); unset KUBECONFIG to use the local single-node cluster" >&2
  exit 1
fi

say "building headroom-operator and headroom-worker, packaging them as OCI images"
cargo build --release -q -p headroom-operator --bin headroom-operator --bin kubectl-headroom -p headroom-worker --bin headroom-worker >&2
e2e/images/build.sh headroom-operator "${CARGO_TARGET_DIR}/release/headroom-operator" >/dev/null
e2e/images/build.sh headroom-worker "${CARGO_TARGET_DIR}/release/headroom-worker" >/dev/null

say "helm upgrade --install headroom charts/headroom"
HELM=$(e2e/tools/build-helm.sh --print)
# Helm installs a chart's crds/ only on first install and never upgrades them:
# apply the CRD first, so a cluster installed by an older build gets new fields.
"${KUBECTL}" apply --server-side --force-conflicts --field-manager=headroom-install -f charts/headroom/crds/ >&2
# kubectl wait fails at once, instead of waiting, while a CRD just created
# has no status.conditions yet ("accessor error: <nil>"): ask again.
for _ in 1 2 3 4 5 6 7 8 9; do
  "${KUBECTL}" get crd/memoryawaretrainingjobs.headroom.dev -o jsonpath='{.status.conditions}' 2>/dev/null | grep -q . && break
  sleep 1
done
"${KUBECTL}" wait --for=condition=Established --timeout=60s crd/memoryawaretrainingjobs.headroom.dev >&2
"${HELM}" upgrade --install headroom charts/headroom -n headroom-system --create-namespace \
  --set image.repository=localhost/headroom-operator --set image.tag=dev \
  --set workerImages.cpu.repository=localhost/headroom-worker --set workerImages.cpu.tag=dev \
  --set workerImages.cuda.repository=localhost/headroom-worker-cuda --set workerImages.cuda.tag=dev \
  --set telemetryIntervalSeconds="${HEADROOM_TELEMETRY_INTERVAL_SECONDS:-1}" \
  --set statusIntervalSeconds="${HEADROOM_STATUS_INTERVAL_SECONDS:-1}" \
  --wait --timeout 180s >&2
# The tag stays `dev` across rebuilds: restart so the new build runs.
"${KUBECTL}" -n headroom-system rollout restart deployment/headroom-operator >&2
"${KUBECTL}" -n headroom-system rollout status deployment/headroom-operator --timeout=180s >&2
# Kueue, for the jobs that name a queue (the e2e suite; not the demo, which
# names none: HEADROOM_INSTALL_KUEUE=0): its pod webhook only touches
# namespaces labelled e2e.headroom.dev/kueue=managed (e2e/kueue/values.yaml).
if [[ ${HEADROOM_INSTALL_KUEUE:-1} == 1 ]]; then
  say "Kueue $(e2e/kueue/kueue.sh version), built from its Go module, with its own Helm chart"
  e2e/kueue/kueue.sh install >&2
fi
echo "export KUBECONFIG=${KUBECONFIG}"
