#!/usr/bin/env bash
# Mesa's lavapipe: a Vulkan 1.3 device (llvmpipe) that runs compute shaders
# on the CPU, for the wgpu worker's tests (`make worker-wgpu-test`,
# docs/gpu.md "The GPU path on lavapipe"). Debian's mesa-vulkan-drivers
# ships it, with the Vulkan loader (libvulkan1); nothing else is needed.
#
# Mesa 25 at least: Debian 12's own Mesa (22.3.6, LLVM 15) miscompiles the
# tests' kernels (a wrong sum, LoRA drift) and crashes on SPIR-V. On Debian
# 12 (bookworm) it comes from bookworm-backports, added as a deb822 source
# signed by the same keyring as the default sources; on trixie and later
# the default suite's Mesa is new enough.
#
# Idempotent: apt runs only when lavapipe is missing or older than wanted
# (CI runs as root). Prints the version installed.
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive
wanted=25 # Mesa's major version, at least
packages=(mesa-vulkan-drivers libvulkan1)

installed() {
  dpkg-query -W -f='${db:Status-Abbrev} ${Version}\n' mesa-vulkan-drivers 2>/dev/null \
    | awk '$1 == "ii" { print $2 }'
}

recent_enough() {
  local version
  version=$(installed)
  [[ -n ${version} ]] && dpkg --compare-versions "${version}" ge "${wanted}" \
    && dpkg -s libvulkan1 >/dev/null 2>&1
}

if ! recent_enough; then
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  target=()
  if [[ ${codename} == bookworm ]]; then
    # The mirror and keyring of the default sources (deb822 since Debian
    # 12's images; the classic sources.list otherwise), bookworm-backports
    # beside them.
    mirror=http://deb.debian.org/debian
    keyring=/usr/share/keyrings/debian-archive-keyring.gpg
    if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
      uri=$(awk '/^URIs:/ { for (i = 2; i <= NF; i++) if ($i !~ /security/) { print $i; exit } }' \
        /etc/apt/sources.list.d/debian.sources)
      key=$(awk '/^Signed-By:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources)
      [[ -n ${uri} ]] && mirror=${uri}
      [[ -n ${key} && -f ${key} ]] && keyring=${key}
    fi
    backports=/etc/apt/sources.list.d/bookworm-backports.sources
    source="Types: deb
URIs: ${mirror}
Suites: bookworm-backports
Components: main
Signed-By: ${keyring}"
    if [[ ! -f ${backports} ]] || [[ $(cat "${backports}") != "${source}" ]]; then
      printf '%s\n' "${source}" >"${backports}"
      apt-get update
    fi
    target=(-t bookworm-backports)
  fi
  apt-get install -y --no-install-recommends "${target[@]}" "${packages[@]}" \
    || { apt-get update && apt-get install -y --no-install-recommends "${target[@]}" "${packages[@]}"; }
  if ! recent_enough; then
    echo "mesa-vulkan-drivers $(installed) is older than Mesa ${wanted} on ${codename:-this system}" >&2
    exit 1
  fi
fi

# Mesa 25 names its ICD files without the architecture (lvp_icd.json, a
# bare library name the loader finds on the multiarch path); Mesa 22 had
# lvp_icd.$(uname -m).json. The Makefile's WGPU_ENV picks the same one.
icd=
for candidate in /usr/share/vulkan/icd.d/lvp_icd.json "/usr/share/vulkan/icd.d/lvp_icd.$(uname -m).json"; do
  if [[ -f ${candidate} ]]; then
    icd=${candidate}
    break
  fi
done
if [[ -z ${icd} ]]; then
  echo "no lavapipe ICD in /usr/share/vulkan/icd.d after installing ${packages[*]}" >&2
  exit 1
fi
echo "lavapipe: mesa-vulkan-drivers $(installed), ICD ${icd}"
