{{/*
Engine pod specs. Input: (dict "root" $ "pool" <pools item> "plan" <kvgate.poolPlan> "role" "single"|"leader"|"worker").
*/}}

{{- define "kvgate.enginePodLabels" -}}
{{ include "kvgate.labels" (dict "root" .root "component" "engine") }}
kvgate.io/pool: {{ .plan.pool }}
kvgate.io/backend: {{ .plan.backend }}
{{- end -}}

{{- define "kvgate.engineSelectorLabels" -}}
{{ include "kvgate.selectorLabels" (dict "root" .root "component" "engine") }}
kvgate.io/pool: {{ .plan.pool }}
{{- end -}}

{{/* Waits until /engines/<spec>/manifest.json records this spec's hash (engines/trtllm/engine_build.py). */}}
{{- define "kvgate.waitForEngineScript" -}}
import json, sys, time
from pathlib import Path
from engines.spec import load_spec, spec_hash
spec = load_spec(sys.argv[1])
want, manifest = spec_hash(spec), Path("/engines") / spec.name / "manifest.json"
while True:
    try:
        if json.loads(manifest.read_text()).get("spec_hash") == want:
            print(f"{spec.name}: engine built for spec hash {want[:12]}", flush=True)
            break
    except (OSError, ValueError):
        pass
    print(f"{spec.name}: waiting for the engine builder ({manifest} with spec hash {want[:12]})", flush=True)
    time.sleep(30)
{{- end -}}

{{/*
Where a GPU pool's pods run: the pool's nodeSelector merged over engines.gpu.nodeSelector (the
pool's keys win) and both tolerations lists. Engine pods and the pool's engine-builder Job use
it, so the build lands on nodes the pool may use. Input: (dict "root" $ "pool" <pools item>).
Output starts with a newline (empty when there is nothing to place).
*/}}
{{- define "kvgate.gpuPlacement" -}}
{{- $gpu := .root.Values.engines.gpu -}}
{{- with (merge (deepCopy (default dict .pool.nodeSelector)) $gpu.nodeSelector) }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (concat (default list .pool.tolerations) $gpu.tolerations) }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "kvgate.tritonPodSpec" -}}
{{- $root := .root -}}
{{- $pool := .pool -}}
{{- $plan := .plan -}}
{{- $gpu := $root.Values.engines.gpu -}}
{{- $img := $root.Values.engines.tritonImage -}}
{{- $serves := ne .role "worker" -}}
automountServiceAccountToken: false
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
# uid 1000: the triton-server user of NVIDIA's Triton images.
securityContext:
  runAsNonRoot: true
  runAsUser: 1000
  runAsGroup: 1000
  fsGroup: 1000
  seccompProfile: {type: RuntimeDefault}
terminationGracePeriodSeconds: 60
{{- include "kvgate.gpuPlacement" (dict "root" $root "pool" $pool) }}
initContainers:
  - name: wait-for-engine
    image: {{ include "kvgate.image" $img }}
    imagePullPolicy: {{ $img.pullPolicy }}
    command: [python3, -c, {{ include "kvgate.waitForEngineScript" . | quote }}, {{ $plan.specName | quote }}]
    resources:
      requests: {cpu: 50m, memory: 128Mi}
      limits: {memory: 256Mi}
    securityContext:
      allowPrivilegeEscalation: false
      capabilities: {drop: [ALL]}
    volumeMounts:
      - {name: engines, mountPath: /engines, readOnly: true}
  {{- if $serves }}
  # The Triton model repository (config.pbtxt + model.py) rendered from the spec (engines/triton/repository.py).
  - name: model-repository
    image: {{ include "kvgate.image" $img }}
    imagePullPolicy: {{ $img.pullPolicy }}
    command: [kvgate, build, repo, {{ $plan.specName | quote }}, --output, /models, --engines-root, /engines]
    resources:
      requests: {cpu: 50m, memory: 128Mi}
      limits: {memory: 512Mi}
    securityContext:
      allowPrivilegeEscalation: false
      capabilities: {drop: [ALL]}
    volumeMounts:
      - {name: models, mountPath: /models}
  {{- end }}
