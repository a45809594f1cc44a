#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# A real Kueue for the local clusters, built from its Go module
# and installed with its own Helm chart (from the same module), its webhooks
# served with its own certificates (the chart's internal cert management).
#
#   e2e/kueue/kueue.sh build     # the binary (cached) and its OCI image archive
#   e2e/kueue/kueue.sh image     # build + import into the local cluster's containerd (if up)
#   e2e/kueue/kueue.sh install   # image + helm upgrade --install into kueue-system of
#                                # the cluster in KUBECONFIG; waits until its pod webhook answers
#   e2e/kueue/kueue.sh crds      # only Kueue's CRDs, on the cluster in KUBECONFIG (the
#                                # loopback control plane of make test-apiserver: no kubelet,
#                                # so no Kueue controller; API tests create its objects)
#   e2e/kueue/kueue.sh version   # prints KUEUE_VERSION
#
# Environment: KUEUE_VERSION (v0.17.0), HEADROOM_CACHE, KUBECONFIG, KUBECTL, HELM,
# KUEUE_IMAGE_IMPORT (auto: import into the local cluster's containerd when
# it is up; 0 for kind, which loads the archive itself).
#
# Values (e2e/kueue/values.yaml): only the `pod` integration (Headroom's
# attempts are pod groups) and a managedJobsNamespaceSelector on the label
# e2e.headroom.dev/kueue=managed, so Kueue's pod webhook (failurePolicy Fail)
# touches only the namespaces of the tests that opt in.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "${ROOT}"
# shellcheck source=../cluster/lib/common.sh
source e2e/cluster/lib/common.sh

: "${KUEUE_VERSION:=v0.17.0}"
KUEUE_MODULE=sigs.k8s.io/kueue
KUEUE_DIR="${HEADROOM_CACHE}/kueue/${KUEUE_VERSION}"
KUEUE_BIN="${KUEUE_DIR}/bin/kueue"
KUEUE_IMAGE_NAME="kueue:${KUEUE_VERSION}"
KUEUE_ARCHIVE="${HEADROOM_CACHE}/images/kueue_${KUEUE_VERSION}.oci.tar"
KUEUE_NAMESPACE=kueue-system
MANAGED_LABEL=e2e.headroom.dev/kueue=managed
VALUES=e2e/kueue/values.yaml

kubectl_bin() {
  if [[ -n ${KUBECTL:-} ]]; then
    echo "${KUBECTL}"
  elif [[ -x ${HEADROOM_BIN_DIR}/kubectl ]]; then
    echo "${HEADROOM_BIN_DIR}/kubectl"
  else
    command -v kubectl || die "no kubectl: run e2e/cluster/build-binaries.sh kubectl or set KUBECTL"
  fi
}

helm_bin() {
  if [[ -n ${HELM:-} ]]; then
    echo "${HELM}"
  elif command -v helm >/dev/null 2>&1; then
    command -v helm
  else
    e2e/tools/build-helm.sh --print
  fi
}

