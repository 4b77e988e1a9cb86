"""Engine specs, the TensorRT-LLM mapping, the Triton model and the CPU reference engine."""
