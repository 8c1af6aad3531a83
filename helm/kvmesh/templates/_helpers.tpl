{{- define "kvmesh.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvmesh.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvmesh.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvmesh.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvmesh.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvmesh.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvmesh.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The least-privilege rules: exactly the verbs the operator (and kopf) use. */}}
{{- define "kvmesh.rules" -}}
- apiGroups: [kvmesh.dev]
  resources: [llmservices]
  verbs: [get, list, watch, patch]
- apiGroups: [kvmesh.dev]
  resources: [llmservices/status]
  verbs: [get, patch]
- apiGroups: [ray.io]
  resources: [rayservices]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}

{{/* image.pullSecrets as comma-separated names (entries are names or {name: ...}). */}}
{{- define "kvmesh.pullSecretNames" -}}
{{- if hasKey .Values "imagePullSecrets" -}}
{{- fail "imagePullSecrets moved to image.pullSecrets (it is also the default of every LLMService pod)" -}}
{{- end -}}
{{- $names := list -}}
{{- range .Values.image.pullSecrets -}}
{{- if kindIs "string" . -}}
{{- $names = append $names . -}}
{{- else if kindIs "map" . -}}
{{- $names = append $names (get . "name") -}}
{{- end -}}
{{- end -}}
{{- join "," (compact $names) -}}
{{- end -}}
