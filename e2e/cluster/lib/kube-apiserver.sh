# shellcheck shell=bash
# kube-apiserver: loopback only, client-cert auth against the harness CA,
# Node+RBAC authorization, default admission plugins.

apiserver_start() {
  local advertise=${APISERVER_ADVERTISE_ADDRESS:-${HEADROOM_BIND_ADDRESS}} reconciler
  # The apiserver publishes its advertise address as the endpoint of the
  # `kubernetes` Service, and Endpoints may not hold loopback IPs: with the
  # default "lease" reconciler it logs "may not be in the loopback range" every
  # 10s. On loopback nothing could reach that Service anyway, so publish no
  # endpoints. A full node binding a routable address gets "lease".
  if [[ ${advertise} == 127.* || ${advertise} == ::1 ]]; then
    reconciler=none
  else
    reconciler=lease
  fi
  # shellcheck disable=SC2054 # commas inside flag values are intended
  local args=(
    # cluster.sh binds 0.0.0.0: pods reach the apiserver on the node IP.
    --bind-address="${APISERVER_BIND_ADDRESS:-${HEADROOM_BIND_ADDRESS}}"
    --advertise-address="${advertise}"
    --endpoint-reconciler-type="${APISERVER_ENDPOINT_RECONCILER:-${reconciler}}"
    --secure-port="${APISERVER_PORT}"
    # Where the apiserver would write self-signed certs; keep it out of /var/run.
    --cert-dir="${PKI_DIR}"
    --tls-cert-file="${PKI_DIR}/apiserver.crt"
    --tls-private-key-file="${PKI_DIR}/apiserver.key"
    --client-ca-file="${PKI_DIR}/ca.crt"
    --etcd-servers="${ETCD_ENDPOINT}"
    --etcd-cafile="${PKI_DIR}/ca.crt"
    --etcd-certfile="${PKI_DIR}/apiserver-etcd-client.crt"
    --etcd-keyfile="${PKI_DIR}/apiserver-etcd-client.key"
    --kubelet-client-certificate="${PKI_DIR}/apiserver-kubelet-client.crt"
    --kubelet-client-key="${PKI_DIR}/apiserver-kubelet-client.key"
    --authorization-mode=Node,RBAC
    --service-account-issuer="${SERVICE_ACCOUNT_ISSUER}"
    --service-account-key-file="${PKI_DIR}/sa.pub"
    --service-account-signing-key-file="${PKI_DIR}/sa.key"
    --service-cluster-ip-range="${SERVICE_CLUSTER_IP_RANGE}"
    # On TERM, net/http's graceful Shutdown otherwise waits up to
    # --request-timeout (60s) for open watch connections (any running
    # controller/operator has some). This mode drains normal requests and
    # then gives the HTTP server a hard-coded 2s, so `down` takes ~3s.
    --shutdown-send-retry-after=true
    # For the kubelet of cluster.sh.
    --allow-privileged=true
    --v="${APISERVER_LOG_LEVEL:-1}"
  )
  # shellcheck disable=SC2206 # deliberate word splitting of user-supplied flags
  args+=(${APISERVER_EXTRA_ARGS:-})
  start_component kube-apiserver "${HEADROOM_BIN_DIR}/kube-apiserver" "${args[@]}"
}

# /readyz aggregates etcd, informer sync and post-start hooks (RBAC bootstrap,
# priority-and-fairness config, ...), so "ok" means requests will be served.
apiserver_ready() {
  local out
  out=$(curl -sS --max-time 5 --cacert "${PKI_DIR}/ca.crt" \
    --cert "${PKI_DIR}/admin.crt" --key "${PKI_DIR}/admin.key" \
    "${APISERVER_URL}/readyz" 2>/dev/null) || return 1
  [[ ${out} == ok ]]
}
