# shellcheck shell=bash
# Certificates and keys for the harness, generated with openssl.
#
# One CA signs everything (etcd included): this is a throwaway test cluster on
# loopback, so separate etcd/front-proxy CAs would only add moving parts.
# Certificates are ECDSA P-256 (fast to generate, accepted by Go, openssl and
# rustls); the service-account signing key is RSA 2048 so tokens are RS256,
# which every JWT verifier supports.
#
# Everything is created only if missing, so `up` after `down` reuses the same
# CA and the kubeconfig handed to tests stays valid. A serving cert whose SAN
# list changed (e.g. different KUBERNETES_SERVICE_IP) is re-issued.

PKI_DAYS=3650

# _pki_sign NAME SUBJECT EXT_SECTION_TEXT  -- new key + CA-signed cert.
_pki_sign() {
  local name=$1 subject=$2 ext=$3
  local key="${PKI_DIR}/${name}.key" crt="${PKI_DIR}/${name}.crt" csr ext_file
  csr=$(mktemp "${PKI_DIR}/.${name}.csr.XXXXXX")
  ext_file=$(mktemp "${PKI_DIR}/.${name}.ext.XXXXXX")
  printf '%s\n' "${ext}" >"${ext_file}"
  openssl ecparam -name prime256v1 -genkey -noout -out "${key}.tmp" 2>/dev/null
  openssl req -new -key "${key}.tmp" -subj "${subject}" -out "${csr}"
  openssl x509 -req -in "${csr}" -CA "${PKI_DIR}/ca.crt" -CAkey "${PKI_DIR}/ca.key" \
    -CAcreateserial -days "${PKI_DAYS}" -sha256 -extfile "${ext_file}" -out "${crt}.tmp" 2>/dev/null
  chmod 600 "${key}.tmp"
  mv -f "${key}.tmp" "${key}"
  mv -f "${crt}.tmp" "${crt}"
  rm -f "${csr}" "${ext_file}"
}

# pki_client_cert NAME CN [ORG]  -- client certificate (clientAuth).
pki_client_cert() {
  local name=$1 cn=$2 org=${3:-} subject
  [[ -s ${PKI_DIR}/${name}.crt && -s ${PKI_DIR}/${name}.key ]] && return 0
  subject="/CN=${cn}"
  [[ -n ${org} ]] && subject="/O=${org}${subject}"
  _pki_sign "${name}" "${subject}" "basicConstraints=critical,CA:FALSE
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
}

# pki_serving_cert NAME CN SANS [EKU]  -- serving certificate; SANS is an
# openssl subjectAltName value ("DNS:a,IP:1.2.3.4"). Re-issued when SANS change.
pki_serving_cert() {
  local name=$1 cn=$2 sans=$3 eku=${4:-serverAuth}
  local san_file="${PKI_DIR}/${name}.sans"
  if [[ -s ${PKI_DIR}/${name}.crt && -s ${PKI_DIR}/${name}.key && -f ${san_file} ]] &&
    [[ $(<"${san_file}") == "${sans}" ]]; then
    return 0
  fi
  _pki_sign "${name}" "/CN=${cn}" "basicConstraints=critical,CA:FALSE
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=${eku}
subjectAltName=${sans}"
  printf '%s\n' "${sans}" >"${san_file}"
}

pki_ca() {
  [[ -s ${PKI_DIR}/ca.crt && -s ${PKI_DIR}/ca.key ]] && return 0
  log "generating CA in ${PKI_DIR}"
  openssl ecparam -name prime256v1 -genkey -noout -out "${PKI_DIR}/ca.key" 2>/dev/null
  chmod 600 "${PKI_DIR}/ca.key"
  openssl req -x509 -new -key "${PKI_DIR}/ca.key" -sha256 -days "${PKI_DAYS}" \
    -subj "/CN=headroom-e2e-ca" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
    -addext "subjectKeyIdentifier=hash" \
    -out "${PKI_DIR}/ca.crt"
}

pki_service_account_keys() {
  [[ -s ${PKI_DIR}/sa.key && -s ${PKI_DIR}/sa.pub ]] && return 0
  openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "${PKI_DIR}/sa.key.tmp" 2>/dev/null
  chmod 600 "${PKI_DIR}/sa.key.tmp"
  openssl pkey -in "${PKI_DIR}/sa.key.tmp" -pubout -out "${PKI_DIR}/sa.pub"
  mv -f "${PKI_DIR}/sa.key.tmp" "${PKI_DIR}/sa.key"
}

