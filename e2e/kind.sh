#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# `make e2e-kind`: the same end-to-end suite as `make e2e`, on a kind cluster,
# for machines with Docker (the local single-node cluster of `make e2e` needs
# none). Steps: create the kind cluster (if it does not exist), build the
# operator and worker images with the Dockerfiles in e2e/images, load them into
# the kind node, install Headroom with Helm, run every test target of
# headroom-e2e with KUBECONFIG at the kind cluster, delete the cluster.
#
#   e2e/kind.sh [TEST FILTER...]
#
# Needs: docker (with a running daemon; BuildKit), kind, cargo; kubectl and
# helm from PATH, else built from their Go modules (needs go):
# e2e/cluster/build-binaries.sh kubectl, e2e/tools/build-helm.sh.
#
# Environment:
#   KIND_CLUSTER_NAME=headroom-e2e   the cluster (created if missing)
#   HEADROOM_KEEP_CLUSTER=1          do not delete the cluster at the end
#   KIND_IMAGES=docker               docker: `docker build` with the Dockerfiles, then
#                                    `kind load docker-image`; oci: the Docker-free OCI
#                                    archives of e2e/images/build.sh (umoci; Debian/Ubuntu
#                                    host), then `kind load image-archive`
#   KIND_NODE_IMAGE                  passed to `kind create cluster --image` when set;
#                                    local: the node image built here (e2e/kind/cluster.sh),
#                                    the default when this script had to start dockerd
#   E2E_TEST_THREADS=2, KUBECTL, HELM
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "${ROOT}"
: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
: "${CARGO_TARGET_DIR:=${HEADROOM_CACHE}/target}"
: "${KIND_CLUSTER_NAME:=headroom-e2e}"
KIND_IMAGES_GIVEN=${KIND_IMAGES:-}
: "${KIND_IMAGES:=docker}"
: "${E2E_TEST_THREADS:=2}"
# The suite's jobs (samples/) name localhost/headroom-worker:dev.
IMAGE_TAG=dev
export HEADROOM_CACHE CARGO_TARGET_DIR IMAGE_TAG

# HEADROOM_BIN_DIR (where build-binaries.sh puts kubectl), log, die.
# shellcheck source=cluster/lib/common.sh
source e2e/cluster/lib/common.sh
say() { printf '\n\033[1m== %s\033[0m\n' "$*" >&2; }

# --- prerequisites, checked before anything is built or created -------------
# No Docker daemon answering: start Debian's docker.io by hand (root;
# e2e/kind/dockerd.sh), and since such a machine has no Docker Hub either,
# build kind's node image here (KIND_NODE_IMAGE=local, e2e/kind/README.md).
# The same when DOCKER_HOST is already that daemon's socket.
STARTED_DOCKERD=0
OUR_DOCKER="unix://${HEADROOM_CACHE}/state/docker/docker.sock"
if [[ ${DOCKER_HOST:-} == "${OUR_DOCKER}" ]] || { ! docker info >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; }; then
  if ! DOCKER_HOST=${OUR_DOCKER} docker info >/dev/null 2>&1; then
    e2e/kind/dockerd.sh up
    STARTED_DOCKERD=1
  fi
  export DOCKER_HOST=${OUR_DOCKER}
  : "${KIND_NODE_IMAGE:=local}"
  # No registry for the Dockerfiles' base images either.
  KIND_IMAGES=${KIND_IMAGES_GIVEN:-oci}
fi
command -v docker >/dev/null 2>&1 || die "docker not found: make e2e-kind needs Docker (use make e2e for the Docker-free local cluster)"
docker info >/dev/null 2>&1 || die "the Docker daemon is not reachable ('docker info' fails): start it, or use make e2e"
if ! command -v kind >/dev/null 2>&1; then
  command -v go >/dev/null 2>&1 || die "kind not found and no go to build it: install kind, or use make e2e"
  GOBIN=${HEADROOM_CACHE}/kind/bin go install sigs.k8s.io/kind@v0.33.0 >&2
  PATH=${HEADROOM_CACHE}/kind/bin:${PATH}
fi
command -v cargo >/dev/null 2>&1 || die "cargo not found: the suite is a Rust test crate"
case ${KIND_IMAGES} in
  docker) ;;
  oci) [[ $(uname -s) == Linux ]] || die "KIND_IMAGES=oci builds images with umoci on a Linux host; use KIND_IMAGES=docker" ;;
  *) die "KIND_IMAGES=${KIND_IMAGES}: use docker or oci" ;;
esac
if [[ -z ${KUBECTL:-} ]]; then
  if command -v kubectl >/dev/null 2>&1; then
    KUBECTL=$(command -v kubectl)
  else
    command -v go >/dev/null 2>&1 || die "no kubectl on PATH and no go to build one: install kubectl or set KUBECTL"
    K8S_BINARIES=kubectl BUILD_ETCD=0 e2e/cluster/build-binaries.sh >&2
    KUBECTL=${HEADROOM_BIN_DIR}/kubectl
  fi
