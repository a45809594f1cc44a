# syntax=docker/dockerfile:1
# headroom-worker-cuda: the worker built with burn's CUDA backend and NVML
# telemetry, for `backend: cuda` jobs (the operator's --cuda-worker-image;
# the chart's workerImages.cuda). The same contents as the Docker-free build:
#
#   make worker-cuda image-cuda
#
# Both build with Debian's LLVM 22 standing in for the LLVM 23 bundle cubecl
# would download (worker/cuda/install-build-deps.sh; docs/gpu.md says why and
# what that means), strip the debug info, and add libdevice from the pinned
# nvidia-cuda-nvcc-cu12 wheel (worker/cuda/fetch-runtime.sh) at
# /usr/local/cuda/nvvm/libdevice with CUDA_PATH=/usr/local/cuda. The CUDA
# driver (libcuda, libnvidia-ml) is not in the image: the NVIDIA container
# toolkit mounts the node's into the container
# (NVIDIA_DRIVER_CAPABILITIES=compute,utility: CUDA and NVML).
#
# Build from the repository root:
#   docker build -f e2e/images/worker-cuda.Dockerfile -t localhost/headroom-worker-cuda:dev .

ARG RUST_VERSION=1.95
FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
RUN apt-get update && apt-get install -y --no-install-recommends python3-pip binutils \
 && rm -rf /var/lib/apt/lists/*
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    HEADROOM_LLVM_SHIM_HOME=/opt/headroom/llvm-shim bash worker/cuda/install-build-deps.sh \
 && XDG_DATA_HOME=/opt/headroom/llvm-shim CUDARC_CUDA_VERSION=12080 \
    cargo build --release --locked -p headroom-worker --features cuda --bin headroom-worker \
 && objcopy --strip-debug target/release/headroom-worker /headroom-worker
RUN HEADROOM_CACHE=/cache bash worker/cuda/fetch-runtime.sh
RUN e2e/images/mkrootfs.sh /rootfs /headroom-worker \
      /cache/cuda-runtime/cuda-12.8/nvvm/libdevice/libdevice.10.bc:/usr/local/cuda/nvvm/libdevice/libdevice.10.bc \
      /cache/cuda-runtime/cuda-12.8/LICENSE:/usr/local/cuda/LICENSE.nvidia

FROM scratch
COPY --from=build /rootfs/ /
# COPY does not promise to keep the owner; the home directory is 65532's.
COPY --from=build --chown=65532:65532 /rootfs/home/nonroot /home/nonroot
USER 65532:65532
WORKDIR /home/nonroot
ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/bin:/usr/sbin:/bin:/sbin \
    CUDA_PATH=/usr/local/cuda \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
LABEL org.opencontainers.image.title=headroom-worker-cuda
ENTRYPOINT ["/usr/local/bin/headroom-worker"]
