#!/usr/bin/env bash
# The CUDA pieces the worker needs at run time besides the driver, from PyPI
# (the only place they are reachable from here), into a CUDA_PATH-shaped
# directory:
#
#   $HEADROOM_CACHE/cuda-runtime/cuda-12.8/nvvm/libdevice/libdevice.10.bc
#   $HEADROOM_CACHE/cuda-runtime/cuda-12.8/LICENSE (NVIDIA's, from the wheel)
#   $HEADROOM_CACHE/cuda-runtime/cuda-12.8/lib64/libnccl.so.2 and LICENSE.nccl
#     (nvidia-nccl-cu12, the NCCL build PyTorch's CUDA 12.8 wheels pin)
#
# Why only libdevice: burn 0.22's CUDA backend (cubecl-cuda 0.11) compiles
# kernels through LLVM's NVPTX target by default (cubecl-cuda src/compiler.rs:
# `CudaBackend::Llvm` unless the `cpp` feature is on) and the driver JIT-loads
# the PTX, so neither NVRTC nor nvcc nor the CUDA headers are used. Kernels
# that call a math function NVPTX has no instruction for link NVIDIA's
# libdevice bitcode, which cubecl-llvm looks for at
# $CUDA_PATH/nvvm/libdevice/libdevice.10.bc (src/nvptx/libdevice.rs).
# libcuda and libnvidia-ml come from the node's driver (the NVIDIA container
# toolkit mounts them into the container). NCCL is for data-parallel
# replicas (worker/src/collective/nccl.rs): no driver or toolkit ships it, so
# the image carries it; cudarc opens it by the name libnccl.so, which the
# image gives it (Makefile image-cuda).
#
# Prints the directory. Idempotent; the wheel is checked against a pinned
# sha256.
set -euo pipefail

: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
WHEEL_VERSION=12.8.93
WHEEL=nvidia_cuda_nvcc_cu12-${WHEEL_VERSION}-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl
WHEEL_SHA256=2d6dc36fb7cb5ac9c0b8825bc13d193c35487a315664007287d0126531238011
OUT="${HEADROOM_CACHE}/cuda-runtime/cuda-12.8"
LIBDEVICE="${OUT}/nvvm/libdevice/libdevice.10.bc"
NCCL_VERSION=2.26.2
NCCL_WHEEL=nvidia_nccl_cu12-${NCCL_VERSION}-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
NCCL_SHA256=694cf3879a206553cc9d7dbda76b13efaf610fdb70a50cba303de1b0d1530ac6
NCCL="${OUT}/lib64/libnccl.so.2"

if [[ -s ${LIBDEVICE} && -s ${OUT}/LICENSE && -s ${NCCL} && -s ${OUT}/LICENSE.nccl ]]; then
  printf '%s\n' "${OUT}"
  exit 0
fi

wheels="${HEADROOM_CACHE}/wheels"
mkdir -p "${wheels}"
if ! echo "${NCCL_SHA256}  ${wheels}/${NCCL_WHEEL}" | sha256sum -c --quiet >/dev/null 2>&1; then
  command -v python3 >/dev/null || { echo "fetch-runtime: python3 with pip is needed to download ${NCCL_WHEEL} from PyPI" >&2; exit 1; }
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux2014_x86_64 --python-version 3.11 \
    "nvidia-nccl-cu12==${NCCL_VERSION}" -d "${wheels}" >&2
  echo "${NCCL_SHA256}  ${wheels}/${NCCL_WHEEL}" | sha256sum -c --quiet ||
    { echo "fetch-runtime: ${NCCL_WHEEL} does not match its pinned sha256" >&2; exit 1; }
fi
if ! echo "${WHEEL_SHA256}  ${wheels}/${WHEEL}" | sha256sum -c --quiet >/dev/null 2>&1; then
  command -v python3 >/dev/null || { echo "fetch-runtime: python3 with pip is needed to download ${WHEEL} from PyPI" >&2; exit 1; }
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux2014_x86_64 --python-version 3.11 \
    "nvidia-cuda-nvcc-cu12==${WHEEL_VERSION}" -d "${wheels}" >&2
  echo "${WHEEL_SHA256}  ${wheels}/${WHEEL}" | sha256sum -c --quiet ||
    { echo "fetch-runtime: ${WHEEL} does not match its pinned sha256" >&2; exit 1; }
fi

tmp=$(mktemp -d)
trap 'rm -rf "${tmp}"' EXIT
python3 - "${wheels}/${WHEEL}" "${tmp}" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    z.extract("nvidia/cuda_nvcc/nvvm/libdevice/libdevice.10.bc", out)
    lic = [n for n in z.namelist() if n.endswith(".dist-info/License.txt")][0]
    z.extract(lic, out)
    open(out + "/license-path", "w").write(lic)
PY
python3 - "${wheels}/${NCCL_WHEEL}" "${tmp}" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    z.extract("nvidia/nccl/lib/libnccl.so.2", out)
    lic = [n for n in z.namelist() if n.endswith(".dist-info/License.txt")][0]
    z.extract(lic, out)
    open(out + "/nccl-license-path", "w").write(lic)
PY
mkdir -p "${OUT}/lib64"
install -m 0755 "${tmp}/nvidia/nccl/lib/libnccl.so.2" "${NCCL}"
install -m 0644 "${tmp}/$(cat "${tmp}/nccl-license-path")" "${OUT}/LICENSE.nccl"
mkdir -p "${OUT}/nvvm/libdevice"
install -m 0644 "${tmp}/nvidia/cuda_nvcc/nvvm/libdevice/libdevice.10.bc" "${LIBDEVICE}"
install -m 0644 "${tmp}/$(cat "${tmp}/license-path")" "${OUT}/LICENSE"
printf '%s\n' "${OUT}"
