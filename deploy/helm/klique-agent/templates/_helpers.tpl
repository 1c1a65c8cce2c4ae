{{- define "klique-agent.name" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "klique-agent.labels" -}}
app.kubernetes.io/name: klique-agent
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "klique-agent.selector" -}}
app.kubernetes.io/name: klique-agent
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "klique-agent.tokenSecret" -}}
{{- .Values.token.existingSecret | default (printf "%s-token" (include "klique-agent.name" .)) -}}
{{- end -}}

{{- define "klique-agent.config" -}}
[agent.kubernetes]
namespace = {{ .Release.Namespace | quote }}
outputs_dir = "/klique-work"
poll_seconds = 1.0
gpu_resource = {{ .Values.kubernetes.gpuResource | quote }}
shared_gpu_resource = {{ .Values.kubernetes.sharedGpuResource | quote }}
default_image = {{ .Values.kubernetes.defaultImage | quote }}
relay_image = {{ .Values.kubernetes.relayImage | default (printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion)) | quote }}
ttl_seconds_after_finished = {{ .Values.kubernetes.ttlSecondsAfterFinished | int }}
gang_seconds = {{ .Values.kubernetes.gangSeconds | int }}
image_pull_seconds = {{ .Values.kubernetes.imagePullSeconds | int }}
leader_election = true
lease_seconds = {{ .Values.kubernetes.leaseSeconds | int }}
{{- with .Values.kubernetes.localQueue }}
local_queue = {{ . | quote }}
{{- end }}
{{- with .Values.kubernetes.scratchSize }}
scratch_size = {{ . | quote }}
{{- end }}
{{- if and .Values.kubernetes.sharedFilesystem.path .Values.kubernetes.sharedFilesystem.claimName }}
shared_path = {{ .Values.kubernetes.sharedFilesystem.path | quote }}
shared_volume = { persistentVolumeClaim = { claimName = {{ .Values.kubernetes.sharedFilesystem.claimName | quote }} } }
{{- end }}
{{- with .Values.workVolume.claimName }}
work_volume = { persistentVolumeClaim = { claimName = {{ . | quote }} } }
{{- end }}

[agent.kubernetes.volumes]
{{- range $name, $volume := .Values.volumes }}
{{ $name | quote }} = { path = {{ $volume.path | quote }}, read_only = {{ if eq (toString $volume.readOnly) "false" }}false{{ else }}true{{ end }}, source = { persistentVolumeClaim = { claimName = {{ $volume.claimName | quote }} } } }
{{- end }}

[agent.kubernetes.templates]
{{- range $name, $text := .Values.templates }}
{{ $name | quote }} = {{ $text | toJson }}
{{- end }}
{{- end -}}
