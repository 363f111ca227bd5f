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

{{/* etcd[s]://[USER@]HOST:PORT[/prefix][?ca=&cert=&key=&password_file=] for --registry:
     the endpoint (deployed or yours), then the client credentials mounted at /etc/kdn/etcd. */}}
{{- define "kdn.registry" -}}
{{- $c := .Values.etcd.client -}}
{{- $base := "" -}}
{{- if .Values.etcd.deploy -}}
{{- $base = printf "%s-etcd:2379%s" (include "kdn.fullname" .) .Values.etcd.prefix -}}
{{- else -}}
{{- $base = required "set etcd.endpoint (HOST:PORT[/prefix]) or etcd.deploy=true" .Values.etcd.endpoint | trimPrefix "etcd://" | trimPrefix "etcds://" -}}
{{- end -}}
{{- $opts := list -}}
{{- if $c.ca }}{{ $opts = append $opts "ca=/etc/kdn/etcd/ca.crt" }}{{ end -}}
{{- if $c.cert }}{{ $opts = append $opts "cert=/etc/kdn/etcd/tls.crt&key=/etc/kdn/etcd/tls.key" }}{{ end -}}
{{- if $c.user }}{{ $opts = append $opts "password_file=/etc/kdn/etcd/password" }}{{ end -}}
{{- if $c.tls }}etcds{{ else }}etcd{{ end }}://{{ with $c.user }}{{ . }}@{{ end }}{{ $base }}{{ with $opts }}?{{ join "&" . }}{{ end }}
{{- end -}}

{{/* Whether the etcd client Secret is mounted (any credential or CA from it). */}}
{{- define "kdn.etcdSecret" -}}
{{- $c := .Values.etcd.client -}}
{{- if or $c.ca $c.cert $c.user -}}
{{- required "etcd.client.secret: a Secret holding ca.crt, tls.crt/tls.key and/or password" $c.secret -}}
{{- end -}}
{{- end -}}

{{- define "kdn.secretName" -}}
{{- required "auth.existingSecret: create a Secret holding tokens.txt and edge.token (see values.yaml)" .Values.auth.existingSecret -}}
{{- end -}}
