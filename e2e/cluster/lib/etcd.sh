# shellcheck shell=bash
# etcd: single member, loopback only, TLS with client-cert auth on the client
# port; the peer port is plain HTTP on loopback (single member, never dialled).

etcd_start() {
  mkdir -p "${ETCD_DATA_DIR}"
  chmod 700 "${ETCD_DATA_DIR}"
  local args=(
    --name=headroom
    --data-dir="${ETCD_DATA_DIR}"
    --listen-client-urls="${ETCD_ENDPOINT}"
    --advertise-client-urls="${ETCD_ENDPOINT}"
    # Set explicitly: the defaults (localhost:2380) could clash with a real etcd.
    --listen-peer-urls="http://${HEADROOM_BIND_ADDRESS}:${ETCD_PEER_PORT}"
    --initial-advertise-peer-urls="http://${HEADROOM_BIND_ADDRESS}:${ETCD_PEER_PORT}"
    --initial-cluster="headroom=http://${HEADROOM_BIND_ADDRESS}:${ETCD_PEER_PORT}"
    --initial-cluster-state=new
    --cert-file="${PKI_DIR}/etcd-server.crt"
    --key-file="${PKI_DIR}/etcd-server.key"
    --trusted-ca-file="${PKI_DIR}/ca.crt"
    --client-cert-auth=true
    --log-level=warn
  )
  # Test data is disposable: skipping fsync makes etcd (and so every API
  # write) much faster on slow CI disks. Set ETCD_UNSAFE_NO_FSYNC=false to keep
  # durability.
  if [[ ${ETCD_UNSAFE_NO_FSYNC:-true} == true ]]; then
    args+=(--unsafe-no-fsync=true)
  fi
  # shellcheck disable=SC2206 # deliberate word splitting of user-supplied flags
  args+=(${ETCD_EXTRA_ARGS:-})
  start_component etcd "${HEADROOM_BIN_DIR}/etcd" "${args[@]}"
}

etcd_ready() {
  local out
  out=$(curl -sS --max-time 3 --cacert "${PKI_DIR}/ca.crt" \
    --cert "${PKI_DIR}/apiserver-etcd-client.crt" --key "${PKI_DIR}/apiserver-etcd-client.key" \
    "${ETCD_ENDPOINT}/health" 2>/dev/null) || return 1
  [[ ${out} == *'"health":"true"'* ]]
}
