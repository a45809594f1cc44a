#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Builds the Kubernetes and etcd binaries the e2e harness runs, from source
# fetched through the Go module proxy (no release tarballs needed).
#
#   e2e/cluster/build-binaries.sh                 # default list (K8S_BINARIES) + etcd
#   e2e/cluster/build-binaries.sh kubelet kube-scheduler   # extra/other binaries
#   K8S_VERSION=latest e2e/cluster/build-binaries.sh       # newest v1.33.x on the proxy
#   FORCE=1 e2e/cluster/build-binaries.sh         # rebuild even if present
#
# Output: $HEADROOM_CACHE/k8s/$K8S_VERSION/bin/{kube-apiserver,kubectl,etcd,...}
#
# Why a throwaway module: k8s.io/kubernetes cannot be `go install`ed because its
# go.mod replaces the staging modules (k8s.io/api, k8s.io/client-go, ...) with
# ./staging/src paths that are not part of its module zip. We generate a module
# that requires k8s.io/kubernetes and replaces every staging module with its
# published v0.X.Y twin, then `go build` the cmd/ packages from there. etcd's
# server module has the same problem (relative replaces), same fix.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# Kubernetes components that can be built; each maps to k8s.io/kubernetes/cmd/<name>.
KNOWN_K8S_BINARIES="kube-apiserver kubectl kubelet kube-controller-manager kube-scheduler kube-proxy kubeadm"
# What gets built by default. Extend this (or pass names as arguments) when the
# harness grows into a full node.
: "${K8S_BINARIES:=kube-apiserver kube-controller-manager kubectl}"
: "${BUILD_ETCD:=1}"
: "${FORCE:=0}"
# Series used when K8S_VERSION=latest.
: "${K8S_SERIES:=v1.33}"

if [[ ${K8S_VERSION:-} == latest ]]; then
  # Newest non-prerelease patch of the series that the module proxy lists.
  K8S_VERSION=$(go list -m -versions k8s.io/kubernetes | tr ' ' '\n' |
    grep -E "^${K8S_SERIES//./\\.}\\.[0-9]+$" | sort -V | tail -n1)
  [[ -n ${K8S_VERSION} ]] || { echo "no ${K8S_SERIES}.x on the Go module proxy" >&2; exit 1; }
  export K8S_VERSION
fi

# shellcheck source=lib/common.sh
source "${HERE}/lib/common.sh"

