"""Turn a :class:`ScheduledStep` into one forward pass and the sampled tokens.

Token slots: a sequence's token at position ``p`` lives at primary token slot
``block_slots[p // B] * B + p % B`` (``B`` = tokens per block). The runner builds the
packed :class:`StepBatch` — decode rows first, then prefill chunks — executes the
pool's block copies before the forward (offload bytes leave a slot before it is
overwritten; onboarded bytes are in place before attention reads them), and returns
one sampled token per sequence that asked for one.
"""

from __future__ import annotations

import time

import torch

from engines.reference.kv_cache import PagedKvCache
from engines.reference.model import DecodeGroup, LlamaModel, PrefillSpan, StepBatch
from engines.reference.sampling import Sampled, sample
from engines.reference.scheduler import ScheduledStep, Sequence
from retention.types import Tier


class StepRunner:
    def __init__(self, model: LlamaModel, cache: PagedKvCache, *, onboard_delay_s: float = 0.0) -> None:
        self.model = model
        self.cache = cache
        self.onboard_delay_s = onboard_delay_s  # fault knob (ReferenceEngineConfig.fault_onboard_delay_ms)
        self.tokens_per_block = cache.geometry.tokens_per_block

    def token_slots(self, seq: Sequence, start: int, stop: int) -> torch.Tensor:
        bs = self.tokens_per_block
        positions = torch.arange(start, stop)
        blocks = torch.tensor(seq.block_slots, dtype=torch.int64)
        return blocks[positions // bs] * bs + positions % bs

    def execute_copies(self, step: ScheduledStep) -> None:
        for copy in step.copies:
            self.cache.copy_block(int(copy.src_tier), copy.src_slot, int(copy.dst_tier), copy.dst_slot)
            if self.onboard_delay_s and copy.src_tier == Tier.SECONDARY and copy.dst_tier == Tier.PRIMARY:
                time.sleep(self.onboard_delay_s)  # a slow host link, on purpose (test/chaos only)

    def run(self, step: ScheduledStep) -> list[tuple[Sequence, Sampled]]:
        """Forward the step; returns ``(sequence, sampled token)`` for every sampling row."""
        self.execute_copies(step)
        token_ids: list[int] = []
        positions: list[torch.Tensor] = []
        write_slots: list[torch.Tensor] = []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        decode = None
        if step.decodes:
            rows = len(step.decodes)
            width = max(w.start + 1 for w in step.decodes)
            context = torch.zeros(rows, width, dtype=torch.int64)
            mask = torch.zeros(rows, 1, 1, width, dtype=torch.bool)
            for row, work in enumerate(step.decodes):
                seq = work.seq
                slots = self.token_slots(seq, 0, work.start + 1)
                context[row, : work.start + 1] = slots
                context[row, work.start + 1 :] = slots[0]
                mask[row, 0, 0, : work.start + 1] = True
                token_ids.append(seq.tokens[work.start])
                positions.append(torch.tensor([work.start]))
                write_slots.append(slots[-1:])
                logit_rows.append(row)
                sampled.append(seq)
            decode = DecodeGroup(0, context, mask)
        prefills: list[PrefillSpan] = []
        for work in step.prefills:
            seq = work.seq
            first = len(token_ids)
            stop = work.start + work.length
            slots = self.token_slots(seq, 0, stop)
            token_ids.extend(seq.tokens[work.start : stop])
            positions.append(torch.arange(work.start, stop))
            write_slots.append(slots[work.start :])
            prefills.append(PrefillSpan(first, work.length, slots, work.start))
            if work.sample:
                logit_rows.append(first + work.length - 1)
                sampled.append(seq)
        batch = StepBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.int64),
            positions=torch.cat(positions),
            write_slots=torch.cat(write_slots),
            prefills=prefills,
            decode=decode,
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64),
        )
        logits = self.model.forward(batch, self.cache)
        for work in (*step.decodes, *step.prefills):
            work.seq.num_computed = work.start + work.length
        if not sampled:
            return []
        return list(zip(sampled, sample(logits, sampled)))
