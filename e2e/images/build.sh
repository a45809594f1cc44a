#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Builds an OCI image from one binary without Docker, saves it as an OCI
# archive and imports it into the local cluster's containerd.
#
#   e2e/images/build.sh NAME BINARY [EXTRA[:DEST]...]
#
#   NAME     image name: "headroom-operator" -> localhost/headroom-operator:dev,
#            "headroom-operator:v1" -> localhost/headroom-operator:v1, and a
#            name with a "/" is used as given (":dev" added if it has no tag).
#   BINARY   the entrypoint; goes to /usr/local/bin/<basename> with every shared
#            library ldd resolves for it (see mkrootfs.sh).
#   EXTRA    more files (SRC, or SRC:DEST inside the image); ELF files bring
#            their libraries too.
#
# Image: one layer, user 65532:65532, WORKDIR /home/nonroot, /tmp mode 1777
# (mount an emptyDir there and run with readOnlyRootFilesystem), entrypoint
# the binary. The layer tar is normalised (sorted, mtime SOURCE_DATE_EPOCH,
# numeric owners), so the same inputs give the same image digest.
#
# Output: $HEADROOM_CACHE/images/<name>_<tag>.oci.tar (an OCI image layout in a
# tar; `ctr images import`, `kind load image-archive`, `skopeo copy
# oci-archive:...` and `docker load` (Docker >= 25) all read it).
#
# Environment:
#   IMAGE_TAG=dev  IMAGE_REGISTRY=localhost  IMAGE_USER=65532:65532
#   IMAGE_ENV="K=V ..." more environment for the image (PATH is always set)
#   IMAGE_IMPORT=auto   auto: import if the cluster's containerd is up; 1: must; 0: never
#   IMAGE_FORCE=1       rebuild even if the archive matches the inputs
#   SOURCE_DATE_EPOCH   timestamps in the image (default 0)
#   CONTAINERD_SOCK     default: the cluster's ($HEADROOM_STATE/containerd/containerd.sock)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CLUSTER_LIB="${HERE}/../cluster/lib"
# shellcheck source=../cluster/lib/cluster-env.sh
source "${CLUSTER_LIB}/cluster-env.sh"
# shellcheck source=../cluster/lib/common.sh
source "${CLUSTER_LIB}/common.sh"
# shellcheck source=../cluster/lib/packages.sh
source "${CLUSTER_LIB}/packages.sh"

