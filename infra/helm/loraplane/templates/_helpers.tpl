{{/* Names, labels and the parts every loraplane pod shares. */}}

{{- define "loraplane.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loraplane.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "loraplane.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "loraplane.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* A Kubernetes name part from an id (ids may hold '.' and '_'). */}}
{{- define "loraplane.dnsPart" -}}
{{- regexReplaceAll "[^a-z0-9-]" (lower .) "-" | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "loraplane.labels" -}}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{ include "loraplane.selectorLabels" . }}
{{- end }}

{{- define "loraplane.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplane.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "loraplane.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "loraplane.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "loraplane.image" -}}
{{- $tag := default .root.Chart.AppVersion .tag -}}
{{ printf "%s:%s" .root.Values.image.repository $tag }}
{{- end }}

{{/* Where each runtime finds what the chart mounts (loraplane.yaml names them too). */}}
{{- define "loraplane.paths" -}}
home: /var/lib/loraplane
config: /etc/loraplane/config
secretFiles: /etc/loraplane/secret-files
secrets: /var/run/loraplane/secrets
keyring: /etc/loraplane/keyring
apiKeys: /etc/loraplane/api-keys
schedules: /etc/loraplane/schedules
{{- end }}

{{/* Every container: no privilege, no capability, a read-only root filesystem. */}}
{{- define "loraplane.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
{{- end }}

{{/* The Secret files of a runtime: its Kafka principal's password and `.files`
     (a list of {name, key, path}), as one projected volume's sources. */}}
{{- define "loraplane.secretSources" -}}
{{- $root := .root -}}
{{- $files := .files -}}
{{- if $root.Values.kafka.sasl.enabled }}
{{- $user := required (printf "kafka.sasl.users.%s" .principal) (index $root.Values.kafka.sasl.users .principal) }}
{{- $files = prepend $files (dict "name" $user.secretName "key" $root.Values.kafka.sasl.passwordKey "path" (printf "kafka/%s.password" .principal)) }}
{{- end }}
{{- range $files }}
- secret:
    name: {{ .name }}
    items:
      - key: {{ .key }}
        path: {{ .path }}
{{- end }}
{{- end }}

{{/* The init container that copies the Secret files, mode 0600, where the runtimes read
     them: `loraplane secrets install` (a Secret volume's files are group-readable). */}}
{{- define "loraplane.secretsInit" -}}
{{- $paths := include "loraplane.paths" . | fromYaml -}}
- name: secrets
  image: {{ include "loraplane.image" (dict "root" . "tag" .Values.image.tag) }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [loraplane]
  args: [secrets, install, --from, {{ $paths.secretFiles }}, --to, {{ $paths.secrets }}]
  securityContext:
    {{- include "loraplane.containerSecurityContext" . | nindent 4 }}
  resources:
    requests: {cpu: 50m, memory: 64Mi}
    limits: {memory: 128Mi}
  volumeMounts:
    - {name: secret-files, mountPath: {{ $paths.secretFiles }}, readOnly: true}
    - {name: secrets, mountPath: {{ $paths.secrets }}}
{{- end }}

{{/* The environment of every loraplane container: its settings file, and its Kafka user
     when that is not the principal's own name. */}}
{{- define "loraplane.env" -}}
{{- $paths := include "loraplane.paths" .root | fromYaml -}}
- name: LORAPLANE_CONFIG
  value: {{ $paths.config }}/loraplane.yaml
{{- if .root.Values.kafka.sasl.enabled }}
{{- $user := index .root.Values.kafka.sasl.users .principal }}
{{- if $user.username }}
- name: LORAPLANE_KAFKA__USERNAME
  value: {{ $user.username | quote }}
- name: LORAPLANE_KAFKA__PASSWORD_FILE
  value: {{ $paths.secrets }}/kafka/{{ .principal }}.password
{{- end }}
{{- end }}
{{- end }}

{{/* Volumes of every loraplane pod: settings, the Secret files and their private copies,
     the keyring, /tmp; `.apiKeys` and `.schedules` when the runtime reads them. */}}
{{- define "loraplane.volumes" -}}
- name: config
  configMap:
    name: {{ include "loraplane.fullname" .root }}-config
- name: secret-files
  projected:
    defaultMode: 256  # 0400; fsGroup adds group read, which the init container's copy drops
    sources:
      {{- include "loraplane.secretSources" . | trim | nindent 6 }}
- name: secrets
  emptyDir:
    medium: Memory
    sizeLimit: 1Mi
- name: keyring
  configMap:
    name: {{ .root.Values.keyring.configMapName }}
    items:
      - {key: {{ .root.Values.keyring.key }}, path: keyring.yaml}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
{{- if .apiKeys }}
- name: api-keys
  secret:
    secretName: {{ .root.Values.secrets.apiKeys.name }}
    defaultMode: 288  # 0440: digests only; read by the pod's group
    items:
      - {key: {{ .root.Values.secrets.apiKeys.key }}, path: api-keys.json}
{{- end }}
{{- if and .schedules .root.Values.schedules.configMapName }}
- name: schedules
  configMap:
    name: {{ .root.Values.schedules.configMapName }}
    items:
      - {key: {{ .root.Values.schedules.key }}, path: schedules.yaml}
{{- end }}
{{- end }}

{{- define "loraplane.volumeMounts" -}}
{{- $paths := include "loraplane.paths" .root | fromYaml -}}
- {name: config, mountPath: {{ $paths.config }}, readOnly: true}
- {name: secrets, mountPath: {{ $paths.secrets }}, readOnly: true}
- {name: keyring, mountPath: {{ $paths.keyring }}, readOnly: true}
- {name: home, mountPath: {{ $paths.home }}}
- {name: tmp, mountPath: /tmp}
{{- if .apiKeys }}
- {name: api-keys, mountPath: {{ $paths.apiKeys }}, readOnly: true}
{{- end }}
{{- if and .schedules .root.Values.schedules.configMapName }}
- {name: schedules, mountPath: {{ $paths.schedules }}, readOnly: true}
{{- end }}
{{- end }}

{{/* An HTTP probe set on a named port: startup (up to `.startupSeconds`), liveness,
     readiness. */}}
{{- define "loraplane.httpProbes" -}}
startupProbe:
  httpGet: {path: {{ .path }}, port: {{ .port }}}
  periodSeconds: 5
  failureThreshold: {{ div (.startupSeconds | int) 5 }}
livenessProbe:
  httpGet: {path: {{ .path }}, port: {{ .port }}}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
readinessProbe:
  httpGet: {path: {{ .path }}, port: {{ .port }}}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 2
{{- end }}

{{/* A control-plane runtime (router, streams app, scoring keepers, planner, sink) as a
     Deployment or StatefulSet. `.name` suffixes the workload's name, `.component` labels
     it, `.args` follow `loraplane`, `.port` is its listener ({name, port}) whose `.path`
     the probes ask, `.metricsPort` (optional) a second one named `metrics`, `.values` its
     section (replicas, resources, placement). */}}
{{- define "loraplane.runtime" -}}
{{- $root := .root -}}
{{- $v := .values -}}
{{- $name := printf "%s-%s" (include "loraplane.fullname" $root) .name -}}
{{- if and .metricsPort (eq (int .metricsPort) (int .port.port)) }}
{{- fail (printf "%s: metricsPort %d is its port too: the runtime would not start (two listeners on one port)" .name (int .metricsPort)) }}
{{- end }}
apiVersion: apps/v1
kind: {{ .kind }}
metadata:
  name: {{ $name }}
  labels:
    {{- include "loraplane.labels" . | nindent 4 }}
spec:
  replicas: {{ $v.replicas }}
  {{- if eq .kind "StatefulSet" }}
  serviceName: {{ $name }}
  podManagementPolicy: Parallel
  {{- else }}
  strategy:
    type: RollingUpdate
    rollingUpdate: {maxSurge: 1, maxUnavailable: 0}
  {{- end }}
  selector:
    matchLabels:
      {{- include "loraplane.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "loraplane.labels" . | nindent 8 }}
      annotations:
        checksum/config: {{ include (print $root.Template.BasePath "/config.yaml") $root | sha256sum }}
    spec:
      serviceAccountName: {{ include "loraplane.serviceAccountName" $root }}
      automountServiceAccountToken: false
      enableServiceLinks: false
      terminationGracePeriodSeconds: {{ .grace }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      initContainers:
        {{- include "loraplane.secretsInit" $root | nindent 8 }}
      containers:
        - name: {{ .component }}
          image: {{ include "loraplane.image" (dict "root" $root "tag" $root.Values.image.tag) }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: [loraplane]
          args:
            {{- toYaml .args | nindent 12 }}
          env:
            {{- include "loraplane.env" . | nindent 12 }}
            {{- with .env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - {name: {{ .port.name }}, containerPort: {{ .port.port }}, protocol: TCP}
            {{- with .metricsPort }}
            - {name: metrics, containerPort: {{ . }}, protocol: TCP}
            {{- end }}
          {{- include "loraplane.httpProbes" (dict "path" .path "port" .port.name "startupSeconds" (.startupSeconds | default 120)) | nindent 10 }}
          securityContext:
            {{- include "loraplane.containerSecurityContext" $root | nindent 12 }}
          resources:
            {{- toYaml $v.resources | nindent 12 }}
          volumeMounts:
            {{- include "loraplane.volumeMounts" . | nindent 12 }}
      volumes:
        {{- include "loraplane.volumes" . | nindent 8 }}
        - name: home
          emptyDir:
            sizeLimit: {{ .homeSize | default "2Gi" }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $v.affinity }}
      affinity:
        {{- toYaml $v.affinity | nindent 8 }}
      {{- else if .spread }}
      affinity:
        podAntiAffinity:
          preferredDuringSchedulingIgnoredDuringExecution:
            - weight: 100
              podAffinityTerm:
                topologyKey: kubernetes.io/hostname
                labelSelector:
                  matchLabels:
                    {{- include "loraplane.selectorLabels" . | nindent 20 }}
      {{- end }}
{{- end }}
