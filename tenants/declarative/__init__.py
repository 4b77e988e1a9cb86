"""The declarative registry: ``registry.yaml`` → a plan of changes → one audited transaction.

* ``load_registry(text) / parse_registry(data) -> RegistryFile`` (``schema.py``): refuses
  unknown fields and bad values with the path that holds them.
* ``compute_plan(session, doc, prune=False) -> Plan`` (``plan.py``): what would change.
* ``apply_registry(session, doc, actor=, now=, prune=, dry_run=) -> Plan`` (``apply.py``).
"""

from tenants.declarative.apply import apply_plan, apply_registry
from tenants.declarative.plan import Change, FieldChange, Plan, compute_plan
from tenants.declarative.schema import RegistryFile, load_registry, parse_registry

__all__ = [
    "Change",
    "FieldChange",
    "Plan",
    "RegistryFile",
    "apply_plan",
    "apply_registry",
    "compute_plan",
    "load_registry",
    "parse_registry",
]
