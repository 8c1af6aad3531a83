{{/* Labels of every monitoring object: the chart's, plus monitoring.labels (Prometheus selects by them). */}}
{{- define "kvmesh.monitoringLabels" -}}
{{ include "kvmesh.labels" . }}
{{- with .Values.monitoring.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The namespaces LLMServices live in: the operator's watchNamespaces, else any. */}}
{{- define "kvmesh.llmserviceNamespaces" -}}
{{- if empty .Values.watchNamespaces -}}
any: true
{{- else -}}
matchNames:
{{- range .Values.watchNamespaces }}
  - {{ . | quote }}
{{- end }}
{{- end -}}
{{- end -}}
