# shellcheck shell=bash
# The node's IPv4: what pods use to reach the API server (the `kubernetes`
# Service endpoint), the kubelet's InternalIP, and a SAN of the serving certs.
# It must not be loopback (Endpoints reject 127/8) and must be reachable from
# the pod bridge; the host's primary address (source of the default route) is.

detect_node_ip() {
  local ip
  ip=$(ip -4 route get 1.1.1.1 2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p' | head -n1)
  if [[ -z ${ip} ]]; then
    # No default route: first global address on any interface.
    ip=$(ip -4 -o addr show scope global 2>/dev/null | awk '{sub(/\/.*/, "", $4); print $4; exit}')
  fi
  [[ -n ${ip} ]] || return 1
  printf '%s\n' "${ip}"
}
