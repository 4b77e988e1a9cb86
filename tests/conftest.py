"""Shared fixtures. Tests mirror the source tree; each folder may add its own conftest."""

from __future__ import annotations

import os

# Why: 2 shared cores; one torch thread keeps forward passes stable and lets tests run side by side.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
