"""Pure mapping from an engine spec to TensorRT-LLM release/1.2 build commands and executor arguments.

Nothing here imports TensorRT-LLM: functions that construct binding objects take the
``tensorrt_llm.bindings.executor`` module as an argument, so tests can pass a recording
double and the Triton model passes the real one (see :mod:`engines.trtllm.bindings`).
"""
