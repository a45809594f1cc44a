#!/usr/bin/env bash
# Pod networking for a kind cluster created with
# `networking.disableDefaultCNI: true`: what kindnetd (kind's CNI, a nested
# Go module the module proxy does not serve) does, done once from outside.
# Each node gets a CNI config for its own podCIDR (Debian's bridge,
# host-local, portmap and loopback plugins, in the base image), masquerading
# traffic that leaves the pod network, and a route to every other node's
# podCIDR through that node's address on the kind network.
#
#   e2e/kind/cni.sh CLUSTER KUBECTL...    (e.g. cni.sh hr kubectl --context kind-hr)
#
# Run after `kind create cluster` (every node has its podCIDR then), before
# anything needs pod networking; nodes turn Ready once their config exists.
set -euo pipefail
cluster=$1
shift
kubectl=("$@")
nodes=$("${kubectl[@]}" get nodes -o jsonpath='{range .items[*]}{.metadata.name} {.spec.podCIDR} {.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}')
[[ -n ${nodes} ]] || { echo "cni.sh: no nodes in ${cluster}" >&2; exit 1; }
# The cluster's pod network: masquerade only what leaves it.
pod_net=$(docker exec "${cluster}-control-plane" sh -c "grep -o 'cluster-cidr=[^ ]*' /etc/kubernetes/manifests/kube-controller-manager.yaml | cut -d= -f2")
while read -r node cidr _; do
  [[ -n ${cidr} ]] || { echo "cni.sh: node ${node} has no podCIDR" >&2; exit 1; }
  docker exec -i "${node}" sh -c 'mkdir -p /etc/cni/net.d && cat > /etc/cni/net.d/10-headroom.conflist' <<JSON
{
  "cniVersion": "0.4.0",
  "name": "headroom-kind",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {"type": "host-local", "ranges": [[{"subnet": "${cidr}"}]], "routes": [{"dst": "0.0.0.0/0"}]}
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
  # Pods reach the world (and the kind network) from the node's address.
  docker exec "${node}" sh -c "iptables -t nat -C POSTROUTING -s ${cidr} ! -d ${pod_net} -j MASQUERADE 2>/dev/null ||
    iptables -t nat -A POSTROUTING -s ${cidr} ! -d ${pod_net} -j MASQUERADE"
  while read -r other other_cidr other_ip; do
    [[ ${other} == "${node}" ]] && continue
    docker exec "${node}" ip route replace "${other_cidr}" via "${other_ip}"
  done <<<"${nodes}"
done <<<"${nodes}"
echo "cni.sh: $(wc -l <<<"${nodes}") node(s) configured (pod network ${pod_net})" >&2
