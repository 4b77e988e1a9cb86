{{/*
Names and labels. Every object carries app.kubernetes.io/component, which the
NetworkPolicy and the monitors select on.
*/}}
{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvgate
{{ include "kvgate.selectorLabels" . }}
{{- end -}}

{{- define "kvgate.image" -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}

{{/* The existing Secret every secret comes from (schema: required, non-empty). */}}
{{- define "kvgate.secretName" -}}
{{- required "secrets.existingSecret: name an existing Secret holding the admin tokens, key pepper and database URL" .Values.secrets.existingSecret -}}
{{- end -}}

{{/*
KVGATE_DATABASE_URL, from the Secret only. With the bundled PostgreSQL the URL is composed
by the kubelet from the password variable defined just before it ($(VAR) expansion), so
the rendered manifest holds no password either way.
*/}}
{{- define "kvgate.databaseEnv" -}}
{{- $secret := include "kvgate.secretName" . -}}
{{- if .Values.postgres.bundled }}
- name: KVGATE_POSTGRES_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ $secret }}, key: {{ .Values.secrets.keys.postgresPassword }}}
- name: KVGATE_DATABASE_URL
  value: {{ printf "postgresql+psycopg://kvgate:$(KVGATE_POSTGRES_PASSWORD)@%s-postgres:5432/kvgate" (include "kvgate.fullname" .) | quote }}
{{- else }}
- name: KVGATE_DATABASE_URL
  valueFrom:
    secretKeyRef: {name: {{ $secret }}, key: {{ .Values.secrets.keys.databaseUrl }}}
{{- end }}
{{- end -}}

{{/* Restricted pod security for kvgate's own containers (uid 10001 from build/Dockerfile.gateway). */}}
{{- define "kvgate.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{- define "kvgate.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end -}}

{{/* Does any pool run TensorRT-LLM? (then the engines volume, builder and Triton objects exist) */}}
{{- define "kvgate.hasTrtllmPools" -}}
{{- $found := false -}}
{{- range .Values.pools -}}
{{- $plan := include "kvgate.poolPlan" (dict "root" $ "pool" .) | fromYaml -}}
{{- if eq $plan.backend "tensorrt_llm" }}{{ $found = true }}{{ end -}}
{{- end -}}
{{- if $found }}true{{ end -}}
{{- end -}}

{{- define "kvgate.enginesClaim" -}}
{{- default (printf "%s-engines" (include "kvgate.fullname" .)) .Values.engines.storage.existingClaim -}}
{{- end -}}

{{/* The gateway's trace capture claim (gateway.traces.persistence enabled): existingClaim or the chart's. */}}
{{- define "kvgate.tracesClaim" -}}
{{- default (printf "%s-traces" (include "kvgate.fullname" .)) .Values.gateway.traces.persistence.existingClaim -}}
{{- end -}}

