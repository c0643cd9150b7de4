{{/*
The Deployment of one service (dict "root" $ "component" c). The three services share this shape;
what differs (storage, model cache, GPUs, autoscaling) is switched on the component's values.
*/}}
{{- define "specwire.deployment" -}}
{{- $root := .root -}}
{{- $c := .component -}}
{{- $v := index $root.Values $c -}}
{{- $name := include "specwire.componentName" . -}}
{{- $health := include "specwire.healthService" . -}}
{{- $scripts := printf "%s-scripts" (include "specwire.fullname" $root) -}}
{{- /* The registry keeps its data on a volume unless it is stored in PostgreSQL. */ -}}
{{- $dataVolume := and (eq $c "config") (not (include "specwire.postgresql" $root)) -}}
{{- /* NCCL between the ranks of a tensor-parallel target passes data through /dev/shm, which container
runtimes cap at 64 MiB: a memory-backed volume of its own there. */ -}}
{{- $sharedMemory := and (eq $c "target") (gt (int (default 1 $v.tensorParallel)) 1) (include "specwire.gpuEnabled" .) -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specwire.labels" . | nindent 4 }}
  {{- include "specwire.annotations" (dict "root" $root) }}
spec:
  {{- if not (and (hasKey $v "autoscaling") $v.autoscaling.enabled) }}
  replicas: {{ $v.replicaCount }}
  {{- end }}
  revisionHistoryLimit: 5
  selector:
    matchLabels:
      {{- include "specwire.selectorLabels" . | nindent 6 }}
  {{- if $dataVolume }}
  # One SQLite writer on a ReadWriteOnce volume: the old pod must be gone before the new one mounts it.
  strategy:
    type: Recreate
  {{- else if eq $c "config" }}
  # The registry in PostgreSQL: replicas share no volume, so they roll one by one without a gap.
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0
  {{- else if $v.updateStrategy }}
  strategy:
    {{- toYaml $v.updateStrategy | nindent 4 }}
  {{- end }}
  template:
    metadata:
      labels:
        {{- include "specwire.podLabels" . | nindent 8 }}
      annotations:
        checksum/settings: {{ include "specwire.settings" . | sha256sum }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "specwire.serviceAccountName" $root }}
      automountServiceAccountToken: {{ $root.Values.serviceAccount.automountToken }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      {{- with $root.Values.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ $c }}
          image: {{ include "specwire.image" (dict "root" $root "image" $v.image) | quote }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command:
            - {{ printf "%s-service" $c }}
          args:
            {{- include "specwire.args" . | nindent 12 }}
          ports:
            - name: grpc
              containerPort: {{ $v.port }}
              protocol: TCP
            {{- if $root.Values.metrics.enabled }}
            - name: metrics
              containerPort: {{ $root.Values.metrics.port }}
              protocol: TCP
            {{- end }}
          envFrom:
            - configMapRef:
                name: {{ $name }}
            {{- with $v.envFrom }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          env:
            - name: POD_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            - name: POD_NAMESPACE
              valueFrom:
                fieldRef:
                  fieldPath: metadata.namespace
            {{- if $root.Values.otel.enabled }}
            {{- $attrs := list "k8s.namespace.name=$(POD_NAMESPACE)" "k8s.pod.name=$(POD_NAME)" (printf "service.version=%s" $root.Chart.AppVersion) }}
            {{- range $k, $val := $root.Values.otel.resourceAttributes }}
            {{- $attrs = append $attrs (printf "%s=%s" $k $val) }}
            {{- end }}
            - name: OTEL_RESOURCE_ATTRIBUTES
              value: {{ join "," $attrs | quote }}
            {{- with $root.Values.otel.headersSecret.name }}
            - name: OTEL_EXPORTER_OTLP_HEADERS
              valueFrom:
                secretKeyRef:
                  name: {{ . }}
                  key: {{ $root.Values.otel.headersSecret.key }}
            {{- end }}
            {{- end }}
            {{- with $root.Values.auth.existingSecret }}
            - name: SPECWIRE_AUTH_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {{ . }}
                  key: {{ $root.Values.auth.secretKey }}
            {{- end }}
            {{- if and (eq $c "config") $root.Values.auth.adminExistingSecret }}
            - name: SPECWIRE_ADMIN_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {{ $root.Values.auth.adminExistingSecret }}
                  key: {{ $root.Values.auth.adminSecretKey }}
            {{- end }}
            {{- if and (hasKey $v "model") $v.model.hfTokenSecret.name }}
            - name: HF_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {{ $v.model.hfTokenSecret.name }}
                  key: {{ $v.model.hfTokenSecret.key }}
            {{- end }}
            {{- if and (eq $c "config") (include "specwire.postgresql" $root) }}
            # The registry's PostgreSQL URL: config-service's --db default (no --db argument is passed).
            - name: SPECWIRE_DB
              valueFrom:
                secretKeyRef:
                  name: {{ $v.postgresql.existingSecret }}
                  key: {{ $v.postgresql.secretKey }}
            {{- end }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- if $v.probes.startup.enabled }}
          startupProbe:
            {{- include "specwire.probe" (dict "root" $root "component" $c "probe" $v.probes.startup "service" "") | trim | nindent 12 }}
          {{- end }}
          {{- if $v.probes.liveness.enabled }}
          livenessProbe:
            {{- include "specwire.probe" (dict "root" $root "component" $c "probe" $v.probes.liveness "service" "") | trim | nindent 12 }}
          {{- end }}
          {{- if $v.probes.readiness.enabled }}
          readinessProbe:
            {{- include "specwire.probe" (dict "root" $root "component" $c "probe" $v.probes.readiness "service" $health) | trim | nindent 12 }}
          {{- end }}
          {{- if gt (int $v.preStopSleepSeconds) 0 }}
          lifecycle:
            preStop:
              exec:
                command: ["sleep", {{ $v.preStopSleepSeconds | quote }}]
          {{- end }}
          resources:
            {{- include "specwire.resources" . | nindent 12 }}
          {{- with $root.Values.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- if $sharedMemory }}
            - name: dshm
              mountPath: /dev/shm
            {{- end }}
            {{- if $dataVolume }}
            - name: data
              mountPath: {{ $v.persistence.mountPath }}
            {{- end }}
            {{- if hasKey $v "model" }}
            - name: model-cache
              mountPath: {{ $v.model.cache.mountPath }}
            {{- end }}
            {{- if $root.Values.tls.enabled }}
            - name: tls
              mountPath: /etc/specwire/tls
              readOnly: true
            - name: scripts
              mountPath: /etc/specwire/scripts
              readOnly: true
            {{- end }}
            {{- with $v.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir:
            sizeLimit: {{ $v.tmpSizeLimit }}
        {{- if $sharedMemory }}
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: 1Gi
        {{- end }}
        {{- if $dataVolume }}
        - name: data
          {{- if $v.persistence.enabled }}
          persistentVolumeClaim:
            claimName: {{ $v.persistence.existingClaim | default (printf "%s-data" $name) }}
          {{- else }}
          emptyDir:
            sizeLimit: {{ $v.persistence.emptyDirSizeLimit }}
          {{- end }}
        {{- end }}
        {{- if hasKey $v "model" }}
        - name: model-cache
          {{- if $v.model.cache.existingClaim }}
          persistentVolumeClaim:
            claimName: {{ $v.model.cache.existingClaim }}
          {{- else }}
          emptyDir:
            sizeLimit: {{ $v.model.cache.sizeLimit }}
          {{- end }}
        {{- end }}
        {{- if $root.Values.tls.enabled }}
        - name: tls
          secret:
            secretName: {{ include "specwire.tlsSecretName" . }}
        - name: scripts
          configMap:
            name: {{ $scripts }}
        {{- end }}
        {{- with $v.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end -}}
