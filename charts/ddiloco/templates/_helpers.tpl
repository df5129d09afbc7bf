{{/*
Names and labels shared by every template. Object names stay within 63 characters.
*/}}

{{/* The chart's name, or nameOverride. */}}
{{- define "ddiloco.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Prefix of every object name: fullnameOverride, else the release name when it already holds the
chart's name ("ddiloco" -> "ddiloco"), else "<release>-<name>".
*/}}
{{- define "ddiloco.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "ddiloco.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-operator": the Deployment, its Service and ClusterRoles. */}}
{{- define "ddiloco.operatorName" -}}
{{- printf "%s-operator" (include "ddiloco.fullname" . | trunc 54 | trimSuffix "-") -}}
{{- end -}}

{{/*
The identity of remote-region mode: the fullname when it already ends in "-remote" (release
"ddiloco-remote" -> "ddiloco-remote", as the READMEs say), else "<fullname>-remote".
*/}}
{{- define "ddiloco.remoteName" -}}
{{- $full := include "ddiloco.fullname" . -}}
{{- if hasSuffix "-remote" $full -}}
{{- $full | trunc 57 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-remote" ($full | trunc 50 | trimSuffix "-") -}}
{{- end -}}
{{- end -}}

{{/* The ServiceAccount of either mode. */}}
{{- define "ddiloco.serviceAccountName" -}}
{{- if .Values.serviceAccount.name -}}
{{- .Values.serviceAccount.name -}}
{{- else if .Values.remoteRegion.enabled -}}
{{- include "ddiloco.remoteName" . -}}
{{- else -}}
{{- include "ddiloco.operatorName" . -}}
{{- end -}}
{{- end -}}

{{/* The operator's ServiceAccount as an RBAC subject (a list item). */}}
{{- define "ddiloco.operatorSubject" -}}
- kind: ServiceAccount
  name: {{ include "ddiloco.serviceAccountName" . }}
  namespace: {{ .Release.Namespace }}
{{- end -}}

{{/* Labels that select a component's pods; pass (dict "ctx" $ "component" "operator"). */}}
{{- define "ddiloco.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ddiloco.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Every object's labels; same argument as ddiloco.selectorLabels. */}}
{{- define "ddiloco.labels" -}}
{{ include "ddiloco.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: ddiloco
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The image reference: repository@digest, else repository:tag (tag defaults to appVersion). */}}
{{- define "ddiloco.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/* The operator's liveness URL as seen from inside the cluster (the helm test pod). */}}
{{- define "ddiloco.healthUrl" -}}
{{- printf "http://%s.%s.svc:%d/healthz" (include "ddiloco.operatorName" .) .Release.Namespace (int .Values.operator.healthPort) -}}
{{- end -}}
