"""Capacity planning for pools: model shapes, hardware, and the KV/weight arithmetic (pure).

``kvgate plan`` (server/cli/plan.py) is the front end; docs/capacity.md shows it at work.
"""

from engines.capacity.arithmetic import CapacityPlan, PlanError, PlanInputs, count_params, kv_bytes_per_token, plan
from engines.capacity.hardware import Hardware, HardwareError, load_gpu
from engines.capacity.shapes import ModelShape, ShapeError, load_shape, shape_from_config

__all__ = [
    "CapacityPlan", "Hardware", "HardwareError", "ModelShape", "PlanError", "PlanInputs", "ShapeError",
    "count_params", "kv_bytes_per_token", "load_gpu", "load_shape", "plan", "shape_from_config",
]
