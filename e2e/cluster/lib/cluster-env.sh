# shellcheck shell=bash
# shellcheck disable=SC2034 # variables are used by the files that source this one
# Defaults of the single-node cluster (cluster.sh). Sourced BEFORE common.sh,
# so the control-plane defaults there only fill what is still unset.
#
# The cluster lives next to the plain control plane (controlplane.sh), never on
# top of it: its own state dir and its own ports, so both can run at once.

: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
: "${HEADROOM_STATE:=${HEADROOM_CACHE}/state/cluster}"
: "${ETCD_CLIENT_PORT:=22379}"
: "${ETCD_PEER_PORT:=22380}"
: "${APISERVER_PORT:=26443}"
: "${CONTROLLER_MANAGER_PORT:=26257}"
: "${SCHEDULER_PORT:=26259}"
# Node ports: the upstream defaults plus 10000, so a kubelet/kube-proxy of
# another cluster on this host (10250, 10256, ...) cannot clash with ours.
: "${KUBELET_PORT:=20250}"
: "${KUBELET_HEALTHZ_PORT:=20248}"
: "${KUBE_PROXY_HEALTHZ_PORT:=20256}"
: "${KUBE_PROXY_METRICS_PORT:=20249}"

# One node, one /24 for pods. kube-controller-manager's node IPAM gets the same
# range as --cluster-cidr with a /24 mask, so node.spec.podCIDR always equals
# the static host-local range in the CNI config.
: "${POD_CIDR:=10.244.0.0/24}"
: "${CNI_BRIDGE:=headroom0}"
: "${CNI_BIN_DIR:=/usr/lib/cni}"

# Images built by e2e/images/build.sh (OCI archives) and the sandbox image.
: "${HEADROOM_IMAGES_DIR:=${HEADROOM_CACHE}/images}"
: "${PAUSE_IMAGE:=localhost/headroom-pause:3.10}"

CONTAINERD_DIR="${HEADROOM_STATE}/containerd"
: "${CONTAINERD_SOCK:=${CONTAINERD_DIR}/containerd.sock}"
KUBELET_DIR="${HEADROOM_STATE}/kubelet"
CNI_CONF_DIR="${HEADROOM_STATE}/cni/net.d"
CNI_IPAM_DIR="${HEADROOM_STATE}/cni/ipam"
