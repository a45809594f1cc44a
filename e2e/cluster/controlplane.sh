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
source "${HERE}/lib/pki.sh"
source "${HERE}/lib/etcd.sh"
source "${HERE}/lib/kube-apiserver.sh"
source "${HERE}/lib/kube-controller-manager.sh"
source "${HERE}/lib/lifecycle.sh"

KUBECTL="${HEADROOM_BIN_DIR}/kubectl"
# Start order; stopped in reverse. The full node (kube-scheduler, containerd,
# kubelet, kube-proxy) is cluster.sh; each component has a lib/<name>.sh
# providing <fn>_start and <fn>_ready.
COMPONENTS=(etcd kube-apiserver kube-controller-manager)

need_binaries() {
  local missing=() b
  for b in etcd kube-apiserver kube-controller-manager kubectl; do
    [[ -x ${HEADROOM_BIN_DIR}/${b} ]] || missing+=("${b}")
  done
  ((${#missing[@]})) || return 0
  if [[ ${HEADROOM_AUTO_BUILD:-0} == 1 ]]; then
    "${HERE}/build-binaries.sh"
  else
    die "missing ${missing[*]} in ${HEADROOM_BIN_DIR}; run e2e/cluster/build-binaries.sh first (or set HEADROOM_AUTO_BUILD=1)"
  fi
}

healthy() {
  component_pid etcd >/dev/null && etcd_ready &&
    component_pid kube-apiserver >/dev/null && apiserver_ready && basics_work &&
    component_pid kube-controller-manager >/dev/null && controller_manager_ready
}

cmd_up() {
  local t0 deadline
  t0=$(now)
  need_binaries
  ensure_packages openssl:openssl curl:curl
  take_lock
  if healthy; then
    log "control plane already up (${APISERVER_URL})"
    return 0
  fi
  mkdir -p "${RUN_DIR}" "${LOG_DIR}"
  pki_ensure_controlplane
  write_kubeconfig "${KUBECONFIG_ADMIN}" admin headroom-admin

  start_one etcd "${ETCD_START_TIMEOUT}" || die "etcd failed to start"
  start_one kube-apiserver "${APISERVER_START_TIMEOUT}" || die "kube-apiserver failed to start"

  deadline=$(($(now) + APISERVER_START_TIMEOUT))
  until basics_work; do
    if (($(now) >= deadline)); then
      kubectl_admin get namespace default >&2 || true
      show_log_tail kube-apiserver
      die "apiserver is ready but 'kubectl get namespace default' keeps failing"
    fi
    sleep 0.5
  done
  start_one kube-controller-manager "${APISERVER_START_TIMEOUT}" || die "kube-controller-manager failed to start"
  log "control plane up in $(($(now) - t0))s: ${APISERVER_URL}, KUBECONFIG=${KUBECONFIG_ADMIN}"
}

cmd_down() {
  take_lock
  local i
  for ((i = ${#COMPONENTS[@]} - 1; i >= 0; i--)); do
    stop_component "${COMPONENTS[i]}"
  done
  log "control plane stopped"
}

cmd_status() {
  local name pid rc=0 ready
  for name in "${COMPONENTS[@]}"; do
    if pid=$(component_pid "${name}"); then
      if "$(fn_prefix "${name}")_ready"; then ready=ready; else ready="NOT ready"; rc=1; fi
      printf '%-16s running  pid %-8s %s\n' "${name}" "${pid}" "${ready}"
    else
      printf '%-16s stopped\n' "${name}"
      rc=1
    fi
  done
  if ((rc == 0)) && ! basics_work; then
    printf '%-16s %s\n' kubectl "cannot get namespace default"
    rc=1
  fi
  printf 'apiserver  %s\nkubeconfig %s\nstate      %s\n' "${APISERVER_URL}" "${KUBECONFIG_ADMIN}" "${HEADROOM_STATE}"
  return "${rc}"
}

cmd_env() {
  printf 'export KUBECONFIG=%q\n' "${KUBECONFIG_ADMIN}"
  # shellcheck disable=SC2016 # $PATH must expand in the caller's shell
  printf 'export PATH=%q:"$PATH"\n' "${HEADROOM_BIN_DIR}"
}

cmd_clean() {
  cmd_down
  # Only remove what we create; refuse odd paths.
  [[ -n ${HEADROOM_STATE} && ${HEADROOM_STATE} != / && -d ${HEADROOM_STATE} ]] || return 0
  rm -rf "${PKI_DIR}" "${RUN_DIR}" "${LOG_DIR}" "${ETCD_DATA_DIR}" "${KUBECONFIG_ADMIN}"
  log "removed state in ${HEADROOM_STATE}"
}

case ${1:-} in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) cmd_env ;;
  clean) cmd_clean ;;
  *)
    echo "usage: $0 up|down|status|env|clean" >&2
    exit 2
    ;;
esac
