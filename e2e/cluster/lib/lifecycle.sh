# shellcheck shell=bash
# Start/wait/lock helpers shared by controlplane.sh and cluster.sh (through
# control-plane.sh).
# Needs common.sh; KUBECTL and HERE are set by the sourcing script.

# Maps a component to its lib function prefix.
fn_prefix() {
  case $1 in
    kube-apiserver) echo apiserver ;;
    kube-controller-manager) echo controller_manager ;;
    kube-scheduler) echo scheduler ;;
    kube-proxy) echo kube_proxy ;;
    *) echo "${1//-/_}" ;;
  esac
}

# TCP port checked for a clash before a component starts (empty: none).
component_port() {
  case $1 in
    etcd) echo "${ETCD_CLIENT_PORT}" ;;
    kube-apiserver) echo "${APISERVER_PORT}" ;;
    kube-controller-manager) echo "${CONTROLLER_MANAGER_PORT}" ;;
    kube-scheduler) echo "${SCHEDULER_PORT:-}" ;;
    kubelet) echo "${KUBELET_HEALTHZ_PORT:-}" ;;
    kube-proxy) echo "${KUBE_PROXY_HEALTHZ_PORT:-}" ;;
  esac
}

# Serialise up/down/clean: parallel test jobs may all call `up`.
take_lock() {
  mkdir -p "${HEADROOM_STATE}"
  exec 9>"${HEADROOM_STATE}/.lock"
  flock -w "${LOCK_TIMEOUT}" 9 || die "another $(basename "$0") holds ${HEADROOM_STATE}/.lock for over ${LOCK_TIMEOUT}s"
}

kubectl_admin() { "${KUBECTL}" --kubeconfig "${KUBECONFIG_ADMIN}" --request-timeout=5s "$@"; }

# Beyond /readyz: the default namespace exists (created by a controller inside
# the apiserver shortly after readiness) and an authenticated, RBAC-authorised
# read works end to end with the kubeconfig tests will use.
basics_work() {
  [[ -f ${KUBECONFIG_ADMIN} ]] && kubectl_admin get namespace default -o name >/dev/null 2>&1
}

# wait_ready NAME TIMEOUT  -- poll <fn>_ready; fail fast if the process dies.
wait_ready() {
  local name=$1 timeout=$2 fn deadline
  fn="$(fn_prefix "${name}")_ready"
  deadline=$(($(now) + timeout))
  until "${fn}"; do
    # Optional <fn>_failed: a failure the process survives (e.g. a plugin).
    if declare -F "${fn%_ready}_failed" >/dev/null && "${fn%_ready}_failed"; then
      log "${name} started but failed (see below)"
      show_log_tail "${name}"
      return 1
    fi
    if ! component_pid "${name}" >/dev/null; then
      log "${name} exited during startup"
      show_log_tail "${name}"
      return 1
    fi
    if (($(now) >= deadline)); then
      log "${name} not ready after ${timeout}s"
      show_log_tail "${name}"
      return 1
    fi
    sleep 0.5
  done
}

# start_one NAME TIMEOUT  -- start NAME unless it runs, then wait for ready.
start_one() {
  local name=$1 timeout=$2 port t0
  t0=$(now)
  if component_pid "${name}" >/dev/null; then
    log "${name} already running (pid $(component_pid "${name}"))"
  else
    port=$(component_port "${name}")
    if [[ -n ${port} ]] && port_in_use "${HEADROOM_BIND_ADDRESS}" "${port}"; then
      ss -ltnp 2>/dev/null | grep -E ":${port}\b" >&2 || true
      die "${HEADROOM_BIND_ADDRESS}:${port} is already in use by another process; pick other ports (see lib/common.sh)"
    fi
    log "starting ${name} (log: $(log_file "${name}"))"
    "$(fn_prefix "${name}")_start"
  fi
  wait_ready "${name}" "${timeout}" || return 1
  log "${name} ready after $(($(now) - t0))s"
}
