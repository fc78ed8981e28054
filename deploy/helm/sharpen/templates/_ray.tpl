{{/*
The Ray part's helpers, shared by both modes (ray.mode): `kuberay` renders a RayCluster and a RayJob for the KubeRay
operator, `static` plain Deployments and a Job. A head or worker pod is the same pod in either mode; only who
starts `ray start` differs (KubeRay builds the command from rayStartParams; static mode renders it from the same
parameters).
*/}}

{{- define "sharpen.rayMode" -}}
{{- $mode := .Values.ray.mode -}}
{{- if not (has $mode (list "kuberay" "static")) -}}
{{- fail (printf "ray.mode must be kuberay or static, not %q" $mode) -}}
{{- end -}}
{{- $mode -}}
{{- end -}}

{{/* The RayCluster's name (kuberay; KubeRay names the head Service "<name>-head-svc"): at most 53 characters. */}}
{{- define "sharpen.rayClusterName" -}}
{{- include "sharpen.fullname" (dict "root" . "component" "ray") | trunc 53 | trimSuffix "-" -}}
{{- end -}}

{{/* The GCS address of the static cluster's head Service. */}}
{{- define "sharpen.rayHeadAddress" -}}
{{ include "sharpen.fullname" (dict "root" . "component" "ray-head") }}:6379
{{- end -}}

{{/* Labels of every pod of the Ray part (nodes, the driver, the job submitter): the NetworkPolicy's selector. */}}
{{- define "sharpen.rayLabels" -}}
sharpen-ray-cluster: {{ .Release.Name }}
{{ include "sharpen.clientLabel" . }}
{{- end -}}

{{/* Ray's token authentication: every node, driver, submitter and the autoscaler present the same token. */}}
{{- define "sharpen.rayAuthEnv" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "sharpen.authSecret" . }}
      key: ray-token
{{- end -}}

{{- define "sharpen.rayEnv" -}}
- name: HOME
  value: /tmp
- name: HF_HUB_OFFLINE
  value: "1"
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{ include "sharpen.rayAuthEnv" . }}
# The bearer token the run's clients present to the sandbox, environment and reward-model servers.
- name: SHARPEN_SERVICE_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "sharpen.authSecret" . }}
      key: service-token
{{- with .Values.ray.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Args: root, shmSize (the node's /dev/shm, where Ray keeps its object store), recipe (mount the run's recipe). */}}
{{- define "sharpen.rayMounts" -}}
{{ include "sharpen.scratchMounts" (dict "shmSize" .shmSize) }}
- {name: models, mountPath: /models, readOnly: true}
- {name: runs, mountPath: /runs}
{{- if .recipe }}
- {name: recipe, mountPath: /etc/sharpen, readOnly: true}
{{- end }}
{{- end -}}

{{- define "sharpen.rayVolumes" -}}
{{ include "sharpen.scratchVolumes" (dict "shmSize" .shmSize) }}
{{ include "sharpen.storageVolume" (dict "name" "models" "claim" .root.Values.storage.modelsClaim) }}
{{ include "sharpen.storageVolume" (dict "name" "runs" "claim" .root.Values.storage.runsClaim) }}
{{- if .recipe }}
- name: recipe
  configMap:
    name: {{ include "sharpen.fullname" (dict "root" .root "component" "train") }}
{{- end }}
{{- end -}}

{{/*
`ray start` parameters of a node, as a YAML map: the chart's own (ports, GPUs; strings, as KubeRay's
rayStartParams must be) with the group's `rayStartParams` over them, passed through unchanged (a non-string value
there fails validation against KubeRay's schema). Args: root, role (head|worker), group (its values).
*/}}
{{- define "sharpen.rayStartParams" -}}
{{- $params := dict "dashboard-agent-listen-port" "52365" "num-gpus" (toString (int .group.gpus)) -}}
{{- if eq .role "head" -}}
{{- $_ := merge $params (dict "port" "6379" "dashboard-host" "0.0.0.0" "dashboard-port" "8265" "ray-client-server-port" "10001") -}}
{{- end -}}
{{- toYaml (merge (deepCopy (.group.rayStartParams | default dict)) $params) -}}
{{- end -}}