# Harness tools built from this repo's e2e/cluster/tools/<name> (see below).
KNOWN_TOOLS="hr-cri hr-probe"
TOOLS=""
LPP=0
if (($#)); then K8S_BINARIES="$*"; fi
k8s_list=""
for b in ${K8S_BINARIES}; do
  if [[ ${b} == local-path-provisioner ]]; then
    LPP=1
    continue
  fi
  if [[ " ${KNOWN_TOOLS} " == *" ${b} "* ]]; then
    TOOLS+=" ${b}"
    continue
  fi
  [[ " ${KNOWN_K8S_BINARIES} " == *" ${b} "* ]] || die "unknown binary '${b}' (known: ${KNOWN_K8S_BINARIES} ${KNOWN_TOOLS} local-path-provisioner)"
  k8s_list+=" ${b}"
done
K8S_BINARIES=${k8s_list# }
TOOLS=${TOOLS# }

command -v go >/dev/null 2>&1 || die "go not found in PATH"

STAMP_DIR="${HEADROOM_BIN_DIR}/.stamps"
K8S_SRC="${K8S_CACHE_DIR}/src"
ETCD_SRC="${HEADROOM_CACHE}/etcd/${ETCD_VERSION}/src"
TIMINGS="${K8S_CACHE_DIR}/build-times.log"
mkdir -p "${HEADROOM_BIN_DIR}" "${STAMP_DIR}" "${K8S_SRC}"

# One build per version at a time (parallel test jobs may all call this).
exec 9>"${K8S_CACHE_DIR}/.build.lock"
flock 9 # no timeout: a concurrent cold build legitimately takes minutes

# Build settings mirrored from kubernetes' hack/lib/golang.sh: static
# (CGO_ENABLED=0 -- upstream builds kubelet with cgo, but nothing in it needs
# cgo and this box may have no C compiler) and tags selinux,notest.
export CGO_ENABLED=0
GO_TAGS="selinux,notest"

# Bump when the build flags below change, so existing binaries get rebuilt.
RECIPE_REV=2
# Recipe string for a binary (stored in bin/.stamps/NAME); rebuilt when it changes.
recipe() { printf '%s tags=%s rev=%s\n' "$1" "${GO_TAGS}" "${RECIPE_REV}"; }

up_to_date() {
  local name=$1 want=$2
  [[ ${FORCE} == 1 ]] && return 1
  [[ -x ${HEADROOM_BIN_DIR}/${name} && -f ${STAMP_DIR}/${name} ]] || return 1
  [[ $(<"${STAMP_DIR}/${name}") == "${want}" ]]
}

record_time() {
  local what=$1 secs=$2
  log "${what}: ${secs}s"
  printf '%s %s %ss (go %s, %s cpus)\n' "$(date -u +%FT%TZ)" "${what}" "${secs}" \
    "$(go env GOVERSION)" "$(nproc)" >>"${TIMINGS}"
}

# build_one NAME PKG LDFLAGS WORKDIR  -- go build into a temp file, then rename,
# so an interrupted build never leaves a half-written binary behind.
build_one() {
  local name=$1 pkg=$2 ldflags=$3 dir=$4 t0 tmp
  t0=$(now)
  tmp="${HEADROOM_BIN_DIR}/.${name}.tmp.$$"
  log "building ${name} (${pkg})"
  (cd "${dir}" && go build -trimpath -tags "${GO_TAGS}" -ldflags "${ldflags}" -o "${tmp}" "${pkg}")
  mv -f "${tmp}" "${HEADROOM_BIN_DIR}/${name}"
  record_time "build ${name}" $(($(now) - t0))
}

T_START=$(now)

# ---------------------------------------------------------------- kubernetes
todo=()
for b in ${K8S_BINARIES}; do
  if up_to_date "${b}" "$(recipe "k8s.io/kubernetes@${K8S_VERSION}")"; then
    log "${b} ${K8S_VERSION} already built, skipping"
  else
    todo+=("${b}")
  fi
done

if ((${#todo[@]})); then
  t0=$(now)
  log "preparing build module for k8s.io/kubernetes@${K8S_VERSION} in ${K8S_SRC}"
  dl=$(go mod download -json "k8s.io/kubernetes@${K8S_VERSION}")
  kmod=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p' <<<"${dl}")
  kinfo=$(sed -n 's/^[[:space:]]*"Info": "\(.*\)",$/\1/p' <<<"${dl}")
  [[ -f ${kmod} ]] || die "could not download k8s.io/kubernetes@${K8S_VERSION}: ${dl}"

  # Staging modules are published as v0.<minor>.<patch> for v1.<minor>.<patch>.
  staging_version="v0.${K8S_VERSION#v1.}"
  {
    echo "// Generated by e2e/cluster/build-binaries.sh; safe to delete."
    echo "module headroom.invalid/k8s-build"
    echo
    # Same language version and GODEBUG defaults as upstream's main module.
    grep -E '^go [0-9]' "${kmod}"
    awk '/^godebug \(/{b=1} b||/^godebug /{print} b&&/^\)/{b=0}' "${kmod}"
    echo
    echo "require k8s.io/kubernetes ${K8S_VERSION}"
    echo
    echo "replace ("
    # Lines look like:  k8s.io/api => ./staging/src/k8s.io/api
    sed -n "s#^[[:space:]]*\(k8s\.io/[^[:space:]]*\)[[:space:]]*=>[[:space:]]*\./staging/src/.*#\t\1 => \1 ${staging_version}#p" "${kmod}"
    echo ")"
  } >"${K8S_SRC}/go.mod.new"
  grep -q "k8s.io/api => k8s.io/api ${staging_version}" "${K8S_SRC}/go.mod.new" ||
    die "found no staging replace lines in ${kmod}"
  # Keep the existing go.mod/go.sum if nothing changed (saves re-resolving).
  if ! cmp -s "${K8S_SRC}/go.mod.new" "${K8S_SRC}/go.mod.gen" 2>/dev/null; then
    cp "${K8S_SRC}/go.mod.new" "${K8S_SRC}/go.mod"
    cp "${K8S_SRC}/go.mod.new" "${K8S_SRC}/go.mod.gen"
    rm -f "${K8S_SRC}/go.sum"
  fi
  rm -f "${K8S_SRC}/go.mod.new"

  pkgs=()
  for b in "${todo[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/${b}"); done
  # Downloads every module these packages need and fills go.sum.
  (cd "${K8S_SRC}" && go list -mod=mod -tags "${GO_TAGS}" -deps "${pkgs[@]}" >/dev/null)
  record_time "download k8s ${K8S_VERSION} modules" $(($(now) - t0))

  # Version stamping as in hack/lib/version.sh, so `--version` and the
  # apiserver's /version report the real release (kubectl's version-skew
  # check and the 1.33 compatibility-version logic read it). No git commit is
  # known when building from the proxy, so gitCommit keeps upstream's
  # placeholder and gitTreeState stays empty, as hack/lib/version.sh does
  # without a commit; buildDate is the tag's publication time, which keeps
  # rebuilds reproducible.
  minor=${K8S_VERSION#v1.}
  minor=${minor%%.*}
  build_date=$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "${kinfo}")
  [[ -n ${build_date} ]] || build_date=1970-01-01T00:00:00Z
  ldflags="-s -w"
  for p in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    ldflags+=" -X ${p}.gitVersion=${K8S_VERSION} -X ${p}.gitMajor=1 -X ${p}.gitMinor=${minor}"
    ldflags+=" -X ${p}.buildDate=${build_date}"
  done

  for b in "${todo[@]}"; do
    build_one "${b}" "k8s.io/kubernetes/cmd/${b}" "${ldflags}" "${K8S_SRC}"
    recipe "k8s.io/kubernetes@${K8S_VERSION}" >"${STAMP_DIR}/${b}"
  done
fi

# ---------------------------------------------------------------------- etcd
if [[ ${BUILD_ETCD} == 1 ]]; then
  if up_to_date etcd "$(recipe "go.etcd.io/etcd/server/v3@${ETCD_VERSION}")"; then
    log "etcd ${ETCD_VERSION} already built, skipping"
  else
    t0=$(now)
    mkdir -p "${ETCD_SRC}"
    dl=$(go mod download -json "go.etcd.io/etcd/server/v3@${ETCD_VERSION}")
    emod=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p' <<<"${dl}")
    [[ -f ${emod} ]] || die "could not download go.etcd.io/etcd/server/v3@${ETCD_VERSION}: ${dl}"
    # The server module's own require lines pin its sibling modules (api,
    # client, pkg, raft) to the same release, so no replaces are needed here.
    {
      echo "// Generated by e2e/cluster/build-binaries.sh; safe to delete."
      echo "module headroom.invalid/etcd-build"
      echo
      grep -E '^go [0-9]' "${emod}"
      echo
      echo "require go.etcd.io/etcd/server/v3 ${ETCD_VERSION}"
    } >"${ETCD_SRC}/go.mod.new"
    if ! cmp -s "${ETCD_SRC}/go.mod.new" "${ETCD_SRC}/go.mod.gen" 2>/dev/null; then
      cp "${ETCD_SRC}/go.mod.new" "${ETCD_SRC}/go.mod"
      cp "${ETCD_SRC}/go.mod.new" "${ETCD_SRC}/go.mod.gen"
      rm -f "${ETCD_SRC}/go.sum"
    fi
    rm -f "${ETCD_SRC}/go.mod.new"
    (cd "${ETCD_SRC}" && go list -mod=mod -deps go.etcd.io/etcd/server/v3 >/dev/null)
    record_time "download etcd ${ETCD_VERSION} modules" $(($(now) - t0))
    # etcd's own build script sets GitSHA; we only know the tag.
    build_one etcd go.etcd.io/etcd/server/v3 \
      "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=${ETCD_VERSION}" "${ETCD_SRC}"
    recipe "go.etcd.io/etcd/server/v3@${ETCD_VERSION}" >"${STAMP_DIR}/etcd"
  fi
fi

# --------------------------------------------------------------------- tools
# hr-cri (e2e/cluster/tools/hr-cri): a tiny CRI client used by cluster.sh to
# tear pods down through the CRI (crictl's module, sigs.k8s.io/cri-tools, is
# not served by the Go module proxy here). Built against the cri-api staging
# module of the pinned release. hr-probe: node-test.sh's workload (stdlib only).
for t in ${TOOLS}; do
  tool_src="${HERE}/tools/${t}"
  want="$(recipe "${t}@$(cat "${tool_src}"/*.go | sha256sum | cut -c1-16) cri-api@v0.${K8S_VERSION#v1.}")"
  if up_to_date "${t}" "${want}"; then
    log "${t} already built, skipping"
    continue
  fi
  tdir="${HEADROOM_CACHE}/tools/${t}/src"
  mkdir -p "${tdir}"
  cp "${tool_src}"/*.go "${tdir}/"
  printf '// Generated by e2e/cluster/build-binaries.sh; safe to delete.\nmodule headroom.invalid/%s\n\ngo 1.24.0\n\nrequire k8s.io/cri-api v0.%s\n' \
    "${t}" "${K8S_VERSION#v1.}" >"${tdir}/go.mod"
  rm -f "${tdir}/go.sum"
  (cd "${tdir}" && go mod tidy >&2)
  # hr-probe is the test workload: built with cgo so it links glibc
  # dynamically and its image exercises e2e/images/build.sh's ldd copying.
  if [[ ${t} == hr-probe ]]; then
    CGO_ENABLED=1 build_one "${t}" . "-s -w" "${tdir}"
  else
    build_one "${t}" . "-s -w" "${tdir}"
  fi
  printf '%s\n' "${want}" >"${STAMP_DIR}/${t}"
done

# local-path-provisioner: the module proxy's zip has no vendor/ tree, so the
# build resolves its go.sum-pinned dependencies through the proxy (-mod=mod).
if ((LPP)); then
  want="$(recipe "github.com/rancher/local-path-provisioner@${LPP_VERSION}")"
  if up_to_date local-path-provisioner "${want}"; then
    log "local-path-provisioner ${LPP_VERSION} already built, skipping"
  else
    dl=$(go mod download -json "github.com/rancher/local-path-provisioner@${LPP_VERSION}")
    lpp_dir=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"${dl}")
    [[ -d ${lpp_dir} ]] || die "could not download local-path-provisioner ${LPP_VERSION}: ${dl}"
    GOFLAGS=-mod=mod build_one local-path-provisioner . "-s -w -X main.VERSION=${LPP_VERSION}" "${lpp_dir}"
    printf '%s\n' "${want}" >"${STAMP_DIR}/local-path-provisioner"
  fi
  TOOLS+="${TOOLS:+ }local-path-provisioner"
fi

what="k8s ${K8S_VERSION}: ${K8S_BINARIES}${TOOLS:+; tools: ${TOOLS}}"
[[ ${BUILD_ETCD} == 1 ]] && what+="; etcd ${ETCD_VERSION}"
record_time "build-binaries.sh total (${what})" $(($(now) - T_START))

for b in ${K8S_BINARIES}; do
  case ${b} in
    kubectl) v=$("${HEADROOM_BIN_DIR}/kubectl" version --client 2>/dev/null | sed -n 1p) ;;
    *) v=$("${HEADROOM_BIN_DIR}/${b}" --version 2>/dev/null | sed -n 1p) ;;
  esac
  log "${HEADROOM_BIN_DIR}/${b}: ${v}"
done
if [[ ${BUILD_ETCD} == 1 ]]; then
  log "${HEADROOM_BIN_DIR}/etcd: $("${HEADROOM_BIN_DIR}/etcd" --version | sed -n 1p)"
fi
