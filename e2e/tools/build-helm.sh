#!/usr/bin/env bash
# Builds helm from its Go module into the Headroom cache (no binary downloads).
#   e2e/tools/build-helm.sh            # prints nothing but the log; the binary is $HEADROOM_CACHE/tools/helm-<version>/helm
#   e2e/tools/build-helm.sh --print    # prints the binary's path (builds first if needed)
set -euo pipefail
: "${HELM_VERSION:=v3.22.0}"
: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
dir="${HEADROOM_CACHE}/tools/helm-${HELM_VERSION}"
bin="${dir}/helm"
if [[ ! -x ${bin} ]]; then
  mkdir -p "${dir}"
  echo "building helm ${HELM_VERSION} from the Go module proxy" >&2
  GOBIN="${dir}" GOFLAGS=-mod=mod go install -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION}" \
    "helm.sh/helm/v3/cmd/helm@${HELM_VERSION}" >&2
fi
if [[ ${1:-} == --print ]]; then
  echo "${bin}"
fi
