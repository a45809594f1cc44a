{{- define "headroom.name" -}}
{{- default "headroom-operator" .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "headroom.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if .Values.nameOverride -}}
{{- if contains .Values.nameOverride .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- else if contains "headroom" .Release.Name -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-headroom-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "headroom.labels" -}}
app.kubernetes.io/name: {{ include "headroom.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* A default worker image, repository:tag (the tag defaults to the chart's
appVersion); empty when its repository is "". */}}
{{- define "headroom.workerImage" -}}
{{- with .image.repository -}}
{{- printf "%s:%s" . ($.image.tag | default $.chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/* A file of cluster-scoped objects (files/*-policy.yaml, also read by
the tests as written) with the chart's labels on each object: inserted under
each top-level `metadata:`, the rest as written. */}}
{{- define "headroom.withChartLabels" -}}
{{- $labels := printf "metadata:\n  labels:\n%s\n" (include "headroom.labels" .root | indent 4) -}}
{{- regexReplaceAll "(?m)^metadata:\n" .text $labels -}}
{{- end -}}

{{- define "headroom.selectorLabels" -}}
app.kubernetes.io/name: {{ include "headroom.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The operator's rules on namespaced resources: in a ClusterRole when it
watches every namespace, in a Role of the one it watches otherwise. */}}
{{- define "headroom.namespacedRules" -}}
# delete: a finished job whose spec.ttlSecondsAfterFinished has passed.
- apiGroups: ["headroom.dev"]
  resources: ["memoryawaretrainingjobs"]
  verbs: ["get", "list", "watch", "delete"]
# Status: the operator's own fields (a merge patch), and the workers'
# telemetry entries, which workers post to the worker API and the operator
# writes together (server-side apply).
- apiGroups: ["headroom.dev"]
  resources: ["memoryawaretrainingjobs/status"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Checkpoint claims and the headless Service of multi-worker jobs; `get` on
# services also reads the worker API's own Service address at start.
- apiGroups: [""]
  resources: ["services", "persistentvolumeclaims"]
  verbs: ["get", "create", "patch"]
# Claims are also watched, metadata only: a launch reads there whether its
# checkpoint claim exists and whose it is, instead of asking first.
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["list", "watch"]
# The shared model cache's claims have no owner: the operator deletes one
# no job has used for modelCache.idleSeconds.
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["delete"]
# The NetworkPolicy of each multi-worker attempt: its link ports admit the
# job's own workers only.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
# Kueue (jobs labelled kueue.x-k8s.io/queue-name): the job's LocalQueue, and
# the Workload of a queued attempt's pod group for Kueue's waiting reason.
# Read only: Kueue admits, Headroom never writes its objects.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["localqueues", "workloads"]
  verbs: ["get"]
{{- end -}}

{{/* The operator's rules on cluster-scoped resources: always in its ClusterRole. */}}
{{- define "headroom.clusterRules" -}}
# The worker API checks each worker's pod-bound token.
- apiGroups: ["authentication.k8s.io"]
  resources: ["tokenreviews"]
  verbs: ["create"]
# A job whose checkpoint claim filled up: whether its StorageClass lets the
# operator grow the claim (allowVolumeExpansion).
- apiGroups: ["storage.k8s.io"]
  resources: ["storageclasses"]
  verbs: ["get"]
{{- if .Values.metrics.authorization }}
# metrics.authorization: whether a scraper's user may get /metrics.
- apiGroups: ["authorization.k8s.io"]
  resources: ["subjectaccessreviews"]
  verbs: ["create"]
{{- end }}
# The GPU inventory (GPU Feature Discovery labels, allocatable devices).
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list", "watch"]
# Kueue: the flavors and quota of a queued job's ClusterQueue, to plan within them.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["clusterqueues", "resourceflavors"]
  verbs: ["get"]
{{- end -}}
