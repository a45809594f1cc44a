#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# `make bench-first-fit`: does the planner's first plan fit, on real pods?
# (the grid and what is reported: e2e/src/bin/bench-first-fit.rs).
#
#   e2e/bench-first-fit.sh [--jobs N] [--parallel P] [--steps S] [--dry-run]
#
# With KUBECONFIG unset it uses the local single-node cluster (root), started
# if it is not up and left running; Headroom is (re)installed by
# e2e/install.sh. --dry-run prints the grid and its plans, offline.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "${ROOT}"
: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
: "${CARGO_TARGET_DIR:=${HEADROOM_CACHE}/target}"
export HEADROOM_CACHE CARGO_TARGET_DIR

cargo build --release -q -p headroom-e2e --bin bench-first-fit
if [[ " $* " != *" --dry-run "* ]]; then
  env=$(e2e/install.sh)
  eval "${env}"
fi
exec "${CARGO_TARGET_DIR}/release/bench-first-fit" "$@"
