{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "blockserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: the release name, plus the chart name unless it already holds it. */}}
{{- define "blockserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "blockserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "blockserve.labels" -}}
helm.sh/chart: {{ include "blockserve.chart" . }}
{{ include "blockserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: blockserve
{{- end }}

{{- define "blockserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "blockserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels and selector labels of one component (api or engine): (dict "root" $ "component" "api"). */}}
{{- define "blockserve.componentLabels" -}}
{{ include "blockserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "blockserve.componentSelectorLabels" -}}
{{ include "blockserve.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "blockserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "blockserve.engineServiceName" -}}
{{ include "blockserve.fullname" . }}-engine
{{- end }}

{{/* Headless: its DNS name resolves to every engine pod's address (what the api pods route over). */}}
{{- define "blockserve.engineHeadlessServiceName" -}}
{{ include "blockserve.fullname" . }}-engine-headless
{{- end }}

{{- define "blockserve.apiKeySecretName" -}}
{{ .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "blockserve.fullname" .)) }}
{{- end }}

{{- define "blockserve.apiKeySecretKey" -}}
{{ ternary .Values.apiKey.existingSecretKey "api-key" (ne .Values.apiKey.existingSecret "") }}
{{- end }}

{{- define "blockserve.apiKeyEnabled" -}}
{{- if or .Values.apiKey.existingSecret .Values.apiKey.value }}true{{ end }}
{{- end }}

{{/* Whether the chart makes the API key Secret (from apiKey.value). */}}
{{- define "blockserve.apiKeySecretCreated" -}}
{{- if and .Values.apiKey.value (not .Values.apiKey.existingSecret) }}true{{ end }}
{{- end }}

{{/*
One setting as an environment variable value. Helm reads numbers in values files as float64,
which print as 5.36870912e+08; whole numbers are printed as integers instead.
*/}}
{{- define "blockserve.settingValue" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- end }}

{{/* The ConfigMap's data: every set `config` entry (null and "" are left out). */}}
{{- define "blockserve.configData" -}}
{{- range $name := keys .Values.config | sortAlpha }}
{{- $value := get $.Values.config $name }}
{{- if has $name (list "BLOCKSERVE_API_KEY" "BLOCKSERVE_SCHEDULER_ADDR" "BLOCKSERVE_ENGINE_DISCOVERY") }}
{{- fail (printf "config.%s is set by the chart: use %s instead" $name (ternary "apiKey.value or apiKey.existingSecret" "engine.schedulerPort" (eq $name "BLOCKSERVE_API_KEY"))) }}
{{- end }}
{{- if eq $name "BLOCKSERVE_API_KEYS" }}
{{- fail "config.BLOCKSERVE_API_KEYS holds secrets: put them in a Secret and name it in apiKeys.existingSecret" }}
{{- end }}
{{- if or (eq $name "BLOCKSERVE_SECRETS_DIR") (hasPrefix "BLOCKSERVE_CURVE_" $name) }}
{{- fail (printf "config.%s is set by the chart: use curve.enabled and curve.existingSecret instead" $name) }}
{{- end }}
{{- if eq $name "BLOCKSERVE_ALLOW_UNAUTHENTICATED" }}
{{- fail "config.BLOCKSERVE_ALLOW_UNAUTHENTICATED is set by the chart: curve.enabled=false sets it on the scheduler" }}
{{- end }}
{{- if not (or (kindIs "invalid" $value) (eq (toString $value) "")) }}
{{ $name }}: {{ include "blockserve.settingValue" $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* A change of the settings rolls the pods. */}}
{{- define "blockserve.configChecksum" -}}
checksum/config: {{ include "blockserve.configData" . | sha256sum }}
{{- end }}

{{- define "blockserve.drainSeconds" -}}
{{ .Values.config.BLOCKSERVE_DRAIN_TIMEOUT_S | ceil | int }}
{{- end }}

{{/* The settings ConfigMap for every container. */}}
{{- define "blockserve.envFrom" -}}
- configMapRef:
    name: {{ include "blockserve.fullname" . }}-config
{{- end }}

{{/* Writable places under a read-only root filesystem. */}}
{{- define "blockserve.writableVolumes" -}}
- name: tmp
  emptyDir: {}
- name: home
  emptyDir: {}
{{- end }}

{{- define "blockserve.writableVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/blockserve
{{- end }}

{{/* Pod-level settings shared by every pod of the chart. */}}
{{- define "blockserve.podSpecCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
# Service links would add variables such as BLOCKSERVE_PORT=tcp://... for a Service named
# "blockserve", colliding with the settings' BLOCKSERVE_ prefix.
enableServiceLinks: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/*
CURVE keys (see values.yaml, `curve`): the Secret's name. Without existingSecret the chart makes it from
curve.keys, or, with no keys given, the hook Job makes it once.
*/}}
{{- define "blockserve.curveSecretName" -}}
{{ .Values.curve.existingSecret | default (printf "%s-curve" (include "blockserve.fullname" .)) }}
{{- end }}

{{- define "blockserve.curveSecretCreated" -}}
{{- if and .Values.curve.enabled (not .Values.curve.existingSecret) .Values.curve.keys }}
{{- range $key := list "server-public-key" "server-secret-key" "api-public-key" "api-secret-key" "worker-public-key" "worker-secret-key" }}
{{- if not (get $.Values.curve.keys $key) }}
{{- fail (printf "curve.keys needs all six keys of `blockserve keys` (curve.keys.%s is missing), or none: the keys Job then makes them" $key) }}
{{- end }}
{{- end }}true
{{- end }}
{{- end }}

{{- define "blockserve.curveKeysJob" -}}
{{- if and .Values.curve.enabled (not .Values.curve.existingSecret) (not .Values.curve.keys) }}true{{ end }}
{{- end }}

{{/* The keys Job's ServiceAccount, Role and RoleBinding share this name. */}}
{{- define "blockserve.curveKeysJobName" -}}
{{ include "blockserve.fullname" . }}-curve-keys
{{- end }}

{{/* The hook annotations of the keys Job and what it needs, created in `weight` order before it. */}}
{{- define "blockserve.curveKeysHook" -}}
helm.sh/hook: pre-install,pre-upgrade
helm.sh/hook-weight: {{ . | quote }}
helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
{{- end }}

{{/*
A container's CURVE keys, when curve.enabled: (dict "root" $ "role" "scheduler"|"api"|"worker"). The env
entry and the volume mount go in the container, the volume in the pod; each file is named after the
setting it sets.
*/}}
{{- define "blockserve.curveFiles" -}}
{{- if eq .role "scheduler" }}
- key: server-secret-key
  path: BLOCKSERVE_CURVE_SERVER_SECRET_KEY
- key: api-public-key
  path: BLOCKSERVE_CURVE_API_CLIENT_KEYS
- key: worker-public-key
  path: BLOCKSERVE_CURVE_WORKER_CLIENT_KEYS
{{- else }}
- key: server-public-key
  path: BLOCKSERVE_CURVE_SERVER_KEY
- key: {{ .role }}-secret-key
  path: BLOCKSERVE_CURVE_CLIENT_SECRET_KEY
{{- end }}
{{- end }}

{{- define "blockserve.curveEnv" -}}
- name: BLOCKSERVE_SECRETS_DIR
  value: {{ .root.Values.curve.mountPath | quote }}
{{- end }}

{{- define "blockserve.curveVolumeMount" -}}
- name: curve-{{ .role }}
  mountPath: {{ .root.Values.curve.mountPath }}
  readOnly: true
{{- end }}

{{- define "blockserve.curveVolume" -}}
- name: curve-{{ .role }}
  secret:
    secretName: {{ include "blockserve.curveSecretName" .root }}
    # Owner and group (fsGroup) may read: the containers run as a non-root user.
    defaultMode: 0440
    items:
      {{- include "blockserve.curveFiles" . | trim | nindent 6 }}
{{- end }}

{{/* Changed chart-made keys roll the pods. */}}
{{- define "blockserve.curveChecksum" -}}
{{- if include "blockserve.curveSecretCreated" . }}
checksum/curve: {{ toJson .Values.curve.keys | sha256sum }}
{{- end }}
{{- end }}
