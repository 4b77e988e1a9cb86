"""The gateway: app factory, OpenAI-compatible routes, admin API, auth, admission, metrics, CLI."""
