#!/usr/bin/env bash
# kind's base image, built here without a registry or kind's Dockerfile
# (which downloads containerd, runc, crictl and the CNI plugins from release
# pages): a Debian bookworm rootfs from debootstrap with the packages kind's
# images/base/Dockerfile installs plus Debian's containerd 1.6, runc and CNI
# plugins, kind's own files (entrypoint, units, /kind/bin, from the kind Go
# module), the same systemd trimming, imported with `docker import`.
#
#   e2e/kind/base-image.sh        prints the image name (built once, cached)
#
# Needs root (debootstrap, chroot), go (the kind module), a Docker daemon
# (e2e/kind/dockerd.sh up). Environment: HEADROOM_CACHE, KIND_VERSION.
set -euo pipefail
: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
: "${KIND_VERSION:=v0.33.0}"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# K8S_VERSION, HEADROOM_BIN_DIR (where e2e/cluster/build-binaries.sh puts binaries).
# shellcheck source=../cluster/lib/common.sh
source "${HERE}/../cluster/lib/common.sh"
SUITE=bookworm
# kind's package list (images/base/Dockerfile) less nfs-common, open-iscsi and
# fuse-overlayfs (rootless and storage extras), plus what kind builds itself.
PACKAGES=systemd,systemd-sysv,dbus,conntrack,iptables,nftables,iproute2,ethtool,util-linux,mount,kmod,libseccomp2,pigz,e2fsprogs,bash,ca-certificates,curl,jq,procps,containerd,runc,containernetworking-plugins
# crictl: kind runs `crictl inspecti` and `crictl images` on its nodes, and
# cri-tools is not served by the Go module proxy; the project's CRI client
# answers those (e2e/cluster/tools/hr-cri).
"${HERE}/../cluster/build-binaries.sh" hr-cri >/dev/null 2>&1 ||
  { echo "base-image: building hr-cri failed (e2e/cluster/build-binaries.sh hr-cri)" >&2; exit 1; }
CRICTL="${HEADROOM_BIN_DIR}/hr-cri"
tag=$(printf '%s\n' "${KIND_VERSION}" "${SUITE}" "${PACKAGES}" | cat - "$0" "${CRICTL}" | sha256sum | cut -c1-12)
IMAGE="localhost/kind-base:${SUITE}-${tag}"
if docker image inspect "${IMAGE}" >/dev/null 2>&1; then
  printf '%s\n' "${IMAGE}"
  exit 0
fi

# shellcheck source=../cluster/lib/packages.sh
source "${HERE}/../cluster/lib/packages.sh"
ensure_debs debootstrap jq
files=$(cd /tmp && go mod download -json "sigs.k8s.io/kind@${KIND_VERSION}" | jq -r .Dir)/images/base/files
[[ -d ${files} ]] || { echo "base-image: no images/base/files in the kind module (${files})" >&2; exit 1; }
work="${HEADROOM_CACHE}/kind/base-build"
rm -rf "${work}"
mkdir -p "${work}"
trap 'rm -rf "${work}"' EXIT
root="${work}/rootfs"
echo "base-image: debootstrap ${SUITE} (minbase + ${PACKAGES//,/ })" >&2
debootstrap --variant=minbase --include="${PACKAGES}" "${SUITE}" "${root}" http://deb.debian.org/debian >"${work}/debootstrap.log" 2>&1 ||
  { tail -20 "${work}/debootstrap.log" >&2; exit 1; }

# kind's files, modes as its Dockerfile sets them.
install -d -m 0755 "${root}/kind" "${root}/kind/bin" "${root}/etc/kubernetes/manifests"
cp -r "${files}/kind/." "${root}/kind/"
cp -r "${files}/etc/." "${root}/etc/"
install -m 0755 "${files}/usr/local/bin/"* "${root}/usr/local/bin/"
chmod 0755 "${root}"/kind/bin/*
# This VM drops CAP_SYS_RESOURCE from every bounding set, so no process may
# lower an OOM score: kind's containerd config asks for the pod sandboxes'
# -998 (restrict_oom_score_adj = false) and runc init dies ("can't get final
# child's PID from pipe"). Restricted, containerd clamps the score to its own
# (what the local cluster's containerd does, e2e/cluster/lib/containerd.sh).
sed -i 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' "${root}/etc/containerd/config.toml"
grep -q 'restrict_oom_score_adj = true' "${root}/etc/containerd/config.toml" ||
  { echo "base-image: kind's containerd config no longer sets restrict_oom_score_adj" >&2; exit 1; }
# On a cgroup v1 host with cgroupns, the entrypoint leaves the kubelet's
# cgroup to systemd, which creates kubelet.slice only under the controllers
# it manages; the kubelet refuses to start while hugetlb (and any other v1
# controller) lacks it.
cat >"${root}/etc/systemd/system/kubelet.service.d/12-headroom-cgroup-v1.conf" <<'UNIT'
[Service]
ExecStartPre=/bin/sh -c "[ -f /sys/fs/cgroup/cgroup.controllers ] || for d in /sys/fs/cgroup/*/; do [ -L \"$${d%%/}\" ] || mkdir -p \"$${d}kubelet.slice\" \"$${d}kubelet\" 2>/dev/null || true; done"
UNIT
# Where kind's units and scripts expect Debian's binaries.
ln -sf /usr/bin/containerd "${root}/usr/local/bin/containerd"
ln -sf /usr/bin/ctr "${root}/usr/local/bin/ctr"
ln -sf /usr/bin/containerd-shim-runc-v2 "${root}/usr/local/bin/containerd-shim-runc-v2"
install -d "${root}/usr/local/sbin" "${root}/opt/cni"
ln -sf /usr/sbin/runc "${root}/usr/local/sbin/runc"
ln -sfn /usr/lib/cni "${root}/opt/cni/bin"
install -m 0755 "${CRICTL}" "${root}/usr/local/bin/crictl"
# The base runtime spec kind's containerd config names (its Dockerfile: ctr oci spec | jq).
chroot "${root}" ctr oci spec |
  jq '.hooks.createContainer[.hooks.createContainer | length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' |
  jq 'del(.process.rlimits)' >"${root}/etc/containerd/cri-base.json"

# The same trimming as kind's Dockerfile: nothing starts but what kind enables.
chroot "${root}" sh -ec '
  find /lib/systemd/system/sysinit.target.wants/ -name "systemd-tmpfiles-setup.service" -delete
  rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/*
  rm -f /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/basic.target.wants/*
  rm -f /lib/systemd/system/sockets.target.wants/*udev* /lib/systemd/system/sockets.target.wants/*initctl*
  echo "ReadKMsg=no" >> /etc/systemd/journald.conf
  ln -sf /usr/lib/systemd/systemd /sbin/init
  systemctl enable kubelet.service containerd.service undo-mount-hacks.service
  systemctl mask systemd-binfmt.service
  apt-get clean
  rm -rf /var/lib/apt/lists/* /var/cache/debconf/*-old /var/log/*.log
'

echo "base-image: docker import ${IMAGE}" >&2
tar -C "${root}" --numeric-owner -c . | docker import \
  --change 'ENV container=docker' \
  --change 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' \
  - "${IMAGE}-rootfs" >/dev/null
# docker import takes no STOPSIGNAL; systemd stops cleanly on SIGRTMIN+3.
printf 'FROM %s\nSTOPSIGNAL SIGRTMIN+3\n' "${IMAGE}-rootfs" | DOCKER_BUILDKIT=0 docker build -q -t "${IMAGE}" - >/dev/null
docker rmi "${IMAGE}-rootfs" >/dev/null
printf '%s\n' "${IMAGE}"
