# shellcheck shell=bash
# Dynamic volumes, as on a real cluster: Rancher's local-path-provisioner
# (built from its Go module by build-binaries.sh, pinned in LPP_VERSION) runs
# beside the other components as a host process and serves the default
# StorageClass $STORAGE_CLASS. Each claim gets its own directory under
# $HEADROOM_STATE/volumes, made by a helper pod once a pod uses the claim
# (WaitForFirstConsumer) and removed by another when the claim is deleted
# (reclaimPolicy Delete): claims come and go, nothing to recycle by hand.
#
# The directories are made 0777 by the provisioner's setup script, so non-root
# workers (65532) can write although hostPath volumes ignore fsGroup. The
# helper pods run a busybox image built here (Debian's busybox-static), as no
# registry is reachable. Earlier versions pre-made a pool of 32 `local` PVs;
# those still unclaimed are removed on `up` (claimed ones stay until released).

: "${STORAGE_CLASS:=headroom-local}"
: "${VOLUME_HELPER_IMAGE:=localhost/headroom-volume-helper:dev}"
LPP_NAMESPACE=headroom-storage
LPP_PROVISIONER=rancher.io/local-path
VOLUMES_DIR="${HEADROOM_STATE}/volumes"
OLD_POOL_LABEL=headroom.dev/volume-pool

local_path_provisioner_start() {
  start_component local-path-provisioner "${HEADROOM_BIN_DIR}/local-path-provisioner" \
    start \
    --kubeconfig "${KUBECONFIG_ADMIN}" \
    --namespace "${LPP_NAMESPACE}" \
    --provisioner-name "${LPP_PROVISIONER}" \
    --configmap-name local-path-config \
    --service-account-name local-path-helper \
    --helper-image "${VOLUME_HELPER_IMAGE}"
}

# Ready once its controller runs (the library logs this when it starts).
local_path_provisioner_ready() {
  grep -q "Started provisioner controller" "$(log_file local-path-provisioner)" 2>/dev/null
}

# The helper pods' image: busybox as /bin/sh, mkdir and rm (what the setup
# and teardown scripts below use; cp for the e2e suite, which puts files on
# claims with it); root, as it makes directories on the host.
volume_helper_image_ensure() {
  local busybox=/bin/busybox
  [[ -x ${busybox} ]] || die "${busybox} missing (Debian package busybox-static)"
  IMAGE_USER=0:0 ROOTFS_CA_CERTS=0 ROOTFS_BIN_DIR=/bin IMAGE_IMPORT=0 \
    "${HERE}/../images/build.sh" "${VOLUME_HELPER_IMAGE}" "${busybox}" \
    "${busybox}:/bin/sh" "${busybox}:/bin/mkdir" "${busybox}:/bin/rm" "${busybox}:/bin/cp" >/dev/null
}

storage_manifests() {
  cat <<YAML
apiVersion: v1
kind: Namespace
metadata: {name: ${LPP_NAMESPACE}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: local-path-helper, namespace: ${LPP_NAMESPACE}}
automountServiceAccountToken: false
---
apiVersion: v1
kind: ConfigMap
metadata: {name: local-path-config, namespace: ${LPP_NAMESPACE}}
data:
  config.json: |-
    {"nodePathMap": [{"node": "DEFAULT_PATH_FOR_NON_LISTED_NODES", "paths": ["${VOLUMES_DIR}"]}]}
  setup: |-
    #!/bin/sh
    set -eu
    mkdir -m 0777 -p "\$VOL_DIR"
  teardown: |-
    #!/bin/sh
    set -eu
    rm -rf "\$VOL_DIR"
  helperPod.yaml: |-
    apiVersion: v1
    kind: Pod
    metadata: {name: helper-pod}
    spec:
      automountServiceAccountToken: false
      containers:
      - name: helper-pod
        image: ${VOLUME_HELPER_IMAGE}
        imagePullPolicy: Never
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: ${STORAGE_CLASS}
  annotations: {storageclass.kubernetes.io/is-default-class: "true"}
provisioner: ${LPP_PROVISIONER}
volumeBindingMode: WaitForFirstConsumer
reclaimPolicy: Delete
YAML
}

storage_ensure() {
  local provisioner stale
  mkdir -p "${VOLUMES_DIR}"
  volume_helper_image_ensure || return 1
  containerd_import_images || return 1
  # A StorageClass's provisioner is immutable: replace the old no-provisioner class.
  provisioner=$(kubectl_admin get storageclass "${STORAGE_CLASS}" -o jsonpath='{.provisioner}' 2>/dev/null || true)
  if [[ -n ${provisioner} && ${provisioner} != "${LPP_PROVISIONER}" ]]; then
    kubectl_admin delete storageclass "${STORAGE_CLASS}" >/dev/null || return 1
  fi
  kubectl_admin apply -f - >/dev/null <<<"$(storage_manifests)" || return 1
  # The old pre-made pool: unclaimed volumes would still be bound statically.
  stale=$(kubectl_admin get pv -l "${OLD_POOL_LABEL}" \
    -o jsonpath='{range .items[?(@.status.phase!="Bound")]}{.metadata.name}{"\n"}{end}') || return 1
  if [[ -n ${stale} ]]; then
    # shellcheck disable=SC2086 # one name per word
    kubectl_admin delete pv ${stale} --wait=false >/dev/null || return 1
    log "storage: removed $(wc -l <<<"${stale}") unclaimed volume(s) of the old pre-made pool"
  fi
  start_one local-path-provisioner 60 || return 1
}
