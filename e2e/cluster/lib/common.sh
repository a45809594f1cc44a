# shellcheck shell=bash
# shellcheck disable=SC2034 # variables are used by the files that source this one
# Shared settings and helpers for the e2e cluster harness.
#
# Sourced (never executed) by build-binaries.sh, controlplane.sh and the
# per-component files in lib/. Every setting can be overridden from the
# environment, so tests can run several harnesses side by side by choosing a
# different HEADROOM_STATE and ports.
#
# Layout (nothing of this lives inside the git clone):
#   $HEADROOM_CACHE/k8s/$K8S_VERSION/src/   throwaway Go module used to build
#   $HEADROOM_CACHE/k8s/$K8S_VERSION/bin/   kube-apiserver, kubectl, etcd, ...
#   $HEADROOM_STATE/                        one running cluster:
#       pki/        CA, serving/client certs, service-account keys
#       etcd-data/  etcd data dir
#       run/        <component>.pid
#       logs/       <component>.log
#       kubeconfig  admin kubeconfig (O=system:masters)

# --- versions ---------------------------------------------------------------
# Pinned so that controlplane.sh can find the binaries without asking the
# network. Bump both here; `K8S_VERSION=latest ./build-binaries.sh` prints and
# builds the newest v1.33 patch the Go module proxy knows.
: "${K8S_VERSION:=v1.33.13}"
# The etcd minor Kubernetes 1.33 itself is tested against (hack/lib/etcd.sh,
# cluster/images/etcd use 3.5.x); newest 3.5 patch on the proxy.
: "${ETCD_VERSION:=v3.5.35}"
# The clusters' volume provisioner (local and kind), from its Go module.
: "${LPP_VERSION:=v0.0.30}"

# --- locations --------------------------------------------------------------
: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
: "${HEADROOM_STATE:=${HEADROOM_CACHE}/state/controlplane}"
K8S_CACHE_DIR="${HEADROOM_CACHE}/k8s/${K8S_VERSION}"
: "${HEADROOM_BIN_DIR:=${K8S_CACHE_DIR}/bin}"

PKI_DIR="${HEADROOM_STATE}/pki"
RUN_DIR="${HEADROOM_STATE}/run"
LOG_DIR="${HEADROOM_STATE}/logs"
ETCD_DATA_DIR="${HEADROOM_STATE}/etcd-data"
KUBECONFIG_ADMIN="${HEADROOM_STATE}/kubeconfig"

# --- network ----------------------------------------------------------------
# Everything listens on loopback only. Ports are deliberately away from the
# defaults (2379/2380/6443) and outside the NodePort range (30000-32767), so a
# later kube-proxy on this host cannot capture them.
: "${HEADROOM_BIND_ADDRESS:=127.0.0.1}"
: "${ETCD_CLIENT_PORT:=12379}"
: "${ETCD_PEER_PORT:=12380}"
: "${APISERVER_PORT:=16443}"
: "${CONTROLLER_MANAGER_PORT:=16257}"
: "${SERVICE_CLUSTER_IP_RANGE:=10.96.0.0/16}"
# First IP of the service range: the `kubernetes` Service ClusterIP, which must
# be a SAN of the serving cert.
: "${KUBERNETES_SERVICE_IP:=10.96.0.1}"
: "${CLUSTER_DOMAIN:=cluster.local}"
: "${SERVICE_ACCOUNT_ISSUER:=https://kubernetes.default.svc.${CLUSTER_DOMAIN}}"

ETCD_ENDPOINT="https://${HEADROOM_BIND_ADDRESS}:${ETCD_CLIENT_PORT}"
APISERVER_URL="https://${HEADROOM_BIND_ADDRESS}:${APISERVER_PORT}"

# --- timeouts (seconds) -----------------------------------------------------
: "${ETCD_START_TIMEOUT:=30}"
: "${APISERVER_START_TIMEOUT:=90}"
: "${STOP_TIMEOUT:=20}"
# How long up/down wait for another up/down on the same state dir.
: "${LOCK_TIMEOUT:=300}"

# --- logging ----------------------------------------------------------------
log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Seconds since the epoch, for timings.
now() { date +%s; }

# --- process helpers --------------------------------------------------------
pid_file() { printf '%s/%s.pid' "${RUN_DIR}" "$1"; }
log_file() { printf '%s/%s.log' "${LOG_DIR}" "$1"; }

