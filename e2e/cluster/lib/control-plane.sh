# shellcheck shell=bash
# The control plane both scripts run: etcd, kube-apiserver and
# kube-controller-manager. controlplane.sh runs it alone on loopback;
# cluster.sh runs it with its own state dir, ports and flags (cluster-env.sh
# and the "cluster flavour" block of cluster.sh) and adds the node.
#
# Needs common.sh; sources the PKI, the three components and lifecycle.sh.
# The sourcing script sets HERE, KUBECTL and COMPONENTS (its start order,
# beginning with CONTROL_PLANE).

# shellcheck source=pki.sh
source "${BASH_SOURCE[0]%/*}/pki.sh"
# shellcheck source=etcd.sh
source "${BASH_SOURCE[0]%/*}/etcd.sh"
# shellcheck source=kube-apiserver.sh
source "${BASH_SOURCE[0]%/*}/kube-apiserver.sh"
# shellcheck source=kube-controller-manager.sh
source "${BASH_SOURCE[0]%/*}/kube-controller-manager.sh"
# shellcheck source=lifecycle.sh
source "${BASH_SOURCE[0]%/*}/lifecycle.sh"

# Start order; stopped in reverse.
CONTROL_PLANE=(etcd kube-apiserver kube-controller-manager)

# need_binaries NAME...  -- etcd and every NAME must be in HEADROOM_BIN_DIR.
# Missing ones are built by build-binaries.sh when HEADROOM_AUTO_BUILD=1;
# otherwise this fails saying what to run.
need_binaries() {
  local missing=() b
  for b in etcd "$@"; do
    [[ -x ${HEADROOM_BIN_DIR}/${b} ]] || missing+=("${b}")
  done
  ((${#missing[@]})) || return 0
  [[ ${HEADROOM_AUTO_BUILD:-0} == 1 ]] ||
    die "missing ${missing[*]} in ${HEADROOM_BIN_DIR}; run: e2e/cluster/build-binaries.sh $* (or set HEADROOM_AUTO_BUILD=1)"
  log "building ${missing[*]} (cold: several minutes)"
  K8S_BINARIES="$*" "${HERE}/build-binaries.sh"
}

# The control plane's certificates (kept across restarts) and the admin
# kubeconfig; run before controlplane_start.
controlplane_prepare() {
  mkdir -p "${RUN_DIR}" "${LOG_DIR}"
  pki_ensure_controlplane
  write_kubeconfig "${KUBECONFIG_ADMIN}" admin headroom-admin
}

# Starts what of the control plane does not run and waits for each part:
# etcd, kube-apiserver (until an authenticated read with the admin
# kubeconfig works), kube-controller-manager. Dies on the first failure,
# with the component's log tail.
controlplane_start() {
  local deadline
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
}

# Stops the control plane in reverse start order (TERM, then KILL); safe
# when it is already stopped.
controlplane_stop() {
  local i
  for ((i = ${#CONTROL_PLANE[@]} - 1; i >= 0; i--)); do
    stop_component "${CONTROL_PLANE[i]}"
  done
}

# True if every component of COMPONENTS runs and is ready, and an
# authenticated read works.
components_healthy() {
  local c
  for c in "${COMPONENTS[@]}"; do
    component_pid "${c}" >/dev/null && "$(fn_prefix "${c}")_ready" || return 1
  done
  basics_work
}

# components_status WIDTH  -- a line per component of COMPONENTS (running,
# pid, ready; names padded to WIDTH) and, when all are ready, a line if
# kubectl still cannot read. Fails unless everything is up.
components_status() {
  local width=$1 name pid rc=0 ready
  for name in "${COMPONENTS[@]}"; do
    if pid=$(component_pid "${name}"); then
      if "$(fn_prefix "${name}")_ready"; then ready=ready; else ready="NOT ready"; rc=1; fi
      printf '%-*s running  pid %-8s %s\n' "${width}" "${name}" "${pid}" "${ready}"
    else
      printf '%-*s stopped\n' "${width}" "${name}"
      rc=1
    fi
  done
  if ((rc == 0)) && ! basics_work; then
    printf '%-*s %s\n' "${width}" kubectl "cannot get namespace default"
    rc=1
  fi
  return "${rc}"
}

# The environment for a shell to use the cluster: eval "$(<script> env)".
print_env() {
  printf 'export KUBECONFIG=%q\n' "${KUBECONFIG_ADMIN}"
  # shellcheck disable=SC2016 # $PATH must expand in the caller's shell
  printf 'export PATH=%q:"$PATH"\n' "${HEADROOM_BIN_DIR}"
}

# True if HEADROOM_STATE is a directory `clean` may delete in.
state_dir_exists() {
  [[ -n ${HEADROOM_STATE} && ${HEADROOM_STATE} != / && -d ${HEADROOM_STATE} ]]
}

# remove_state [PATH...]  -- deletes the control plane's state (PKI, pid
# files, logs, etcd data, admin kubeconfig) and the PATHs. Only what the
# scripts create, and never through a mount (a hostPath bind mount would
# take host files with it). Run after everything is stopped.
remove_state() {
  if awk -v s="${HEADROOM_STATE}/" 'index($5, s) == 1 {found=1} END {exit !found}' /proc/self/mountinfo; then
    die "mounts remain under ${HEADROOM_STATE}; not deleting anything"
  fi
  rm -rf --one-file-system "${PKI_DIR}" "${RUN_DIR}" "${LOG_DIR}" "${ETCD_DATA_DIR}" "${KUBECONFIG_ADMIN}" "$@"
}