# write_kubeconfig PATH CERT_NAME [USER]  -- self-contained kubeconfig
# (certificates embedded) for the client cert pki/CERT_NAME.{crt,key}.
write_kubeconfig() {
  local path=$1 cert=$2 user=${3:-$2} tmp
  tmp="${path}.tmp.$$"
  (
    umask 077
    cat >"${tmp}" <<KUBECONFIG
apiVersion: v1
kind: Config
clusters:
- name: headroom-e2e
  cluster:
    server: ${APISERVER_URL}
    certificate-authority-data: $(base64 -w0 <"${PKI_DIR}/ca.crt")
users:
- name: ${user}
  user:
    client-certificate-data: $(base64 -w0 <"${PKI_DIR}/${cert}.crt")
    client-key-data: $(base64 -w0 <"${PKI_DIR}/${cert}.key")
contexts:
- name: headroom-e2e
  context:
    cluster: headroom-e2e
    user: ${user}
    namespace: default
current-context: headroom-e2e
KUBECONFIG
  )
  mv -f "${tmp}" "${path}"
}

# All certs the control plane needs. The node components' certs are in
# pki_ensure_node.
pki_ensure_controlplane() {
  mkdir -p "${PKI_DIR}"
  chmod 700 "${PKI_DIR}"
  pki_ca
  pki_service_account_keys

  local host sans
  host=$(hostname 2>/dev/null || echo localhost)
  sans="DNS:localhost,DNS:${host},DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
  sans+=",DNS:kubernetes.default.svc.${CLUSTER_DOMAIN},IP:127.0.0.1,IP:${KUBERNETES_SERVICE_IP}"
  [[ ${HEADROOM_BIND_ADDRESS} != 127.0.0.1 ]] && sans+=",IP:${HEADROOM_BIND_ADDRESS}"
  # cluster.sh advertises the node IP (pods dial it through the `kubernetes`
  # Service); unset for the loopback-only control plane.
  if [[ -n ${APISERVER_ADVERTISE_ADDRESS:-} && ${APISERVER_ADVERTISE_ADDRESS} != 127.* &&
    ${APISERVER_ADVERTISE_ADDRESS} != "${HEADROOM_BIND_ADDRESS}" ]]; then
    sans+=",IP:${APISERVER_ADVERTISE_ADDRESS}"
  fi
  pki_serving_cert apiserver kube-apiserver "${sans}"

  # etcd's gRPC gateway dials its own client port with the serving cert, so
  # that cert needs clientAuth as well.
  sans="DNS:localhost,IP:127.0.0.1"
  [[ ${HEADROOM_BIND_ADDRESS} != 127.0.0.1 ]] && sans+=",IP:${HEADROOM_BIND_ADDRESS}"
  pki_serving_cert etcd-server etcd "${sans}" "serverAuth,clientAuth"

  pki_client_cert apiserver-etcd-client kube-apiserver-etcd-client
  # For apiserver -> kubelet (logs/exec) once a kubelet exists.
  pki_client_cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
  pki_client_cert admin headroom-admin system:masters
  rm -f "${PKI_DIR}/ca.srl"
}

# Certs and kubeconfigs of the node components (cluster.sh). Each component
# authenticates as the identity the bootstrap RBAC policy and the Node
# authorizer expect, so no extra RBAC is needed:
#   kubelet       CN=system:node:<node>, O=system:nodes   (Node authorizer)
#   kube-scheduler CN=system:kube-scheduler               (system:kube-scheduler)
#   kube-proxy    CN=system:kube-proxy                    (system:node-proxier)
# The kubelet also gets a serving cert for its node name and IP, so the
# apiserver -> kubelet connection (logs, exec) is not self-signed.
pki_ensure_node() {
  local node=$1 node_ip=$2 dir=$3
  pki_client_cert "kubelet-${node}" "system:node:${node}" system:nodes
  pki_serving_cert kubelet-serving "${node}" "DNS:${node},DNS:localhost,IP:${node_ip},IP:127.0.0.1"
  pki_client_cert kube-scheduler system:kube-scheduler
  pki_client_cert kube-proxy system:kube-proxy
  rm -f "${PKI_DIR}/ca.srl"
  write_kubeconfig "${dir}/kubelet.kubeconfig" "kubelet-${node}" "system:node:${node}"
  write_kubeconfig "${dir}/kube-scheduler.kubeconfig" kube-scheduler system:kube-scheduler
  write_kubeconfig "${dir}/kube-proxy.kubeconfig" kube-proxy system:kube-proxy
}
