#!/usr/bin/env bash
# A kind cluster from local parts: the node image of node-image.sh, 1
# control-plane and KIND_WORKERS (default 2) workers, kind's CNI replaced by
# cni.sh, one host directory mounted in every node at /var/headroom-shared
# (the ReadWriteMany storage class's), kubeadm pointed at the etcd (and, when built, CoreDNS) tags made
# here. Used by e2e/kind.sh when KIND_NODE_IMAGE=local.
#
#   e2e/kind/cluster.sh create NAME     (needs DOCKER_HOST at a daemon, kind on PATH)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../cluster/lib/common.sh
source "${HERE}/../cluster/lib/common.sh"
: "${KIND_WORKERS:=2}"
[[ ${1:-} == create && -n ${2:-} ]] || { sed -n '2,8p' "$0" >&2; exit 2; }
name=$2
image=$("${HERE}/node-image.sh")
config=$(mktemp)
trap 'rm -f "${config}"' EXIT
# The ReadWriteMany class's filesystem (files/default-storage.yaml): one host
# directory, the same in every node.
shared="${HEADROOM_CACHE}/state/kind/${name}/shared"
rm -rf "${shared}"
mkdir -p "${shared}"
mounts="  extraMounts:\n  - {hostPath: ${shared}, containerPath: /var/headroom-shared}\n"
{
  printf 'kind: Cluster\napiVersion: kind.x-k8s.io/v1alpha4\nnetworking:\n  disableDefaultCNI: true\nnodes:\n- role: control-plane\n'"${mounts}"
  for _ in $(seq "${KIND_WORKERS}"); do printf -- '- role: worker\n'"${mounts}"; done
  printf 'kubeadmConfigPatches:\n- |\n  kind: ClusterConfiguration\n  etcd:\n    local:\n      imageTag: %s\n  dns:\n    imageTag: %s\n' \
    "${ETCD_VERSION#v}-0" "$(sed -n 's/^COREDNS_VERSION=//p' "${HERE}/node-image.sh")"
} >"${config}"
kind create cluster --name "${name}" --image "${image}" --config "${config}" --wait 0s >&2
kubectl=("${HEADROOM_BIN_DIR}/kubectl" --context "kind-${name}")
[[ -x ${kubectl[0]} ]] || kubectl=(kubectl --context "kind-${name}")
"${HERE}/cni.sh" "${name}" "${kubectl[@]}"
