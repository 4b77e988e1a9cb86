"""Replays in worker processes, each result kept in memory and, optionally, in a JSON-lines store.

Used by the routing benches, whose grids take tens of minutes: a store lets a run be resumed
or split, and a result once replayed is never replayed again for the same key.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any


def replay_all(todo: dict[Hashable, tuple[Callable[..., Any], tuple]], saved: dict, *, workers: int,
               store: Path | None, field: str, progress: Callable[[Hashable], str]) -> float:
    """Run ``fn(*args)`` for every ``key: (fn, args)`` of ``todo`` (``fn`` a module-level function);
    ``saved[key]`` = its result, each appended to ``store`` as ``{"key": list(key), field: result}``
    as it finishes (so an interrupted run keeps what it did). Prints ``[progress(key) i/n s]``;
    returns the wall seconds."""
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(fn, *args): key for key, (fn, args) in todo.items()}
        for done, future in enumerate(as_completed(futures), start=1):
            key = futures[future]
            saved[key] = future.result()
            if store is not None:
                with store.open("a") as handle:
                    handle.write(json.dumps({"key": list(key), field: saved[key]}) + "\n")  # type: ignore[arg-type]
            print(f"[{progress(key)} {done}/{len(todo)} {time.perf_counter() - started:.0f}s]", flush=True)
    return time.perf_counter() - started
