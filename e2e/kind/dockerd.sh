#!/usr/bin/env bash
# A Docker daemon for kind on a machine that has none running: Debian's
# docker.io (installed with apt when dockerd is missing), started by hand with
# its own data root, exec root, pid file and socket under $HEADROOM_CACHE, and
# e2e/kind/runc-bounded as its default runtime (kind's privileged nodes need
# it where the VM drops a capability from every bounding set).
#
#   e2e/kind/dockerd.sh up     start it unless a daemon answers already (idempotent)
#   e2e/kind/dockerd.sh down   stop the daemon this script started (not another one)
#   e2e/kind/dockerd.sh env    print DOCKER_HOST=... for the daemon in use
#
# A daemon that already answers (`docker info` with the caller's DOCKER_HOST,
# e.g. Docker Desktop on a laptop) is used as it is and never stopped.
set -euo pipefail
: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR="${HEADROOM_CACHE}/state/docker"
SOCK="${DIR}/docker.sock"
PIDFILE="${DIR}/dockerd.pid"
LOG="${DIR}/dockerd.log"

ours() { [[ -s ${PIDFILE} ]] && kill -0 "$(cat "${PIDFILE}")" 2>/dev/null; }
answers() { docker info >/dev/null 2>&1; }

case ${1:-} in
  up)
    if ours; then
      echo "dockerd.sh: ours is running (${SOCK})" >&2
      exit 0
    fi
    if [[ -z ${DOCKER_HOST:-} || ${DOCKER_HOST} == "unix://${SOCK}" ]] && DOCKER_HOST= answers; then
      echo "dockerd.sh: a Docker daemon answers already; using it" >&2
      exit 0
    fi
    if ! command -v dockerd >/dev/null; then
      [[ $(id -u) == 0 ]] || { echo "dockerd.sh: no dockerd; install docker.io (root) or start Docker" >&2; exit 1; }
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >&2
    fi
    mkdir -p "${DIR}/data" "${DIR}/exec"
    # The bridge and iptables rules are the daemon's own (docker0); kind adds its network.
    nohup dockerd --data-root "${DIR}/data" --exec-root "${DIR}/exec" \
      --host "unix://${SOCK}" --pidfile "${PIDFILE}" \
      --add-runtime "runc-bounded=${HERE}/runc-bounded" --default-runtime runc-bounded \
      >"${LOG}" 2>&1 &
    for _ in $(seq 60); do
      DOCKER_HOST="unix://${SOCK}" answers && { echo "dockerd.sh: up (${SOCK}, log ${LOG})" >&2; exit 0; }
      sleep 0.5
    done
    echo "dockerd.sh: dockerd did not answer within 30 s; tail of ${LOG}:" >&2
    tail -20 "${LOG}" >&2
    exit 1
    ;;
  down)
    if ours; then
      pid=$(cat "${PIDFILE}")
      kill "${pid}"
      for _ in $(seq 60); do kill -0 "${pid}" 2>/dev/null || break; sleep 0.5; done
      echo "dockerd.sh: stopped" >&2
    fi
    ;;
  env)
    if ours; then echo "DOCKER_HOST=unix://${SOCK}"; else echo "DOCKER_HOST=${DOCKER_HOST:-}"; fi
    ;;
  *)
    sed -n '2,14p' "$0" >&2
    exit 2
    ;;
esac