{{/*
Probes with KubeRay's timings (ray-operator/controllers/ray/utils/constant.go, v1.7.0): liveness after 30 s, every
5 s, failing after 120 misses (10 minutes: a node busy in a long collective is not killed); readiness after 10 s,
every 5 s, 10 misses; timeouts of 5 s on the head, 2 s on workers. The route is the one KubeRay probes for
Ray >= 2.53, the dashboard agent's /api/healthz (the raylet, and on the head the GCS too; no token needed). KubeRay
injects its own probes only into a container that has none, so these hold in both modes. The startup probe gives a
first start (imports, joining the GCS) 5 minutes before liveness counts.
*/}}
{{- define "sharpen.rayProbes" -}}
{{- $timeout := ternary 5 2 (eq .role "head") -}}
startupProbe:
  httpGet: {path: /api/healthz, port: agent}
  periodSeconds: 5
  timeoutSeconds: {{ $timeout }}
  failureThreshold: 60
livenessProbe:
  httpGet: {path: /api/healthz, port: agent}
  initialDelaySeconds: 30
  periodSeconds: 5
  timeoutSeconds: {{ $timeout }}
  successThreshold: 1
  failureThreshold: 120
readinessProbe:
  httpGet: {path: /api/healthz, port: agent}
  initialDelaySeconds: 10
  periodSeconds: 5
  timeoutSeconds: {{ $timeout }}
  successThreshold: 1
  failureThreshold: 10
{{- end -}}

{{/*
A Ray node's pod template (metadata and spec), the same in both modes. Args: root, role (head|worker), name (the
worker group's name), group (its values), recipe (mount the run's recipe: the head of a RayJob's cluster runs the
driver), command (static mode: the container's command, a list; KubeRay writes its own).
*/}}
{{- define "sharpen.rayPodTemplate" -}}
{{- $root := .root -}}
{{- $ctx := dict "root" $root "component" (printf "ray-%s" .role) -}}
metadata:
  labels:
    {{- include "sharpen.labels" $ctx | nindent 4 }}
    {{- include "sharpen.rayLabels" $root | nindent 4 }}
    {{- if eq .role "worker" }}
    sharpen-ray-group: {{ .name }}
    {{- end }}
spec:
  {{- include "sharpen.podSecurity" (dict "root" $root) | nindent 2 }}
  {{- include "sharpen.scheduling" (dict "root" $root "overrides" (list $root.Values.ray.scheduling .group.scheduling)) | nindent 2 }}
  containers:
    - name: ray
      {{- include "sharpen.image" (dict "root" $root "key" "gpu") | nindent 6 }}
      {{- with .command }}
      command:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      env:
        {{- include "sharpen.rayEnv" $root | nindent 8 }}
      ports:
        - {name: agent, containerPort: 52365}
        {{- if eq .role "head" }}
        - {name: gcs-server, containerPort: 6379}
        - {name: dashboard, containerPort: 8265}
        - {name: client, containerPort: 10001}
        {{- end }}
      {{- include "sharpen.rayProbes" . | nindent 6 }}
      {{- include "sharpen.resources" (dict "resources" .group.resources "gpus" .group.gpus) | nindent 6 }}
      {{- include "sharpen.containerSecurity" dict | nindent 6 }}
      volumeMounts:
        {{- include "sharpen.rayMounts" (dict "shmSize" .group.shmSize "recipe" .recipe) | nindent 8 }}
  volumes:
    {{- include "sharpen.rayVolumes" (dict "root" $root "shmSize" .group.shmSize "recipe" .recipe) | nindent 4 }}
    {{- if and (eq .role "head") $root.Values.ray.autoscaling.enabled (eq (include "sharpen.rayMode" $root) "kuberay") }}
    # The autoscaler container (KubeRay adds it to the head pod) patches the RayCluster through the API server: only it
    # mounts a service-account token, the pod as a whole does not (automountServiceAccountToken: false).
    - name: autoscaler-token
      projected:
        sources:
          - serviceAccountToken: {path: token, expirationSeconds: 3600}
          - configMap: {name: kube-root-ca.crt, items: [{key: ca.crt, path: ca.crt}]}
          - downwardAPI: {items: [{path: namespace, fieldRef: {fieldPath: metadata.namespace}}]}
    {{- end }}
{{- end -}}

