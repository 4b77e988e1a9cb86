"""The serving gateway: OpenAI-compatible routes in front of the pools' engine models.

Request path: auth (API key -> tenant snapshot, cached) -> admission (limits) ->
chat template + tokenization with segment boundaries -> retention planner ->
engine client (tritonclient.grpc.aio stream) -> incremental detokenization -> SSE.
"""
