#!/usr/bin/env bash
# Assembles a minimal root filesystem for one binary: the binary, the shared
# libraries it loads (as ldd resolves them, plus the ELF interpreter), a
# distroless-style /etc/passwd and /etc/group with the non-root user 65532,
# a world-writable /tmp, and any extra files.
#
#   e2e/images/mkrootfs.sh OUTDIR BINARY [EXTRA...]
#
# EXTRA is SRC or SRC:DEST. SRC alone is copied to the same absolute path.
# ELF extras get their libraries too. Run as root so ownership (65532 for
# /home/nonroot) is recorded; build.sh and the Dockerfiles both call this, so
# the image contents are the same either way.
#
# Environment:
#   ROOTFS_BIN_DIR     where BINARY goes (default /usr/local/bin)
#   ROOTFS_CA_CERTS    1 (default) copies /etc/ssl/certs/ca-certificates.crt if present
set -euo pipefail

usage() { echo "usage: $0 OUTDIR BINARY [EXTRA[:DEST]...]" >&2; exit 2; }
(($# >= 2)) || usage
OUT=$1 BIN=$2
shift 2
: "${ROOTFS_BIN_DIR:=/usr/local/bin}"
: "${ROOTFS_CA_CERTS:=1}"

[[ -f ${BIN} && -x ${BIN} ]] || { echo "mkrootfs: ${BIN} is not an executable file" >&2; exit 1; }
[[ -n ${OUT} && ${OUT} != / ]] || { echo "mkrootfs: refusing OUTDIR '${OUT}'" >&2; exit 1; }
rm -rf "${OUT}"
mkdir -p "${OUT}"
OUT=$(cd "${OUT}" && pwd)

is_elf() { [[ $(head -c4 "$1" 2>/dev/null | od -An -c | tr -d ' ') == '177ELF' ]]; }

# put SRC DEST  -- copy file content (symlinks followed), keep the mode.
put() {
  local src=$1 dest=$2
  mkdir -p "${OUT}$(dirname "${dest}")"
  cp -L --preserve=mode "${src}" "${OUT}${dest}"
}

# Mirror the host's merged-/usr symlinks (/lib -> usr/lib, ...) so library
# paths written as /lib/... and /usr/lib/... both resolve in the image.
for d in bin sbin lib lib64 lib32 libx32; do
  if [[ -L /${d} ]]; then
    ln -sfn "$(readlink "/${d}")" "${OUT}/${d}"
    mkdir -p "${OUT}/$(readlink -f "/${d}")"
  fi
done

# libs_of ELF  -- one absolute path per line: every library ldd resolves and the
# interpreter. Fails on "not found".
libs_of() {
  local out
  if ! out=$(ldd "$1" 2>&1); then
    # Static executables: ldd exits 1 with "not a dynamic executable".
    [[ ${out} == *"not a dynamic executable"* || ${out} == *"statically linked"* ]] && return 0
    echo "mkrootfs: ldd $1 failed: ${out}" >&2
    return 1
  fi
  if grep -q 'not found' <<<"${out}"; then
    echo "mkrootfs: unresolved libraries for $1:" >&2
    grep 'not found' <<<"${out}" >&2
    return 1
  fi
  # "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" and
  # "/lib64/ld-linux-x86-64.so.2 (0x...)"; skip linux-vdso (no file).
  awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' <<<"${out}"
}

# add_libs ELF  -- copy the libraries of ELF into the image, each at the
# canonical directory of the path ldd printed (so /lib/... lands in usr/lib
# on merged-/usr hosts, where /lib is a symlink in the image as well).
add_libs() {
  local lib dir
  while IFS= read -r lib; do
    [[ -n ${lib} ]] || continue
    dir=$(readlink -f "$(dirname "${lib}")")
    [[ -e ${OUT}${dir}/$(basename "${lib}") ]] && continue
    put "${lib}" "${dir}/$(basename "${lib}")"
  done < <(libs_of "$1")
}

name=$(basename "${BIN}")
put "${BIN}" "${ROOTFS_BIN_DIR}/${name}"
chmod 0755 "${OUT}${ROOTFS_BIN_DIR}/${name}"
if is_elf "${BIN}"; then add_libs "${BIN}"; fi

for extra in "$@"; do
  src=${extra%%:*}
  # SRC alone: its own name in its canonical directory (a symlink such as
  # xtables' libxt_MASQUERADE.so -> libxt_NAT.so keeps the name programs look for).
  if [[ ${extra} == *:* ]]; then dest=${extra#*:}; else dest=$(readlink -f "$(dirname "${src}")")/$(basename "${src}"); fi
  [[ ${dest} == /* ]] || { echo "mkrootfs: destination of ${extra} must be absolute" >&2; exit 1; }
  [[ -e ${src} ]] || { echo "mkrootfs: extra file ${src} does not exist" >&2; exit 1; }
  if [[ -d ${src} ]]; then
    mkdir -p "${OUT}${dest}"
    cp -a "${src}/." "${OUT}${dest}/"
  else
    put "${src}" "${dest}"
    if is_elf "${src}"; then add_libs "${src}"; fi
  fi
done

# Users as in distroless: root, nobody, and nonroot (65532), the one images run as.
mkdir -p "${OUT}/etc" "${OUT}/home/nonroot" "${OUT}/root" "${OUT}/tmp"
cat >"${OUT}/etc/passwd" <<'PASSWD'
root:x:0:0:root:/root:/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin
nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin
PASSWD
cat >"${OUT}/etc/group" <<'GROUP'
root:x:0:
nobody:x:65534:
nonroot:x:65532:
GROUP
# glibc >= 2.34 has the files/dns NSS modules built in; this just pins the order.
printf 'passwd: files\ngroup: files\nhosts: files dns\n' >"${OUT}/etc/nsswitch.conf"
if [[ ${ROOTFS_CA_CERTS} == 1 && -f /etc/ssl/certs/ca-certificates.crt ]]; then
  put /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
fi
chmod 1777 "${OUT}/tmp"
chmod 0700 "${OUT}/root"
chmod 0755 "${OUT}/home/nonroot"
chown 65532:65532 "${OUT}/home/nonroot" 2>/dev/null || echo "mkrootfs: not root, /home/nonroot stays owned by $(id -u)" >&2

# The loader inside the image must resolve everything from the image alone
# (no ld.so.cache there): ask it, without running the program.
if is_elf "${BIN}" && ldd "${BIN}" >/dev/null 2>&1; then
  interp=$(libs_of "${BIN}" | grep -m1 '/ld-linux' || true)
  if [[ -n ${interp} ]] && ((EUID == 0)); then
    if ! out=$(chroot "${OUT}" "${interp}" --list "${ROOTFS_BIN_DIR}/${name}" 2>&1) || grep -q 'not found' <<<"${out}"; then
      echo "mkrootfs: the image's loader cannot resolve ${name}:" >&2
      echo "${out}" >&2
      exit 1
    fi
  fi
fi
echo "mkrootfs: ${OUT}: $(find "${OUT}" -type f | wc -l) files, $(du -sh "${OUT}" | cut -f1)" >&2
