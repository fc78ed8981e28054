{{/*
Where a pod may run: nodeSelector, tolerations, affinity, topologySpreadConstraints, runtimeClassName,
priorityClassName and schedulerName. The chart-wide `scheduling` values apply to every pod; each entry of
`overrides` (a component's or a Ray group's own `scheduling`, most specific last) replaces whole fields of it, so a
GPU group's tolerations are its own, not appended to the chart-wide ones. Args: root, overrides (a list of dicts,
entries may be nil). Renders pod-spec fields at the indentation of the caller.
*/}}
{{- define "sharpen.scheduling" -}}
{{- $scheduling := deepCopy (.root.Values.scheduling | default dict) -}}
{{- range .overrides -}}
{{- range $field, $value := (. | default dict) -}}
{{- $_ := set $scheduling $field $value -}}
{{- end -}}
{{- end -}}
{{- range $field := list "nodeSelector" "tolerations" "affinity" "topologySpreadConstraints" -}}
{{- with index $scheduling $field }}
{{ $field }}:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
{{- range $field := list "runtimeClassName" "priorityClassName" "schedulerName" -}}
{{- with index $scheduling $field }}
{{ $field }}: {{ . }}
{{- end }}
{{- end -}}
{{- end -}}
