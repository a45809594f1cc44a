#!/usr/bin/env bash
# kind's node image for the local cluster's Kubernetes version, assembled here
# without `kind build node-image` (which pulls etcd, CoreDNS, pause, kindnetd
# and the storage images from registries this machine cannot reach): the base
# image of base-image.sh, kubeadm, kubelet and kubectl from
# e2e/cluster/build-binaries.sh, and the control-plane images made with
# e2e/images/build.sh from the same binaries, imported into the node's
# containerd the way kind's builder does it (containerd started by hand in a
# build container, `ctr images import`, `docker commit`).
#
#   e2e/kind/node-image.sh          prints the image name (cached by input hash)
#
# Not in it (e2e/kind/README.md): kindnetd (cni.sh writes each node's CNI
# config instead).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../cluster/lib/cluster-env.sh
source "${HERE}/../cluster/lib/cluster-env.sh"
# shellcheck source=../cluster/lib/common.sh
source "${HERE}/../cluster/lib/common.sh"
# pause_image_ensure, volume_helper_image_ensure: the local cluster's images.
# shellcheck source=../cluster/lib/containerd.sh
source "${HERE}/../cluster/lib/containerd.sh"
# shellcheck source=../cluster/lib/storage.sh
source "${HERE}/../cluster/lib/storage.sh"
# shellcheck source=../cluster/lib/packages.sh
source "${HERE}/../cluster/lib/packages.sh"
# What the images below are made of (kube-proxy's iptables and conntrack, the
# pause binary's gcc, busybox), as for the local cluster.
ensure_debs "${NODE_PACKAGES[@]}" dash
BASE=$("${HERE}/base-image.sh")
"${HERE}/../cluster/build-binaries.sh" kubeadm kubelet kubectl kube-apiserver kube-controller-manager kube-scheduler kube-proxy local-path-provisioner >/dev/null 2>&1 || true
for b in kubeadm kubelet kubectl kube-apiserver kube-controller-manager kube-scheduler kube-proxy etcd local-path-provisioner; do
  [[ -x ${HEADROOM_BIN_DIR}/${b} ]] || { echo "node-image: no ${HEADROOM_BIN_DIR}/${b} (e2e/cluster/build-binaries.sh ${b})" >&2; exit 1; }
