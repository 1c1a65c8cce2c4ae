{{- define "klique.name" -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "klique.labels" -}}
app.kubernetes.io/name: klique
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "klique.selector" -}}
app.kubernetes.io/name: klique
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "klique.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The environment every process reads (config/settings/production.py). */}}
{{- define "klique.env" -}}
- name: DJANGO_SETTINGS_MODULE
  value: config.settings.production
- name: KLIQUE_BASE_DOMAIN
  value: {{ .Values.baseDomain | quote }}
{{- with .Values.extraHosts }}
- name: KLIQUE_EXTRA_HOSTS
  value: {{ join "," . | quote }}
{{- end }}
- name: KLIQUE_FILES_DIR
  value: /var/lib/klique-files
- name: KLIQUE_MAX_OUTPUT_MB
  value: {{ .Values.files.maxOutputMb | quote }}
- name: KLIQUE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: DATABASE_URL
  valueFrom: {secretKeyRef: {name: {{ .Values.secrets.name }}, key: {{ .Values.secrets.databaseUrlKey }}}}
- name: REDIS_URL
  valueFrom: {secretKeyRef: {name: {{ .Values.secrets.name }}, key: {{ .Values.secrets.redisUrlKey }}}}
- name: SECRET_KEY
  valueFrom: {secretKeyRef: {name: {{ .Values.secrets.name }}, key: {{ .Values.secrets.secretKeyKey }}}}
- name: KLIQUE_MASTER_KEYS
  valueFrom: {secretKeyRef: {name: {{ .Values.secrets.name }}, key: {{ .Values.secrets.masterKeysKey }}}}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "klique.podSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "klique.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- define "klique.scheduling" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "klique.filesVolume" -}}
- name: files
{{- if .Values.files.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.files.existingClaim }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}
