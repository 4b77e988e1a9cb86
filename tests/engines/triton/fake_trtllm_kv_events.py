"""KV cache events of the ``fake_trtllm`` double: the ``kv_cache`` submodule's event classes
(cpp/tensorrt_llm/nanobind/executor/bindings.cpp ``kv_cache.*``) and the executor's KVCacheEventManager.

When events are made and flushed is the block manager's business (``fake_block_manager``: storeBlocks,
releaseBlocks, FakeEventQueue); these classes are only the data they carry and the manager that hands
them out. Templates: use them through a module (``fake_trtllm_bound``).
"""

from __future__ import annotations

from tests.engines.triton.fake_block_manager import FakeEventQueue
from tests.engines.triton.fake_trtllm_bound import Bound
from tests.engines.triton.fake_trtllm_checks import check_float


class UniqueToken:
    def __init__(self, token_id):
        self.token_id, self.token_extra_id = token_id, 0


class KVCacheCreatedData:
    def __init__(self, levels):
        self.num_blocks_per_cache_level = levels


class KVCacheStoredBlockData:
    def __init__(self, block_hash, tokens, cache_level, priority, lora_id=None):
        self.block_hash, self.tokens, self.cache_level, self.priority = block_hash, tokens, cache_level, priority
        self.lora_id = lora_id


class KVCacheStoredData:
    def __init__(self, parent_hash, blocks):
        self.parent_hash, self.blocks = parent_hash, blocks


class KVCacheRemovedData:
    def __init__(self, block_hashes):
        self.block_hashes = block_hashes


class KVCacheEventDiffInt:
    def __init__(self, old_value, new_value):
        self.old_value, self.new_value = old_value, new_value


class KVCacheUpdatedData:
    def __init__(self, block_hash, cache_level=None, priority=None):
        self.block_hash, self.cache_level, self.priority = block_hash, cache_level, priority


class KVCacheEvent:
    def __init__(self, event_id, data, window_size=0, attention_dp_rank=None):
        self.event_id, self.data, self.window_size = event_id, data, window_size
        self.attention_dp_rank = attention_dp_rank


# The module's ``kv_cache`` submodule holds these, in this order.
KV_CACHE_CLASSES = (UniqueToken, KVCacheCreatedData, KVCacheStoredBlockData, KVCacheStoredData, KVCacheRemovedData,
                    KVCacheEventDiffInt, KVCacheUpdatedData, KVCacheEvent)


class KVCacheEventManager(Bound):
    """executor.h ``KVCacheEventManager`` wraps the KV cache manager (executorImpl.cpp); its
    ``get_latest_events`` is ``BlockManager::getLatestEvents`` (batch_manager/kvCacheManager.cpp):
    empty when the block manager has no event manager, i.e. ``event_buffer_max_size == 0``
    (trtGptModelInflightBatching.cpp createKvCacheManager: ``getEventBufferMaxSize() > 0 ?
    make_unique<KVCacheEventManager>(...) : nullptr``). Queueing, flushing, the buffer bound and
    the worker's delay: ``fake_block_manager.FakeEventQueue``."""

    def __init__(self, buffer_max_size):
        event = self._bindings.KVCacheEvent
        self.buffer_max_size = buffer_max_size
        self.queue = FakeEventQueue(buffer_max_size, lambda event_id, data: event(event_id, data),
                                    lag=self._bindings.event_lag)

    def get_latest_events(self, timeout_ms=None):
        """kvCacheEventManager.cpp ``getEvents`` (NVIDIA/TensorRT-LLM 8c498e94; the same body in all four
        indexed snapshots): with a timeout, ``mEmptyCV.wait_for(lck, timeout, pred)``; without one
        (``timeout_ms=None``, the binding's default: ``std::nullopt``), ``mEmptyCV.wait(lck, pred)`` with
        ``pred = !mEvents.empty() || !mRun`` -- it returns only once the worker thread has delivered a batch
        (``mRun`` turns false only in the manager's destructor). The double has no other thread: a batch already handed to the worker
        (``FakeEventQueue.flush``) is delivered at once, and a call that nothing could ever wake raises
        instead of hanging the test. With a zero buffer the block manager has no event manager and
        ``BlockManager::getLatestEvents`` returns an empty deque without waiting."""
        check_float("timeout_ms", timeout_ms, optional=True)
        if timeout_ms is None and self.buffer_max_size:
            return self.queue.take(wait=True)
        return self.queue.take()
