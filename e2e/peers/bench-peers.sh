#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# `make bench-peers`: Headroom's launch path against Kubeflow's
# training-operator (v1, PyTorchJob), on the same loopback control plane
# (etcd + kube-apiserver + kube-controller-manager, no kubelet), through one
# neutral harness (e2e/peers/harness). Not part of .ci/run: it is a
# benchmark, minutes long, and its figures go to docs/benchmarks.md.
#
#   e2e/peers/bench-peers.sh [harness flags...]   # e.g. -rounds 1 -jobs 100, -only headroom
#
# Kubeflow is built from its Go module at KUBEFLOW_VERSION and run as a tuned
# user would run it: --controller-threads 16 and client QPS/burst raised
# (the harness's -kubeflow-threads / -kubeflow-qps). It also needs what its
# Deployment would give it: the PyTorchJob CRD (from the module's
# manifests), and a webhook serving certificate, both in its Secret and on
# disk where the kubelet would mount it (its cert rotator waits for the file
# and its webhook server serves it), even though no webhook is registered
# here. Its pods name the namespace's `default` account, which the harness
# makes (this control plane runs no serviceaccount controller).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "${ROOT}"
# shellcheck source=../cluster/lib/common.sh
source e2e/cluster/lib/common.sh
: "${KUBEFLOW_VERSION:=v1.9.3}"
: "${CARGO_TARGET_DIR:=${HEADROOM_CACHE}/target}"
export CARGO_TARGET_DIR
PEERS="${HEADROOM_CACHE}/peers"
KUBEFLOW_MODULE=github.com/kubeflow/training-operator
KUBEFLOW_BIN="${PEERS}/training-operator-${KUBEFLOW_VERSION}"
HARNESS_BIN="${PEERS}/harness"
KUBECTL="${HEADROOM_BIN_DIR}/kubectl"
# Kubeflow's cert rotator reads its Secret from MY_POD_NAMESPACE, and its
# webhook server reads the files from this fixed directory.
CERT_NAMESPACE=kubeflow-peers
CERT_DIR=/tmp/k8s-webhook-server/serving-certs
export KUBECONFIG="${KUBECONFIG_ADMIN}"
mkdir -p "${PEERS}"

e2e/cluster/controlplane.sh up

if [[ ! -x ${KUBEFLOW_BIN} ]]; then
  log "building Kubeflow training-operator ${KUBEFLOW_VERSION} from its Go module (a few minutes, once)"
  t0=$(now)
  tmp=$(mktemp -d)
  GOBIN="${tmp}" go install "${KUBEFLOW_MODULE}/cmd/training-operator.v1@${KUBEFLOW_VERSION}"
  mv "${tmp}/training-operator.v1" "${KUBEFLOW_BIN}"
  rmdir "${tmp}"
  log "built in $(($(now) - t0)) s: ${KUBEFLOW_BIN}"
fi
module_dir=$(go mod download -json "${KUBEFLOW_MODULE}@${KUBEFLOW_VERSION}" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[[ -d ${module_dir} ]] || die "no module directory for ${KUBEFLOW_MODULE}@${KUBEFLOW_VERSION}"

log "building the harness and headroom-operator (release)"
(cd e2e/peers/harness && go build -o "${HARNESS_BIN}" .)
cargo build --release -q -p headroom-operator --bin headroom-operator

log "CRDs: MemoryAwareTrainingJob, and PyTorchJob from ${KUBEFLOW_MODULE}@${KUBEFLOW_VERSION}"
# --force-conflicts: the tests and bench-object apply the same cluster-scoped objects under their own managers.
"${KUBECTL}" apply --server-side --force-conflicts -f crds/ >/dev/null
"${KUBECTL}" apply --server-side -f "${module_dir}/manifests/base/crds/kubeflow.org_pytorchjobs.yaml" >/dev/null
"${KUBECTL}" wait --for condition=established --timeout=60s \
  crd/memoryawaretrainingjobs.headroom.dev crd/pytorchjobs.kubeflow.org >/dev/null

# One CA and a serving cert for training-operator.<ns>.svc, valid long past
# the rotator's look-ahead, so it keeps them rather than rotating.
if [[ ! -s ${PEERS}/certs/tls.crt ]]; then
  mkdir -p "${PEERS}/certs"
  (
    cd "${PEERS}/certs"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/O=training-operator/CN=training-operator-ca" \
      -keyout ca.key -out ca.crt 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=training-operator.${CERT_NAMESPACE}.svc" \
      -keyout tls.key -out tls.csr 2>/dev/null
    printf 'subjectAltName=DNS:training-operator.%s.svc\n' "${CERT_NAMESPACE}" >san.ext
    openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile san.ext -out tls.crt 2>/dev/null
  )
fi
mkdir -p "${CERT_DIR}"
cp "${PEERS}/certs/tls.crt" "${PEERS}/certs/tls.key" "${CERT_DIR}/"
"${KUBECTL}" create namespace "${CERT_NAMESPACE}" --dry-run=client -o yaml | "${KUBECTL}" apply -f - >/dev/null
"${KUBECTL}" -n "${CERT_NAMESPACE}" create secret generic training-operator-webhook-cert \
  --from-file="${PEERS}/certs/ca.crt" --from-file="${PEERS}/certs/ca.key" \
  --from-file="${PEERS}/certs/tls.crt" --from-file="${PEERS}/certs/tls.key" \
  --dry-run=client -o yaml | "${KUBECTL}" apply -f - >/dev/null

mkdir -p "${PEERS}/logs"
log "running the harness (operator logs in ${PEERS}/logs)"
exec "${HARNESS_BIN}" \
  -kubeconfig "${KUBECONFIG}" \
  -headroom "${CARGO_TARGET_DIR}/release/headroom-operator" \
  -headroom-job samples/cpu-oom-first.yaml \
  -kubeflow "${KUBEFLOW_BIN}" \
  -kubeflow-cert-namespace "${CERT_NAMESPACE}" \
  -log-dir "${PEERS}/logs" \
  "$@"
