"""First-start demo data for ``kvgate serve --dev``: a pool, a retention class, a tenant, a key.

The key's plaintext can be shown only once, so in dev mode it is also kept in
``.kvgate-dev-demo-key`` (mode 0600) and shown again on later starts. Seeding is a
no-op when the pool already exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tenants import keys, pools, retention_classes, tenant
from tenants.models import Pool, RetentionClass

ACTOR = "system:demo-seed"
DEMO_POOL = "reference"
DEMO_MODEL = "smollm2-135m-instruct"
DEMO_TENANT = "demo"
DEMO_CLASS = "standard"
DEMO_KEY_FILE = ".kvgate-dev-demo-key"


@dataclass(frozen=True, slots=True)
class ReferencePoolShape:
    port: int = 8001
    tokens_per_block: int = 32
    primary_blocks: int = 512
    secondary_blocks: int = 1024
    offload_min_priority: int = 35

    def engine_args(self) -> list[str]:
        return ["--port", str(self.port), "--tokens-per-block", str(self.tokens_per_block),
                "--primary-blocks", str(self.primary_blocks), "--secondary-blocks", str(self.secondary_blocks),
                "--offload-min-priority", str(self.offload_min_priority)]


def seed_demo(factory: sessionmaker[Session], *, pepper: str, shape: ReferencePoolShape,
              key_file: Path = Path(DEMO_KEY_FILE)) -> str | None:
    """Create the demo rows if absent; return the demo key (new, or from ``key_file``)."""
    now = datetime.now(UTC)
    with factory() as session:
        exists = session.scalars(select(Pool.id).where(Pool.name == DEMO_POOL)).first() is not None
    if exists:
        return key_file.read_text().strip() if key_file.exists() else None
    with factory() as session:
        pools.create_pool(session, actor=ACTOR, now=now, name=DEMO_POOL, model_name=DEMO_MODEL,
                          replicas=[{"name": "r0", "endpoint": f"127.0.0.1:{shape.port}"}],
                          engine_spec="reference-smollm2",
                          tokens_per_block=shape.tokens_per_block, primary_blocks=shape.primary_blocks,
                          secondary_blocks=shape.secondary_blocks,
                          secondary_offload_min_priority=shape.offload_min_priority)
    with factory() as session:
        if session.scalars(select(RetentionClass.id)
                           .where(RetentionClass.name == DEMO_CLASS)).first() is None:
            retention_classes.create_class(session, actor=ACTOR, now=now, name=DEMO_CLASS,
                                           description="system prompt kept, context 10 min, last turn 30 s")
    with factory() as session:
        tenant.create_tenant(session, actor=ACTOR, now=now, slug=DEMO_TENANT, display_name="Demo tenant",
                             pool=DEMO_POOL, retention_class=DEMO_CLASS)
    with factory() as session:
        _, plaintext = keys.create_key(session, actor=ACTOR, now=now, tenant=DEMO_TENANT, pepper=pepper, name="demo")
    key_file.write_text(plaintext + "\n")
    key_file.chmod(0o600)
    return plaintext
