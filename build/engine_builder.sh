#!/usr/bin/env bash
# One-shot engine builder (compose service engine-builder, profile gpu): builds every spec in
# KVGATE_ENGINE_SPECS into /engines (skipped when its manifest matches) and renders the
# Triton model repository into /models.
set -euo pipefail
read -r -a specs <<< "${KVGATE_ENGINE_SPECS:-llama-3.1-8b-instruct-fp8kv}"
for spec in "${specs[@]}"; do
  kvgate build engine "$spec" --output /engines
done
kvgate build repo "${specs[@]}" --output /models --engines-root /engines
echo "engine-builder: done (${specs[*]})"
