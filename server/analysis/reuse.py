"""Reuse analytics of a Mooncake-format trace in DuckDB (columnar, out of Python's loops).

Reads the JSONL once into a ``requests`` table, explodes it into one row per block
occurrence (``blocks``), and answers four questions per tenant and per segment:

1. which prefixes are shared most (tokens they save),
2. how soon blocks are reused (the gap since the block's previous use: CDF, percentiles),
3. how many KV bytes reuse would move between the host tier and the GPU per second,
   against a host-link budget,
4. the share of one-shot blocks (used once, never again).

Definitions (the tests compute them by hand on a tiny trace):

* Requests are taken in ``(timestamp, line)`` order. A block occurrence is *reused* when
  the same hash id appeared in an earlier request (an unbounded cache would hit it).
  Ids are global: a salted tenant's ids differ from everyone else's already, and equal
  ids of ``shared`` tenants are real sharing.
* A block's *tokens* are ``block_size``, except the last (partial) block of a request.
  Its *segment* is the one holding its first token (TensorRT-LLM's rule for token-range
  retention): ``system`` below ``system_tokens``, ``context`` below ``context_tokens``,
  else ``turn``; a line without both fields is ``unmarked``.
* A request's *shared prefix* is its leading run of reused blocks (hash ids chain, so a
  reused block's predecessors are reused too). The prefix is named by its last block's id
  and length; *tokens saved* add the prefix tokens of every request that reused it.
* *Reuse gap*: seconds between a block's use and its previous use (any tenant).
* *Transfer*: if every reused token were served from the host tier, ``reused tokens x
  KV bytes per token`` would cross the host link towards the GPU; new tokens are the
  bound for the other direction (offload). Per second of trace time.
* *One-shot*: distinct blocks used by exactly one request.

Reading: plain or gzip JSONL (``trace_file``; zstd, bzip2 and xz are refused by name). Event
lines (any line with an ``op`` key, ``"op": null`` too; the one op is ``delete_response``) are
checked as ``kvgate simulate`` checks them and left out; they are not requests.

Errors: a file DuckDB cannot read, or a line that breaks the trace format (a field of the
wrong JSON type included: nothing is coerced), raises :class:`AnalyzeError` naming the
file line (blank lines counted, as ``retention/trace.py`` counts them; the CLI exits 2).
"""

from __future__ import annotations

import gzip
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from server.analysis.trace_file import TraceFileError, check_compression, is_gzip, trace_lines

ID_MAX = 2**31 - 1
SEGMENTS = ("system", "context", "turn", "unmarked")
CDF_POINTS = 101  # quantiles 0 %, 1 %, ..., 100 % of the reuse gaps, for plots and JSON
# The fields a line may carry and what each must be (``retention/trace.py``'s rules). DuckDB
# reads each as raw JSON and the types are checked here: a typed read would coerce
# ``"10"``, ``10.5`` or ``true`` into an integer and merge tenant ``5`` with ``"5"``.
_FIELDS = {
    "timestamp": "number", "input_length": "integer", "output_length": "integer", "hash_ids": "ids",
    "tenant": "string", "system_tokens": "integer", "context_tokens": "integer", "block_size": "integer",
    "cached_gpu_tokens": "integer", "cached_host_tokens": "integer", "ttft_ms": "number",
}
_KINDS = {  # kind: (the typed value of JSON column {f}, {f} holds a value of another kind, in words)
    "number": ("TRY_CAST({f} AS DOUBLE)", "json_type({f}) NOT IN ('BIGINT', 'UBIGINT', 'DOUBLE')", "a number"),
    "integer": ("TRY_CAST({f} AS BIGINT)",
                "json_type({f}) NOT IN ('BIGINT', 'UBIGINT') OR TRY_CAST({f} AS BIGINT) IS NULL", "an integer"),
    "string": ("{f} ->> '$'", "json_type({f}) <> 'VARCHAR' OR {f} ->> '$' = ''", "a non-empty string"),
    # A list of non-negative integers is digits, commas, brackets and blanks: one scan of the
    # text, where json_type per element cost a third of the load. A sign, point, exponent,
    # quote or letter is a negative, float, string, bool or null id; nested lists fail the cast
    # to NULL, ids past int64 become NULL elements: _validate names both.
    "ids": ("TRY_CAST({f} AS BIGINT[])",
            "json_type({f}) <> 'ARRAY' OR regexp_matches({f}::VARCHAR, '[^0-9,\\[\\] \\t\\r\\n]')",
            "a list of integers in [0, 2^31)"),
}


