"""A pool's engine replicas: gRPC clients, routing, stats polling, registry-vs-engine capacity."""