# True while PID exists and is not a zombie. Daemons are reparented to PID 1;
# in some containers PID 1 is slow to reap, and kill -0 succeeds on zombies.
pid_alive() {
  local state
  kill -0 "$1" 2>/dev/null || return 1
  state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [[ -n ${state} && ${state} != Z ]]
}

# Prints the PID of a running component, or fails. Guards against PID reuse by
# checking that /proc/PID/exe still points at the expected binary name.
component_pid() {
  local name=$1 bin=${2:-$1} file pid exe
  file=$(pid_file "${name}")
  [[ -s ${file} ]] || return 1
  pid=$(<"${file}")
  [[ ${pid} =~ ^[0-9]+$ ]] || return 1
  pid_alive "${pid}" || return 1
  exe=$(readlink "/proc/${pid}/exe" 2>/dev/null || true)
  # A binary replaced by a rebuild shows up as "... (deleted)"; still ours.
  [[ ${exe%% (deleted)} == */"${bin}" ]] || return 1
  printf '%s\n' "${pid}"
}

# start_component NAME BINARY ARGS...  -- start detached, record the PID.
# setsid puts the daemon in its own session so it survives the calling shell
# and a Ctrl-C in the test runner's terminal.
start_component() {
  local name=$1 bin=$2
  shift 2
  local log
  log=$(log_file "${name}")
  mkdir -p "${RUN_DIR}" "${LOG_DIR}"
  printf '\n==== %s starting %s\n' "$(date -u +%FT%TZ)" "${name}" >>"${log}"
  # 9>&- : do not hand the harness lock (fd 9, see take_lock) to the daemon,
  # or the lock would stay held for the daemon's whole life.
  setsid "${bin}" "$@" </dev/null >>"${log}" 2>&1 9>&- &
  local pid=$! i
  printf '%s\n' "${pid}" >"$(pid_file "${name}")"
  # Until the forked shell has exec'd the binary, /proc/PID/exe is bash or
  # setsid and component_pid would call the component dead: wait for the exec
  # (or the process's end) so readiness checks never see that window.
  for ((i = 0; i < 50; i++)); do
    pid_alive "${pid}" || break
    [[ $(readlink "/proc/${pid}/exe" 2>/dev/null) == */"$(basename "${bin}")"* ]] && break
    sleep 0.1
  done
}

# stop_component NAME [BINARY]  -- TERM, wait STOP_TIMEOUT, then KILL.
# Safe when nothing runs.
stop_component() {
  local name=$1 bin=${2:-$1} pid i
  if ! pid=$(component_pid "${name}" "${bin}"); then
    rm -f "$(pid_file "${name}")"
    return 0
  fi
  log "stopping ${name} (pid ${pid})"
  kill -TERM "${pid}" 2>/dev/null || true
  for ((i = 0; i < STOP_TIMEOUT * 10; i++)); do
    pid_alive "${pid}" || break
    sleep 0.1
  done
  if pid_alive "${pid}"; then
    log "${name} did not exit after ${STOP_TIMEOUT}s; sending KILL"
    kill -KILL "${pid}" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
      pid_alive "${pid}" || break
      sleep 0.1
    done
  fi
  rm -f "$(pid_file "${name}")"
}

# Prints the last lines of a component's log to stderr, from its latest start
# only (logs are appended across restarts; start_component writes a marker).
show_log_tail() {
  local name=$1 lines=${2:-40} log start
  log=$(log_file "${name}")
  [[ -f ${log} ]] || return 0
  start=$(grep -n '^==== ' "${log}" | tail -n1 | cut -d: -f1)
  log "last lines (up to ${lines}) of ${log}:"
  tail -n "+${start:-1}" "${log}" | tail -n "${lines}" >&2
}

# True if something accepts TCP connections on HOST:PORT (bash /dev/tcp, no
# extra tools).
port_in_use() {
  (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

# --- packages ---------------------------------------------------------------
# ensure_packages CMD:PKG ...  -- install missing Debian packages. Runs
# `apt-get update` only when the first install attempt fails (e.g. empty
# package lists in a fresh container).
ensure_packages() {
  local pair missing=() sudo=()
  for pair in "$@"; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
  done
  ((${#missing[@]})) || return 0
  command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get; install them by hand"
  if ((EUID != 0)); then
    command -v sudo >/dev/null 2>&1 || die "missing ${missing[*]}; need root or sudo to apt-get install"
    sudo=(sudo)
  fi
  log "installing ${missing[*]} with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  if ! "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}" >&2; then
    "${sudo[@]}" apt-get update >&2
    "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}" >&2
  fi
}
