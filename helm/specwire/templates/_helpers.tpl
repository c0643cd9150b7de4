{{/*
Helpers shared by every template. All are prefixed with the chart name. Helpers that work on one
service take a dict: (dict "root" $ "component" "config"|"draft"|"target").
*/}}

{{/* Chart name, overridable with nameOverride. */}}
{{- define "specwire.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name prefix of every object: <release>-<chart>, or the release name when it contains the chart name. */}}
{{- define "specwire.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of one service's objects; the prefix is cut so that "-target" always fits in 63 characters. */}}
{{- define "specwire.componentName" -}}
{{- printf "%s-%s" (include "specwire.fullname" .root | trunc 56 | trimSuffix "-") .component -}}
{{- end -}}

{{/* Fully qualified DNS name of one service's Service. */}}
{{- define "specwire.componentHost" -}}
{{- printf "%s.%s.svc.%s" (include "specwire.componentName" .) .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{- define "specwire.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Selector labels: only app.kubernetes.io/{name,instance,component}. Selectors are immutable on a
Deployment, so user labels never go here (they would break `helm upgrade`).
*/}}
{{- define "specwire.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specwire.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}

{{/* The chart's own metadata labels. */}}
{{- define "specwire.standardLabels" -}}
helm.sh/chart: {{ include "specwire.chart" .root }}
{{ include "specwire.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: specwire
{{- end -}}

{{/* Metadata labels: the chart's labels plus commonLabels (the chart's keys win on a clash). */}}
{{- define "specwire.labels" -}}
{{- $std := include "specwire.standardLabels" . | fromYaml -}}
{{- toYaml (merge $std (.root.Values.commonLabels | default dict)) -}}
{{- end -}}

{{/* Pod template labels: metadata labels plus the service's podLabels (the chart's keys win). */}}
{{- define "specwire.podLabels" -}}
{{- $v := index .root.Values .component -}}
{{- $labels := include "specwire.labels" . | fromYaml -}}
{{- toYaml (merge $labels ($v.podLabels | default dict)) -}}
{{- end -}}

{{/* metadata.annotations (at indent 2, after a newline) from commonAnnotations plus an optional dict "extra"; empty when none. */}}
{{- define "specwire.annotations" -}}
{{- $all := merge (dict) (.extra | default dict) (.root.Values.commonAnnotations | default dict) -}}
{{- if $all }}
{{ printf "annotations:\n%s" (toYaml $all | indent 2) | indent 2 }}
{{- end -}}
{{- end -}}

{{/*
Image reference for an image block (dict "root" $ "image" <repository/tag/variant>). A per-service
tag is used verbatim; otherwise image.tag or the appVersion, plus "-cuda" for the CUDA variant.
*/}}
{{- define "specwire.image" -}}
{{- $repo := .image.repository | default .root.Values.image.repository -}}
{{- $tag := .image.tag -}}
{{- if not $tag -}}
{{- $tag = .root.Values.image.tag | default .root.Chart.AppVersion -}}
{{- if eq .image.variant "cuda" -}}
{{- $tag = printf "%s-cuda" $tag -}}
{{- end -}}
{{- end -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{- define "specwire.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "specwire.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* grpc.health.v1 service name of each server. */}}
{{- define "specwire.healthService" -}}
{{- get (dict "config" "specwire.config.v1.ConfigService" "draft" "specwire.draft.v1.DraftService" "target" "specwire.target.v1.TargetService") .component -}}
{{- end -}}

{{/* Address the target uses for the config registry. */}}
{{- define "specwire.configAddress" -}}
{{- if .Values.target.configAddress -}}
{{- .Values.target.configAddress -}}
{{- else if .Values.config.enabled -}}
{{- printf "%s:%d" (include "specwire.componentHost" (dict "root" . "component" "config")) (int .Values.config.port) -}}
{{- end -}}
{{- end -}}

{{/*
Address the target uses for the draft service: the headless Service through gRPC's DNS resolver, so
that a round_robin client opens a subchannel per draft pod and spreads its streams over them.
*/}}
{{- define "specwire.draftAddress" -}}
{{- if .Values.target.draftModel -}}
{{- /* A co-located draft: the target drafts in its own process (no address; both are refused at start). */ -}}
{{- else if .Values.target.draftAddress -}}
{{- .Values.target.draftAddress -}}
{{- else if .Values.draft.enabled -}}
{{- printf "dns:///%s:%d" (include "specwire.componentHost" (dict "root" . "component" "draft")) (int .Values.draft.port) -}}
{{- end -}}
{{- end -}}

{{/* The certificate Secret of one service: its own `tls.secretName`, else the shared `tls.secretName`. */}}
{{- define "specwire.tlsSecretName" -}}
{{- (index .root.Values .component).tls.secretName | default .root.Values.tls.secretName -}}
{{- end -}}

{{/* True ("true") when the config registry is stored in PostgreSQL (`config.postgresql.existingSecret`). */}}
{{- define "specwire.postgresql" -}}
{{- if .Values.config.postgresql.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* True ("true") when the service requests GPUs. */}}
{{- define "specwire.gpuEnabled" -}}
{{- $v := index .root.Values .component -}}
{{- if and (hasKey $v "gpu") $v.gpu.enabled -}}true{{- end -}}
{{- end -}}

{{/*
ConfigMap data of one service: its server settings as environment variables. The container's args
refer to them as $(NAME), so the ConfigMap is the one place that holds the server's flags.
*/}}
{{- define "specwire.settings" -}}
{{- $root := .root -}}
{{- $v := index $root.Values .component -}}
{{- $gpu := include "specwire.gpuEnabled" . -}}
{{- $s := dict "SPECWIRE_HOST" $root.Values.listenHost "SPECWIRE_PORT" (toString $v.port) "HOME" "/tmp" -}}
{{- $_ := set $s "SPECWIRE_GRACE" (include "specwire.grace" .) -}}
{{- $_ := set $s "SPECWIRE_MAX_MESSAGE_BYTES" (toString (int64 $v.maxMessageBytes)) -}}
{{- $_ := set $s "SPECWIRE_MAX_CONCURRENT_RPCS" (toString (int64 $v.maxConcurrentRpcs)) -}}
{{- if eq .component "config" -}}
{{- /* With PostgreSQL, SPECWIRE_DB comes from the Secret (a URL with a password stays out of the ConfigMap). */ -}}
{{- if not (include "specwire.postgresql" $root) -}}
{{- $_ := set $s "SPECWIRE_DB" (printf "%s/%s" (trimSuffix "/" $v.persistence.mountPath) $v.dbFile) -}}
{{- end -}}
{{- $_ := set $s "SPECWIRE_MAX_CONFIG_BYTES" (toString (int64 $v.maxConfigBytes)) -}}
{{- $_ := set $s "SPECWIRE_MAX_EXTRA_BYTES" (toString (int64 $v.maxExtraBytes)) -}}
{{- end -}}
{{- if eq .component "draft" -}}
{{- $_ := set $s "SPECWIRE_MAX_SESSIONS" (toString (int64 $v.maxSessions)) -}}
{{- $_ := set $s "SPECWIRE_SESSION_IDLE_TIMEOUT" (toString $v.sessionIdleTimeoutSeconds) -}}
{{- end -}}
{{- if hasKey $v "model" -}}
{{- if $v.model.name -}}
{{- $_ := set $s "SPECWIRE_MODEL" $v.model.name -}}
{{- end -}}
{{- $_ := set $s "HF_HOME" (printf "%s/huggingface" (trimSuffix "/" $v.model.cache.mountPath)) -}}
{{- $_ := set $s "SPECWIRE_CACHE_DIR" (printf "%s/specwire" (trimSuffix "/" $v.model.cache.mountPath)) -}}
{{- if $v.model.offline -}}
{{- $_ := set $s "HF_HUB_OFFLINE" "1" -}}
{{- end -}}
{{- end -}}
{{- if eq .component "target" -}}
{{- $_ := set $s "SPECWIRE_DEVICE" ($v.device | default (ternary "cuda" "cpu" (eq $gpu "true"))) -}}
{{- $_ := set $s "SPECWIRE_DTYPE" ($v.dtype | default (ternary "bfloat16" "float32" (eq $gpu "true"))) -}}
{{- with include "specwire.configAddress" $root -}}
{{- $_ := set $s "SPECWIRE_CONFIG_ADDRESS" . -}}
{{- $_ := set $s "SPECWIRE_CONFIG_STALE_MAX" (toString $v.configStaleMaxSeconds) -}}
{{- end -}}
{{- with include "specwire.draftAddress" $root -}}
{{- $_ := set $s "SPECWIRE_DRAFT_ADDRESS" . -}}
{{- end -}}
{{- if $v.draftModel -}}
{{- $_ := set $s "SPECWIRE_DRAFT_MODEL" $v.draftModel -}}
{{- end -}}
{{- if $v.dflashModel -}}
{{- $_ := set $s "SPECWIRE_DFLASH_MODEL" $v.dflashModel -}}
{{- end -}}
{{- if gt (int $v.tensorParallel) 1 -}}
{{- $_ := set $s "SPECWIRE_TENSOR_PARALLEL" (toString (int $v.tensorParallel)) -}}
{{- end -}}
{{- $q := $v.scheduler -}}
{{- $_ := set $s "SPECWIRE_SCHEDULER" $q.mode -}}
{{- $_ := set $s "SPECWIRE_MAX_BATCH_ROWS" (toString $q.maxBatchRows) -}}
{{- $_ := set $s "SPECWIRE_MAX_TOKENS_PER_STEP" (toString $q.maxTokensPerStep) -}}
{{- $_ := set $s "SPECWIRE_MAX_QUEUED" (toString $q.maxQueued) -}}
{{- $_ := set $s "SPECWIRE_MAX_LANE_REQUESTS" (toString $q.maxLaneRequests) -}}
{{- $_ := set $s "SPECWIRE_KV_CACHE_MB" (toString $q.kvCacheMb) -}}
{{- if $q.slotTokens -}}
{{- $_ := set $s "SPECWIRE_SLOT_TOKENS" (toString $q.slotTokens) -}}
{{- end -}}
{{- $l := $v.limits -}}
{{- range $key, $env := dict "maxModelLen" "SPECWIRE_MAX_MODEL_LEN" "maxNewTokens" "SPECWIRE_MAX_NEW_TOKENS" "maxOutputBytes" "SPECWIRE_MAX_OUTPUT_BYTES" -}}
{{- /* 0 = the server's derived default: the flag is left out. */ -}}
{{- if gt (int64 (index $l $key)) 0 -}}
{{- $_ := set $s $env (toString (int64 (index $l $key))) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $s "SPECWIRE_MAX_REQUEST_ROWS" (toString (int64 $l.maxRequestRows)) -}}
{{- $_ := set $s "SPECWIRE_MAX_PROMPTS" (toString (int64 $l.maxPrompts)) -}}
{{- $_ := set $s "SPECWIRE_MAX_BEAMS" (toString (int64 $l.maxBeams)) -}}
{{- $_ := set $s "SPECWIRE_MAX_STOP_STRINGS" (toString (int64 $l.maxStopStrings)) -}}
{{- $_ := set $s "SPECWIRE_MAX_STOP_STRING_CHARS" (toString (int64 $l.maxStopStringChars)) -}}
{{- $_ := set $s "SPECWIRE_MAX_BIAS_ENTRIES" (toString (int64 $l.maxBiasEntries)) -}}
{{- $_ := set $s "SPECWIRE_MAX_PROMPT_CHARS" (toString (int64 $l.maxPromptChars)) -}}
{{- $_ := set $s "SPECWIRE_PREPARE_WORKERS" (toString (int64 $l.prepareWorkers)) -}}
{{- $_ := set $s "SPECWIRE_MAX_PREPARING" (toString (int64 $l.maxPreparing)) -}}
{{- $_ := set $s "SPECWIRE_STUCK_AFTER" (toString $v.stuckAfterSeconds) -}}
{{- if $v.plugins -}}
{{- $_ := set $s "SPECWIRE_TARGET_PLUGINS" (join "," $v.plugins) -}}
{{- end -}}
{{- end -}}
{{- if $root.Values.metrics.enabled -}}
{{- $_ := set $s "SPECWIRE_PROMETHEUS_PORT" (toString $root.Values.metrics.port) -}}
{{- /* The scrape endpoint binds loopback unless told otherwise: Prometheus scrapes from another pod. */ -}}
{{- $_ := set $s "SPECWIRE_PROMETHEUS_HOST" "0.0.0.0" -}}
{{- end -}}
{{- if $root.Values.tls.enabled -}}
{{- $_ := set $s "SPECWIRE_TLS_CERT_FILE" "/etc/specwire/tls/tls.crt" -}}
{{- $_ := set $s "SPECWIRE_TLS_KEY_FILE" "/etc/specwire/tls/tls.key" -}}
{{- $_ := set $s "SPECWIRE_TLS_CA_FILE" "/etc/specwire/tls/ca.crt" -}}
{{- end -}}
{{- if and (include "specwire.hasTokens" $root) $root.Values.auth.allowInsecureToken (not $root.Values.tls.enabled) -}}
{{- /* The servers check, and the target sends, tokens in plaintext: asked for by auth.allowInsecureToken. */ -}}
{{- $_ := set $s "SPECWIRE_ALLOW_INSECURE_TOKEN" "true" -}}
{{- end -}}
{{- $_ := set $s "OTEL_SERVICE_NAME" $v.otelServiceName -}}
{{- if $root.Values.otel.enabled -}}
{{- $_ := set $s "OTEL_EXPORTER_OTLP_ENDPOINT" $root.Values.otel.endpoint -}}
{{- $_ := set $s "OTEL_EXPORTER_OTLP_PROTOCOL" $root.Values.otel.protocol -}}
{{- $_ := set $s "OTEL_TRACES_SAMPLER" $root.Values.otel.tracesSampler -}}
{{- $_ := set $s "OTEL_TRACES_SAMPLER_ARG" $root.Values.otel.tracesSamplerArg -}}
{{- else -}}
{{- $_ := set $s "OTEL_SDK_DISABLED" "true" -}}
{{- end -}}
{{- toYaml (merge $s ($v.settings | default dict)) -}}
{{- end -}}

{{/* Server command line; flags take their values from the ConfigMap (see specwire.settings). */}}
{{- define "specwire.args" -}}
{{- $v := index .root.Values .component -}}
{{- $settings := include "specwire.settings" . | fromYaml -}}
{{- $args := list "--host" "$(SPECWIRE_HOST)" "--port" "$(SPECWIRE_PORT)" "--grace" "$(SPECWIRE_GRACE)" -}}
{{- $args = concat $args (list "--max-message-bytes" "$(SPECWIRE_MAX_MESSAGE_BYTES)" "--max-concurrent-rpcs" "$(SPECWIRE_MAX_CONCURRENT_RPCS)") -}}
{{- if eq .component "config" -}}
{{- /* With PostgreSQL, no `--db`: config-service takes SPECWIRE_DB (the Secret's URL) as its default, so
the password never shows on the command line. */ -}}
{{- if not (include "specwire.postgresql" .root) -}}
{{- $args = concat $args (list "--db" "$(SPECWIRE_DB)") -}}
{{- end -}}
{{- $args = concat $args (list "--max-config-bytes" "$(SPECWIRE_MAX_CONFIG_BYTES)" "--max-extra-bytes" "$(SPECWIRE_MAX_EXTRA_BYTES)") -}}
{{- end -}}
{{- if hasKey $settings "SPECWIRE_MODEL" -}}
{{- $args = concat $args (list "--model" "$(SPECWIRE_MODEL)") -}}
{{- end -}}
{{- if eq .component "draft" -}}
{{- $args = concat $args (list "--max-sessions" "$(SPECWIRE_MAX_SESSIONS)" "--session-idle-timeout" "$(SPECWIRE_SESSION_IDLE_TIMEOUT)") -}}
{{- end -}}
{{- if eq .component "target" -}}
{{- $args = concat $args (list "--device" "$(SPECWIRE_DEVICE)" "--dtype" "$(SPECWIRE_DTYPE)") -}}
{{- if hasKey $settings "SPECWIRE_CONFIG_ADDRESS" -}}
{{- $args = concat $args (list "--config-address" "$(SPECWIRE_CONFIG_ADDRESS)" "--config-stale-max" "$(SPECWIRE_CONFIG_STALE_MAX)") -}}
{{- end -}}
{{- if hasKey $settings "SPECWIRE_DRAFT_ADDRESS" -}}
{{- $args = concat $args (list "--draft-address" "$(SPECWIRE_DRAFT_ADDRESS)") -}}
{{- if not $v.draftOverlap -}}
{{- $args = concat $args (list "--no-draft-overlap") -}}
{{- end -}}
{{- end -}}
{{- if hasKey $settings "SPECWIRE_DRAFT_MODEL" -}}
{{- $args = concat $args (list "--draft-model" "$(SPECWIRE_DRAFT_MODEL)") -}}
{{- end -}}
{{- if hasKey $settings "SPECWIRE_DFLASH_MODEL" -}}
{{- $args = concat $args (list "--dflash-model" "$(SPECWIRE_DFLASH_MODEL)") -}}
{{- end -}}
{{- if hasKey $settings "SPECWIRE_TENSOR_PARALLEL" -}}
{{- /* target-service starts ranks 1..N-1 itself (no torchrun in the image): one container, N GPUs. */ -}}
{{- $args = concat $args (list "--tensor-parallel" "$(SPECWIRE_TENSOR_PARALLEL)") -}}
{{- end -}}
{{- if not $v.adaptiveSpeculation -}}
{{- $args = concat $args (list "--no-adaptive-speculation") -}}
{{- end -}}
{{- $args = concat $args (list "--scheduler" "$(SPECWIRE_SCHEDULER)" "--max-batch-rows" "$(SPECWIRE_MAX_BATCH_ROWS)") -}}
{{- $args = concat $args (list "--max-tokens-per-step" "$(SPECWIRE_MAX_TOKENS_PER_STEP)" "--max-queued" "$(SPECWIRE_MAX_QUEUED)") -}}
{{- $args = concat $args (list "--max-lane-requests" "$(SPECWIRE_MAX_LANE_REQUESTS)") -}}
{{- $args = concat $args (list "--kv-cache-mb" "$(SPECWIRE_KV_CACHE_MB)") -}}
{{- if hasKey $settings "SPECWIRE_SLOT_TOKENS" -}}
{{- $args = concat $args (list "--slot-tokens" "$(SPECWIRE_SLOT_TOKENS)") -}}
{{- end -}}
{{- range $flag := list "max-model-len" "max-new-tokens" "max-request-rows" "max-prompts" "max-beams" "max-stop-strings" "max-stop-string-chars" "max-bias-entries" "max-output-bytes" "max-prompt-chars" "prepare-workers" "max-preparing" -}}
{{- $env := printf "SPECWIRE_%s" (upper (replace "-" "_" $flag)) -}}
{{- if hasKey $settings $env -}}
{{- $args = concat $args (list (printf "--%s" $flag) (printf "$(%s)" $env)) -}}
{{- end -}}
{{- end -}}
{{- $args = concat $args (list "--stuck-after" "$(SPECWIRE_STUCK_AFTER)") -}}
{{- if hasKey $settings "SPECWIRE_TARGET_PLUGINS" -}}
{{- $args = concat $args (list "--plugins" "$(SPECWIRE_TARGET_PLUGINS)") -}}
{{- end -}}
{{- end -}}
{{- toYaml (concat $args ($v.extraArgs | default list)) -}}
{{- end -}}

{{/*
One probe (dict "root" $ "component" c "probe" <settings> "service" <health name, "" = overall>).
Native gRPC probes need no binary in the image but speak plaintext only; with TLS the chart's
health-check script runs instead, against the pod's own port, verifying the Service's DNS name. Its
RPC deadline is a second under the probe's timeout, which also covers the Python start.
*/}}
{{- define "specwire.probe" -}}
{{- $v := index .root.Values .component -}}
{{- if .root.Values.tls.enabled }}
exec:
  command:
    - python
    - /etc/specwire/scripts/health_check.py
    - --timeout
    - {{ max 1 (sub (int .probe.timeoutSeconds) 1) | quote }}
    - --tls-server-name
    - {{ include "specwire.componentHost" . }}
    - {{ printf "127.0.0.1:%d/%s" (int $v.port) .service | quote }}
{{- else }}
grpc:
  port: {{ $v.port }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
{{- end }}
periodSeconds: {{ .probe.periodSeconds }}
timeoutSeconds: {{ .probe.timeoutSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
{{- end -}}

{{/* Pod-spec `resources`: the service's block plus its GPUs (requests = limits) when enabled. */}}
{{- define "specwire.resources" -}}
{{- $v := index .root.Values .component -}}
{{- $res := deepCopy ($v.resources | default dict) -}}
{{- if include "specwire.gpuEnabled" . -}}
{{- /* A tensor-parallel target takes one GPU per rank. */ -}}
{{- $count := ternary (int $v.tensorParallel) (int $v.gpu.count) (gt (int (default 1 $v.tensorParallel)) 1) -}}
{{- $gpus := dict $v.gpu.resourceName $count -}}
{{- $_ := set $res "limits" (merge (deepCopy $gpus) ($res.limits | default dict)) -}}
{{- $_ := set $res "requests" (merge (deepCopy $gpus) ($res.requests | default dict)) -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/*
The server's `--grace` (dict "root" $ "component" c): `graceSeconds`, or what the pod leaves after its
preStop sleep minus 5 s, so the server has drained and exited before the kubelet's SIGKILL.
*/}}
{{- define "specwire.grace" -}}
{{- $v := index .root.Values .component -}}
{{- if gt (int $v.graceSeconds) 0 -}}
{{- int $v.graceSeconds -}}
{{- else -}}
{{- max 1 (sub (sub (int $v.terminationGracePeriodSeconds) (int $v.preStopSleepSeconds)) 5) -}}
{{- end -}}
{{- end -}}

{{/* "true" when the servers get a bearer token (reader or admin) from a Secret. */}}
{{- define "specwire.hasTokens" -}}
{{- if or .Values.auth.existingSecret .Values.auth.adminExistingSecret -}}true{{- end -}}
{{- end -}}

{{/* Checks of values that the schema cannot express. */}}
{{- define "specwire.validate" -}}
{{- range $c := list "config" "draft" "target" -}}
{{- if or (eq $c "target") (index $.Values $c).enabled -}}
{{- if and $.Values.tls.enabled (not (include "specwire.tlsSecretName" (dict "root" $ "component" $c))) -}}
{{- fail (printf "tls.enabled needs a certificate Secret for %s: set tls.secretName (a kubernetes.io/tls Secret with ca.crt, shared by the services) or %s.tls.secretName" $c $c) -}}
{{- end -}}
{{- end -}}
{{- if and (not $.Values.tls.enabled) (index $.Values $c).tls.secretName -}}
{{- fail (printf "%s.tls.secretName is set but tls.enabled is false: set tls.enabled=true to serve TLS, or clear %s.tls.secretName" $c $c) -}}
{{- end -}}
{{- end -}}
{{- if and (gt (int .Values.config.replicaCount) 1) (not (include "specwire.postgresql" .)) -}}
{{- fail (printf "config.replicaCount is %d but the registry is on SQLite, which has one writer on one ReadWriteOnce volume: set config.replicaCount=1, or store the registry in PostgreSQL with config.postgresql.existingSecret (a Secret holding a postgresql:// URL)" (int .Values.config.replicaCount)) -}}
{{- end -}}
{{- if and (include "specwire.postgresql" .) .Values.config.persistence.existingClaim -}}
{{- fail "config.persistence.existingClaim is set but config.postgresql.existingSecret stores the registry in PostgreSQL, so the claim would not be used: clear one of them" -}}
{{- end -}}
{{- if and (include "specwire.hasTokens" .) (not .Values.tls.enabled) (not .Values.auth.allowInsecureToken) -}}
{{- fail "auth tokens without TLS would travel in plaintext (the servers refuse to start so): set tls.enabled with tls.secretName, or auth.allowInsecureToken=true on a pod network you trust" -}}
{{- end -}}
{{- if and .Values.auth.adminExistingSecret (not .Values.auth.existingSecret) (not .Values.tls.enabled) -}}
{{- fail "auth.adminExistingSecret needs auth.existingSecret: the targets read the registry and the draft service with the reader token (without TLS there is no client certificate to stand for it)" -}}
{{- end -}}
{{- $tp := int .Values.target.tensorParallel -}}
{{- if and (gt $tp 1) .Values.target.gpu.enabled (ne (int .Values.target.gpu.count) 1) (ne (int .Values.target.gpu.count) $tp) -}}
{{- fail (printf "target.gpu.count is %d but target.tensorParallel is %d: a tensor-parallel target takes one GPU per rank; leave target.gpu.count at 1 or set it to %d" (int .Values.target.gpu.count) $tp $tp) -}}
{{- end -}}
{{- if and .Values.target.dflashModel (gt $tp 1) -}}
{{- fail "target.dflashModel with target.tensorParallel > 1: the DFlash assistant drafts through the target's embeddings and LM head on rank 0 alone (the target refuses it at start); unset one of them" -}}
{{- end -}}
{{- if and .Values.target.draftModel .Values.target.draftAddress -}}
{{- fail "target.draftModel and target.draftAddress both name a draft model (the target refuses both at start): clear target.draftAddress to draft in the target's process, or target.draftModel to use the draft service" -}}
{{- end -}}
{{- if and .Values.otel.enabled (not .Values.otel.endpoint) -}}
{{- fail "otel.enabled needs otel.endpoint, e.g. http://otel-collector.observability:4317" -}}
{{- end -}}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.enabled) -}}
{{- fail "metrics.serviceMonitor.enabled needs metrics.enabled: the ServiceMonitor scrapes the metrics port" -}}
{{- end -}}
{{- if and (not .Values.config.enabled) (not .Values.target.configAddress) -}}
{{- fail "config.enabled is false: set target.configAddress to the config registry the target should use" -}}
{{- end -}}
{{- range $c := list "config" "draft" "target" -}}
{{- $v := index $.Values $c -}}
{{- $grace := int (include "specwire.grace" (dict "root" $ "component" $c)) -}}
{{- if ge (add $grace (int $v.preStopSleepSeconds)) (int $v.terminationGracePeriodSeconds) -}}
{{- fail (printf "%s: --grace %ds after a %ds preStop sleep does not end before terminationGracePeriodSeconds (%d): raise terminationGracePeriodSeconds or lower graceSeconds" $c $grace (int $v.preStopSleepSeconds) (int $v.terminationGracePeriodSeconds)) -}}
{{- end -}}
{{- end -}}
{{- if and (gt (int64 .Values.target.limits.maxOutputBytes) 0) (gt (int64 .Values.target.limits.maxOutputBytes) (int64 .Values.target.maxMessageBytes)) -}}
{{- fail (printf "target.limits.maxOutputBytes (%d) is above target.maxMessageBytes (%d): such a response could never be sent" (int64 .Values.target.limits.maxOutputBytes) (int64 .Values.target.maxMessageBytes)) -}}
{{- end -}}
{{- range $c := list "draft" "target" -}}
{{- $a := (index $.Values $c).autoscaling -}}
{{- if and $a.enabled (gt (int $a.minReplicas) (int $a.maxReplicas)) -}}
{{- fail (printf "%s.autoscaling.minReplicas (%d) is above maxReplicas (%d)" $c (int $a.minReplicas) (int $a.maxReplicas)) -}}
{{- end -}}
{{- $load := dig "load" dict $a -}}
{{- $loadMetrics := or (dig "requestsQueued" nil $load) (dig "requestsRunning" nil $load) (dig "kvSlotUsage" nil $load) -}}
{{- if and $a.enabled (not $a.targetCPUUtilizationPercentage) (not $a.metrics) (not $loadMetrics) -}}
{{- fail (printf "%s.autoscaling has no metric: set targetCPUUtilizationPercentage, metrics%s" $c (ternary " or load" "" (eq $c "target"))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