fi
if [[ -z ${HELM:-} ]]; then
  if command -v helm >/dev/null 2>&1; then
    HELM=$(command -v helm)
  else
    command -v go >/dev/null 2>&1 || die "no helm on PATH and no go to build one: install helm or set HELM"
    HELM=$(e2e/tools/build-helm.sh --print)
  fi
fi
export KUBECTL

# --- cluster -----------------------------------------------------------------
KUBECONFIG_KIND=$(mktemp "${TMPDIR:-/tmp}/headroom-kind-kubeconfig.XXXXXX")
finish() {
  local rc=$?
  if [[ ${HEADROOM_KEEP_CLUSTER:-0} == 1 ]]; then
    say "HEADROOM_KEEP_CLUSTER=1: kind cluster ${KIND_CLUSTER_NAME} stays (kind delete cluster --name ${KIND_CLUSTER_NAME})"
  elif kind get clusters 2>/dev/null | grep -qx "${KIND_CLUSTER_NAME}"; then
    say "kind delete cluster --name ${KIND_CLUSTER_NAME}"
    kind delete cluster --name "${KIND_CLUSTER_NAME}" >&2 || rc=1
  fi
  rm -f "${KUBECONFIG_KIND}"
  if ((STARTED_DOCKERD)) && [[ ${HEADROOM_KEEP_CLUSTER:-0} != 1 ]]; then
    e2e/kind/dockerd.sh down || rc=1
  fi
  exit "${rc}"
}
trap finish EXIT

t0=${SECONDS}
if kind get clusters 2>/dev/null | grep -qx "${KIND_CLUSTER_NAME}"; then
  say "reusing kind cluster ${KIND_CLUSTER_NAME}"
else
  say "kind create cluster --name ${KIND_CLUSTER_NAME}"
  if [[ ${KIND_NODE_IMAGE:-} == local ]]; then
    # 1 control-plane + 2 workers from the node image built here.
    e2e/kind/cluster.sh create "${KIND_CLUSTER_NAME}"
  else
    # kind's own node image, CNI and storage; 1 control plane + 2 workers
    # for the several-node scenarios.
    printf 'kind: Cluster\napiVersion: kind.x-k8s.io/v1alpha4\nnodes:\n- role: control-plane\n- role: worker\n- role: worker\n' |
      kind create cluster --name "${KIND_CLUSTER_NAME}" ${KIND_NODE_IMAGE:+--image "${KIND_NODE_IMAGE}"} --config - --wait 180s >&2
  fi
fi
kind get kubeconfig --name "${KIND_CLUSTER_NAME}" >"${KUBECONFIG_KIND}"
export KUBECONFIG=${KUBECONFIG_KIND}
"${KUBECTL}" wait --for=condition=Ready nodes --all --timeout=180s >&2

# --- images --------------------------------------------------------------------
OPERATOR_IMAGE=localhost/headroom-operator:${IMAGE_TAG}
WORKER_IMAGE=localhost/headroom-worker:${IMAGE_TAG}
if [[ ${KIND_IMAGES} == docker ]]; then
  say "docker build ${OPERATOR_IMAGE} and ${WORKER_IMAGE} (e2e/images/*.Dockerfile)"
  DOCKER_BUILDKIT=1 docker build -f e2e/images/operator.Dockerfile -t "${OPERATOR_IMAGE}" . >&2
  DOCKER_BUILDKIT=1 docker build -f e2e/images/worker.Dockerfile -t "${WORKER_IMAGE}" . >&2
  kind load docker-image --name "${KIND_CLUSTER_NAME}" "${OPERATOR_IMAGE}" "${WORKER_IMAGE}" >&2
else
  say "OCI archives without Docker (e2e/images/build.sh), kind load image-archive"
  cargo build --release -p headroom-operator --bin headroom-operator -p headroom-worker --bin headroom-worker >&2
  for name in headroom-operator headroom-worker; do
    IMAGE_IMPORT=0 e2e/images/build.sh "${name}" "${CARGO_TARGET_DIR}/release/${name}" >/dev/null
    kind load image-archive --name "${KIND_CLUSTER_NAME}" "${HEADROOM_CACHE}/images/${name}_${IMAGE_TAG}.oci.tar" >&2
  done
fi

