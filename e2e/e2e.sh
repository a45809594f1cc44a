#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# `make e2e`: the end-to-end suite (every test target of headroom-e2e) on
# real pods.
#
#   e2e/e2e.sh [TEST FILTER...]     # e.g. e2e/e2e.sh gfd pipeline   (cargo test name filters)
#
# With KUBECONFIG unset it uses the local single-node cluster (root; see
# e2e/cluster/README.md): started if it is not up, and stopped again at the
# end if this script started it (HEADROOM_KEEP_CLUSTER=1 keeps it running). A
# cluster that was already up, or one named by KUBECONFIG, is left as it was.
# Headroom is (re)installed with Helm by e2e/install.sh either way; nothing is
# uninstalled, so the next run starts from the same state.
#
# Environment: KUBECONFIG, HEADROOM_KEEP_CLUSTER=1, HEADROOM_KEEP_TEST_NAMESPACES=1
# (the suite keeps every test's namespace), E2E_TEST_THREADS (default 2),
# KUBECTL (default: the kubectl built by e2e/cluster/build-binaries.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "${ROOT}"
: "${HEADROOM_CACHE:=${HOME}/.cache/headroom}"
: "${CARGO_TARGET_DIR:=${HEADROOM_CACHE}/target}"
: "${E2E_TEST_THREADS:=2}"
export HEADROOM_CACHE CARGO_TARGET_DIR
say() { printf '\n\033[1m== %s\033[0m\n' "$*" >&2; }

started_cluster=0
if [[ -z ${KUBECONFIG:-} ]] && ! e2e/cluster/cluster.sh status >/dev/null 2>&1; then
  started_cluster=1
fi

finish() {
  local rc=$?
  if ((started_cluster)); then
    if [[ ${HEADROOM_KEEP_CLUSTER:-0} == 1 ]]; then
      say "HEADROOM_KEEP_CLUSTER=1: the local cluster stays up (stop it with: make cluster-down)"
    else
      say "stopping the local cluster this run started (HEADROOM_KEEP_CLUSTER=1 keeps it)"
      e2e/cluster/cluster.sh down || rc=1
    fi
  fi
  exit "${rc}"
}
trap finish EXIT

t0=${SECONDS}
env=$(e2e/install.sh)
eval "${env}"
# shellcheck source=cluster/lib/common.sh
source e2e/cluster/lib/common.sh
if [[ -z ${KUBECTL:-} ]]; then
  KUBECTL=${HEADROOM_BIN_DIR}/kubectl
  [[ -x ${KUBECTL} ]] || KUBECTL=$(command -v kubectl || true)
fi
[[ -n ${KUBECTL} && -x ${KUBECTL} ]] || die "no kubectl: set KUBECTL or run e2e/cluster/build-binaries.sh kubectl"
export KUBECTL

say "cargo test -p headroom-e2e --tests --no-fail-fast -- --ignored --test-threads=${E2E_TEST_THREADS} --skip several_nodes:: $* (KUBECONFIG=${KUBECONFIG})"
t1=${SECONDS}
# --no-fail-fast: every test binary runs, so one run reports every failure.
# The one-node cluster skips the scenarios that need several (make e2e-kind runs them).
cargo test -p headroom-e2e --tests --no-fail-fast -- --ignored --test-threads="${E2E_TEST_THREADS}" --skip several_nodes:: "$@"
say "e2e passed: install $((t1 - t0)) s, tests $((SECONDS - t1)) s"
