# shellcheck shell=bash
# kube-controller-manager with only what API-level tests need: the garbage
# collector (owner references really delete children), the namespace
# controller (deleted test namespaces really go away) and the PVC/PV
# protection controllers (which release the finalizers that would otherwise
# keep every checkpoint claim, and so its namespace, alive). Workload
# controllers stay off: Headroom's own controller is the one under test.

controller_manager_start() {
  # shellcheck disable=SC2054 # commas inside flag values are intended
  local args=(
    --kubeconfig="${KUBECONFIG_ADMIN}"
    --authentication-kubeconfig="${KUBECONFIG_ADMIN}"
    --authorization-kubeconfig="${KUBECONFIG_ADMIN}"
    --authorization-always-allow-paths=/healthz,/readyz,/livez
    --bind-address="${HEADROOM_BIND_ADDRESS}"
    --secure-port="${CONTROLLER_MANAGER_PORT}"
    --cert-dir="${PKI_DIR}/controller-manager"
    --controllers="${CONTROLLER_MANAGER_CONTROLLERS:-garbagecollector,namespace,pvc-protection,pv-protection}"
    --leader-elect=false
    --use-service-account-credentials=false
    --v="${CONTROLLER_MANAGER_LOG_LEVEL:-1}"
  )
  # shellcheck disable=SC2206 # deliberate word splitting of user-supplied flags
  args+=(${CONTROLLER_MANAGER_EXTRA_ARGS:-})
  start_component kube-controller-manager "${HEADROOM_BIN_DIR}/kube-controller-manager" "${args[@]}"
}

controller_manager_ready() {
  local out
  out=$(curl -sSk --max-time 3 "https://${HEADROOM_BIND_ADDRESS}:${CONTROLLER_MANAGER_PORT}/healthz" 2>/dev/null) || return 1
  [[ ${out} == ok ]]
}
