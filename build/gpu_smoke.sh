#!/usr/bin/env bash
# GPU smoke check for users with an NVIDIA GPU (not runnable on CPU-only machines):
#   build the Llama-3.1-8B FP8-KV engine, start the gpu profile, send a request twice and
#   check reused blocks, force eviction and check host-tier offload and onboarding.
# Needs: docker with the compose plugin, the NVIDIA Container Toolkit, a GPU with FP8
# (Ada/Hopper/Blackwell, >= 24 GB), HF_TOKEN with access to meta-llama/Llama-3.1-8B-Instruct.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v nvidia-smi >/dev/null || { echo "gpu_smoke: nvidia-smi not found: this check needs an NVIDIA GPU" >&2; exit 2; }
docker compose version >/dev/null || { echo "gpu_smoke: docker compose plugin not found" >&2; exit 2; }
[ -n "${HF_TOKEN:-}" ] || { echo "gpu_smoke: set HF_TOKEN (gated Llama weights are downloaded by the builder)" >&2; exit 2; }

export KVGATE_ENGINE_SPECS="${KVGATE_ENGINE_SPECS:-llama-3.1-8b-instruct-fp8kv}"
echo "gpu_smoke: building engine(s) ${KVGATE_ENGINE_SPECS} (first run: tens of minutes) ..."
docker compose --profile gpu build
docker compose --profile gpu run --rm engine-builder
echo "gpu_smoke: starting the gpu profile ..."
docker compose --profile gpu up -d --wait triton
docker compose --profile gpu run --rm --no-deps \
  -v "$PWD/build:/opt/kvgate-smoke:ro" --entrypoint python gateway \
  /opt/kvgate-smoke/gpu_smoke_client.py --url triton:8001
echo "gpu_smoke: ok. Stop the stack with: docker compose --profile gpu down"
