"""A pool's engine replicas: gRPC clients, routing, stats polling, the prompter per engine spec."""
