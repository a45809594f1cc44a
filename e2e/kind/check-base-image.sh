#!/usr/bin/env bash
# Runs IMAGE the way kind runs a node (privileged, tmpfs /tmp and /run, a
# /var volume, /lib/modules read-only) and checks what kind needs of it:
# systemd reaches `running` with no failed unit, containerd is active, and
# its runc starts a privileged and an unprivileged container (the pause image
# of e2e/images, imported into the node's k8s.io namespace), and crictl
# reports that image's ID as kind reads it. Removes the
# container again.
#
#   e2e/kind/check-base-image.sh IMAGE
set -euo pipefail
: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
IMAGE=$1
PAUSE="${HEADROOM_CACHE}/images/headroom-pause_3.10.oci.tar"
node="headroom-kind-check-$$"
fail() { echo "check-base-image: ${IMAGE}: $*" >&2; docker logs "${node}" 2>&1 | tail -30 >&2; exit 1; }
trap 'docker rm -f "${node}" >/dev/null 2>&1 || true' EXIT
docker run --name "${node}" --hostname "${node}" --privileged \
  --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
  --tmpfs /tmp --tmpfs /run --volume /var --volume /lib/modules:/lib/modules:ro \
  --detach --tty --init=false "${IMAGE}" >/dev/null
state=""
for _ in $(seq 60); do
  state=$(docker exec "${node}" systemctl is-system-running 2>/dev/null || true)
  [[ ${state} == running || ${state} == degraded ]] && break
  sleep 0.5
done
[[ ${state} == running ]] || fail "systemd is '${state}': $(docker exec "${node}" systemctl --failed --no-legend 2>&1)"
docker exec "${node}" systemctl is-active --quiet containerd || fail "containerd is not active"
[[ -s ${PAUSE} ]] || { echo "check-base-image: no ${PAUSE} (make cluster-up builds it)" >&2; exit 1; }
docker cp "${PAUSE}" "${node}:/var/pause.tar"
docker exec "${node}" ctr -n k8s.io images import /var/pause.tar >/dev/null || fail "ctr could not import the pause image"
image=$(docker exec "${node}" ctr -n k8s.io images ls -q | head -1)
docker exec "${node}" ctr -n k8s.io run -d --privileged "${image}" privileged >/dev/null || fail "a privileged container did not start"
docker exec "${node}" ctr -n k8s.io run -d "${image}" plain >/dev/null || fail "a plain container did not start"
# kind reads an image's ID through `crictl inspecti` (status.id).
id=$(docker exec "${node}" crictl inspecti "${image}" | jq -r .status.id) || fail "crictl inspecti ${image} failed"
[[ ${id} == sha256:* ]] || fail "crictl inspecti gave no image id: ${id}"
running=$(docker exec "${node}" ctr -n k8s.io tasks ls | grep -c RUNNING || true)
[[ ${running} == 2 ]] || fail "${running} of 2 containers running"
echo "check-base-image: ${IMAGE}: ok (systemd running, containerd $(docker exec "${node}" ctr version 2>/dev/null | awk '/Version/ {print $2; exit}'), privileged and plain containers run, crictl inspecti gives ${id:0:19}…)"
