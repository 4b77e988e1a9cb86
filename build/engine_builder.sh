#!/usr/bin/env bash
# One-shot engine builder (compose service engine-builder, profile gpu): builds every spec in
# KVGATE_ENGINE_SPECS into /engines (skipped when its manifest matches) and renders the
# Triton model repository into /models.
set -euo pipefail
read -r -a specs <<< "${KVGATE_ENGINE_SPECS:-llama-3.1-8b-instruct-fp8kv}"
for spec in "${specs[@]}"; do
  kvgate build engine "$spec" --output /engines
  # The gateway tokenizes (it must know segment boundaries): leave the checkpoint's tokenizer
  # files where it finds them (KVGATE_TOKENIZER_ROOT=/engines/tokenizers, engines/hf_tokenizer.py).
  model=$(python -c "from engines.spec import load_bundled_spec as l; print(l('$spec').model.tokenizer or l('$spec').model.location)")
  python -c "from transformers import AutoTokenizer; AutoTokenizer.from_pretrained('$model').save_pretrained('/engines/tokenizers/$spec')"
done
kvgate build repo "${specs[@]}" --output /models --engines-root /engines
echo "engine-builder: done (${specs[*]})"
