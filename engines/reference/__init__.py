"""The CPU reference engine: SmolLM2 on paged FP8 KV behind the KServe v2 model ``kvgate_llm``.

Entry points (imported from their modules so that ``engines.reference.kserve`` stays light):

* :class:`engines.reference.config.ReferenceEngineConfig` — every knob, validated;
* :func:`engines.reference.loader.load_model` — load the GGUF once (``ModelBundle``);
* :func:`engines.reference.server.start_reference_server` — engine + gRPC server in-process,
  returns ``RunningServer`` (``.port``, ``.url``, ``.engine``, ``await .stop(grace)``);
* :class:`engines.reference.engine.ReferenceEngine` — the engine without gRPC (``generate``).

See docs/architecture.md, "Reference engine".
"""
