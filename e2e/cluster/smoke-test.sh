#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Checks that a running harness (controlplane.sh up) behaves like a real API
# server: /readyz, CRD registration, and CEL validation (x-kubernetes-validations)
# enforced on a server-side dry run. Leaves nothing behind.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "${HERE}/lib/common.sh"

kubectl() { "${HEADROOM_BIN_DIR}/kubectl" --kubeconfig "${KUBECONFIG_ADMIN}" "$@"; }
CRD=widgets.harness.headroom.test

cleanup() { kubectl delete crd "${CRD}" --ignore-not-found --wait=false >/dev/null 2>&1 || true; }
trap cleanup EXIT

ready=$(kubectl get --raw /readyz)
[[ ${ready} == ok ]] || die "/readyz said: ${ready}"
log "/readyz: ${ready}"
kubectl version >&2

kubectl apply -f - <<'YAML'
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.harness.headroom.test
spec:
  group: harness.headroom.test
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            required: [replicas, maxReplicas]
            properties:
              replicas: {type: integer, minimum: 0}
              maxReplicas: {type: integer, minimum: 0}
            x-kubernetes-validations:
            - rule: self.replicas <= self.maxReplicas
              message: replicas must not exceed maxReplicas
YAML
kubectl wait --for=condition=Established "crd/${CRD}" --timeout=30s >&2

widget() {
  printf 'apiVersion: harness.headroom.test/v1\nkind: Widget\nmetadata: {name: w}\nspec: {replicas: %s, maxReplicas: %s}\n' "$1" "$2"
}

# The CRD's REST endpoint can lag "Established" by a moment; retry the good one.
for i in $(seq 1 20); do
  if widget 1 3 | kubectl apply --dry-run=server -f - >&2; then break; fi
  ((i == 20)) && die "valid Widget rejected"
  sleep 0.5
done
log "valid Widget accepted (dry run)"

if out=$(widget 5 3 | kubectl apply --dry-run=server -f - 2>&1); then
  die "invalid Widget was accepted: ${out}"
fi
printf '%s\n' "${out}" >&2
[[ ${out} == *"replicas must not exceed maxReplicas"* ]] || die "rejected, but without the CEL message"
log "invalid Widget rejected with the CEL message -- smoke test passed"
