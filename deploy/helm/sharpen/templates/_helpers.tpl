{{/* Names and labels. Every object is "<release>-<component>" and carries the component label. */}}
{{- define "sharpen.fullname" -}}
{{- printf "%s-%s" .root.Release.Name .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sharpen.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "sharpen.labels" -}}
{{ include "sharpen.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* The label that the NetworkPolicies admit as a caller of the services. */}}
{{- define "sharpen.clientLabel" -}}
{{ .Values.clientLabel.key }}: {{ .Values.clientLabel.value | quote }}
{{- end -}}

{{- define "sharpen.image" -}}
{{- $image := index .root.Values.images .key -}}
image: {{ printf "%s:%s" $image.repository $image.tag | quote }}
imagePullPolicy: {{ $image.pullPolicy }}
{{- end -}}

{{- define "sharpen.authSecret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" .Release.Name) -}}
{{- end -}}

{{/*
Pod-level security: non-root, a fixed uid, no service-account token (no pod here talks to the Kubernetes API).
Takes root and optionally seccompProfile (the sandbox's own); everything else runs under RuntimeDefault.
*/}}
{{- define "sharpen.podSecurity" -}}
automountServiceAccountToken: false
serviceAccountName: {{ .root.Release.Name }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  runAsNonRoot: true
  runAsUser: {{ .root.Values.podSecurity.runAsUser }}
  runAsGroup: {{ .root.Values.podSecurity.runAsGroup }}
  fsGroup: {{ .root.Values.podSecurity.fsGroup }}
  seccompProfile:
    {{- toYaml (.seccompProfile | default (dict "type" "RuntimeDefault")) | nindent 4 }}
{{- end -}}

{{/*
Container-level security, the same for every container: read-only root, no capabilities, no escalation, non-root.
Takes optionally seccompProfile and extra (a dict of further securityContext fields; only the sandbox has any).
*/}}
{{- define "sharpen.containerSecurity" -}}
{{- $context := dict "runAsNonRoot" true "allowPrivilegeEscalation" false "readOnlyRootFilesystem" true -}}
{{- $_ := set $context "capabilities" (dict "drop" (list "ALL")) -}}
{{- $_ := set $context "seccompProfile" (.seccompProfile | default (dict "type" "RuntimeDefault")) -}}
securityContext:
  {{- toYaml (merge (.extra | default dict) $context) | nindent 2 }}
{{- end -}}

{{/* Requests and limits, plus `gpus` NVIDIA GPUs in both when gpus > 0. */}}
{{- define "sharpen.resources" -}}
{{- $resources := deepCopy .resources -}}
{{- if gt (int .gpus) 0 -}}
{{- $_ := set $resources.requests "nvidia.com/gpu" (int .gpus) -}}
{{- $_ := set $resources.limits "nvidia.com/gpu" (int .gpus) -}}
{{- end -}}
resources:
  {{- toYaml $resources | nindent 2 }}
{{- end -}}

{{/* The writable places of a read-only root filesystem: /tmp (also HOME) and, with shmSize, /dev/shm. */}}
{{- define "sharpen.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
{{- if .shmSize }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
{{- end }}
{{- end -}}

{{- define "sharpen.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if .shmSize }}
- name: shm
  mountPath: /dev/shm
{{- end }}
{{- end -}}

{{- define "sharpen.storageVolume" -}}
- name: {{ .name }}
{{- if .claim }}
  persistentVolumeClaim:
    claimName: {{ .claim }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{/* Ingress of a service's port: pods with the client label, plus networkPolicy.extraIngressFrom. */}}
{{- define "sharpen.clientIngress" -}}
- from:
    - podSelector:
        matchLabels:
          {{- include "sharpen.clientLabel" .root | nindent 10 }}
    {{- with .root.Values.networkPolicy.extraIngressFrom }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - protocol: TCP
      port: {{ .port }}
{{- end -}}

{{/* Egress to the cluster DNS only (kube-dns / CoreDNS answer on port 53). */}}
{{- define "sharpen.dnsEgress" -}}
- to:
    - namespaceSelector: {}
      podSelector:
        matchLabels:
          k8s-app: kube-dns
  ports:
    - protocol: UDP
      port: 53
    - protocol: TCP
      port: 53
{{- end -}}

{{/*
A queue-fronted HTTP server (sandbox, environment): Deployment with /healthz and /readyz probes, Service, HPA on
the `sharpen_queue_depth` Pods metric, PodDisruptionBudget. Its replicas hold state (relay sessions, episodes) that
the Service, which spreads every connection over the pods, must not move: each pod advertises its own address
(SHARPEN_ADVERTISE_URL, from its IP) in the answer that opens a session or an episode, and the client sends that
session's or episode's later calls to the pod directly (docs/scaling.md, "Stateful fleets behind Kubernetes").
Args: root, component, values (its section), args (the command line), and optionally isClient (the pods call other services), checksum, seccompProfile, securityExtra (further container securityContext
fields), podExtra (YAML added to the pod spec), volumes / mounts (extra YAML lists).
*/}}
{{- define "sharpen.queueServer" -}}
{{- $root := .root -}}
{{- $values := .values -}}
{{- $ctx := dict "root" $root "component" .component -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "sharpen.fullname" $ctx }}
  labels:
    {{- include "sharpen.labels" $ctx | nindent 4 }}
spec:
  {{- if not $values.autoscaling.enabled }}
  replicas: {{ $values.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "sharpen.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "sharpen.labels" $ctx | nindent 8 }}
        {{- if .isClient }}
        {{- include "sharpen.clientLabel" $root | nindent 8 }}
        {{- end }}
      annotations:
        checksum/config: {{ .checksum | default "" | quote }}
        # for Prometheus set-ups that discover pods by annotation; /metrics needs no token
        prometheus.io/scrape: "true"
        prometheus.io/port: {{ $values.port | quote }}
        prometheus.io/path: /metrics
    spec:
      {{- include "sharpen.podSecurity" (dict "root" $root "seccompProfile" .seccompProfile) | nindent 6 }}
      {{- include "sharpen.scheduling" (dict "root" $root "overrides" (list $values.scheduling)) | nindent 6 }}
      {{- with .podExtra }}
      {{- . | nindent 6 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          {{- include "sharpen.image" (dict "root" $root "key" "cpu") | nindent 10 }}
          command: [sharpen]
          args:
            {{- toYaml .args | nindent 12 }}
          ports:
            - name: http
              containerPort: {{ $values.port }}
          env:
            - name: HOME
              value: /tmp
            - name: HF_HUB_OFFLINE
              value: "1"
            - name: SHARPEN_SERVICE_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {{ include "sharpen.authSecret" $root }}
                  key: service-token
            # This pod's own address, given to clients with every session or episode it opens. POD_IP must come
            # first: Kubernetes expands $(POD_IP) only from variables defined above it.
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            - name: SHARPEN_ADVERTISE_URL
              value: {{ printf "http://$(POD_IP):%v" $values.port | quote }}
          livenessProbe:
            httpGet: {path: /healthz, port: http}
            periodSeconds: 10
            failureThreshold: 3
          readinessProbe:
            httpGet: {path: /readyz, port: http}
            periodSeconds: 5
            failureThreshold: 2
          startupProbe:
            httpGet: {path: /healthz, port: http}
            periodSeconds: 2
            failureThreshold: 60
          {{- include "sharpen.resources" (dict "resources" $values.resources "gpus" 0) | nindent 10 }}
          {{- include "sharpen.containerSecurity" (dict "seccompProfile" .seccompProfile "extra" .securityExtra) | nindent 10 }}
          volumeMounts:
            {{- include "sharpen.scratchMounts" dict | nindent 12 }}
            {{- with .mounts }}
            {{- . | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "sharpen.scratchVolumes" dict | nindent 8 }}
        {{- with .volumes }}
        {{- . | nindent 8 }}
        {{- end }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ include "sharpen.fullname" $ctx }}
  labels:
    {{- include "sharpen.labels" $ctx | nindent 4 }}
spec:
  selector:
    {{- include "sharpen.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: http
      port: {{ $values.port }}
      targetPort: http
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "sharpen.fullname" $ctx }}
  labels:
    {{- include "sharpen.labels" $ctx | nindent 4 }}
spec:
  maxUnavailable: {{ $values.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "sharpen.selectorLabels" $ctx | nindent 6 }}
{{- if $values.autoscaling.enabled }}
---
# Scales on the servers' own queue: `sharpen_queue_depth` from /metrics, served to the HPA as a Pods metric by a
# custom-metrics adapter (e.g. prometheus-adapter); without one the HPA reports the metric as missing and holds.
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "sharpen.fullname" $ctx }}
  labels:
    {{- include "sharpen.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "sharpen.fullname" $ctx }}
  minReplicas: {{ $values.autoscaling.minReplicas }}
  maxReplicas: {{ $values.autoscaling.maxReplicas }}
  metrics:
    - type: Pods
      pods:
        metric:
          name: sharpen_queue_depth
        target:
          type: AverageValue
          averageValue: {{ $values.autoscaling.targetQueueDepth | quote }}
{{- end }}
{{- end -}}

{{/* The Ray pods' helpers (both modes) are in _ray.tpl; the scheduling fields of every pod in _scheduling.tpl. */}}
