#!/usr/bin/env bash
# Checks the CUDA worker image archive `make image-cuda` wrote: what a GPU
# node needs from it is there (run by make image-cuda).
#
#   worker/cuda/check-image.sh ARCHIVE LIBDEVICE NCCL
#
# - config: user 65532, entrypoint /usr/local/bin/headroom-worker,
#   CUDA_PATH=/usr/local/cuda, NVIDIA_DRIVER_CAPABILITIES=compute,utility,
#   LD_LIBRARY_PATH=/usr/local/cuda/lib64;
# - layer: the worker and libdevice (the same bytes as LIBDEVICE) at the paths
#   cubecl-llvm reads, NCCL (the same bytes as NCCL) as
#   /usr/local/cuda/lib64/libnccl.so, the name cudarc opens; no CUDA driver
#   library (the node's is mounted);
# - the worker from the layer starts and, with no plan, exits 78.
set -euo pipefail
ARCHIVE=$1 LIBDEVICE=$2 NCCL=$3
fail() { echo "check-image: ${ARCHIVE}: $*" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "${work}"' EXIT
tar -C "${work}" -xf "${ARCHIVE}"
blob() { printf '%s/blobs/sha256/%s' "${work}" "${1#sha256:}"; }
manifest=$(blob "$(jq -r '.manifests[0].digest' "${work}/index.json")")
config=$(blob "$(jq -r '.config.digest' "${manifest}")")
[[ $(jq -r '.config.User' "${config}") == 65532:65532 ]] || fail "user is not 65532:65532"
[[ $(jq -r '.config.Entrypoint[0]' "${config}") == /usr/local/bin/headroom-worker ]] || fail "entrypoint"
for kv in CUDA_PATH=/usr/local/cuda NVIDIA_DRIVER_CAPABILITIES=compute,utility LD_LIBRARY_PATH=/usr/local/cuda/lib64; do
  jq -e --arg kv "${kv}" '.config.Env | index($kv)' "${config}" >/dev/null || fail "Env lacks ${kv}"
done
layer=$(blob "$(jq -r '.layers[0].digest' "${manifest}")")
mkdir "${work}/rootfs"
tar -C "${work}/rootfs" -xf "${layer}"
cmp -s "${work}/rootfs/usr/local/cuda/nvvm/libdevice/libdevice.10.bc" "${LIBDEVICE}" ||
  fail "no libdevice at /usr/local/cuda/nvvm/libdevice/libdevice.10.bc"
cmp -s "${work}/rootfs/usr/local/cuda/lib64/libnccl.so" "${NCCL}" ||
  fail "no NCCL at /usr/local/cuda/lib64/libnccl.so"
# NCCL loads and answers without a GPU (ncclGetVersion touches no device).
nccl_version=$(python3 - "${work}/rootfs/usr/local/cuda/lib64/libnccl.so" <<'PY'
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
version = ctypes.c_int()
rc = lib.ncclGetVersion(ctypes.byref(version))
if rc:
    sys.exit(f"ncclGetVersion returned {rc}")
print(version.value)
PY
) || fail "libnccl.so does not load or answer ncclGetVersion"
if find "${work}/rootfs" -name 'libcuda.so*' -o -name 'libnvidia-ml.so*' | grep -q .; then
  fail "carries a driver library; the node's must be used"
fi
rc=0
"${work}/rootfs/usr/local/bin/headroom-worker" >/dev/null 2>&1 || rc=$?
[[ ${rc} == 78 ]] || fail "the worker without a plan exited ${rc}, expected 78"
echo "check-image: ${ARCHIVE}: ok ($(du -h "${ARCHIVE}" | cut -f1); worker $(du -h "${work}/rootfs/usr/local/bin/headroom-worker" | cut -f1); NCCL ${nccl_version})"