{{/* The enabled worker groups, sorted by name, as a YAML list of {name, group}. */}}
{{- define "sharpen.rayWorkerGroups" -}}
{{- $groups := list -}}
{{- range $name, $group := .Values.ray.workerGroups -}}
{{- if $group.enabled -}}
{{- $groups = append $groups (dict "name" $name "group" $group) -}}
{{- end -}}
{{- end -}}
{{- toYaml $groups -}}
{{- end -}}

{{/*
The spec of a RayCluster (kuberay mode), for the standalone RayCluster and a RayJob's own cluster alike. Args:
root, recipe (the head mounts the run's recipe: its driver runs there).
*/}}
{{- define "sharpen.rayClusterSpec" -}}
{{- $root := .root -}}
{{- $ray := $root.Values.ray -}}
rayVersion: {{ $ray.rayVersion | quote }}
enableInTreeAutoscaling: {{ $ray.autoscaling.enabled }}
{{- if $ray.autoscaling.enabled }}
autoscalerOptions:
  version: v2
  upscalingMode: {{ $ray.autoscaling.upscalingMode }}
  idleTimeoutSeconds: {{ $ray.autoscaling.idleTimeoutSeconds }}
  {{- include "sharpen.resources" (dict "resources" $ray.autoscaling.resources "gpus" 0) | nindent 2 }}
  {{- include "sharpen.containerSecurity" dict | nindent 2 }}
  env:
    - {name: HOME, value: /tmp}
    {{- include "sharpen.rayAuthEnv" $root | nindent 4 }}
  volumeMounts:
    - {name: tmp, mountPath: /tmp}
    - {name: autoscaler-token, mountPath: /var/run/secrets/kubernetes.io/serviceaccount, readOnly: true}
{{- end }}
{{- with $ray.gcsFaultTolerance }}
{{- if .enabled }}
# GCS fault tolerance: the head keeps the cluster's metadata in an external Redis, so a restarted head takes the
# cluster back and the workers (and their actors) wait for it instead of dying with it.
gcsFaultToleranceOptions:
  redisAddress: {{ required "ray.gcsFaultTolerance.redisAddress: the external Redis, HOST:PORT" .redisAddress | quote }}
  {{- with .redisPasswordSecret.name }}
  redisPassword:
    valueFrom:
      secretKeyRef:
        name: {{ . }}
        key: {{ $ray.gcsFaultTolerance.redisPasswordSecret.key }}
  {{- end }}
  {{- with .externalStorageNamespace }}
  externalStorageNamespace: {{ . | quote }}
  {{- end }}
{{- end }}
{{- end }}
headGroupSpec:
  rayStartParams:
    {{- include "sharpen.rayStartParams" (dict "root" $root "role" "head" "group" $ray.head) | nindent 4 }}
  template:
    {{- include "sharpen.rayPodTemplate" (dict "root" $root "role" "head" "group" $ray.head "recipe" .recipe) | nindent 4 }}
workerGroupSpecs:
  {{- range (include "sharpen.rayWorkerGroups" $root | fromYamlArray) }}
  - groupName: {{ .name }}
    replicas: {{ .group.replicas }}
    minReplicas: {{ .group.minReplicas }}
    maxReplicas: {{ .group.maxReplicas }}
    {{- with .group.numOfHosts }}
    numOfHosts: {{ . }}
    {{- end }}
    rayStartParams:
      {{- include "sharpen.rayStartParams" (dict "root" $root "role" "worker" "group" .group) | nindent 6 }}
    template:
      {{- include "sharpen.rayPodTemplate" (dict "root" $root "role" "worker" "name" .name "group" .group) | nindent 6 }}
  {{- end }}
{{- end -}}