done
ETCD_TAG=${ETCD_VERSION#v}-0
# CoreDNS: the Go module proxy serves v1.14.3 and later only (kubeadm 1.33
# names v1.12.0); cluster.sh points kubeadm's dns.imageTag at it.
COREDNS_VERSION=v1.14.3
COREDNS="${HEADROOM_CACHE}/kind/bin/coredns-${COREDNS_VERSION}"
if [[ ! -x ${COREDNS} ]]; then
  mkdir -p "${HEADROOM_CACHE}/kind/bin"
  (cd /tmp && CGO_ENABLED=0 GOBIN="${HEADROOM_CACHE}/kind/go-bin" go install -ldflags "-s -w" "github.com/coredns/coredns@${COREDNS_VERSION}") >&2
  mv "${HEADROOM_CACHE}/kind/go-bin/coredns" "${COREDNS}"
fi
# Control-plane images under the names kubeadm asks for (etcd under its own
# version: the cluster config patches kubeadm's etcd tag to it). Root: the
# static pods read the node's keys.
archives=()
archive_of() { # REF: where build.sh leaves its archive
  local last=${1##*/}
  printf '%s\n' "${HEADROOM_IMAGES_DIR}/${last/:/_}.oci.tar"
}
image() { # NAME BINARY [EXTRA...]
  IMAGE_IMPORT=0 IMAGE_USER=${IMAGE_USER:-0:0} "${HERE}/../images/build.sh" "$@" >/dev/null
  archives+=("$(archive_of "$1")")
}
for c in kube-apiserver kube-controller-manager kube-scheduler; do
  image "registry.k8s.io/${c}:${K8S_VERSION}" "${HEADROOM_BIN_DIR}/${c}"
done
# kube-proxy programs iptables with the node's backend (files/iptables-wrapper
# picks legacy or nft), with the xtables match and target extensions, and
# conntrack; the wrapper runs under dash.
wrapper="${HERE}/files/iptables-wrapper"
proxy_files=("$(command -v dash):/bin/sh" "$(command -v xtables-legacy-multi)" "$(command -v xtables-nft-multi)"
  "$(command -v conntrack):/usr/sbin/conntrack")
for t in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
  proxy_files+=("${wrapper}:/usr/sbin/${t}")
done
for ext in /usr/lib/x86_64-linux-gnu/xtables/*.so; do proxy_files+=("${ext}"); done
image "registry.k8s.io/kube-proxy:${K8S_VERSION}" "${HEADROOM_BIN_DIR}/kube-proxy" "${proxy_files[@]}"
image "registry.k8s.io/etcd:${ETCD_TAG}" "${HEADROOM_BIN_DIR}/etcd"
# Root: it binds port 53 (the upstream image sets a file capability instead).
image "registry.k8s.io/coredns/coredns:${COREDNS_VERSION}" "${COREDNS}"
# The sandbox image, and what the default storage runs (files/default-storage.yaml):
# the provisioner and its helper pods' busybox, the same images as the local cluster's.
pause_image_ensure
archives+=("$(archive_of "${PAUSE_IMAGE}")")
volume_helper_image_ensure
archives+=("$(archive_of "${VOLUME_HELPER_IMAGE}")")
LPP_IMAGE="localhost/local-path-provisioner:${LPP_VERSION}"
IMAGE_USER=65532:65532 image "${LPP_IMAGE}" "${HEADROOM_BIN_DIR}/local-path-provisioner"
storage=$(sed -e "s|\${LPP_IMAGE}|${LPP_IMAGE}|g" -e "s|\${VOLUME_HELPER_IMAGE}|${VOLUME_HELPER_IMAGE}|g" "${HERE}/files/default-storage.yaml")

# The image is named by everything in it: the base, the node's binaries and
# the images (build.sh's digest of each archive's inputs, beside the archive:
# no need to hash half a gigabyte of archives on every run).
tag=$( (echo "${BASE}" "${storage}"; cat "$0" "${HEADROOM_BIN_DIR}"/{kubeadm,kubelet,kubectl} "${archives[@]/%/.inputs}") | sha256sum | cut -c1-12)
IMAGE="localhost/kind-node:${K8S_VERSION}-${tag}"
if docker image inspect "${IMAGE}" >/dev/null 2>&1; then
  printf '%s\n' "${IMAGE}"
  exit 0
fi

build="headroom-kind-node-build-$$"
trap 'docker rm -f "${build}" >/dev/null 2>&1 || true' EXIT
docker run -d --name "${build}" --privileged --entrypoint sleep "${BASE}" infinity >/dev/null
for b in kubeadm kubelet kubectl; do
  docker cp "${HEADROOM_BIN_DIR}/${b}" "${build}:/usr/bin/${b}"
done
docker exec "${build}" sh -c "echo ${K8S_VERSION} > /kind/version && mkdir -p /kind/images /kind/manifests"
docker exec -i "${build}" sh -c 'cat > /kind/manifests/default-storage.yaml' <<<"${storage}"
for a in "${archives[@]}"; do
  docker cp "${a}" "${build}:/kind/images/"
done
docker exec -d "${build}" containerd
docker exec "${build}" sh -ec '
  for _ in $(seq 60); do ctr version >/dev/null 2>&1 && break; sleep 0.5; done
  for a in /kind/images/*.tar; do ctr -n k8s.io images import --no-unpack "$a" >/dev/null; done
  # The sandbox image kind'"'"'s containerd config names.
  ctr -n k8s.io images tag localhost/headroom-pause:3.10 registry.k8s.io/pause:3.10 >/dev/null
  ctr -n k8s.io images ls -q >&2
  rm -rf /kind/images
  pkill containerd; sleep 1'
docker commit --change 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' "${build}" "${IMAGE}" >/dev/null
printf '%s\n' "${IMAGE}"
