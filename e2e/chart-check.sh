#!/usr/bin/env bash
# Lints and renders the Helm chart, checks its security defaults, and (when a
# cluster is reachable) validates every rendered object with a server-side dry run.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "${ROOT}"
HELM=$(e2e/tools/build-helm.sh --print)
CHART=charts/headroom
NS=headroom-system

"${HELM}" lint --strict "${CHART}"
rendered=$("${HELM}" template headroom "${CHART}" --namespace "${NS}" --include-crds --kube-version "${KUBE_VERSION:-v1.33.0}")

fail() { echo "chart-check: $*" >&2; exit 1; }
grep -q 'readOnlyRootFilesystem: true' <<<"${rendered}" || fail "operator root filesystem is not read-only"
grep -q 'runAsNonRoot: true' <<<"${rendered}" || fail "operator may run as root"
grep -q 'drop: \["ALL"\]' <<<"${rendered}" || fail "capabilities are not dropped"
grep -q 'type: RuntimeDefault' <<<"${rendered}" || fail "no RuntimeDefault seccomp profile"
if grep -nE '^\s*-?\s*(verbs|resources|apiGroups):.*"\*"' <<<"${rendered}"; then fail "RBAC wildcard"; fi
# Values are schema-checked: a typo must be rejected.
if "${HELM}" template headroom "${CHART}" --kube-version "${KUBE_VERSION:-v1.33.0}" --set replicaCont=2 >/dev/null 2>&1; then fail "values.schema.json accepted an unknown key"; fi
if "${HELM}" template headroom "${CHART}" --kube-version "${KUBE_VERSION:-v1.33.0}" --set checkpoints.accessMode=ReadWriteMost >/dev/null 2>&1; then fail "values.schema.json accepted an unknown checkpoint access mode"; fi
grep -q -- '--checkpoint-access-mode=ReadWriteOnce' <<<"${rendered}" || fail "checkpoint access mode is not passed to the operator"
# Every replica derives the same job link keys from the chart's Secret.
grep -q -- '--peer-key-file=/var/run/secrets/headroom.dev/peer-key/key' <<<"${rendered}" || fail "the peer key file is not passed to the operator"
grep -q 'name: headroom-operator-peer-key' <<<"${rendered}" || fail "no peer key Secret"
# The worker API admits only Headroom's pods where NetworkPolicies are enforced.
grep -q 'kind: NetworkPolicy' <<<"${rendered}" || fail "no NetworkPolicy for the operator"
grep -A3 'resources: \["networkpolicies"\]' <<<"${rendered}" | grep -q '"create", "patch"' || fail "the operator may not create the jobs' NetworkPolicies"

