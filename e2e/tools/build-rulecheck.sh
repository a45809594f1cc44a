#!/usr/bin/env bash
# Builds rulecheck (e2e/tools/rulecheck: promtool's `check rules` and `test
# rules` on Prometheus' own packages, without promtool's service discoveries)
# into the Headroom cache, for chart-check's checks of the chart's
# PrometheusRule. The directory is named by a hash of go.mod, go.sum and the
# sources, so a change to any of them builds anew.
#   e2e/tools/build-rulecheck.sh            # prints nothing but the log; the binary is $HEADROOM_CACHE/tools/rulecheck-<hash>/rulecheck
#   e2e/tools/build-rulecheck.sh --print    # prints the binary's path (builds first if needed)
# Cold it took 195 s here on 2 busy cores (load 7-8): `cd e2e/tools/rulecheck
# && GOCACHE=<empty dir> GOMODCACHE=<empty dir> nice -n 19 go build`, the
# modules (142 MB of zips) from the proxy included; promtool takes 893 s.
set -euo pipefail
: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/rulecheck" && pwd)
hash=$(cd "${src}" && LC_ALL=C && cat go.mod go.sum ./*.go | sha256sum | cut -c1-16)
dir="${HEADROOM_CACHE}/tools/rulecheck-${hash}"
bin="${dir}/rulecheck"
if [[ ! -x ${bin} ]]; then
  mkdir -p "${dir}"
  echo "building rulecheck (Prometheus' rule checks) from e2e/tools/rulecheck" >&2
  # go.sum pins every module; -mod=readonly refuses to change it. No VCS
  # stamp: the binary is named by its sources' hash.
  (cd "${src}" && GOFLAGS="-mod=readonly -buildvcs=false" go build -trimpath -ldflags "-s -w" -o "${bin}.tmp" .) >&2
  mv "${bin}.tmp" "${bin}"
fi
if [[ ${1:-} == --print ]]; then
  echo "${bin}"
fi
