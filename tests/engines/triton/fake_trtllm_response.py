"""What the ``fake_trtllm`` executor answers with: cpp/tensorrt_llm/nanobind/executor/request.cpp
(Response, Result, FinishReason, RequestPerfMetrics / KvCacheMetrics).

A Response holds either a Result or an error message, never both: ``has_error()`` is "no Result", and
reading ``result`` of an error Response raises RuntimeError. A Result holds one beam. Templates: use
them through a module (``fake_trtllm_bound``).
"""

from __future__ import annotations

import enum

from tests.engines.triton.fake_trtllm_bound import Bound


class KvCacheMetrics:
    """A request's KV block counts; the executor fills them in when it schedules the request."""

    def __init__(self, total=0, new=0, reused=0, missed=0):
        self.num_total_allocated_blocks, self.num_new_allocated_blocks = total, new
        self.num_reused_blocks, self.num_missed_blocks = reused, missed
        # reused / (reused + missed): total counts getFreeBlock calls, not the prompt's blocks (kvCacheManager.cpp)
        self.kv_cache_hit_rate = reused / (reused + missed) if reused + missed else 0.0


class RequestPerfMetrics:
    def __init__(self, kv):
        self.kv_cache_metrics = kv


class FinishReason(enum.Enum):  # request.cpp (nanobind): nb::enum_<tle::FinishReason>(m, "FinishReason")
    NOT_FINISHED = 0
    END_ID = 1
    STOP_WORDS = 2
    LENGTH = 3
    TIMED_OUT = 4
    CANCELLED = 5


class Result(Bound):
    """Without a ``finish_reason`` a final Result reports LENGTH and any other NOT_FINISHED."""

    def __init__(self, tokens, is_final, perf, log_probs=None, finish_reason=None):
        finish = self._bindings.FinishReason
        self.output_token_ids = [list(tokens)]
        self.is_final = is_final
        self.request_perf_metrics = perf
        # request.cpp: Result.log_probs, std::optional<vector<vector<float>>> (per beam), None unless asked
        self.log_probs = None if log_probs is None else [list(log_probs)]
        # request.cpp: Result.finish_reasons, one per beam (llmRequest.cpp createResult: mFinishReasons)
        self.finish_reasons = [finish_reason or (finish.LENGTH if is_final else finish.NOT_FINISHED)]


class Response:
    def __init__(self, request_id, result=None, error_msg=""):
        self.request_id = request_id
        self._result = result
        self.error_msg = error_msg

    def has_error(self):
        return self._result is None

    @property
    def result(self):
        if self._result is None:
            raise RuntimeError("response has an error")
        return self._result
