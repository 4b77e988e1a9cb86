"""The OpenAI-compatible surface: request schemas, prompts and tools, the completion hot path, log probabilities (the routes that expose it are ``server/gateway/routes.py``)."""
