"""The OpenAI-compatible surface: routes, request schemas, prompts and tools, the completion hot path, log probabilities."""