# The module's directory in the Go module cache (downloaded once).
module_dir() {
  local dir
  dir=$(go mod download -json "${KUEUE_MODULE}@${KUEUE_VERSION}" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [[ -d ${dir} ]] || die "no module directory for ${KUEUE_MODULE}@${KUEUE_VERSION}"
  echo "${dir}"
}

build() {
  if [[ ! -x ${KUEUE_BIN} ]]; then
    log "building Kueue ${KUEUE_VERSION} from its Go module (about 4 min cold on 2 cores, once)"
    local t0 tmp
    t0=$(now)
    tmp=$(mktemp -d)
    # Static, as Kueue's own Dockerfile builds it (CGO_ENABLED=0).
    CGO_ENABLED=0 GOBIN="${tmp}" GOFLAGS=-mod=mod go install -trimpath -ldflags "-s -w" \
      "${KUEUE_MODULE}/cmd/kueue@${KUEUE_VERSION}" >&2
    mkdir -p "$(dirname "${KUEUE_BIN}")"
    mv "${tmp}/kueue" "${KUEUE_BIN}"
    rmdir "${tmp}"
    log "built in $(($(now) - t0)) s: ${KUEUE_BIN}"
  fi
  # The image holds the binary at /usr/local/bin/kueue; the chart runs
  # /manager, which the post-renderer (post-render.sh) points there.
  IMAGE_TAG=${KUEUE_VERSION} IMAGE_IMPORT=${KUEUE_IMAGE_IMPORT:-auto} \
    e2e/images/build.sh "${KUEUE_IMAGE_NAME}" "${KUEUE_BIN}" >/dev/null
  [[ -s ${KUEUE_ARCHIVE} ]] || die "no image archive at ${KUEUE_ARCHIVE}"
}

crds() {
  local kubectl dir
  kubectl=$(kubectl_bin)
  dir=$(module_dir)
  "${kubectl}" apply --server-side --force-conflicts --field-manager=headroom-kueue \
    -f "${dir}/config/components/crd/bases/" >/dev/null
  "${kubectl}" wait --for condition=Established --timeout=60s \
    crd/resourceflavors.kueue.x-k8s.io crd/clusterqueues.kueue.x-k8s.io \
    crd/localqueues.kueue.x-k8s.io crd/workloads.kueue.x-k8s.io \
    crd/workloadpriorityclasses.kueue.x-k8s.io >/dev/null
  log "Kueue ${KUEUE_VERSION} CRDs applied"
}

# Whether Kueue's pod webhook answers: a server-side dry run of a queued pod
# in an opted-in namespace comes back gated.
webhook_answers() {
  local kubectl=$1 ns=$2 out
  out=$("${kubectl}" -n "${ns}" create --dry-run=server -o jsonpath='{.spec.schedulingGates[*].name}' -f - 2>/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: kueue-webhook-probe
  labels: {kueue.x-k8s.io/queue-name: probe}
spec:
  containers: [{name: c, image: localhost/kueue-probe:none}]
EOF
  ) || return 1
  [[ ${out} == *kueue.x-k8s.io/admission* ]]
}

install() {
  local kubectl helm dir t0 probe_ns
  kubectl=$(kubectl_bin)
  helm=$(helm_bin)
  dir=$(module_dir)
  t0=$(now)
  local revision_values
  revision_values=$(sha256sum "${VALUES}" e2e/kueue/post-render.sh | sha256sum | cut -c1-16)
  # Already installed at this version with these values: only wait below.
  if [[ $("${kubectl}" -n "${KUEUE_NAMESPACE}" get deployment kueue-controller-manager \
    -o jsonpath='{.metadata.annotations.e2e\.headroom\.dev/kueue-install}' 2>/dev/null || true) != "${KUEUE_VERSION}-${revision_values}" ]]; then
    log "helm upgrade --install kueue ${KUEUE_VERSION} (${dir}/charts/kueue)"
    "${helm}" upgrade --install kueue "${dir}/charts/kueue" -n "${KUEUE_NAMESPACE}" --create-namespace \
      -f "${VALUES}" --set "controllerManager.manager.image.tag=${KUEUE_VERSION}" \
      --post-renderer "${ROOT}/e2e/kueue/post-render.sh" --wait --timeout 300s >&2
    "${kubectl}" -n "${KUEUE_NAMESPACE}" annotate deployment kueue-controller-manager --overwrite \
      "e2e.headroom.dev/kueue-install=${KUEUE_VERSION}-${revision_values}" >/dev/null
  fi
  "${kubectl}" -n "${KUEUE_NAMESPACE}" rollout status deployment/kueue-controller-manager --timeout=300s >&2
  probe_ns=kueue-webhook-probe
  "${kubectl}" create namespace "${probe_ns}" --dry-run=client -o yaml | "${kubectl}" apply -f - >/dev/null
  "${kubectl}" label namespace "${probe_ns}" --overwrite "${MANAGED_LABEL}" >/dev/null
  local deadline=$(($(now) + 180))
  until webhook_answers "${kubectl}" "${probe_ns}"; do
    (($(now) < deadline)) || die "Kueue's pod webhook does not gate a queued pod after 180 s (kubectl -n ${KUEUE_NAMESPACE} logs deploy/kueue-controller-manager)"
    sleep 2
  done
  # An APIService that stays unavailable blocks every namespace deletion
  # (NamespaceDeletionDiscoveryFailure): none may be left so (post-render.sh).
  deadline=$(($(now) + 60))
  local unavailable
  while unavailable=$("${kubectl}" get apiservices --no-headers | awk '$3 != "True" {print $1}') && [[ -n ${unavailable} ]]; do
    (($(now) < deadline)) || die "APIServices unavailable after installing Kueue (namespaces could not be deleted): ${unavailable}"
    sleep 2
  done
  log "Kueue ${KUEUE_VERSION} serves its webhooks ($(($(now) - t0)) s)"
}

case ${1:-} in
  build) build ;;
  image) build ;;
  install) build && install ;;
  crds) crds ;;
  version) echo "${KUEUE_VERSION}" ;;
  *) sed -n '3,18p' "$0" >&2; exit 2 ;;
esac
