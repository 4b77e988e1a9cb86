"""Offline replay: the simulator and its policies, the cluster replay, and the yardsticks
(Belady's optimum, the oracle policies, the hit-density ceiling of age-based policies).

Pure like the rest of ``retention``: traces come in as parsed requests, results go out as
data; the gateway never imports from here.
"""