# --- Headroom ------------------------------------------------------------------
say "helm upgrade --install headroom charts/headroom"
# Helm never upgrades a chart's crds/: apply the CRD first (a reused cluster may hold an older one).
"${KUBECTL}" apply --server-side --force-conflicts --field-manager=headroom-install -f charts/headroom/crds/ >&2
# kubectl wait fails at once, instead of waiting, while a CRD just created
# has no status.conditions yet ("accessor error: <nil>"): ask again.
for _ in 1 2 3 4 5 6 7 8 9; do
  "${KUBECTL}" get crd/memoryawaretrainingjobs.headroom.dev -o jsonpath='{.status.conditions}' 2>/dev/null | grep -q . && break
  sleep 1
done
"${KUBECTL}" wait --for=condition=Established --timeout=60s crd/memoryawaretrainingjobs.headroom.dev >&2
# install ACCESS_MODE STORAGE_CLASS: the chart, with the checkpoint volumes given.
install() {
  "${HELM}" upgrade --install headroom charts/headroom -n headroom-system --create-namespace \
    --set image.repository=localhost/headroom-operator --set image.tag="${IMAGE_TAG}" \
    --set workerImages.cpu.repository=localhost/headroom-worker --set workerImages.cpu.tag="${IMAGE_TAG}" \
    --set workerImages.cuda.repository=localhost/headroom-worker-cuda --set workerImages.cuda.tag="${IMAGE_TAG}" \
    --set telemetryIntervalSeconds="${HEADROOM_TELEMETRY_INTERVAL_SECONDS:-1}" \
    --set statusIntervalSeconds="${HEADROOM_STATUS_INTERVAL_SECONDS:-1}" \
    --set checkpoints.accessMode="$1" --set checkpoints.storageClassName="$2" \
    --wait --timeout 180s >&2
  # A reused cluster may run an older build under the same tag.
  "${KUBECTL}" -n headroom-system rollout restart deployment/headroom-operator >&2
  "${KUBECTL}" -n headroom-system rollout status deployment/headroom-operator --timeout=180s >&2
}
install ReadWriteOnce ""

# --- Kueue ---------------------------------------------------------------------
# Built from its Go module into an OCI archive (no Docker needed in either
# image mode), loaded into the kind nodes, installed with its own chart.
say "Kueue $(e2e/kueue/kueue.sh version): build, kind load image-archive, helm install"
KUEUE_IMAGE_IMPORT=0 e2e/kueue/kueue.sh build
kind load image-archive --name "${KIND_CLUSTER_NAME}" \
  "${HEADROOM_CACHE}/images/kueue_$(e2e/kueue/kueue.sh version).oci.tar" >&2
KUEUE_IMAGE_IMPORT=0 KUBECTL=${KUBECTL} HELM=${HELM} e2e/kueue/kueue.sh install

# --- suite ---------------------------------------------------------------------
# The fine-tuning scenarios serve a hub stand-in on this machine; pods reach it
# at the kind network's gateway (the host's address on that bridge).
if [[ -z ${HEADROOM_E2E_HUB_HOST:-} ]]; then
  HEADROOM_E2E_HUB_HOST=$(docker network inspect kind -f '{{range .IPAM.Config}}{{if .Gateway}}{{.Gateway}} {{end}}{{end}}' | tr ' ' '\n' | grep -m1 '\.')
  export HEADROOM_E2E_HUB_HOST
fi
say "cargo test -p headroom-e2e --tests --no-fail-fast -- --ignored --test-threads=${E2E_TEST_THREADS} --skip read_write_many $*"
t1=${SECONDS}
# The whole suite, with the several-node scenarios (tests/several_nodes.rs),
# on the chart's default ReadWriteOnce checkpoints...
cargo test -p headroom-e2e --tests --no-fail-fast -- --ignored --test-threads="${E2E_TEST_THREADS}" --skip read_write_many "$@"
# ...then the chart again with ReadWriteMany checkpoints on the cluster's
# shared-filesystem class (e2e/kind/files/default-storage.yaml), for the
# scenarios that need it.
rwx_tests=0
for f in "${@:-read_write_many}"; do
  [[ several_nodes::read_write_many_stages_train_on_several_nodes_when_none_has_room_for_two == *"${f}"* ]] && rwx_tests=1
done
if ((rwx_tests)) && ! "${KUBECTL}" get storageclass headroom-shared >/dev/null 2>&1; then
  # kind's own node image has no shared-filesystem class (the local one's
  # e2e/kind/files/default-storage.yaml does).
  say "no StorageClass headroom-shared on this cluster: the ReadWriteMany scenario is skipped"
  rwx_tests=0
fi
if ((rwx_tests)); then
  say "helm upgrade: checkpoints.accessMode=ReadWriteMany, storageClassName=headroom-shared"
  install ReadWriteMany headroom-shared
  cargo test -p headroom-e2e --test several_nodes -- --ignored read_write_many
fi
say "e2e on kind passed: setup $((t1 - t0)) s, tests $((SECONDS - t1)) s"