# The rendered document of kind $1 (in namespace $2, if given).
doc() { awk -v kind="$1" -v ns="${2:-}" 'BEGIN { RS = "\n---\n" }
  $0 ~ ("\nkind: " kind "\n") && (ns == "" || $0 ~ ("\n  namespace: " ns "\n")) { print; print "---" }'; }
# The kubelet's probes have a port of their own, which no Service and no
# NetworkPolicy rule names, and one source holds at most a share of each port.
grep -q -- '--probe-addr=0.0.0.0:8082' <<<"${rendered}" || fail "the probe address is not passed to the operator"
[[ $(grep -c 'httpGet: {path: /[a-z]*z, port: probes}' <<<"${rendered}") == 2 ]] || fail "the liveness and readiness probes do not call the probe port"
if grep -nE 'port: (8082|probes)\b' <<<"$(doc NetworkPolicy <<<"${rendered}")$(doc Service <<<"${rendered}")"; then fail "a NetworkPolicy rule or Service names the probe port"; fi
# /metrics names every tenant's jobs: by default only the monitoring
# namespace may scrape it; an empty metricsFrom admits every pod.
grep -A4 'port: 8080, protocol: TCP' <<<"$(doc NetworkPolicy <<<"${rendered}")" | grep -q 'kubernetes.io/metadata.name: monitoring' || fail "the metrics port admits more than the monitoring namespace by default"
if "${HELM}" template headroom "${CHART}" --kube-version "${KUBE_VERSION:-v1.33.0}" --show-only templates/networkpolicy.yaml --set 'networkPolicy.metricsFrom=null' | grep -A4 'port: 8080' | grep -q 'from:'; then fail "metricsFrom=null still limits who scrapes /metrics"; fi
grep -q -- '--per-source-connection-share=0.25' <<<"${rendered}" || fail "the per-source connection share is not passed to the operator"
# /metrics behind TokenReview + SubjectAccessReview is off by default (no
# flag, no subjectaccessreviews right); on, the operator gets the flag and
# exactly that right, and the ServiceMonitor sends Prometheus's token.
if grep -q -- '--metrics-authorization\|subjectaccessreviews' <<<"${rendered}"; then fail "metrics authorization (or its RBAC) rendered by default"; fi
metrics_auth=$("${HELM}" template headroom "${CHART}" --kube-version "${KUBE_VERSION:-v1.33.0}" --set metrics.authorization=true --set metrics.serviceMonitor.enabled=true)
grep -q -- '- --metrics-authorization$' <<<"${metrics_auth}" || fail "metrics.authorization does not pass --metrics-authorization"
grep -A1 'resources: \["subjectaccessreviews"\]' <<<"$(doc ClusterRole <<<"${metrics_auth}")" | grep -q 'verbs: \["create"\]' || fail "metrics.authorization does not grant create on subjectaccessreviews"
grep -q 'bearerTokenFile: ' <<<"$(doc ServiceMonitor <<<"${metrics_auth}")" || fail "with metrics.authorization the ServiceMonitor sends no token"
for scoped in "" "--set watchNamespace=team-a"; do
  # shellcheck disable=SC2086
  "${HELM}" template headroom "${CHART}" --kube-version "${KUBE_VERSION:-v1.33.0}" --set metrics.authorization=true ${scoped} | grep -q 'subjectaccessreviews' || fail "metrics.authorization grants no subjectaccessreviews (${scoped:-all namespaces})"
done
for share in 0 1.5; do
  if "${HELM}" template headroom "${CHART}" --kube-version "${KUBE_VERSION:-v1.33.0}" --set perSourceConnectionShare="${share}" >/dev/null 2>&1; then fail "values.schema.json accepted perSourceConnectionShare=${share}"; fi
done
# GitOps: with existing Secrets the chart renders neither the CA nor the peer
# key (nor their checksums, which a render without cluster access would
# change every time) and mounts the named ones.
own_secrets=$("${HELM}" template headroom "${CHART}" --kube-version "${KUBE_VERSION:-v1.33.0}" --set workerApi.tls.existingSecret=my-ca --set peerKey.existingSecret=my-peer-key)
if grep -q 'name: .*-worker-api-ca$\|name: .*-peer-key$' <<<"${own_secrets}"; then fail "existingSecret still renders the generated CA or peer key"; fi
if grep -q 'checksum/' <<<"${own_secrets}"; then fail "existingSecret still puts a checksum of a generated Secret on the operator"; fi
grep -q 'secretName: my-ca$' <<<"${own_secrets}" || fail "workerApi.tls.existingSecret is not mounted"
grep -q 'secretName: my-peer-key$' <<<"${own_secrets}" || fail "peerKey.existingSecret is not mounted"
# The usual knobs reach the operator's pod; nameOverride names it.
knobs=$("${HELM}" template headroom "${CHART}" --kube-version "${KUBE_VERSION:-v1.33.0}" --set 'imagePullSecrets[0].name=regcred' \
  --set podLabels.team=ml --set priorityClassName=system-cluster-critical --set 'extraArgs={--lease-seconds=30}' --set nameOverride=hr)
deployment=$(doc Deployment <<<"${knobs}")
grep -A1 'imagePullSecrets:' <<<"${deployment}" | grep -q -- '- name: regcred$' || fail "imagePullSecrets do not reach the operator's pod"
grep -q '^        team: ml$' <<<"${deployment}" || fail "podLabels are not on the operator's pod"
grep -q 'priorityClassName: system-cluster-critical$' <<<"${deployment}" || fail "priorityClassName is not on the operator's pod"
grep -q -- '- "--lease-seconds=30"$' <<<"${deployment}" || fail "extraArgs do not reach the operator"
grep -q '^  name: headroom-hr$' <<<"${deployment}" || fail "nameOverride does not name the operator"
grep -q 'app.kubernetes.io/name: hr$' <<<"${deployment}" || fail "nameOverride does not label the operator"
if grep -q 'imagePullSecrets\|priorityClassName' <<<"$(doc Deployment <<<"${rendered}")"; then fail "imagePullSecrets or priorityClassName rendered by default"; fi
if "${HELM}" template headroom "${CHART}" --kube-version "${KUBE_VERSION:-v1.33.0}" --set 'imagePullSecrets={regcred}' >/dev/null 2>&1; then fail "values.schema.json accepted imagePullSecrets as strings (a PodSpec takes [{name}])"; fi
# The cluster-scoped policies and their bindings carry the chart's labels.
[[ $(doc 'ValidatingAdmissionPolicy(Binding)?' <<<"${rendered}" | grep -c '^    app.kubernetes.io/instance: headroom$') == 4 ]] || fail "the admission policies lack the chart's labels"
# Alerts and the dashboard only when asked for; their queries are checked
# against the served metrics by the operator's metrics tests.
if grep -q '^kind: PrometheusRule$\|grafana_dashboard' <<<"${rendered}"; then fail "the PrometheusRule or the dashboard rendered by default"; fi
observability=$("${HELM}" template headroom "${CHART}" --kube-version "${KUBE_VERSION:-v1.33.0}" --set metrics.prometheusRule.enabled=true --set metrics.dashboard.enabled=true)
grep -q 'alert: HeadroomWorkerNearBudget$' <<<"$(doc PrometheusRule <<<"${observability}")" || fail "metrics.prometheusRule.enabled renders no alerts"
grep -q '"uid": "headroom-jobs"' <<<"$(doc ConfigMap <<<"${observability}")" || fail "metrics.dashboard.enabled renders no dashboard"
# The alerts as Prometheus reads them: `check rules` and `test rules`
# (e2e/testdata/alerts/) by rulecheck, promtool's two rule commands on
# Prometheus' own packages (e2e/tools/rulecheck, built and cached by
# e2e/tools/build-rulecheck.sh: 195 s cold on 2 busy cores here, `cd
# e2e/tools/rulecheck && GOCACHE=<empty dir> GOMODCACHE=<empty dir> nice -n 19
# go build`, modules from the proxy included; cached, a second run builds
# nothing). HEADROOM_PROMTOOL=1 also runs the real promtool
# (e2e/tools/build-promtool.sh, 893 s cold).
checkers=("$(e2e/tools/build-rulecheck.sh --print)")
if [[ ${HEADROOM_PROMTOOL:-} == 1 ]]; then checkers+=("$(e2e/tools/build-promtool.sh --print)"); fi
alerts=$(mktemp -d)
# The PrometheusRule's spec is a rule file.
doc PrometheusRule <<<"${observability}" | sed -n '/^spec:$/,/^---$/p' | sed '1d;$d' | sed 's/^  //' >"${alerts}/rules.yaml"
cp e2e/testdata/alerts/headroom-rules-test.yaml "${alerts}/"
for checker in "${checkers[@]}"; do
  "${checker}" check rules "${alerts}/rules.yaml" || fail "${checker##*/} check rules refused the PrometheusRule"
  "${checker}" test rules "${alerts}/headroom-rules-test.yaml" || fail "${checker##*/} test rules failed (e2e/testdata/alerts/headroom-rules-test.yaml)"
done
rm -rf "${alerts}"
# A job that names a Secret is admitted only if its creator may get that
# Secret: the admission policy is on by default, and can be turned off.
grep -q '^kind: ValidatingAdmissionPolicy$' <<<"${rendered}" || fail "no token Secret admission policy by default"
grep -q "resource('secrets')" <<<"$(doc ValidatingAdmissionPolicy <<<"${rendered}")" || fail "the admission policy does not check the creator's access to the Secret"
grep -q '^kind: ValidatingAdmissionPolicyBinding$' <<<"${rendered}" || fail "the token Secret admission policy is not bound"
if "${HELM}" template headroom "${CHART}" --kube-version "${KUBE_VERSION:-v1.33.0}" --set secretAccessPolicy.enabled=false | grep -q 'name: headroom-token-secret-access'; then fail "secretAccessPolicy.enabled=false still renders the policy"; fi
# The spec's cross-field rules live in their own policy (not in the CRD, so
# status writes skip them), rendered and bound by default, only for spec
# writes, and can be turned off (a second release in the same cluster).
if "${HELM}" template headroom "${CHART}" --kube-version "${KUBE_VERSION:-v1.33.0}" --set specRulesPolicy.enabled=false | grep -q 'name: headroom-spec-rules'; then fail "specRulesPolicy.enabled=false still renders the policy"; fi
spec_rules=$("${HELM}" template headroom "${CHART}" --kube-version "${KUBE_VERSION:-v1.33.0}" --set secretAccessPolicy.enabled=false)
grep -q '^  name: headroom-spec-rules$' <<<"$(doc ValidatingAdmissionPolicy <<<"${spec_rules}")" || fail "no spec-rules admission policy"
grep -q '^  policyName: headroom-spec-rules$' <<<"$(doc ValidatingAdmissionPolicyBinding <<<"${spec_rules}")" || fail "the spec-rules admission policy is not bound"
grep -q 'object.spec != oldObject.spec' <<<"${spec_rules}" || fail "the spec-rules policy is not limited to spec writes"
if grep -q 'x-kubernetes-validations' <<<"${rendered}"; then fail "the CRD carries CEL rules (they belong in the spec-rules policy)"; fi
# The token policy re-checks a job's Secrets when its pods change, checks its
# image pull Secrets, and keeps its hub sources immutable on its own.
token_policy=$(doc ValidatingAdmissionPolicy <<<"${rendered}")
for what in podsChanged unreadablePullSecrets 'spec.model.pretrained.huggingFace is immutable' 'spec.data.huggingFace is immutable'; do
  grep -q "${what}" <<<"${token_policy}" || fail "the token Secret policy lacks ${what}"
done
# The workers' allow-lists are off by default, and rendered (each list's rule
# only) once a list is set.
if grep -q 'headroom-worker-allow-lists' <<<"${rendered}"; then fail "worker allow-lists rendered by default"; fi
allow_lists=$("${HELM}" template headroom "${CHART}" --kube-version "${KUBE_VERSION:-v1.33.0}" --show-only templates/worker-allow-lists-policy.yaml \
  --set 'workerAllowLists.imagePrefixes={registry.example.com/ml/}' --set 'workerAllowLists.priorityClasses={batch-low}' --set 'workerAllowLists.tolerationKeys={dedicated}')
for what in 'spec.worker.image: ' 'spec.worker.priorityClassName: ' 'spec.worker.tolerations: ' 'policyName: headroom-worker-allow-lists'; do
  grep -q "${what}" <<<"${allow_lists}" || fail "workerAllowLists set: no ${what}"
done
images_only=$("${HELM}" template headroom "${CHART}" --kube-version "${KUBE_VERSION:-v1.33.0}" --show-only templates/worker-allow-lists-policy.yaml --set 'workerAllowLists.imagePrefixes={registry.example.com/ml/}')
if grep -q 'spec.worker.tolerations: ' <<<"${images_only}"; then fail "an empty workerAllowLists.tolerationKeys still renders its rule"; fi
if "${HELM}" template headroom "${CHART}" --kube-version "${KUBE_VERSION:-v1.33.0}" --set 'workerAllowLists.imagePrefixes={registry.example.com}' >/dev/null 2>&1; then fail "values.schema.json accepted an image prefix that would also match registry.example.com.elsewhere.io"; fi
# One watched namespace: namespaced RBAC there. The ClusterRole keeps the
# cluster-scoped needs and reading pods for the GPU inventory, nothing on
# jobs, pod writes, Services, claims or events.
WATCHED=team-a
scoped=$("${HELM}" template headroom "${CHART}" --namespace "${NS}" --kube-version "${KUBE_VERSION:-v1.33.0}" --set watchNamespace="${WATCHED}")
cluster_role=$(doc ClusterRole <<<"${scoped}")
[[ -n ${cluster_role} ]] || fail "no ClusterRole with watchNamespace=${WATCHED}"
if grep -nE 'memoryawaretrainingjobs|services|persistentvolumeclaims|events' <<<"${cluster_role}"; then fail "with watchNamespace=${WATCHED} the ClusterRole still grants namespaced resources"; fi
if grep -A1 'resources: \["pods"\]' <<<"${cluster_role}" | grep -nE '"(get|create|patch|update|delete|deletecollection)"'; then fail "with watchNamespace=${WATCHED} the ClusterRole grants more on pods than list and watch"; fi
grep -q 'resources: \["tokenreviews"\]' <<<"${cluster_role}" || fail "with watchNamespace=${WATCHED} the ClusterRole lacks tokenreviews"
grep -q 'resources: \["nodes"\]' <<<"${cluster_role}" || fail "with watchNamespace=${WATCHED} the ClusterRole lacks nodes"
role=$(doc Role "${WATCHED}" <<<"${scoped}")
for resource in memoryawaretrainingjobs memoryawaretrainingjobs/status pods persistentvolumeclaims events; do
  grep -q "\"${resource}\"" <<<"${role}" || fail "with watchNamespace=${WATCHED} no Role in ${WATCHED} grants ${resource}"
done
grep -q 'name: headroom-operator$' <<<"$(doc RoleBinding "${WATCHED}" <<<"${scoped}")" || fail "with watchNamespace=${WATCHED} no RoleBinding in ${WATCHED}"
if grep -q "\"pods\"" <<<"$(doc Role "${WATCHED}" <<<"${rendered}")"; then fail "without watchNamespace a Role in ${WATCHED}"; fi

if [[ -n ${KUBECONFIG:-} ]]; then
  source e2e/cluster/lib/common.sh
  KUBECTL=${KUBECTL:-${HEADROOM_BIN_DIR}/kubectl}
  "${KUBECTL}" create namespace "${NS}" --dry-run=client -o yaml | "${KUBECTL}" apply -f - >/dev/null
  "${KUBECTL}" apply --server-side --force-conflicts --dry-run=server -f - <<<"${rendered}"
  # The allow-lists' CEL compiles (the API server checks it on create), and
  # refuses what is not listed: a copy bound to one labelled namespace only,
  # so other users of this control plane are not held to it.
  "${KUBECTL}" apply --server-side --force-conflicts --dry-run=server -f - <<<"${allow_lists}"
  allow_ns=allow-lists-check-$$
  allow_copy=$(sed -e 's/name: headroom-worker-allow-lists$/name: headroom-worker-allow-lists-check/' \
    -e 's/policyName: headroom-worker-allow-lists$/policyName: headroom-worker-allow-lists-check\n  matchResources: {namespaceSelector: {matchLabels: {headroom.dev\/allow-lists-check: "yes"}}}/' <<<"${allow_lists}")
  "${KUBECTL}" apply --server-side --force-conflicts -f - <<<"${allow_copy}" >/dev/null
  "${KUBECTL}" create namespace "${allow_ns}" >/dev/null
  "${KUBECTL}" label namespace "${allow_ns}" headroom.dev/allow-lists-check=yes >/dev/null
  # The sample with its worker image line replaced by $1.
  job_with() { sed "s#^    image: localhost/headroom-worker:dev\$#$1#" samples/cpu-finetune-tiny-llama.yaml; }
  listed='    image: registry.example.com/ml/worker:1'
  refused=""
  for _ in $(seq 1 60); do # the policy takes effect asynchronously
    if refused=$("${KUBECTL}" -n "${allow_ns}" apply --dry-run=server -f samples/cpu-finetune-tiny-llama.yaml 2>&1); then sleep 0.5; else break; fi
  done
  allow_check=ok
  grep -q 'spec.worker.image: localhost/headroom-worker:dev is not from a registry this cluster allows' <<<"${refused}" || allow_check="an unlisted image was not refused: ${refused}"
  "${KUBECTL}" -n "${allow_ns}" apply --dry-run=server -f - <<<"$(job_with "${listed}\n    priorityClassName: batch-low\n    tolerations: [{key: dedicated, operator: Exists}]")" >/dev/null \
    || allow_check="a listed image, priority class and toleration were refused"
  for unlisted in '    image: registry.example.com.elsewhere.io/ml/worker:1' "${listed}\n    priorityClassName: system-cluster-critical" "${listed}\n    tolerations: [{operator: Exists}]"; do
    said=$("${KUBECTL}" -n "${allow_ns}" apply --dry-run=server -f - <<<"$(job_with "${unlisted}")" 2>&1) || true
    grep -q "ValidatingAdmissionPolicy 'headroom-worker-allow-lists-check'.* denied request: spec.worker" <<<"${said}" || allow_check="not refused by the allow-lists: ${unlisted}: ${said}"
  done
  "${KUBECTL}" delete --ignore-not-found -f - <<<"${allow_copy}" >/dev/null
  "${KUBECTL}" delete namespace "${allow_ns}" --wait=false >/dev/null
  [[ ${allow_check} == ok ]] || fail "workerAllowLists: ${allow_check}"
fi

# Least privilege, for real: run the operator with the chart's ServiceAccount
# token (only the chart's RBAC) and push a job through it.
if [[ -n ${KUBECONFIG:-} && ${CHART_CHECK_RBAC:-1} == 1 ]]; then
  : "${CARGO_TARGET_DIR:=${HEADROOM_CACHE:-${HOME}/.cache/headroom}/target}"
  cargo build -q -p headroom-operator --bin headroom-operator
  k() { "${KUBECTL}" "$@"; }
  # --force-conflicts: the API-server tests apply the same cluster-scoped policy under their own manager.
  # Leases from earlier runs (this control plane's state persists) would hide
  # one this run leaves behind.
  k -n "${NS}" delete leases --all >/dev/null
  k apply --server-side --force-conflicts -f - <<<"${rendered}" >/dev/null
  k -n "${NS}" scale deployment headroom-operator --replicas=0 >/dev/null # no kubelet here; we run it ourselves
  token=$(k -n "${NS}" create token headroom-operator --duration=10m)
  server=$(k config view --raw --minify -o jsonpath='{.clusters[0].cluster.server}')
  ca=$(k config view --raw --minify -o jsonpath='{.clusters[0].cluster.certificate-authority-data}')
  sa_kubeconfig=$(mktemp)
  work_ns=rbac-check-$$
  cat >"${sa_kubeconfig}" <<KUBECONFIG
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "${server}", certificate-authority-data: "${ca}"}}]
users: [{name: operator, user: {token: "${token}"}}]
contexts: [{name: c, context: {cluster: c, user: operator}}]
current-context: c
KUBECONFIG
  log=$(mktemp)
  worker_api_port=${CHART_CHECK_WORKER_API_PORT:-18081}
  # The worker API over TLS from the chart's own CA Secret, as in a cluster.
  ca_dir=$(mktemp -d)
  for f in ca.crt ca.key; do
    k -n "${NS}" get secret headroom-operator-worker-api-ca -o jsonpath="{.data.${f//./\\.}}" | base64 -d >"${ca_dir}/${f}"
  done
  KUBECONFIG=${sa_kubeconfig} POD_NAMESPACE=${NS} RUST_LOG=info "${CARGO_TARGET_DIR}/debug/headroom-operator" \
    --metrics-addr 127.0.0.1:0 --probe-addr 127.0.0.1:0 --lease-seconds 5 --lease-name headroom-operator-leader \
    --worker-api-ca-dir "${ca_dir}" \
    --worker-api-addr "127.0.0.1:${worker_api_port}" --worker-api-service headroom-operator-worker-api >"${log}" 2>&1 &
  op=$!
  watch_ns=rbac-watched-$$
  other_ns=rbac-unwatched-$$
  cleanup() {
    kill "${op}" 2>/dev/null || true
    k delete namespace "${work_ns}" "${watch_ns}" "${other_ns}" --ignore-not-found --wait=false >/dev/null 2>&1 || true
    rm -f "${sa_kubeconfig}"
    rm -rf "${ca_dir}"
  }
  trap cleanup EXIT
  k create namespace "${work_ns}" >/dev/null
  # No service-account controller on this control plane; workers run under `default`.
  k -n "${work_ns}" create serviceaccount default >/dev/null
  k apply -n "${work_ns}" -f samples/cpu-oom-first.yaml >/dev/null
  ok=0
  for _ in $(seq 1 150); do
    if k -n "${work_ns}" get pod oom-then-fit-a1-s0 >/dev/null 2>&1; then ok=1; break; fi
    sleep 0.2
  done
  ((ok)) || { cat "${log}" >&2; fail "the operator could not create the worker pod with the chart's RBAC"; }
  # The worker API with the chart's RBAC (a TokenReview, the pod, the status
  # patch): the pod's own projected-style token, bound to it, reports telemetry.
  grep -q -- '"--worker-api-service=headroom-operator-worker-api"\|--worker-api-service=headroom-operator-worker-api' <<<"${rendered}" \
    || fail "the worker API Service is not passed to the operator"
  worker_token=$(k -n "${work_ns}" create token default --audience headroom.dev/worker-api \
    --bound-object-kind Pod --bound-object-name oom-then-fit-a1-s0 --duration=10m)
  telemetry='{"name":"oom-then-fit-a1-s0","attempt":1,"stage":0,"layerStart":0,"layerEnd":1,"step":1,"memory":{"peakBytes":1000},"updatedAt":"2026-11-26T10:00:00Z"}'
  # Verified against the chart's CA under the Service's DNS name (its
  # certificate's name), which --resolve points at this loopback port.
  api_host=headroom-operator-worker-api.${NS}.svc
  code=$(curl -s -o /dev/stderr -w '%{http_code}' --cacert "${ca_dir}/ca.crt" --resolve "${api_host}:${worker_api_port}:127.0.0.1" \
    -X POST -H "Authorization: Bearer ${worker_token}" \
    -H 'Content-Type: application/json' --data "${telemetry}" "https://${api_host}:${worker_api_port}/v1/telemetry")
  [[ ${code} == 204 ]] || { cat "${log}" >&2; fail "the worker API refused a worker's own telemetry with the chart's RBAC (HTTP ${code})"; }
  k -n "${work_ns}" get pod oom-then-fit-a1-s0 -o jsonpath='{.spec.containers[0].env[?(@.name=="HEADROOM_WORKER_API_CA")].value}' | grep -q 'BEGIN CERTIFICATE' \
    || fail "the worker pod is not given the worker API's CA"
  k -n "${work_ns}" get pod oom-then-fit-a1-s0 -o jsonpath='{.spec.containers[0].env[?(@.name=="HEADROOM_WORKER_API")].value}' | grep -q '^https://' \
    || fail "the worker pod is not given an https worker API URL"
  # The operator writes held reports asynchronously (a first report at once,
  # but after the 204): poll for it rather than race the write.
  ok=0
  for _ in $(seq 1 50); do
    if k -n "${work_ns}" get memoryawaretrainingjob oom-then-fit -o jsonpath='{.status.workers[0].name}' | grep -q oom-then-fit-a1-s0; then ok=1; break; fi
    sleep 0.2
  done
  ((ok)) || fail "the worker's telemetry is not in the job status after 10 s"
  k -n "${work_ns}" patch pod oom-then-fit-a1-s0 --subresource=status --type=merge \
    -p '{"status":{"phase":"Failed","containerStatuses":[{"name":"worker","image":"i","imageID":"","ready":false,"restartCount":0,"state":{"terminated":{"exitCode":137,"reason":"OOMKilled"}}}]}}' >/dev/null
  ok=0
  for _ in $(seq 1 150); do
    if k -n "${work_ns}" get pod oom-then-fit-a2-s0 >/dev/null 2>&1; then ok=1; break; fi
    sleep 0.2
  done
  ((ok)) || { cat "${log}" >&2; fail "no retry with the chart's RBAC"; }
  sleep 1
  # A namespace being deleted (another test's, on the shared control plane)
  # refuses new objects with "forbidden" too; that is not RBAC.
  if grep -iE 'forbidden|cannot (create|patch|get|list|watch)' "${log}" | grep -v 'NamespaceTerminating'; then fail "the chart's RBAC is missing a permission the operator uses"; fi
  if grep -q $'\e\[' "${log}"; then fail "the operator's log (not a terminal) carries ANSI colour codes"; fi
  echo "chart-check: the operator ran a job through an OOM retry with only the chart's RBAC"
  k -n "${NS}" get lease headroom-operator-leader -o jsonpath='{.spec.holderIdentity}' | grep -q . \
    || fail "the operator did not lead through the chart's Lease"

  # Uninstall, as helm does it (every templated object; CRDs stay): nothing
  # of the release may remain in its namespace, the leader Lease included.
  kill "${op}"; wait "${op}" 2>/dev/null || true
  "${HELM}" template headroom "${CHART}" --namespace "${NS}" --kube-version "${KUBE_VERSION:-v1.33.0}" \
    | k delete --ignore-not-found --wait=false -f - >/dev/null
  left=$(k -n "${NS}" get leases,roles,rolebindings,serviceaccounts,deployments,services -l app.kubernetes.io/instance=headroom -o name)
  stray=$(k -n "${NS}" get leases -o name)
  [[ -z ${left} && -z ${stray} ]] || fail "left behind after uninstall: ${left} ${stray}"
  echo "chart-check: uninstall leaves no Lease or RBAC behind"

  # One watched namespace: with only the namespaced RBAC (a Role there, the
  # ClusterRole for nodes, TokenReviews and reading pods) the operator runs a
  # job in that namespace and leaves a job in another one alone.
  scoped=$("${HELM}" template headroom "${CHART}" --namespace "${NS}" --kube-version "${KUBE_VERSION:-v1.33.0}" --set watchNamespace="${watch_ns}")
  k create namespace "${watch_ns}" >/dev/null
  k create namespace "${other_ns}" >/dev/null
  k -n "${watch_ns}" create serviceaccount default >/dev/null
  k -n "${NS}" delete leases --all >/dev/null
  k apply --server-side --force-conflicts -f - <<<"${scoped}" >/dev/null
  k -n "${NS}" scale deployment headroom-operator --replicas=0 >/dev/null
  token=$(k -n "${NS}" create token headroom-operator --duration=10m)
  sed -i "s|token: \".*\"|token: \"${token}\"|" "${sa_kubeconfig}"
  KUBECONFIG=${sa_kubeconfig} POD_NAMESPACE=${NS} RUST_LOG=info "${CARGO_TARGET_DIR}/debug/headroom-operator" \
    --metrics-addr 127.0.0.1:0 --probe-addr 127.0.0.1:0 --lease-seconds 5 --lease-name headroom-operator-leader --watch-namespace "${watch_ns}" \
    --worker-api-addr "127.0.0.1:${worker_api_port}" --worker-api-service headroom-operator-worker-api >"${log}" 2>&1 &
  op=$!
  k apply -n "${other_ns}" -f samples/cpu-oom-first.yaml >/dev/null
  k apply -n "${watch_ns}" -f samples/cpu-oom-first.yaml >/dev/null
  ok=0
  for _ in $(seq 1 150); do
    if k -n "${watch_ns}" get pod oom-then-fit-a1-s0 >/dev/null 2>&1; then ok=1; break; fi
    sleep 0.2
  done
  ((ok)) || { cat "${log}" >&2; fail "with watchNamespace the operator could not create the worker pod with the chart's namespaced RBAC"; }
  k -n "${watch_ns}" get memoryawaretrainingjob oom-then-fit -o jsonpath='{.status.phase}' | grep -q . \
    || { cat "${log}" >&2; fail "with watchNamespace the operator did not write the job's status"; }
  sleep 1
  [[ -z $(k -n "${other_ns}" get pods -o name) ]] || fail "with watchNamespace=${watch_ns} the operator created pods in ${other_ns}"
  [[ -z $(k -n "${other_ns}" get memoryawaretrainingjob oom-then-fit -o jsonpath='{.status.phase}') ]] \
    || fail "with watchNamespace=${watch_ns} the operator wrote a status in ${other_ns}"
  if grep -iE 'forbidden|cannot (create|patch|get|list|watch)' "${log}" | grep -v 'NamespaceTerminating'; then fail "the chart's namespaced RBAC is missing a permission the operator uses"; fi
  echo "chart-check: with watchNamespace the operator ran a job with only the chart's namespaced RBAC"
  kill "${op}"; wait "${op}" 2>/dev/null || true
  k delete --ignore-not-found --wait=false -f - <<<"${scoped}" >/dev/null
fi
echo "chart-check: ok"
