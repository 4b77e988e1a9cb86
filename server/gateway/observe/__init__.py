"""What the gateway measures: Prometheus metrics, registry-vs-engine capacity, miss-ratio curves, live trace capture, SLO guards."""
