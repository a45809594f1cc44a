#!/usr/bin/env bash
# Builds promtool (Prometheus' rule checker) from its Go module into the
# Headroom cache (no binary downloads), for chart-check's
# `promtool check rules` / `promtool test rules` of the chart's PrometheusRule.
#   e2e/tools/build-promtool.sh            # prints nothing but the log; the binary is $HEADROOM_CACHE/tools/promtool-<version>/promtool
#   e2e/tools/build-promtool.sh --print    # prints the binary's path (builds first if needed)
# The Go module's version v0.3MM.P is Prometheus 3.MM.P.
set -euo pipefail
: "${PROMTOOL_VERSION:=v0.316.0}"
: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
dir="${HEADROOM_CACHE}/tools/promtool-${PROMTOOL_VERSION}"
bin="${dir}/promtool"
if [[ ! -x ${bin} ]]; then
  mkdir -p "${dir}"
  echo "building promtool ${PROMTOOL_VERSION} from the Go module proxy" >&2
  GOBIN="${dir}" GOFLAGS=-mod=mod go install -trimpath -ldflags "-s -w" \
    "github.com/prometheus/prometheus/cmd/promtool@${PROMTOOL_VERSION}" >&2
fi
if [[ ${1:-} == --print ]]; then
  echo "${bin}"
fi
