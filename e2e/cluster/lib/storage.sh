# shellcheck shell=bash
# Persistent volumes without a provisioner: a default StorageClass
# ($STORAGE_CLASS, kubernetes.io/no-provisioner, WaitForFirstConsumer) and a
# pool of `local` PVs, one directory each under $HEADROOM_STATE/volumes.
#
# Why not the kube-controller-manager's built-in hostPath provisioner: it
# creates root-owned 0750 directories, and hostPath volumes ignore fsGroup, so
# non-root pods (Headroom's workers run as 65532) could not write. `local`
# volumes honour fsGroup. Released volumes (their claim was deleted) are wiped
# and made Available again on every `cluster.sh up`.

: "${STORAGE_CLASS:=headroom-local}"
: "${STORAGE_POOL_SIZE:=32}"
: "${STORAGE_PV_CAPACITY:=20Gi}"
VOLUMES_DIR="${HEADROOM_STATE}/volumes"
POOL_LABEL=headroom.dev/volume-pool

storage_pv() { # NAME DIR
  cat <<YAML
apiVersion: v1
kind: PersistentVolume
metadata:
  name: $1
  labels: {${POOL_LABEL}: "${STORAGE_CLASS}"}
spec:
  capacity: {storage: ${STORAGE_PV_CAPACITY}}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: ${STORAGE_CLASS}
  local: {path: $2}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions:
        - {key: kubernetes.io/hostname, operator: In, values: [${NODE_NAME}]}
---
YAML
}

storage_ensure() {
  local have released name i dir manifests="" n_new=0 n_recycled=0
  kubectl_admin apply -f - >/dev/null <<YAML || return 1
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: ${STORAGE_CLASS}
  annotations: {storageclass.kubernetes.io/is-default-class: "true"}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
reclaimPolicy: Retain
YAML
  # Wipe and recreate volumes whose claim is gone (Released, or Failed).
  released=$(kubectl_admin get pv -l "${POOL_LABEL}=${STORAGE_CLASS}" \
    -o jsonpath='{range .items[?(@.status.phase!="Available")]}{.metadata.name} {.status.phase}{"\n"}{end}' |
    awk '$2 == "Released" || $2 == "Failed" {print $1}') || return 1
  for name in ${released}; do
    kubectl_admin delete pv "${name}" --wait=true >/dev/null || return 1
    n_recycled=$((n_recycled + 1))
  done
  have=$(kubectl_admin get pv -l "${POOL_LABEL}=${STORAGE_CLASS}" -o name) || return 1
  for ((i = 0; i < STORAGE_POOL_SIZE; i++)); do
    name=$(printf '%s-%02d' "${STORAGE_CLASS}" "${i}")
    grep -qx "persistentvolume/${name}" <<<"${have}" && continue
    dir="${VOLUMES_DIR}/${name}"
    # A fresh directory for a new or recycled volume (never through a mount).
    if [[ -d ${dir} ]]; then
      findmnt -rn -o TARGET | grep -q "^${dir}" && { log "${dir} is mounted; not recycling ${name}"; continue; }
      rm -rf --one-file-system "${dir}"
    fi
    mkdir -p "${dir}"
    chmod 0777 "${dir}"
    manifests+=$(storage_pv "${name}" "${dir}")$'\n'
    n_new=$((n_new + 1))
  done
  if [[ -n ${manifests} ]]; then
    kubectl_admin apply -f - >/dev/null <<<"${manifests}" || return 1
  fi
  ((n_new == 0)) || log "storage: ${n_new} local volume(s) created (${n_recycled} recycled); default StorageClass ${STORAGE_CLASS}"
}
