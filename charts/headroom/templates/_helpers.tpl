{{- define "headroom.name" -}}headroom-operator{{- end -}}

{{- define "headroom.fullname" -}}
{{- if contains "headroom" .Release.Name -}}
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

{{- define "headroom.selectorLabels" -}}
app.kubernetes.io/name: {{ include "headroom.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
