#!/usr/bin/env bash
# `make gpu-check`: validates the CUDA worker on this machine's NVIDIA GPU and
# prints the figures docs/gpu.md asks for. Needs no network and no
# Rust toolchain: only the CUDA build's calibrate binary (which contains the
# worker: it runs each case as `calibrate --worker`, the production code
# path) and libdevice, either
#   - from a build here: $CARGO_TARGET_DIR/cuda/calibrate (make worker-cuda)
#     and $HEADROOM_CACHE/cuda-runtime/cuda-12.8 (worker/cuda/fetch-runtime.sh), or
#   - from gpu-bundle/ in the working tree (make gpu-bundle on the build
#     machine: calibrate.xz + libdevice, under 64 MiB, to carry to a GPU
#     machine that receives only the working tree and a few build outputs).
#
#   worker/cuda/gpu-check.sh [calibrate options]   e.g. --quick (under 4 min), --only B, --only 'T b8$|B b4', --large, --steps 5,
#                                                  --autotune minimal (instead of the plan's level, in every process)
#
# Every process of one run shares cubecl's autotune results and compiled
# kernels ($HEADROOM_GPU_CACHE_DIR, else $TMPDIR/headroom-gpu-runtime), as a
# job's workers do on its checkpoint volume: the first process to meet a
# shape tunes it (the speed rows print that first step's time).
#
# What it runs (calibrate --backend cuda, worker/src/bin/calibrate/gpu.rs):
#   1. a bf16 smoke run: 5 training steps on GPU 0, NVML used/total and the
#      allocator's in-use/reserved bytes as the worker's probe reads them;
#   2. the lean ops (blocked attention, chunked cross-entropy, the NF4 LoRA
#      linear) against the naive ones on the GPU in fp32 and bf16, values
#      and gradients, both against the f32 reference on the CPU;
#   2b. the checkpoint load on the device: a dense and an nf4 bf16 stage of a
#      model whose largest tensor (a 128,256-token embedding) dwarfs its
#      blocks, each loaded in a child; cubecl's live and reserved bytes
#      beyond the weights against the planner's load term (the largest
#      tensor's upload, one dense block): what the CPU cannot measure;
#   3. the calibration grid: bf16 Llama models (110M-1.1B, s up to 8192; 3B
#      with --large) planned by the real planner for this GPU, each a worker
#      process; the planner's CUDA prediction against the measured device
#      peak, in the table format of docs/benchmarks.md; on a machine with
#      two GPUs or more, also TinyLlama as 2 ZeRO-1 replicas (NCCL) and its
#      nf4 QLoRA as 2 pipeline stages, one worker process per GPU
#      (CUDA_VISIBLE_DEVICES, PCI bus order), each worker's peak against its
#      stage's figure;
#   4. speed: TinyLlama-1.1B full fine-tunes at s 2048 (tokens/s, MFU), then
#      tokens/s and the telemetry overhead of a GPT 12 x 768 (one sample's
#      cost with NVML; the step time with and without the reporter thread).
# The output is also written to gpu-check.md in the current directory (or
# $GPU_CHECK_OUT).
#
# Exit: 0 targets met; 1 a step failed or the targets were missed (the CUDA
# profile needs calibrating: operator/planner/src/backend.rs); 2 nothing to
# run here (no NVIDIA GPU, or no CUDA build), with the reason.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
: "${CARGO_TARGET_DIR:=${HEADROOM_CACHE}/target}"
: "${GPU_CHECK_OUT:=gpu-check.md}"
BUNDLE="${ROOT}/gpu-bundle"

say() { printf 'gpu-check: %s\n' "$*" >&2; }

# --- a GPU? -------------------------------------------------------------------
if ! ls /dev/nvidia[0-9]* >/dev/null 2>&1 && ! command -v nvidia-smi >/dev/null 2>&1; then
  say "no NVIDIA GPU on this machine (no /dev/nvidia0, no nvidia-smi): nothing to check."
  say "Run it on a machine with an NVIDIA GPU and its driver; bring the CUDA build with"
  say "'make gpu-bundle' (here) and the working tree with gpu-bundle/ (there). docs/gpu.md."
  exit 2
fi
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >&2 || true

# --- the CUDA build -------------------------------------------------------------
work=$(mktemp -d)
trap 'rm -rf "${work}"' EXIT
if [[ -x ${CARGO_TARGET_DIR}/cuda/calibrate ]]; then
  calibrate=${CARGO_TARGET_DIR}/cuda/calibrate
elif [[ -s ${BUNDLE}/calibrate.xz ]]; then
  (cd "${BUNDLE}" && sha256sum -c --quiet SHA256SUMS) || { say "gpu-bundle/ does not match its SHA256SUMS"; exit 1; }
  calibrate=${work}/calibrate
  if command -v xz >/dev/null 2>&1; then
    xz -dc "${BUNDLE}/calibrate.xz" >"${calibrate}"
  else # a bare GPU machine may lack xz; Python's lzma reads it too
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' \
      "${BUNDLE}/calibrate.xz" >"${calibrate}"
  fi
  chmod +x "${calibrate}"
  # Built on Debian 12: libstdc++, libzstd, libz from the bundle where this machine lacks them.
  if ldd "${calibrate}" 2>/dev/null | grep -q "not found"; then
    export LD_LIBRARY_PATH=${BUNDLE}/lib${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}
  fi
else
  say "no CUDA build: neither ${CARGO_TARGET_DIR}/cuda/calibrate (make worker-cuda) nor gpu-bundle/calibrate.xz (make gpu-bundle)."
  exit 2
fi

# --- libdevice (CUDA_PATH) ---------------------------------------------------------
if [[ -n ${CUDA_PATH:-} && -s ${CUDA_PATH}/nvvm/libdevice/libdevice.10.bc ]]; then
  :
elif [[ -s ${BUNDLE}/cuda/nvvm/libdevice/libdevice.10.bc ]]; then
  export CUDA_PATH=${BUNDLE}/cuda
elif [[ -s ${HEADROOM_CACHE}/cuda-runtime/cuda-12.8/nvvm/libdevice/libdevice.10.bc ]]; then
  export CUDA_PATH=${HEADROOM_CACHE}/cuda-runtime/cuda-12.8
elif [[ -s /usr/local/cuda/nvvm/libdevice/libdevice.10.bc ]]; then
  export CUDA_PATH=/usr/local/cuda
else
  say "no libdevice.10.bc (worker/cuda/fetch-runtime.sh, or a CUDA toolkit at CUDA_PATH): kernels with math functions would not compile."
  exit 2
fi
say "calibrate: ${calibrate}; CUDA_PATH=${CUDA_PATH}; output: ${GPU_CHECK_OUT}"

set +e
"${calibrate}" --backend cuda "$@" | tee "${GPU_CHECK_OUT}"
rc=${PIPESTATUS[0]}
set -e
case ${rc} in
  0) say "targets met" ;;
  1) say "a step failed or the CUDA profile missed its targets (see above and docs/gpu.md)" ;;
  2) say "could not run on this machine (see above)" ;;
  *) say "calibrate exited ${rc}" ;;
esac
exit "${rc}"