class AnalyzeError(ValueError):
    """The trace cannot be analysed; the message names the file or line."""


@dataclass(frozen=True, slots=True)
class TraceTables:
    """An open DuckDB connection holding ``requests`` and ``blocks`` for one trace."""

    con: duckdb.DuckDBPyConnection
    block_size: int
    requests: int
    has_outcome: bool

    def rows(self, sql: str, params: dict[str, Any] | None = None) -> list[tuple]:
        return self.con.execute(sql, params or {}).fetchall()

    def dicts(self, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        cur = self.con.execute(sql, params or {})
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def _clean(exc: Exception) -> str:
    text = str(exc).split("\n")[0]
    return text.replace("Invalid Input Error: ", "").replace("Conversion Error: ", "")


def load_trace(path: Path, *, block_size: int | None = None, threads: int | None = None,
               memory_limit: str = "1GB", temp_directory: Path | None = None) -> TraceTables:
    """Read and validate ``path``; build the ``requests`` and ``blocks`` tables.

    With ``temp_directory`` the tables live in a database file there and DuckDB keeps to
    ``memory_limit`` by spilling, so a trace of millions of lines does not need its size in
    RAM; without it everything is in memory.
    """
    if not path.is_file():
        raise AnalyzeError(f"trace file not found: {path}")
    try:
        check_compression(path)
    except TraceFileError as exc:
        raise AnalyzeError(f"{path}: {exc}") from None
    config: dict[str, Any] = {"preserve_insertion_order": True, "memory_limit": memory_limit}
    if threads is not None:
        config["threads"] = threads
    if temp_directory is not None:
        config["temp_directory"] = str(temp_directory)
    try:
        # A database file in the temporary directory (not in memory): tables then live in the
        # buffer pool and can leave RAM, which an in-memory database's cannot.
        database = str(temp_directory / "trace.duckdb") if temp_directory is not None else ":memory:"
        con = duckdb.connect(database, config=config)
    except duckdb.Error as exc:
        raise AnalyzeError(f"cannot start DuckDB: {_clean(exc)}") from None
    con.execute("SET enable_progress_bar = false")  # DuckDB's own bar would mix with --json and ours
    source = {"path": str(path), "compression": "gzip" if is_gzip(path) else "none"}
    try:
        con.execute(_read_sql(), source)
        if _may_have_null_op(path):
            con.execute(_NULL_OP_SQL, source)
    except duckdb.Error as exc:
        raise AnalyzeError(f"{path}: {_first_bad_line(path) or _clean(exc)}") from None
    bad = con.execute("SELECT record, bad_field FROM raw WHERE bad_field IS NOT NULL ORDER BY record LIMIT 1").fetchone()
    if bad is not None:
        raise AnalyzeError(f"{path}: {_wrong_type(path, bad[0], bad[1])}")
    events = {row[0] for row in con.execute("SELECT record FROM raw WHERE event").fetchall()}
    if events:
        _check_events(path, events)
        con.execute("DELETE FROM raw WHERE event")
    # Record numbers are fixed now; every later order is explicit (ORDER BY), and without
    # insertion order DuckDB can stream and spill the big window and CUBE queries.
    con.execute("SET preserve_insertion_order = false")
    count = con.execute("SELECT count(*) FROM raw").fetchone()[0]
    if not count:
        raise AnalyzeError(f"{path}: the trace holds no requests")
    sizes = [r[0] for r in con.execute("SELECT DISTINCT block_size FROM raw WHERE block_size IS NOT NULL").fetchall()]
    if len(sizes) > 1:
        raise AnalyzeError(f"{path}: lines carry different block sizes {sorted(sizes)}; one trace has one block size")
    if sizes and block_size is not None and sizes[0] != block_size:
        raise AnalyzeError(f"{path}: the lines say block_size {sizes[0]} but --block-size {block_size} was given")
    if sizes and con.execute("SELECT count(*) FROM raw WHERE block_size IS NULL").fetchone()[0]:
        raise AnalyzeError(f"{path}: some lines carry block_size {sizes[0]} and others none")
    bs = int(sizes[0]) if sizes else (block_size or 512)
    if bs < 1:
        raise AnalyzeError(f"{path}: block_size must be >= 1")
    _validate(con, path, bs)
    con.execute("""
        CREATE TABLE requests AS
        SELECT row_number() OVER (ORDER BY timestamp, record) - 1 AS idx, record, timestamp AS ts,
               coalesce(tenant, '-') AS tenant, input_length, output_length, hash_ids, system_tokens, context_tokens,
               cached_gpu_tokens, cached_host_tokens, ttft_ms
        FROM raw ORDER BY idx
    """)
    con.execute("DROP TABLE raw")
    con.execute("""
        CREATE TABLE occ AS
        SELECT idx, ts, tenant, input_length, system_tokens, context_tokens,
               unnest(hash_ids) AS h, unnest(range(len(hash_ids))) AS pos
        FROM requests
    """)
    con.execute("""
        CREATE TABLE blocks AS
        SELECT idx, ts, tenant, h, pos,
               least($bs, input_length - pos * $bs) AS tokens,
               CASE WHEN system_tokens IS NULL OR context_tokens IS NULL THEN 'unmarked'
                    WHEN pos * $bs < system_tokens THEN 'system'
                    WHEN pos * $bs < context_tokens THEN 'context'
                    ELSE 'turn' END AS segment,
               lag(ts) OVER (PARTITION BY h ORDER BY idx) AS prev_ts,
               count(*) OVER (PARTITION BY h) AS uses
        FROM occ
    """, {"bs": bs})
    con.execute("DROP TABLE occ")
    con.execute("ALTER TABLE blocks ADD COLUMN reused BOOLEAN")
    con.execute("UPDATE blocks SET reused = prev_ts IS NOT NULL")
    has_outcome = con.execute("SELECT count(cached_gpu_tokens) > 0 FROM requests").fetchone()[0]
    return TraceTables(con, bs, int(count), bool(has_outcome))


def _read_sql() -> str:
    """``raw``: one row per non-blank line, the fields typed, ``event`` for op lines, and
    ``bad_field``: the first field of a request line whose JSON value is of the wrong kind."""
    columns = "{" + ", ".join(f"{name}: 'JSON'" for name in (*_FIELDS, "op")) + "}"
    values = ", ".join(_KINDS[kind][0].format(f=f'"{name}"') + f' AS "{name}"' for name, kind in _FIELDS.items())
    bad = " ".join(f"""WHEN "{name}" IS NOT NULL AND ({_KINDS[kind][1].format(f=f'"{name}"')}) THEN '{name}'"""
                   for name, kind in _FIELDS.items())
    return (f"CREATE TABLE raw AS SELECT record, op IS NOT NULL AS event, "
            f"CASE WHEN op IS NOT NULL THEN NULL {bad} END AS bad_field, {values} "
            f"FROM (SELECT row_number() OVER () AS record, * FROM read_json($path, format='newline_delimited', "
            f"compression=$compression, columns={columns}))")


# ``op: null`` reads as SQL NULL in ``raw``, as if the key were absent; but an ``op`` key makes
# an event line whatever its value (``retention/trace.py``, which refuses any op but
# ``delete_response``). A second scan asks each line whether it has the key (blank lines are
# skipped and rows numbered as in ``raw``); such lines become events, checked and refused there.
_NULL_OP_SQL = ("UPDATE raw SET event = true, bad_field = NULL WHERE NOT event AND record IN ("
                "SELECT record FROM (SELECT row_number() OVER () AS record, json_exists(json, '$.op') AS has_op "
                "FROM read_json_objects($path, format='newline_delimited', compression=$compression)) WHERE has_op)")


_NULL_OP = re.compile(rb'"op"\s*:\s*null|\\u')  # an op key set to null, or any escape (a key may be spelled with one)


def _may_have_null_op(path: Path, chunk: int = 1 << 22) -> bool:
    """Whether ``path`` may hold a line whose ``op`` is null: its bytes, read in large chunks (gunzipped
    if need be), hold ``"op": null`` or a ``\\u`` escape. A byte search costs a fraction of
    :data:`_NULL_OP_SQL`'s second JSON scan (which doubled the load of a large trace), so that scan runs
    only where it can find something."""
    overlap = 64  # longer than any match that could straddle two chunks ("op" and spaces before null)
    with (gzip.open(path, "rb") if is_gzip(path) else path.open("rb")) as handle:
        tail = b""
        while block := handle.read(chunk):
            window = tail + block
            if _NULL_OP.search(window):
                return True
            tail = window[-overlap:]
    return False


def _records(path: Path) -> Iterator[tuple[int, int, str]]:
    """(record, line, text) per non-blank line: ``record`` counts as DuckDB numbers the rows it
    reads (blank lines skipped), ``line`` counts every line, as ``retention.trace`` does."""
    record = 0
    with trace_lines(path) as lines:
        for line, text in enumerate(lines, start=1):
            if text.strip():
                record += 1
                yield record, line, text


def _line_of(path: Path, record: int) -> tuple[int, str]:
    """The file line number and text of DuckDB's row ``record`` (only on an error: it reads the file)."""
    for number, line, text in _records(path):
        if number == record:
            return line, text
    raise AnalyzeError(f"{path}: the file changed while it was read")


def _wrong_type(path: Path, record: int, name: str) -> str:
    line, text = _line_of(path, record)
    value = json.loads(text).get(name)
    kind = _KINDS[_FIELDS[name]][2]
    if name == "hash_ids" or value == "":
        return f"line {line}: {name} must be {kind}"
    if _FIELDS[name] == "integer" and isinstance(value, int) and not isinstance(value, bool):  # past int64
        return f"line {line}: {name} {value} is out of range"
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return f"line {line}: {name} has the wrong type: expected {kind}, got {shown}"


def _check_events(path: Path, records: set[int]) -> None:
    """Event lines (``op``, e.g. ``delete_response``) are no requests: analysed traces leave them
    out, after ``retention.trace`` checked them as ``kvgate simulate`` does."""
    from retention.trace import TraceError, parse_trace_events

    def only_events() -> Iterator[str]:  # every other line blank: line numbers stay the file's
        record = 0
        with trace_lines(path) as lines:
            for text in lines:
                record += bool(text.strip())
                yield text if text.strip() and record in records else ""

    try:
        parse_trace_events(only_events())
    except (TraceError, TraceFileError) as exc:
        raise AnalyzeError(f"{path}: {exc}") from None


def _first_bad_line(path: Path) -> str | None:
    """Only when DuckDB refused the file: find the first unreadable line in Python, by number.

    (DuckDB's own message counts lines differently: it skips blank ones.)
    """
    try:
        for _, line, text in _records(path):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                return f"line {line}: not valid JSON ({exc.msg})"
            if not isinstance(obj, dict):
                return f"line {line}: expected a JSON object"
    except TraceFileError as exc:
        return str(exc)
    return None


def _validate(con: duckdb.DuckDBPyConnection, path: Path, bs: int) -> None:
    """The first line (in file order) that breaks a rule of ``retention/trace.py``, as an error."""
    checks = [
        ("timestamp IS NULL OR NOT isfinite(timestamp) OR timestamp < 0", "timestamp must be a number >= 0 (ms)"),
        ("input_length IS NULL OR input_length < 1", "input_length must be an integer >= 1"),
        ("output_length IS NULL OR output_length < 0", "output_length must be an integer >= 0"),
        ("hash_ids IS NULL OR list_count(hash_ids) <> len(hash_ids) "
         f"OR list_min(hash_ids) < 0 OR list_max(hash_ids) > {ID_MAX}",
         "hash_ids must be a list of integers in [0, 2^31)"),
        # ceil without the addition: an input_length near 2^63 must not overflow INT64 in the check
        (f"len(hash_ids) <> input_length // {bs} + CASE WHEN input_length % {bs} > 0 THEN 1 ELSE 0 END",
         f"the number of hash_ids must be ceil(input_length / {bs}) (block size {bs})"),
        ("system_tokens < 0 OR context_tokens < 0 OR coalesce(system_tokens, 0) > coalesce(context_tokens, input_length) "
         "OR coalesce(context_tokens, 0) > input_length", "need system_tokens <= context_tokens <= input_length"),
    ]
    for condition, message in checks:
        try:
            row = con.execute(f"SELECT min(record) FROM raw WHERE {condition}").fetchone()
        except duckdb.Error as exc:  # an arithmetic overflow on some extreme value: still one line, never a traceback
            raise AnalyzeError(f"{path}: a value is out of range for the check '{message}' ({exc})") from None
        if row[0] is not None:
            raise AnalyzeError(f"{path}: line {_line_of(path, row[0])[0]}: {message}")


# --- the four questions ------------------------------------------------------------------------


def overview(t: TraceTables) -> dict[str, Any]:
    row = t.dicts("""
        SELECT count(*) AS requests, sum(input_length) AS prompt_tokens, sum(output_length) AS output_tokens,
               (max(ts) - min(ts)) / 1000.0 AS duration_s, count(DISTINCT tenant) AS tenants
        FROM requests
    """)[0]
    blocks = t.dicts("SELECT count(*) AS block_uses, count(DISTINCT h) AS distinct_blocks FROM blocks")[0]
    return {**row, **blocks, "block_size": t.block_size}


def reuse_by_group(t: TraceTables) -> list[dict[str, Any]]:
    """Per (tenant, segment), plus ``*`` rows for all tenants / all segments.

    Fields: block uses, distinct blocks, tokens, reused tokens, reuse share (the hit rate
    of an unbounded cache), one-shot blocks and their share, one-shot token share.
    """
    return t.dicts("""
        WITH firsts AS (
            SELECT h, arg_min(tenant, idx) AS tenant, arg_min(segment, idx) AS segment,
                   max(tokens) AS tokens, count(*) AS uses
            FROM blocks GROUP BY h
        ),
        uses AS (
            SELECT coalesce(tenant, '*') AS tenant, coalesce(segment, '*') AS segment,
                   count(*) AS block_uses, sum(tokens) AS tokens, sum(CASE WHEN reused THEN tokens ELSE 0 END) AS reused_tokens
            FROM blocks GROUP BY CUBE (tenant, segment)
        ),
        distinct_ AS (
            SELECT coalesce(tenant, '*') AS tenant, coalesce(segment, '*') AS segment,
                   count(*) AS distinct_blocks, count(*) FILTER (WHERE uses = 1) AS one_shot_blocks,
                   sum(tokens) AS distinct_tokens, sum(CASE WHEN uses = 1 THEN tokens ELSE 0 END) AS one_shot_tokens
            FROM firsts GROUP BY CUBE (tenant, segment)
        )
        SELECT u.tenant, u.segment, u.block_uses, u.tokens, u.reused_tokens,
               u.reused_tokens / u.tokens AS reuse_share,
               coalesce(d.distinct_blocks, 0) AS distinct_blocks, coalesce(d.one_shot_blocks, 0) AS one_shot_blocks,
               coalesce(d.one_shot_blocks / d.distinct_blocks, 0.0) AS one_shot_share,
               coalesce(d.one_shot_tokens / d.distinct_tokens, 0.0) AS one_shot_token_share
        FROM uses u LEFT JOIN distinct_ d USING (tenant, segment)
        ORDER BY u.tenant = '*' DESC, u.tenant, u.segment = '*' DESC, u.segment
    """)


def top_prefixes(t: TraceTables, *, top: int = 10) -> list[dict[str, Any]]:
    """The shared prefixes that saved the most tokens, per tenant (``top`` each)."""
    return t.dicts("""
        WITH per_request AS (
            SELECT idx, any_value(tenant) AS tenant,
                   coalesce(min(pos) FILTER (WHERE NOT reused), count(*)) AS hit_blocks
            FROM blocks GROUP BY idx
        ),
        saved AS (
            SELECT b.idx, sum(b.tokens) AS saved
            FROM blocks b JOIN per_request p ON b.idx = p.idx AND b.pos < p.hit_blocks GROUP BY b.idx
        ),
        hits AS (
            SELECT p.idx, p.tenant, p.hit_blocks, b.h AS end_id, b.segment AS end_segment, s.saved
            FROM per_request p JOIN blocks b ON b.idx = p.idx AND b.pos = p.hit_blocks - 1 JOIN saved s ON s.idx = p.idx
            WHERE p.hit_blocks > 0
        ),
        prefixes AS (
            SELECT tenant, end_id, hit_blocks AS blocks, any_value(end_segment) AS ends_in,
                   count(*) AS requests, sum(saved) AS tokens_saved, max(saved) AS prefix_tokens
            FROM hits GROUP BY tenant, end_id, hit_blocks
        )
        SELECT * FROM (
            SELECT *, row_number() OVER (PARTITION BY tenant ORDER BY tokens_saved DESC, end_id) AS rank FROM prefixes
        ) WHERE rank <= $top ORDER BY tenant, rank
    """, {"top": top})


def reuse_gaps(t: TraceTables) -> list[dict[str, Any]]:
    """Reuse-gap percentiles (seconds) per (tenant, segment) and ``*`` totals, with a CDF.

    One query per grouping (not a CUBE): exact quantiles hold their group's gaps in memory,
    and four groupings at once would hold every gap four times.
    """
    quantiles = [i / (CDF_POINTS - 1) for i in range(CDF_POINTS)]
    rows: list[dict[str, Any]] = []
    for tenant, segment in (("'*'", "'*'"), ("'*'", "segment"), ("tenant", "'*'"), ("tenant", "segment")):
        keys = [k for k in (tenant, segment) if not k.startswith("'")]
        group = f"GROUP BY {', '.join(keys)}" if keys else ""
        rows += t.dicts(f"""
            SELECT {tenant} AS tenant, {segment} AS segment, count(*) AS reuses,
                   quantile_cont(gap, 0.5) AS p50_s, quantile_cont(gap, 0.9) AS p90_s,
                   quantile_cont(gap, 0.99) AS p99_s, max(gap) AS max_s, quantile_cont(gap, $q) AS cdf_s
            FROM (SELECT tenant, segment, (ts - prev_ts) / 1000.0 AS gap FROM blocks WHERE reused)
            {group}
        """, {"q": quantiles})
    rows = [r for r in rows if r["reuses"]]
    return sorted(rows, key=lambda r: (r["tenant"] != "*", r["tenant"], r["segment"] != "*", r["segment"]))


def transfer(t: TraceTables, *, kv_bytes_per_token: float, link_bytes_per_s: float) -> dict[str, Any]:
    """KV bytes per second over the host link if reuse came from the host tier (and new blocks went there)."""
    per_second = t.dicts("""
        SELECT floor(ts / 1000.0) AS second,
               sum(CASE WHEN reused THEN tokens ELSE 0 END) AS reused_tokens,
               sum(CASE WHEN reused THEN 0 ELSE tokens END) AS new_tokens
        FROM blocks GROUP BY second ORDER BY second
    """)
    span = t.rows("SELECT min(ts), max(ts) FROM requests")[0]
    seconds = max(1.0, math.floor(span[1] / 1000.0) - math.floor(span[0] / 1000.0) + 1)
    onboard = [r["reused_tokens"] * kv_bytes_per_token for r in per_second]
    offload = [r["new_tokens"] * kv_bytes_per_token for r in per_second]
    # seconds without any request move nothing: they count as zeros in the percentiles
    zeros = max(int(seconds) - len(per_second), 0)

    def pct(values: list[float], q: float) -> float:
        return idle_percentile(values, zeros, q)

    by_tenant = t.dicts("""
        SELECT tenant, sum(CASE WHEN reused THEN tokens ELSE 0 END) AS reused_tokens,
               sum(CASE WHEN reused THEN 0 ELSE tokens END) AS new_tokens
        FROM blocks GROUP BY tenant ORDER BY tenant
    """)
    out: dict[str, Any] = {
        "kv_bytes_per_token": kv_bytes_per_token, "link_bytes_per_s": link_bytes_per_s, "seconds": seconds,
        "onboard_mean_bytes_per_s": sum(onboard) / seconds, "onboard_p99_bytes_per_s": pct(onboard, 0.99),
        "onboard_max_bytes_per_s": max(onboard, default=0.0),
        "offload_mean_bytes_per_s": sum(offload) / seconds, "offload_p99_bytes_per_s": pct(offload, 0.99),
        "offload_max_bytes_per_s": max(offload, default=0.0),
        "seconds_over_budget": sum(1 for a, b in zip(onboard, offload, strict=True) if a + b > link_bytes_per_s),
        "tenants": [{"tenant": r["tenant"], "onboard_mean_bytes_per_s": r["reused_tokens"] * kv_bytes_per_token / seconds,
                     "offload_mean_bytes_per_s": r["new_tokens"] * kv_bytes_per_token / seconds} for r in by_tenant],
        "timeline": [{"second": r["second"], "onboard_bytes": a, "offload_bytes": b}
                     for r, a, b in zip(per_second, onboard, offload, strict=True)],
    }
    if t.has_outcome:
        observed = t.rows("SELECT sum(cached_host_tokens) FROM requests")[0][0] or 0
        out["observed_onboard_mean_bytes_per_s"] = observed * kv_bytes_per_token / seconds
    return out


def idle_percentile(values: list[float], zeros: int, q: float) -> float:
    """The ``q`` quantile (linear interpolation) of ``values`` plus ``zeros`` more 0.0s.

    The idle seconds of a trace are counted, never listed: a trace spanning 1e12 seconds with
    two requests has 1e12 zeros. In the sorted whole the zeros come first (values are >= 0),
    so rank ``i`` is 0.0 below ``zeros`` and ``sorted(values)[i - zeros]`` from there on; the
    result equals sorting the materialized list.
    """
    ranked = sorted(values)
    n = zeros + len(ranked)
    if not n:
        return 0.0

    def at(i: int) -> float:
        return 0.0 if i < zeros else ranked[i - zeros]

    k = (n - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return at(lo) + (at(hi) - at(lo)) * (k - lo)


def observed_outcome(t: TraceTables) -> list[dict[str, Any]]:
    """What the engine reported for a live capture: cached tokens by tier and TTFT, per tenant."""
    if not t.has_outcome:
        return []
    rows = t.dicts("""
        SELECT coalesce(tenant, '*') AS tenant, count(*) AS requests, sum(input_length) AS prompt_tokens,
               sum(cached_gpu_tokens) AS cached_gpu_tokens, sum(cached_host_tokens) AS cached_host_tokens,
               sum(cached_gpu_tokens) / sum(input_length) AS gpu_hit_share,
               sum(cached_host_tokens) / sum(input_length) AS host_hit_share,
               quantile_cont(ttft_ms, 0.5) AS ttft_p50_ms, quantile_cont(ttft_ms, 0.99) AS ttft_p99_ms
        FROM requests GROUP BY CUBE (tenant)
    """)
    return sorted(rows, key=lambda r: (r["tenant"] != "*", r["tenant"]))
