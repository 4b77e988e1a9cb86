"""``tenants/`` is a lower layer: importing it never pulls in ``server`` or FastAPI."""

from __future__ import annotations

import subprocess
import sys


def test_tenants_does_not_import_upward() -> None:
    code = (
        "import sys, pkgutil, importlib, tenants\n"
        "for m in pkgutil.walk_packages(tenants.__path__, 'tenants.'):\n"
        "    if 'migrations' not in m.name: importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('server', 'fastapi', 'engines', 'starlette'))\n"
        "print(','.join(bad))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""