{{/*
kvgate.poolPlan: everything derived for one pool, as YAML (callers use `fromYaml`).
Input: (dict "root" $ "pool" <pools item>). The engine spec is read from files/specs/
(a link to engines/specs/, the same files both images bundle), so the chart cannot drift
from the spec the engine serves.

Sizing (per engine pod):
  ranksPerPod  = tensor_parallel * pipeline_parallel / nodes
  pinned bytes = host_cache_size_per_rank * ranksPerPod — TensorRT-LLM gives every rank its own host
                 pool of host_cache_size_per_rank bytes: BaseKVCacheManager::calculateFreeMemBytes returns
                 freeSecondaryMemBytes = config.getHostCacheSize() per rank process
                 (NVIDIA/TensorRT-LLM cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp)
  memory       = pinned + /dev/shm (an emptyDir in memory counts against the pod) + overhead
*/}}
{{- define "kvgate.poolPlan" -}}
{{- $root := .root -}}
{{- $pool := .pool -}}
{{- $raw := $root.Files.Get (printf "files/specs/%s.yaml" $pool.spec) -}}
{{- if not $raw -}}
{{- fail (printf "pools[%s].spec: no engine spec %q in engines/specs/" $pool.name $pool.spec) -}}
{{- end -}}
{{- $spec := fromYaml $raw -}}
{{- $fullname := include "kvgate.fullname" $root -}}
{{- $name := printf "%s-engine-%s" $fullname $pool.name -}}
{{- if gt (len $name) 52 -}}
{{- fail (printf "pools[%s]: %q is longer than 52 characters (StatefulSet pod labels); shorten the pool or release name" $pool.name $name) -}}
{{- end -}}
{{- $tp := int (default 1 $spec.build.tensor_parallel) -}}
{{- $pp := int (default 1 $spec.build.pipeline_parallel) -}}
{{- $world := mul $tp $pp -}}
{{- $multinode := dig "multinode" "enabled" false $pool -}}
{{- $nodes := 1 -}}
{{- if $multinode -}}
{{- $nodes = int (dig "multinode" "nodes" 2 $pool) -}}
{{- if eq $spec.backend "reference" -}}
{{- fail (printf "pools[%s].multinode: the CPU reference engine runs in one pod" $pool.name) -}}
{{- end -}}
{{- if or (lt $nodes 2) (ne (mod $world $nodes) 0) -}}
{{- fail (printf "pools[%s].multinode.nodes: %d must be >= 2 and divide the spec's %d ranks (tensor_parallel x pipeline_parallel)" $pool.name $nodes $world) -}}
{{- end -}}
{{- end -}}
{{- $ranksPerPod := div $world $nodes -}}
{{- $kv := $spec.kv_cache -}}
{{- $hostCache := int64 (default 0 $kv.host_cache_size_per_rank) -}}
{{- $gpu := $root.Values.engines.gpu -}}
{{- $shmGiB := int (default $gpu.shmSizeGiB $pool.shmSizeGiB) -}}
{{- $overheadGiB := int (default $gpu.hostMemoryOverheadGiB $pool.hostMemoryOverheadGiB) -}}
{{- $pinned := mul $hostCache $ranksPerPod -}}
{{- $pinnedMi := div (add $pinned 1048575) 1048576 -}}
{{- $memoryMi := add $pinnedMi (mul (add $shmGiB $overheadGiB) 1024) -}}
{{- if and (eq $spec.backend "tensorrt_llm") $pool.resources -}}
{{- fail (printf "pools[%s].resources: GPU pools are sized from the spec (GPUs, pinned host memory); tune engines.gpu or the pool's shmSizeGiB / hostMemoryOverheadGiB" $pool.name) -}}
{{- end -}}
{{- $reg := default dict $pool.registry -}}
{{- $primary := 0 -}}
{{- $secondary := 0 -}}
{{- if eq $spec.backend "reference" -}}
{{- $primary = int $spec.reference.primary_blocks -}}
{{- $secondary = int (default 0 $spec.reference.secondary_blocks) -}}
{{- else -}}
{{- $primary = int (required (printf "pools[%s].registry.primary_blocks: TensorRT-LLM pools state their GPU block count" $pool.name) $reg.primary_blocks) -}}
{{- $secondary = int (required (printf "pools[%s].registry.secondary_blocks: TensorRT-LLM pools state their host-tier block count" $pool.name) $reg.secondary_blocks) -}}
{{- end -}}
{{- $ns := $root.Release.Namespace -}}
name: {{ $name }}
pool: {{ $pool.name }}
specName: {{ $spec.name }}
specDigest: {{ $raw | sha256sum | trunc 10 }}
backend: {{ $spec.backend }}
tritonModel: {{ default "kvgate_llm" $spec.triton.model_name }}
replicas: {{ int $pool.replicas }}
multinode: {{ $multinode }}
nodes: {{ $nodes }}
worldSize: {{ $world }}
ranksPerPod: {{ $ranksPerPod }}
hostCacheSize: {{ $hostCache }}
pinnedBytes: {{ $pinned }}
shmSizeGiB: {{ $shmGiB }}
memoryMi: {{ $memoryMi }}
tokensPerBlock: {{ int $spec.build.tokens_per_block }}
offloadMinPriority: {{ int $kv.secondary_offload_min_priority }}
primaryBlocks: {{ $primary }}
secondaryBlocks: {{ $secondary }}
maxBatchSize: {{ int $spec.build.max_batch_size }}
maxNumTokens: {{ int $spec.build.max_num_tokens }}
maxInputLen: {{ int $spec.build.max_input_len }}
maxOutputLen: {{ sub (int $spec.build.max_seq_len) (int $spec.build.max_input_len) }}
kvDtype: {{ ternary "fp8_e4m3" $spec.quantization.kv_cache (eq $spec.quantization.kv_cache "fp8") }}
endpoints:
{{- range $i := until (int $pool.replicas) }}
  - name: {{ printf "r%d" $i }}
    endpoint: {{ printf "%s-%d.%s.%s.svc.%s:8001" $name $i $name $ns $root.Values.clusterDomain }}
{{- end }}
{{- end -}}
