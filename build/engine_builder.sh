#!/usr/bin/env bash
# One-shot engine builder (compose service engine-builder, profile gpu): builds every spec in
# KVGATE_ENGINE_SPECS (bundled names or YAML paths) into /engines (skipped when its manifest
# matches) and renders the Triton model repository into /models.
set -euo pipefail
read -r -a specs <<< "${KVGATE_ENGINE_SPECS:-llama-3.1-8b-instruct-fp8kv}"
for spec in "${specs[@]}"; do
  kvgate build engine "$spec" --output /engines
  # The gateway tokenizes (it must know segment boundaries): leave the checkpoint's tokenizer
  # files where it and `kvgate build repo` look (/engines/tokenizers/<spec name>,
  # engines/hf_tokenizer.py), fetched at the commit the engine was just built from (its manifest's
  # model.resolved_revision). The spec goes in as an argument, never into the Python source.
  python3 -c 'import sys; from engines.triton.repository import save_spec_tokenizer; print(save_spec_tokenizer(sys.argv[1], sys.argv[2]))' "$spec" /engines
done
kvgate build repo "${specs[@]}" --output /models --engines-root /engines
echo "engine-builder: done (${specs[*]})"
