#!/usr/bin/env bash
# Mesa's lavapipe: a Vulkan 1.3 device (llvmpipe) that runs compute shaders
# on the CPU, for the wgpu worker's tests (`make worker-wgpu-test`,
# docs/gpu.md "The GPU path on lavapipe"). Debian's mesa-vulkan-drivers
# ships it with the Vulkan loader (libvulkan1); nothing else is needed.
# Idempotent: apt runs only when the package is missing (CI runs as root).
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive
packages=(mesa-vulkan-drivers libvulkan1)
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
  apt-get install -y --no-install-recommends "${packages[@]}" \
    || { apt-get update && apt-get install -y --no-install-recommends "${packages[@]}"; }
fi

icd=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json
[[ $(uname -m) == aarch64 ]] && icd=/usr/share/vulkan/icd.d/lvp_icd.aarch64.json
if [[ ! -f ${icd} ]]; then
  echo "no lavapipe ICD at ${icd} after installing ${packages[*]}" >&2
  exit 1
fi
echo "lavapipe: mesa-vulkan-drivers $(dpkg-query -W -f='${Version}' mesa-vulkan-drivers), ICD ${icd}"
