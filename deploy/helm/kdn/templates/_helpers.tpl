{{/* Names and labels. */}}
{{- define "kdn.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kdn.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kdn.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kdn.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* etcd://HOST:PORT[/prefix] for --registry. */}}
{{- define "kdn.registry" -}}
{{- if .Values.etcd.deploy -}}
etcd://{{ include "kdn.fullname" . }}-etcd:2379{{ .Values.etcd.prefix }}
{{- else -}}
{{- required "set etcd.endpoint (etcd://HOST:PORT[/prefix]) or etcd.deploy=true" .Values.etcd.endpoint -}}
{{- end -}}
{{- end -}}

{{- define "kdn.secretName" -}}
{{- required "auth.existingSecret: create a Secret holding tokens.txt and edge.token (see values.yaml)" .Values.auth.existingSecret -}}
{{- end -}}