(($# >= 2)) || { sed -n '3,16p' "$0" >&2; exit 2; }
NAME=$1 BINARY=$2
shift 2
EXTRAS=("$@")

: "${IMAGE_TAG:=dev}"
: "${IMAGE_REGISTRY:=localhost}"
: "${IMAGE_USER:=65532:65532}"
: "${IMAGE_IMPORT:=auto}"
: "${IMAGE_FORCE:=0}"
: "${IMAGE_ENV:=}"
read -r -a IMAGE_ENV_LIST <<<"${IMAGE_ENV}"
for kv in "${IMAGE_ENV_LIST[@]}"; do
  [[ ${kv} =~ ^[A-Za-z_][A-Za-z0-9_]*=[^[:space:]]*$ ]] || die "IMAGE_ENV: '${kv}' is not KEY=VALUE"
done
: "${SOURCE_DATE_EPOCH:=0}"

# --- image reference ---------------------------------------------------------
image_ref() {
  local n=$1 last
  [[ ${n} == */* ]] || n="${IMAGE_REGISTRY}/${n}"
  last=${n##*/}
  [[ ${last} == *:* || ${last} == *@* ]] || n="${n}:${IMAGE_TAG}"
  printf '%s\n' "${n}"
}
REF=$(image_ref "${NAME}")
[[ ${REF} =~ ^[a-z0-9]([a-z0-9._/-]*[a-z0-9])?(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})$ ]] ||
  die "invalid image reference '${REF}' (lower-case name, optional :tag)"
REPO=${REF%:*} TAG=${REF##*:}
# localhost/headroom-operator:dev -> headroom-operator_dev.oci.tar
ARCHIVE="${HEADROOM_IMAGES_DIR}/${REPO##*/}_${TAG}.oci.tar"

[[ -f ${BINARY} && -x ${BINARY} ]] || die "${BINARY} is not an executable file"
ENTRY="/usr/local/bin/$(basename "${BINARY}")"

ensure_debs umoci jq
mkdir -p "${HEADROOM_IMAGES_DIR}"

# --- skip when nothing changed -----------------------------------------------
# Everything that decides the archive's bytes.
inputs_digest() {
  {
    printf 'ref=%s user=%s epoch=%s entry=%s env=%s\n' "${REF}" "${IMAGE_USER}" "${SOURCE_DATE_EPOCH}" "${ENTRY}" "${IMAGE_ENV}"
    sha256sum "${HERE}/build.sh" "${HERE}/mkrootfs.sh" | cut -d' ' -f1
    sha256sum "$(readlink -f "${BINARY}")" | cut -d' ' -f1
    ldd "${BINARY}" 2>/dev/null | awk '$3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' | xargs -r readlink -f | xargs -r sha256sum || true
    local e
    for e in "${EXTRAS[@]}"; do
      printf 'extra=%s ' "${e}"
      if [[ -d ${e%%:*} ]]; then tar -C "${e%%:*}" -cf - . | sha256sum; else sha256sum <"${e%%:*}"; fi
    done
  } | sha256sum | cut -d' ' -f1
}

import_image() {
  local out
  if [[ ${IMAGE_IMPORT} == 0 ]]; then return 0; fi
  if [[ ! -S ${CONTAINERD_SOCK} ]] || ! ctr --address "${CONTAINERD_SOCK}" version >/dev/null 2>&1; then
    [[ ${IMAGE_IMPORT} == 1 ]] && die "containerd at ${CONTAINERD_SOCK} is not running (e2e/cluster/cluster.sh up)"
    log "containerd at ${CONTAINERD_SOCK} is not running; not imported (cluster.sh up imports the archives it needs)"
    return 0
  fi
  local want have
  want=$(tar -xOf "${ARCHIVE}" index.json | jq -r '.manifests[0].digest')
  have=$(ctr --address "${CONTAINERD_SOCK}" -n k8s.io images ls "name==${REF}" | awk 'NR == 2 {print $3}')
  if [[ ${have} == "${want}" ]]; then
    log "${REF} already in containerd (${CONTAINERD_SOCK}) at ${want}"
    return 0
  fi
  # The k8s.io namespace is the one the CRI plugin (so the kubelet) sees;
  # import unpacks into the default (overlayfs) snapshotter.
  out=$(ctr --address "${CONTAINERD_SOCK}" -n k8s.io images import "${ARCHIVE}" 2>&1) ||
    die "ctr images import ${ARCHIVE} failed: ${out}"
  ctr --address "${CONTAINERD_SOCK}" -n k8s.io images ls "name==${REF}" | sed 1d | grep -q . ||
    die "import of ${ARCHIVE} did not create ${REF}: ${out}"
  log "imported ${REF} into containerd (${CONTAINERD_SOCK}, namespace k8s.io)"
}

T0=$(now)
DIGEST=$(inputs_digest)
STAMP="${ARCHIVE}.inputs"
if [[ ${IMAGE_FORCE} != 1 && -f ${ARCHIVE} && -f ${STAMP} && $(<"${STAMP}") == "${DIGEST}" ]]; then
  log "${REF}: ${ARCHIVE} is up to date"
  import_image
  printf '%s\n' "${REF}"
  exit 0
fi

# --- build ---------------------------------------------------------------------
WORK=$(mktemp -d "${HEADROOM_IMAGES_DIR}/.build.XXXXXX")
trap 'rm -rf "${WORK}"' EXIT
"${HERE}/mkrootfs.sh" "${WORK}/rootfs" "${BINARY}" "${EXTRAS[@]}"

# A normalised layer: same inputs -> same bytes -> same digest.
tar -C "${WORK}/rootfs" --sort=name --numeric-owner --mtime="@${SOURCE_DATE_EPOCH}" \
  --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
  -cf "${WORK}/layer.tar" .

CREATED=$(date -u -d "@${SOURCE_DATE_EPOCH}" +%Y-%m-%dT%H:%M:%SZ)
L="${WORK}/layout"
umoci init --layout "${L}"
umoci new --image "${L}:${TAG}"
umoci raw add-layer --image "${L}:${TAG}" \
  --history.created "${CREATED}" --history.created_by "e2e/images/build.sh $(basename "${BINARY}")" \
  "${WORK}/layer.tar"
env_args=()
for kv in "${IMAGE_ENV_LIST[@]}"; do env_args+=(--config.env "${kv}"); done
umoci config --image "${L}:${TAG}" --no-history \
  --created "${CREATED}" --author "headroom e2e/images/build.sh" \
  --architecture amd64 --os linux \
  --config.user "${IMAGE_USER}" \
  --config.workingdir /home/nonroot \
  --config.env PATH=/usr/local/bin:/usr/local/sbin:/usr/bin:/usr/sbin:/bin:/sbin \
  "${env_args[@]}" \
  --config.entrypoint "${ENTRY}" \
  --config.label "org.opencontainers.image.title=${REPO##*/}"
umoci gc --layout "${L}"

# Name the manifest with the full reference: containerd's importer keeps a
# full ref in org.opencontainers.image.ref.name as is (a bare tag would become
# "import-<date>:<tag>"), and io.containerd.image.name is what `docker load`
# and `ctr import` read first.
jq --arg ref "${REF}" \
  '.manifests |= map(.annotations = {"io.containerd.image.name": $ref, "org.opencontainers.image.ref.name": $ref})' \
  "${L}/index.json" >"${WORK}/index.json"
mv "${WORK}/index.json" "${L}/index.json"

chmod -R a+rX "${L}"
tar -C "${L}" --sort=name --numeric-owner --owner=0 --group=0 --mtime="@${SOURCE_DATE_EPOCH}" \
  -cf "${WORK}/image.oci.tar" oci-layout index.json blobs
mv -f "${WORK}/image.oci.tar" "${ARCHIVE}"
printf '%s\n' "${DIGEST}" >"${STAMP}"

MANIFEST=$(jq -r '.manifests[0].digest' "${L}/index.json")
log "${REF}: ${ARCHIVE} ($(du -h "${ARCHIVE}" | cut -f1), manifest ${MANIFEST}) built in $(($(now) - T0))s"
import_image
printf '%s\n' "${REF}"
