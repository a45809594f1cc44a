# shellcheck shell=bash
# kube-scheduler with its own identity (system:kube-scheduler, bound by the
# bootstrap RBAC policy), default profile, no leader election (one instance).

scheduler_start() {
  local kc="${HEADROOM_STATE}/kube-scheduler.kubeconfig"
  # shellcheck disable=SC2054 # commas inside flag values are intended
  local args=(
    --kubeconfig="${kc}"
    --authentication-kubeconfig="${kc}"
    --authorization-kubeconfig="${kc}"
    --authorization-always-allow-paths=/healthz,/readyz,/livez
    --bind-address="${HEADROOM_BIND_ADDRESS}"
    --secure-port="${SCHEDULER_PORT}"
    --cert-dir="${PKI_DIR}/kube-scheduler"
    --leader-elect=false
    --v="${SCHEDULER_LOG_LEVEL:-1}"
  )
  # shellcheck disable=SC2206 # deliberate word splitting of user-supplied flags
  args+=(${SCHEDULER_EXTRA_ARGS:-})
  start_component kube-scheduler "${HEADROOM_BIN_DIR}/kube-scheduler" "${args[@]}"
}

scheduler_ready() {
  local out
  out=$(curl -sSk --max-time 3 "https://${HEADROOM_BIND_ADDRESS}:${SCHEDULER_PORT}/healthz" 2>/dev/null) || return 1
  [[ ${out} == ok ]]
}
