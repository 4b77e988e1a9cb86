"""What the gateway measures: Prometheus metrics, miss-ratio curves, live trace capture, SLO guards."""