containers:
  - name: {{ ternary "triton" "worker" $serves }}
    image: {{ include "kvgate.image" $img }}
    imagePullPolicy: {{ $img.pullPolicy }}
    {{- if eq .role "single" }}
    command: [tritonserver, --model-repository=/models, --http-port=8000, --grpc-port=8001, --metrics-port=8002]
    {{- else if eq .role "leader" }}
    # One tritonserver under mpirun over the group's hosts: the kvgate_llm model runs the
    # TensorRT-LLM executor in orchestrator mode, which spawns one worker per rank on these slots.
    command: [bash, -c]
    args:
      - |
        hosts=""
        for i in $(seq 0 $((LWS_GROUP_SIZE - 1))); do
          if [ "$i" = 0 ]; then h="$POD_NAME"; else h="$POD_NAME-$i"; fi
          hosts="$hosts${hosts:+,}$h.{{ $plan.name }}.$POD_NAMESPACE:{{ $plan.ranksPerPod }}"
        done
        exec mpirun -np 1 --host "$hosts" --mca plm_rsh_agent {{ dig "multinode" "rshAgent" "ssh -p 2222" $pool | quote }} \
          tritonserver --model-repository=/models --http-port=8000 --grpc-port=8001 --metrics-port=8002
    env:
      - name: POD_NAME
        valueFrom: {fieldRef: {fieldPath: metadata.name}}
      - name: POD_NAMESPACE
        valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
    {{- else }}
    # Workers hold GPUs and wait for the leader's mpirun to start ranks here through the rsh
    # agent (default: an sshd on 2222 that the image must provide with keys; NOT in build/Dockerfile.triton).
    command: {{ toJson (dig "multinode" "workerCommand" (list "/usr/sbin/sshd" "-D" "-e" "-p" "2222") $pool) }}
    {{- end }}
    ports:
      {{- if $serves }}
      - {name: http, containerPort: 8000, protocol: TCP}
      - {name: grpc, containerPort: 8001, protocol: TCP}
      - {name: metrics, containerPort: 8002, protocol: TCP}
      {{- else }}
      - {name: rsh, containerPort: 2222, protocol: TCP}
      {{- end }}
    {{- if $serves }}
    # KServe v2 health endpoints on Triton's HTTP port. Loading an engine takes minutes.
    startupProbe:
      httpGet: {path: /v2/health/ready, port: http}
      periodSeconds: 10
      failureThreshold: {{ div (int $gpu.startupSeconds) 10 }}
    livenessProbe:
      httpGet: {path: /v2/health/live, port: http}
      periodSeconds: 10
      timeoutSeconds: 5
      failureThreshold: 3
    readinessProbe:
      httpGet: {path: /v2/health/ready, port: http}
      periodSeconds: 5
      timeoutSeconds: 5
      failureThreshold: 2
    {{- end }}
    # GPUs = ranks in this pod; memory = pinned KV host tier (host_cache_size per rank)
    # + /dev/shm + overhead (kvgate.poolPlan). Requests equal limits: pinned memory
    # cannot be reclaimed, so the pod must not be overcommitted.
    resources:
      requests:
        cpu: {{ $gpu.cpu | quote }}
        memory: {{ printf "%dMi" (int64 $plan.memoryMi) }}
        nvidia.com/gpu: {{ int $plan.ranksPerPod }}
      limits:
        memory: {{ printf "%dMi" (int64 $plan.memoryMi) }}
        nvidia.com/gpu: {{ int $plan.ranksPerPod }}
    securityContext:
      allowPrivilegeEscalation: false
      capabilities: {drop: [ALL]}
    volumeMounts:
      - {name: engines, mountPath: /engines, readOnly: true}
      - {name: models, mountPath: /models}
      - {name: dshm, mountPath: /dev/shm}
volumes:
  - name: engines
    persistentVolumeClaim: {claimName: {{ include "kvgate.enginesClaim" $root }}, readOnly: true}
  - name: models
    emptyDir: {sizeLimit: 64Mi}
  - name: dshm
    emptyDir: {medium: Memory, sizeLimit: {{ printf "%dGi" (int $plan.shmSizeGiB) }}}
{{- end -}}

{{- define "kvgate.referencePodSpec" -}}
{{- $root := .root -}}
{{- $pool := .pool -}}
{{- $plan := .plan -}}
{{- $cpu := $root.Values.engines.cpu -}}
{{- $probe := "import sys, tritonclient.grpc as g; sys.exit(0 if g.InferenceServerClient('127.0.0.1:8001').is_server_ready() else 1)" -}}
automountServiceAccountToken: false
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- include "kvgate.podSecurityContext" $root | nindent 2 }}
{{- with (merge (deepCopy (default dict $pool.nodeSelector)) $cpu.nodeSelector) }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (concat (default list $pool.tolerations) $cpu.tolerations) }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
containers:
  # The CPU reference engine (server/cli/engine.py), flags from the spec as
  # engines.spec.reference_settings() maps them (the same flags docker-compose.yml passes).
  - name: engine
    image: {{ include "kvgate.image" $root.Values.image }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    command:
      - kvgate
      - engine
      - serve
      - --host
      - 0.0.0.0
      - --port
      - "8001"
      - --kv-dtype
      - {{ $plan.kvDtype | quote }}
      - --primary-blocks
      - {{ $plan.primaryBlocks | int | quote }}
      - --secondary-blocks
      - {{ $plan.secondaryBlocks | int | quote }}
      - --tokens-per-block
      - {{ $plan.tokensPerBlock | int | quote }}
      - --offload-min-priority
      - {{ $plan.offloadMinPriority | int | quote }}
      - --max-batch-size
      - {{ $plan.maxBatchSize | int | quote }}
      - --max-num-tokens
      - {{ $plan.maxNumTokens | int | quote }}
      - --max-input-len
      - {{ $plan.maxInputLen | int | quote }}
      - --max-output-len
      - {{ $plan.maxOutputLen | int | quote }}
    env:
      - {name: KVGATE_ENGINE_THREADS, value: {{ $cpu.threads | quote }}}
      - {name: HOME, value: /tmp}
    ports:
      - {name: grpc, containerPort: 8001, protocol: TCP}
    # KServe v2 ServerReady / ServerLive over gRPC (the reference server has no HTTP port).
    startupProbe:
      exec: {command: [python, -c, {{ $probe | quote }}]}
      periodSeconds: 5
      timeoutSeconds: 5
      failureThreshold: 60
    readinessProbe:
      exec: {command: [python, -c, {{ $probe | quote }}]}
      periodSeconds: 15
      timeoutSeconds: 5
      failureThreshold: 2
    livenessProbe:
      exec: {command: [python, -c, {{ replace "is_server_ready" "is_server_live" $probe | quote }}]}
      periodSeconds: 20
      timeoutSeconds: 5
      failureThreshold: 3
    resources:
      {{- toYaml (default $cpu.resources $pool.resources) | nindent 6 }}
    securityContext:
      {{- include "kvgate.containerSecurityContext" $root | nindent 6 }}
    volumeMounts:
      - {name: tmp, mountPath: /tmp}
volumes:
  - name: tmp
    emptyDir: {sizeLimit: 1Gi}
{{- end -}}
