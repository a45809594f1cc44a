# shellcheck shell=bash
# Debian packages a real node needs, installed once with apt-get.
#
# Checked with dpkg-query (not `command -v`), so a package whose binaries live
# outside PATH (containernetworking-plugins in /usr/lib/cni) is recognised.
# `apt-get update` runs once, and only when something is missing, so a warm
# machine never touches the network here.

# Everything cluster.sh and e2e/images/build.sh use.
# shellcheck disable=SC2034 # used by the files that source this one
NODE_PACKAGES=(
  containerd                  # 1.6 on Debian 12: CRI v1, overlayfs snapshotter, ships ctr
  runc
  containernetworking-plugins # bridge, host-local, loopback, portmap in /usr/lib/cni
  iptables                    # kube-proxy (iptables mode), kubelet, CNI ipMasq/portmap
  conntrack
  umoci                       # OCI image assembly without Docker
  jq
  gcc                         # the static pause binary
  libc6-dev
  openssl
  curl
  util-linux                  # flock, setsid, findmnt, nsenter
  iproute2
  busybox-static              # the volume helper pods' image (lib/storage.sh)
)

# packages_missing PKG...  -- prints the packages that are not installed.
packages_missing() {
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}\n' "${p}" 2>/dev/null | grep -q '^install ok installed$' || printf '%s\n' "${p}"
  done
}

# ensure_debs PKG...  -- apt-get install what is missing (update once first).
ensure_debs() {
  local missing sudo=() t0
  command -v dpkg-query >/dev/null 2>&1 || die "not a Debian/Ubuntu system: install $* by hand"
  mapfile -t missing < <(packages_missing "$@")
  ((${#missing[@]})) || return 0
  if ((EUID != 0)); then
    command -v sudo >/dev/null 2>&1 || die "missing ${missing[*]}; need root or sudo to apt-get install"
    sudo=(sudo)
  fi
  t0=$(now)
  log "installing ${missing[*]} with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  # No systemd here (and we run our own containerd): keep dpkg from trying to
  # start the packaged service. policy-rc.d is honoured by invoke-rc.d and
  # deb-systemd-invoke; it is removed again right after.
  local policy=/usr/sbin/policy-rc.d created_policy=0
  if [[ ! -e ${policy} ]]; then
    printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "${policy}" >/dev/null
    "${sudo[@]}" chmod 755 "${policy}"
    created_policy=1
  fi
  local rc=0
  "${sudo[@]}" apt-get update -qq >&2 || rc=$?
  if ((rc == 0)); then
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 || rc=$?
  fi
  ((created_policy)) && "${sudo[@]}" rm -f "${policy}"
  ((rc == 0)) || die "apt-get failed (exit ${rc}) installing ${missing[*]}"
  log "apt-get install took $(($(now) - t0))s"
}
