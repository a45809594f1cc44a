#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Real etcd + kube-apiserver on loopback for tests.
#
#   e2e/cluster/controlplane.sh up       # start (no-op if already up and healthy)
#   e2e/cluster/controlplane.sh down     # stop (TERM, then KILL); safe if stopped
#   e2e/cluster/controlplane.sh status   # exit 0 only if everything is healthy
#   e2e/cluster/controlplane.sh env      # eval "$(e2e/cluster/controlplane.sh env)"
#   e2e/cluster/controlplane.sh clean    # down + delete the state dir (fresh etcd, new CA)
#
# Binaries come from build-binaries.sh (run it first, or set
# HEADROOM_AUTO_BUILD=1). All settings live in lib/common.sh and can be
# overridden from the environment (ports, state dir, timeouts, extra flags).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "${HERE}/lib/common.sh"
source "${HERE}/lib/control-plane.sh"

KUBECTL="${HEADROOM_BIN_DIR}/kubectl"
# Start order; stopped in reverse. The full node (kube-scheduler, containerd,
# kubelet, kube-proxy) is cluster.sh; each component has a lib/<name>.sh
# providing <fn>_start and <fn>_ready.
COMPONENTS=("${CONTROL_PLANE[@]}")

cmd_up() {
  local t0
  t0=$(now)
  need_binaries kube-apiserver kube-controller-manager kubectl
  ensure_packages openssl:openssl curl:curl
  take_lock
  if components_healthy; then
    log "control plane already up (${APISERVER_URL})"
    return 0
  fi
  controlplane_prepare
  controlplane_start
  log "control plane up in $(($(now) - t0))s: ${APISERVER_URL}, KUBECONFIG=${KUBECONFIG_ADMIN}"
}

cmd_down() {
  take_lock
  controlplane_stop
  log "control plane stopped"
}

cmd_status() {
  local rc=0
  components_status 16 || rc=1
  printf 'apiserver  %s\nkubeconfig %s\nstate      %s\n' "${APISERVER_URL}" "${KUBECONFIG_ADMIN}" "${HEADROOM_STATE}"
  return "${rc}"
}

cmd_clean() {
  cmd_down
  state_dir_exists || return 0
  remove_state
  log "removed state in ${HEADROOM_STATE}"
}

case ${1:-} in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) print_env ;;
  clean) cmd_clean ;;
  *)
    echo "usage: $0 up|down|status|env|clean" >&2
    exit 2
    ;;
esac
