"""Pure KV-retention domain logic: no I/O, no clocks (callers pass ``now``).

Nothing here imports FastAPI, SQL, gRPC or Prometheus; the reference engine, the
gateway and the simulator all drive the same code.
"""
