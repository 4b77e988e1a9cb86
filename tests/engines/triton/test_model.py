"""The kvgate_llm Triton model against doubles of the TensorRT-LLM 1.2 executor and pb_utils.

What is checked is *our* side of the contract: the executor objects the model builds
(names, types, values — the double refuses anything the 1.2 bindings would refuse), and
what the model answers on the KServe side (engines/contract.py).
"""

from __future__ import annotations

import ast
import copy
import json
import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import engines.contract as contract
import engines.response_tensors as response_tensors
from engines.contract import EngineRequest, KvMetrics, SamplingParams, encode_request
from engines.pool_stats import PoolStatsReport
from engines.spec import load_bundled_spec, parse_spec
from engines.trtllm.executor_args import cache_salt_id
from retention.types import DEFAULT_PRIORITY, RetentionPlan, TokenRange
from tests.engines.triton import fake_trtllm
from tests.engines.triton.conftest import SPEC, make_harness

FINAL = 1
PROMPT = tuple(range(100, 100 + 80))  # 2 full blocks of 32 + 16 tokens


def request(*, plan=RetentionPlan(), salt=None, tenant=None, streaming=False, max_new=4, ids=PROMPT):
    return encode_request(
        EngineRequest(
            input_ids=ids, max_new_tokens=max_new, end_id=None, streaming=streaming,
            sampling=SamplingParams(), retention=plan, cache_salt=salt, tenant_id=tenant,
        )
    )


def outputs(sender):
    assert sender.finished.is_set(), "no final response"
    result = []
    for response, flags in sender.responses:
        assert response is not None and not response.has_error(), response.error().message() if response else None
        result.append((response.tensors(), flags))
    return result


def error_of(sender) -> str:
    [(response, flags)] = sender.responses
    assert flags == FINAL and response.has_error()
    return response.error().message()


def recorded_request(h, index=-1):
    return list(h.executor.requests.values())[index]


def test_retention_plan_becomes_kv_cache_retention_config(harness):
    plan = RetentionPlan(
        ranges=(TokenRange(0, 32, 90, None), TokenRange(32, 64, 60, 30_000), TokenRange(64, None, 20, 5_000)),
        decode_priority=10,
        decode_duration_ms=1_000,
    )
    outputs(harness.send(request(plan=plan, salt="salt-of-tenant-a", tenant="tenant-a")))
    sent = recorded_request(harness)
    config = sent.kv_cache_retention_config
    ranges = [(r.token_start, r.token_end, r.priority, r.duration_ms) for r in config.token_range_retention_configs]
    assert ranges == [
        (0, 32, 90, None),  # duration None = no expiry
        (32, 64, 60, timedelta(milliseconds=30_000)),  # std::chrono::milliseconds ↔ timedelta
        (64, 2**31 - 1, 20, timedelta(milliseconds=5_000)),  # open-ended last range: SizeType32 max
    ]
    assert config.decode_retention_priority == 10
    assert config.decode_duration_ms == timedelta(milliseconds=1_000)
    assert sent.cache_salt_id == cache_salt_id("salt-of-tenant-a")
    assert 0 <= sent.cache_salt_id < 2**64
    assert sent.input_token_ids == list(PROMPT)
    assert sent.output_config.exclude_input_from_output is True
    assert sent.output_config.return_perf_metrics is True
    assert sent.end_id == 128009  # the spec's end_id when the request sends none


def test_default_plan_sends_no_retention_config_and_unsalted_request_no_salt(harness):
    outputs(harness.send(request()))
    sent = recorded_request(harness)
    assert sent.kv_cache_retention_config is None
    assert sent.cache_salt_id is None


def test_decode_only_plan_is_still_sent(harness):
    outputs(harness.send(request(plan=RetentionPlan((), decode_priority=80, decode_duration_ms=None))))
    config = recorded_request(harness).kv_cache_retention_config
    assert config.token_range_retention_configs == []
    assert config.decode_retention_priority == 80 and config.decode_duration_ms is None


def test_greedy_and_sampled_requests_map_to_sampling_config(harness):
    outputs(harness.send(request()))
    greedy = recorded_request(harness).sampling_config
    assert (greedy.top_k, greedy.top_p, greedy.temperature) == (1, 1.0, None)
    tensors = request()
    tensors[contract.TEMPERATURE.name] = np.array([0.7], np.float32)
    tensors[contract.TOP_P.name] = np.array([0.9], np.float32)
    tensors[contract.TOP_K.name] = np.array([40], np.int32)
    tensors[contract.RANDOM_SEED.name] = np.array([7], np.uint64)
    outputs(harness.send(tensors))
    sampled = recorded_request(harness).sampling_config
    assert sampled.top_k == 40 and sampled.seed == 7
    assert sampled.top_p == pytest.approx(0.9) and sampled.temperature == pytest.approx(0.7)


def test_an_unseeded_sampled_request_gets_a_fresh_seed_and_a_greedy_one_none(harness):
    # Unset, TensorRT-LLM seeds every request with DefaultDecodingParams::getSeed() == 0: identical
    # unseeded requests would sample identical completions on GPU pools.
    seeds = []
    for _ in range(2):
        tensors = request()
        tensors[contract.TEMPERATURE.name] = np.array([1.0], np.float32)
        outputs(harness.send(tensors))
        seeds.append(recorded_request(harness).sampling_config.seed)
    assert None not in seeds and seeds[0] != seeds[1] and all(0 <= s < 2**64 for s in seeds)
    outputs(harness.send(request()))
    assert recorded_request(harness).sampling_config.seed is None


def test_non_streaming_answer_and_kv_metrics(harness):
    [(first, flags)] = outputs(harness.send(request(salt="s1")))
    assert flags == FINAL
    expected = [(t * 7 + 3) % 1000 + 10 for t in PROMPT][:4]
    assert first[response_tensors.OUTPUT_IDS.name].tolist() == expected
    assert first[response_tensors.SEQUENCE_LENGTH.name].tolist() == [4]
    assert first[response_tensors.KV_REUSED.name].tolist() == [0]
    [(second, _)] = outputs(harness.send(request(salt="s1")))
    # two full 32-token blocks, and the third (tokens 64..78 of the partial block stored at the first
    # request's release) by partial reuse (enable_partial_reuse; kvCacheManager.cpp loadOrAllocateBlocks)
    assert second[response_tensors.KV_REUSED.name].tolist() == [3]
    # total counts getFreeBlock calls: the two full blocks are on the GPU and the partial one is an unreferenced
    # leaf the request takes over (claimLeafBlock): none (kvCacheManager.cpp loadOrAllocateBlocks)
    assert second[response_tensors.KV_TOTAL.name].tolist() == [0]
    assert second[response_tensors.KV_NEW.name].tolist() == [0]
    assert second[response_tensors.KV_ONBOARDED.name].tolist() == [0]  # all of it was on the GPU
    # once every slot has held tokens, TensorRT-LLM's num_new_allocated_blocks is 0 for a miss (getFreeBlock
    # counts slots never used); the contract's "new" is the prompt's missed blocks, num_missed_blocks
    for i in range(22):  # 22 prompts of 3 blocks: past the double's 64 slots
        outputs(harness.send(request(salt="warm", ids=tuple(range(2000 + 100 * i, 2000 + 100 * i + 80)))))
    [(cold, _)] = outputs(harness.send(request(salt="warm", ids=tuple(range(9000, 9080)))))
    assert cold[response_tensors.KV_REUSED.name].tolist() == [0] and cold[response_tensors.KV_NEW.name].tolist() == [3]


def test_salts_isolate_tenants(harness):
    outputs(harness.send(request(salt="tenant-a")))
    [(other, _)] = outputs(harness.send(request(salt="tenant-b")))
    assert other[response_tensors.KV_REUSED.name].tolist() == [0]
    [(same, _)] = outputs(harness.send(request(salt="tenant-a")))
    assert same[response_tensors.KV_REUSED.name].tolist() == [3]  # two full blocks + the partial third


def test_streaming_sends_deltas_and_never_the_end_token(harness):
    # the executor returns no end id (test_end_id.py): the request's last Result is final and empty
    tensors = request(streaming=True, max_new=6, ids=PROMPT[:3])
    tensors[contract.END_ID.name] = np.array([77], np.int32)
    responses = outputs(harness.send(tensors))
    generated = [(t * 7 + 3) % 1000 + 10 for t in PROMPT[:3]]
    assert [r[response_tensors.OUTPUT_IDS.name].tolist() for r, _ in responses] == [[t] for t in generated] + [[]]
    assert [r[response_tensors.SEQUENCE_LENGTH.name].tolist()[0] for r, _ in responses] == [1, 2, 3, 3]
    assert [flags for _, flags in responses] == [0, 0, 0, FINAL]
    assert recorded_request(harness).end_id == 77


def test_bad_input_gets_an_error_naming_the_tensor_and_the_model_keeps_serving(harness):
    tensors = request()
    tensors[contract.RANGE_STARTS.name] = np.array([0, 32], np.int32)
    tensors[contract.RANGE_ENDS.name] = np.array([32], np.int32)
    tensors[contract.RANGE_PRIORITIES.name] = np.array([50, 50], np.int32)
    assert "retention_token_range_ends" in error_of(harness.send(tensors))
    priority = request()
    priority[contract.DECODE_PRIORITY.name] = np.array([101], np.int32)
    assert "retention_decode_priority" in error_of(harness.send(priority))
    assert "input_ids" in error_of(harness.send({contract.REQUEST_OUTPUT_LEN.name: np.array([4], np.int32)}))
    too_long = request(max_new=harness.model.params.max_output_len + 1)
    assert "request_output_len" in error_of(harness.send(too_long))
    assert len(harness.executor.requests) == 0  # nothing invalid reached the executor
    outputs(harness.send(request()))


def test_stats_call_reports_pool_and_per_tenant_blocks_per_tier(harness):
    outputs(harness.send(request(salt="a", tenant="tenant-a")))
    other = tuple(range(500, 500 + 64))
    outputs(harness.send(request(salt="b", tenant="tenant-b", ids=other)))
    outputs(harness.send(request(salt="a", tenant="tenant-a")))  # reuse: stores nothing new
    stats_sender = harness.send({contract.KV_STATS.name: np.array([True])})
    [(tensors, flags)] = outputs(stats_sender)
    report = PoolStatsReport.from_json(tensors[response_tensors.KV_CACHE_STATS.name][0])
    assert flags == FINAL
    # tenant-a: 80 prompt + 4 generated tokens: 2 context blocks + the partial third stored at release;
    # tenant-b: 64 + 4: the first block at context end, the second (holding the last prompt token,
    # filled by generation) and a partial third at release (kvCacheManager.cpp releaseBlocks)
    assert report.tenants == {"tenant-a": [3, 0], "tenant-b": [3, 0]}
    assert report.secondary_offload_min_priority == 35
    assert report.tokens_per_block == 32
    assert report.primary.max_blocks == 64 and report.secondary.max_blocks == 256
    assert report.reused_blocks == 3  # tenant-a's second request: two full blocks + one partially

    a_blocks = [h for h, b in harness.model.ledger._blocks.items() if b.tenant == "tenant-a"]
    harness.executor.offload(a_blocks[1])
    harness.executor.evict(a_blocks[2])  # a leaf
    [(tensors, _)] = outputs(harness.send({contract.KV_STATS.name: np.array([True])}))
    report = PoolStatsReport.from_json(tensors[response_tensors.KV_CACHE_STATS.name][0])
    assert report.tenants == {"tenant-a": [1, 1], "tenant-b": [3, 0]}
    assert report.secondary.used_blocks == 1 and report.secondary.free_blocks == 255
    assert (report.offloaded_blocks, report.evicted_blocks, report.onboarded_blocks) == (1, 1, 0)


class _Recorded(list):
    """``model.finished`` that remembers every request appended to it (the drain clears the list)."""

    def __init__(self):
        super().__init__()
        self.appended = []

    def append(self, item):
        self.appended.append(item)
        super().append(item)


def stats_of(h) -> PoolStatsReport:
    [(tensors, _)] = outputs(h.send({contract.KV_STATS.name: np.array([True])}))
    return PoolStatsReport.from_json(tensors[response_tensors.KV_CACHE_STATS.name][0])


def test_cancelled_request_is_cancelled_in_the_executor(harness):
    """python_backend README (r26.04): "Sending the TRITONSERVER_RESPONSE_COMPLETE_FINAL flag at the end of
    response is still needed even the request is cancelled". The executor answers a cancelled request with
    a final Result (executorImpl.cpp terminateCancelledRequests); the model forwards it with the flag."""
    request_tensors = request(streaming=True, max_new=8)
    inference = harness.pb.InferenceRequest(request_tensors)
    harness.model.execute([inference])
    inference.sender.cancelled = True
    harness.model.pump(timedelta(0))
    [request_id] = harness.executor.requests
    assert harness.executor.cancelled == [request_id]
    [(final, flags)] = outputs(inference.sender)
    assert flags == FINAL and final[response_tensors.OUTPUT_IDS.name].tolist() == []
    assert harness.model.pending == {}


def test_a_request_cancelled_while_running_gets_one_final_answer_and_is_finished_once(harness):
    model, executor = harness.model, harness.executor
    model.finished = done = _Recorded()
    executor.auto_run = False
    inference = harness.pb.InferenceRequest(request(streaming=True, max_new=8, tenant="tenant-a"))
    model.execute([inference])
    executor.step()  # the first token is ready
    inference.sender.cancelled = True  # the client goes away
    model.pump(timedelta(0))
    [request_id] = executor.requests
    assert executor.cancelled == [request_id]
    assert inference.sender.responses == []  # a cancelled client gets nothing but its final answer
    assert request_id in model.pending  # kept until the executor's final response
    executor.step()  # terminateCancelledRequests: the final CANCELLED Result
    model.pump(timedelta(0))
    [(final, flags)] = outputs(inference.sender)
    assert flags == FINAL and final[response_tensors.OUTPUT_IDS.name].tolist() == []
    assert model.pending == {} and [r.tenant_id for r in done.appended] == ["tenant-a"]
    for _ in range(3):
        executor.step()
        model.pump(timedelta(0))
    assert len(inference.sender.responses) == 1 and len(done.appended) == 1
    assert executor.cancelled == [request_id]  # cancel_request is called once


def test_the_double_answers_a_cancelled_request_with_a_final_cancelled_result(harness):
    executor, trt = harness.executor, harness.trt
    request_id = executor.enqueue_request(trt.Request(list(PROMPT), 4, streaming=True))
    executor.cancel_request(request_id)
    [response] = executor.await_responses(timeout=timedelta(0))
    result = response.result
    assert result.is_final and result.output_token_ids == [[]]
    assert result.finish_reasons == [trt.FinishReason.CANCELLED]


def test_a_stop_racing_the_response_thread_sends_one_final_and_loses_no_other_answer(harness, monkeypatch):
    """The response thread has read request A's entry and is building its answer when Triton's execute
    thread handles a ``stop`` for A (which sends A's final answer). The real sender then refuses a second
    final (python_backend response_sender.cc: "Response sender has been closed."): that must neither reach
    A twice nor cost B, the next response of the same batch, its answer."""
    model = harness.model
    a = harness.pb.InferenceRequest(request(ids=tuple(range(100, 140))), request_id="req-a")
    b = harness.pb.InferenceRequest(request(ids=tuple(range(300, 340))), request_id="req-b")
    model.execute([a, b])
    real_encode, fired = response_tensors.encode_response, []

    def encode_then_stop(*args, **kwargs):
        if not fired:
            fired.append(1)
            model.execute([harness.pb.InferenceRequest({contract.STOP.name: np.array([True])}, request_id="req-a")])
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(response_tensors, "encode_response", encode_then_stop)
    model.pump(timedelta(0))
    monkeypatch.setattr(response_tensors, "encode_response", real_encode)
    model.pump(timedelta(0))
    assert [flags for _, flags in a.sender.responses] == [FINAL]
    [(answer, flags)] = outputs(b.sender)
    assert flags == FINAL and len(answer[response_tensors.OUTPUT_IDS.name]) == 4
    assert model.pending == {}


def test_a_failing_send_does_not_cost_the_rest_of_the_batch_its_answers(harness):
    model = harness.model
    a = harness.pb.InferenceRequest(request(ids=tuple(range(100, 140))), request_id="req-a")
    b = harness.pb.InferenceRequest(request(ids=tuple(range(300, 340))), request_id="req-b")
    model.execute([a, b])

    def broken(response=None, flags=0):
        raise harness.pb.TritonModelException("Unable to send response. Response sender has been closed.")

    a.sender.send = broken
    model.pump(timedelta(0))  # one failure is logged, the loop goes on
    assert outputs(b.sender)[0][1] == FINAL
    assert model.pending == {}


def test_the_double_sender_refuses_a_send_after_the_final_flag_like_python_backend(harness):
    sender = harness.pb.InferenceRequest({}).sender
    sender.send(None, flags=FINAL)
    with pytest.raises(harness.pb.TritonModelException, match="Response sender has been closed"):
        sender.send(None, flags=FINAL)


def test_event_batches_drained_on_two_threads_are_applied_in_fetch_order(harness):
    """getEvents returns std::exchange(mEvents, {}) (kvCacheEventManager.cpp): two threads draining get two
    separate batches. The response thread, preempted between fetching the stored events and applying them,
    must not let the stats call apply the later removals first (ghost blocks on the tenant, event gaps)."""
    model = harness.model
    real = model.event_manager
    fetched, release = threading.Event(), threading.Event()

    class Preempted:
        def get_latest_events(self, timeout_ms=None):
            batch = real.get_latest_events(timeout_ms=timeout_ms)
            if threading.current_thread().name == "response-loop":
                fetched.set()
                release.wait(5)
            return batch

    model.execute([harness.pb.InferenceRequest(request(salt="salt-a", tenant="tenant-a"))])
    for response in model.executor.await_responses(timeout=timedelta(0)):
        model._dispatch(response)  # answered; its stored events wait in the event manager
    model.event_manager = Preempted()
    response_loop = threading.Thread(target=model.drain_events, name="response-loop")
    response_loop.start()
    assert fetched.wait(5)
    root = next(b for b in harness.executor.tree.values() if b.parent == 0)
    harness.executor.evict(root.block_hash)  # the engine evicts the blocks: removed events
    reports = []
    stats_call = threading.Thread(target=lambda: reports.append(stats_of(harness)), name="execute")
    stats_call.start()
    stats_call.join(0.3)
    release.set()
    response_loop.join(5)
    stats_call.join(5)
    assert not response_loop.is_alive() and not stats_call.is_alive()
    assert harness.executor.tree == {}
    assert model.ledger.tier_blocks() == [0, 0] and model.ledger.tenants() == {}
    assert model.ledger.gaps == 0
    assert reports[0].tenants == {}


def test_stop_cancels_the_running_request_with_the_same_triton_id(harness):
    running = harness.pb.InferenceRequest(request(streaming=True, max_new=8), request_id="req-7")
    harness.model.execute([running])
    stop = harness.pb.InferenceRequest({contract.STOP.name: np.array([True])}, request_id="req-7")
    harness.model.execute([stop])
    [request_id] = harness.executor.requests
    assert harness.executor.cancelled == [request_id]
    [(tensors, flags)] = outputs(stop.sender)
    assert flags == FINAL and tensors[response_tensors.OUTPUT_IDS.name].tolist() == []
    [(final, flags)] = outputs(running.sender)
    assert flags == FINAL and final[response_tensors.OUTPUT_IDS.name].tolist() == []
    harness.model.pump(timedelta(0))
    assert len(running.sender.responses) == 1  # nothing after the final answer
    other = harness.send({contract.STOP.name: np.array([True])})  # nothing running: still answered
    assert outputs(other)[0][1] == FINAL


def test_multi_gpu_spec_runs_the_executor_in_orchestrator_mode(tmp_path, monkeypatch):
    h = make_harness(tmp_path, monkeypatch, spec_name="llama-3.1-70b-instruct-fp8-tp8")
    try:
        parallel = h.executor.config.parallel_config
        assert parallel.communication_mode.name == "ORCHESTRATOR"
        assert parallel.orchestrator_config.is_orchestrator is True
        # The stock C++ backend's default (TensorRT-LLM triton_backend/inflight_batcher_llm/src/
        # model_state.cc GetExecutorWorkerPath); server r26.04 build.py copies trtllmExecutorWorker there.
        assert parallel.orchestrator_config.worker_executable_path == "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"
        outputs(h.send(request(salt="a", tenant="tenant-a")))
        # The orchestrator process has no local model: no KV event manager (executorImpl.cpp).
        # The model still serves and answers the stats call, without per-tenant or host-tier counts.
        assert h.model.event_manager is None
        [(tensors, flags)] = outputs(h.send({contract.KV_STATS.name: np.array([True])}))
        report = PoolStatsReport.from_json(tensors[response_tensors.KV_CACHE_STATS.name][0])
        assert flags == FINAL and report.tenants == {}
        assert report.secondary.max_blocks == 0 and report.primary.max_blocks == 64  # primary from IterationStats
        assert h.model.ledger._roots == {}  # nothing queued for events that never come
    finally:
        h.model.finalize()


def test_bindings_of_another_tensorrt_llm_release_are_refused(tmp_path, monkeypatch):
    from engines.trtllm.bindings import BindingError

    with pytest.raises(BindingError, match=r"TensorRT-LLM 1\.3\.0 but the engine spec pins 1\.2\.1"):
        make_harness(tmp_path, monkeypatch, version="1.3.0")
    h = make_harness(tmp_path / "unversioned", monkeypatch, version=None)  # no __version__: logged, served
    try:
        outputs(h.send(request()))
    finally:
        h.model.finalize()


def test_single_gpu_spec_uses_the_default_leader_mode(harness):
    assert not hasattr(harness.executor.config, "parallel_config")


def test_without_cache_salt_support_salted_requests_are_refused(tmp_path, monkeypatch):
    h = make_harness(tmp_path, monkeypatch, salt_supported=False)
    try:
        assert "cache_salt_id" in error_of(h.send(request(salt="tenant-a")))
        outputs(h.send(request()))  # unsalted (shared isolation) still served
        assert recorded_request(h).cache_salt_id is None
    finally:
        h.model.finalize()


def test_executor_is_built_from_the_config_pbtxt_parameters(harness):
    executor = harness.executor
    assert executor.model_path.endswith("/engines/llama-3.1-8b-instruct-fp8kv/engine")
    assert executor.model_type.name == "DECODER_ONLY"
    kv = executor.config.kv_cache_config
    assert (kv.secondary_offload_min_priority, kv.host_cache_size, kv.event_buffer_max_size) == (35, 34359738368, 16384)
    [kv_call] = [kwargs for name, kwargs in harness.trt.calls if name == "KvCacheConfig"]
    assert {k: kv_call[k] for k in ("enable_block_reuse", "free_gpu_memory_fraction", "onboard_blocks", "enable_partial_reuse")} == {
        "enable_block_reuse": True, "free_gpu_memory_fraction": 0.85, "onboard_blocks": True, "enable_partial_reuse": True,
    }
    [executor_call] = [kwargs for name, kwargs in harness.trt.calls if name == "ExecutorConfig"]
    assert sorted(executor_call) == ["enable_chunked_context", "guided_decoding_config", "iter_stats_max_iterations",
                                     "kv_cache_config", "max_batch_size", "max_beam_width", "max_num_tokens",
                                     "normalize_log_probs"]
    assert executor_call["normalize_log_probs"] is False  # the contract's log probabilities (engines/contract.py)
    assert executor_call["enable_chunked_context"] is True  # executorConfig.cpp: nb::arg(...) = false
    harness.model.finalize()
    assert executor.shut


def test_model_and_reference_engine_share_one_parser(harness):
    assert harness.module.contract is contract
    # parse_request is defined once, in engines/contract.py; no engine module redefines it.
    root = Path(contract.__file__).parent
    definers = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in ("parse_request", "parse_retention"):
                definers.append(path.relative_to(root).as_posix())
    assert sorted(set(definers)) == ["contract.py"]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("top_k", [0, 40])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_every_sampling_combination_reaches_the_decoder_as_asked(harness, temperature, top_k, top_p):
    """Engine defect: an unset top_p is 0.0 in the decoder (defaultDecodingParams.h), and
    regularizeTopKTopP (samplingTopKKernels.h) turns top_k 0 + top_p 0.0 into greedy. The double
    applies both, so a request that asks to sample must arrive as sampling."""
    tensors = request(max_new=3)
    tensors[contract.TEMPERATURE.name] = np.array([temperature], np.float32)
    tensors[contract.TOP_K.name] = np.array([top_k], np.int32)
    tensors[contract.TOP_P.name] = np.array([top_p], np.float32)
    [(answer, _)] = outputs(harness.send(tensors))
    sent = recorded_request(harness).sampling_config
    greedy_tokens = [(t * 7 + 3) % 1000 + 10 for t in PROMPT][:3]
    if temperature == 0.0:
        assert sent.greedy and sent.effective_top_k == 1
        assert answer[response_tensors.OUTPUT_IDS.name].tolist() == greedy_tokens
    else:
        assert not sent.greedy, f"temperature {temperature}, top_k {top_k}, top_p {top_p} fell back to greedy"
        assert sent.effective_top_k == top_k and sent.effective_top_p == pytest.approx(top_p)
        assert sent.temperature == pytest.approx(temperature)
        assert answer[response_tensors.OUTPUT_IDS.name].tolist() != greedy_tokens


def test_an_engine_without_paged_context_fmha_is_refused_when_the_pool_promises_reuse(tmp_path, monkeypatch):
    """Engine defect: builder.py drops paged context FMHA (FP8 KV without FP8 weights, or SM < 89);
    the executor then runs with reuse off and only logs it. The model must not start."""
    with pytest.raises(Exception, match="use_paged_context_fmha=False") as caught:
        make_harness(tmp_path, monkeypatch, engine={"paged_context_fmha": False, "quant_algo": None})
    assert type(caught.value).__name__ == "TritonModelException"
    assert "fixExecutorConfig" in str(caught.value) and "builder.py" in str(caught.value)


def test_an_engine_built_for_another_block_size_is_refused(tmp_path, monkeypatch):
    with pytest.raises(Exception, match="tokens_per_block 64, the spec says 32"):
        make_harness(tmp_path, monkeypatch, engine={"tokens_per_block": 64})


def test_a_missing_engine_fails_at_start_naming_the_file(tmp_path, monkeypatch):
    with pytest.raises(Exception, match=r"engine/config\.json"):
        make_harness(tmp_path, monkeypatch, write_engine=False)


def test_a_prefix_back_from_the_host_tier_reports_onboarded_blocks(harness):
    # kvCacheManager.cpp loadOrAllocateBlocks: a matched block in host memory goes through onboardBlock
    # (getFreeBlock + onboard), so num_total_allocated_blocks - num_missed_blocks counts it; the model reports it
    outputs(harness.send(request(salt="s1", tenant="tenant-a")))
    outputs(harness.send({contract.KV_STATS.name: np.array([True])}))  # drain the first request's events
    full = [h for h, b in harness.executor.tree.items() if len(b.tokens) == 32]
    assert len(full) == 2
    for block_hash in full:
        harness.executor.offload(block_hash)
    [(second, _)] = outputs(harness.send(request(salt="s1", tenant="tenant-a")))
    assert second[response_tensors.KV_REUSED.name].tolist() == [3]
    assert second[response_tensors.KV_NEW.name].tolist() == [0]
    assert second[response_tensors.KV_TOTAL.name].tolist() == [2]
    assert second[response_tensors.KV_ONBOARDED.name].tolist() == [2]
    assert all(harness.executor.tree[h].level == 0 for h in full)
    [(tensors, _)] = outputs(harness.send({contract.KV_STATS.name: np.array([True])}))
    report = PoolStatsReport.from_json(tensors[response_tensors.KV_CACHE_STATS.name][0])
    assert (report.offloaded_blocks, report.onboarded_blocks) == (2, 2)  # the onboards' updated events


def test_total_blocks_per_request_follow_tensorrt_llm(harness):
    # KVCacheManagerTest (cpp/tests/unit_tests/batch_manager/kvCacheManagerTest.cpp): a second identical
    # request reports getAllocTotalBlocksPerRequest() == numBlocks - numSharedBlocks; reused blocks on the GPU
    # take no getFreeBlock. 65 tokens, 32 per block: 3 blocks, the last token alone in the third (not matched)
    prompt = tuple(range(500, 565))
    [(first, _)] = outputs(harness.send(request(salt="c", ids=prompt)))
    assert (first[response_tensors.KV_TOTAL.name].tolist(), first[response_tensors.KV_NEW.name].tolist()) == ([3], [3])
    [(second, _)] = outputs(harness.send(request(salt="c", ids=prompt)))
    num_blocks, num_shared = 3, len(prompt) // 32
    assert second[response_tensors.KV_REUSED.name].tolist() == [num_shared]
    assert second[response_tensors.KV_TOTAL.name].tolist() == [num_blocks - num_shared]
    assert second[response_tensors.KV_NEW.name].tolist() == [num_blocks - num_shared]
    assert second[response_tensors.KV_ONBOARDED.name].tolist() == [0]


def test_pool_alloc_total_counts_generation_blocks(harness):
    # 64 prompt tokens fill two blocks; the first generation step's addToken (the 65th KV slot, for the first
    # generated token fed back) takes a third (allocateKvCache.cpp d2b9c97c; kvCacheManager.cpp b35ac1b6 addToken
    # -> adjustBlocksIfNeeded -> allocateBlock -> getFreeBlock): in the pool's alloc_total_blocks, not in the
    # request's KvCacheMetrics (addSequence only). max_new 4: steps 2 and 3 stay in it, the 4th token gets no slot
    [(answer, _)] = outputs(harness.send(request(salt="g", ids=tuple(range(700, 764)))))
    assert answer[response_tensors.KV_TOTAL.name].tolist() == [2]
    [(tensors, _)] = outputs(harness.send({contract.KV_STATS.name: np.array([True])}))
    report = PoolStatsReport.from_json(tensors[response_tensors.KV_CACHE_STATS.name][0])
    assert report.alloc_total_blocks == 3 and report.missed_blocks == 2


def test_no_host_tier_reports_no_onboards(harness):
    # a partly matched block that is referenced is copied (getFreeBlock): without a host tier that is never an onboard
    metrics = SimpleNamespace(num_total_allocated_blocks=1, num_new_allocated_blocks=0, num_reused_blocks=3,
                              num_missed_blocks=0)
    result = SimpleNamespace(request_perf_metrics=SimpleNamespace(kv_cache_metrics=metrics))
    assert harness.model._kv_metrics(result).onboarded_blocks == 1  # host tier: counted (may be that copy)
    object.__setattr__(harness.model.params, "host_cache_size", 0)
    kv = harness.model._kv_metrics(result)
    assert (kv.total_blocks, kv.onboarded_blocks) == (1, 0)


def test_stats_before_any_iteration_and_between_iterations(harness):
    # get_latest_iteration_stats() returns only the iterations since the last call: an empty deque
    # before the first request and between two stats calls (executor.h).
    [(tensors, _)] = outputs(harness.send({contract.KV_STATS.name: np.array([True])}))
    report = PoolStatsReport.from_json(tensors[response_tensors.KV_CACHE_STATS.name][0])
    assert report.primary.max_blocks == 64 and report.primary.used_blocks == 0  # from the KV "created" event
    outputs(harness.send(request(salt="a", tenant="tenant-a")))
    for _ in range(2):  # the second call sees an empty deque and keeps the last KvCacheStats
        [(tensors, _)] = outputs(harness.send({contract.KV_STATS.name: np.array([True])}))
        report = PoolStatsReport.from_json(tensors[response_tensors.KV_CACHE_STATS.name][0])
        # the finished request's blocks are cached for reuse, and a cached block is a free one
        assert report.primary.used_blocks == 0 and report.primary.free_blocks == 64
        assert report.alloc_total_blocks == 3 and report.tenants == {"tenant-a": [3, 0]}


def test_stats_without_kv_cache_stats_fall_back_to_events(tmp_path, monkeypatch):
    h = make_harness(tmp_path, monkeypatch, kv_cache_stats=False)  # IterationStats.kv_cache_stats is None
    try:
        h.executor.auto_run = False
        running = h.pb.InferenceRequest(request(salt="a", tenant="tenant-a"))
        h.model.execute([running])
        h.executor.step()
        report = stats_of(h)
        # no KvCacheStats: used is what the running requests hold (80 prompt tokens: 3 blocks), as TensorRT-LLM counts it
        assert (report.primary.max_blocks, report.primary.used_blocks, report.primary.free_blocks) == (64, 3, 61)
        while h.executor.active:
            h.executor.step()
        h.model.pump(timedelta(0))
        outputs(running.sender)
        report = stats_of(h)
        assert (report.primary.used_blocks, report.primary.free_blocks) == (0, 64)  # cached blocks are free
        assert report.tenants == {"tenant-a": [3, 0]}  # held or cached, per tenant: the event ledger
    finally:
        h.model.finalize()


def test_a_non_streaming_request_gets_exactly_one_final_message_however_it_ends(harness):
    """The gateway calls non-streaming requests as unary (server/gateway/replicas/engine_client.py):
    answer, bad input, executor error (terminateActiveRequests), stop and the stop call itself each
    get one response with the final flag, and nothing after it however long the model keeps pumping."""
    def pumped(sender, turns=3):
        for _ in range(turns):
            harness.model.pump(timedelta(0))
        assert len(sender.responses) == 1 and sender.responses[0][1] == FINAL, sender.responses
        return sender.responses[0][0]

    assert not pumped(harness.send(request(max_new=6))).has_error()
    bad = request()
    bad[contract.DECODE_PRIORITY.name] = np.array([101], np.int32)
    assert pumped(harness.send(bad)).has_error()

    harness.executor.auto_run = False  # requests stay active until stepped
    failing = harness.pb.InferenceRequest(request(max_new=6))
    harness.model.execute([failing])
    [request_id] = [rid for rid in harness.executor.active]
    harness.executor.ready.append(harness.trt.Response(request_id, None, "Encountered an error in forwardAsync function"))
    harness.model.pump(timedelta(0))
    for _ in range(8):  # the double keeps the request: its later answer must be dropped
        harness.executor.step()
    assert pumped(failing.sender).has_error()

    running = harness.pb.InferenceRequest(request(max_new=6), request_id="req-9")
    harness.model.execute([running])
    stop = harness.pb.InferenceRequest({contract.STOP.name: np.array([True])}, request_id="req-9")
    harness.model.execute([stop])
    for _ in range(8):
        harness.executor.step()
    assert not pumped(stop.sender).has_error()
    assert not pumped(running.sender).has_error()


def test_kv_cache_stats_count_cached_blocks_as_free_and_only_never_used_slots_as_new(harness):
    """kvCacheManager.h KvCacheStats: used = max - free; evictionPolicy.cpp releaseBlock counts a released
    block as free even while it is kept for reuse; kvCacheManager.cpp getFreeBlock counts a block in
    alloc_new only when it has no key; with block reuse (the spec's) every block is keyed by its release, so
    only never-used blocks count and never more than the pool (without reuse every block is new:
    test_bindings_and_ledger.py)."""
    executor = harness.executor
    executor.auto_run = False
    running = harness.pb.InferenceRequest(request())
    harness.model.execute([running])
    executor.step()
    report = stats_of(harness)
    assert (report.primary.used_blocks, report.primary.free_blocks) == (3, 61)  # held by the running request
    while executor.active:
        executor.step()
    harness.model.pump(timedelta(0))
    outputs(running.sender)
    executor.auto_run = True
    for i in range(30):  # 30 more prompts of 3 blocks, none shared: 93 missed blocks in a 64-block pool
        outputs(harness.send(request(ids=tuple(range(1000 + 100 * i, 1000 + 100 * i + 80)))))
    report = stats_of(harness)
    assert (report.primary.used_blocks, report.primary.free_blocks) == (0, 64)
    assert report.missed_blocks == 93 and report.alloc_new_blocks == 64


def _spec_with(**build):
    data = load_bundled_spec(SPEC).model_dump(mode="json")
    data["build"].update(build)
    return parse_spec(copy.deepcopy(data), source="tuned.yaml")


def test_a_prompt_longer_than_max_num_tokens_is_served_with_chunked_context(tmp_path, monkeypatch):
    """trtGptModel.h: without chunked context (the binding's default) and with context FMHA, the executor's
    maximum input length is min(max_seq_len - 1, max_num_tokens); the spec allows max_num_tokens below
    max_input_len, so the executor must be built with chunked context."""
    spec = _spec_with(max_num_tokens=2048)
    h = make_harness(tmp_path, monkeypatch, spec=spec)
    try:
        assert h.executor.config.enable_chunked_context is True
        [(answer, flags)] = outputs(h.send(request(ids=tuple(range(10, 4010)))))
        assert flags == FINAL and answer[response_tensors.SEQUENCE_LENGTH.name].tolist() == [4]
    finally:
        h.model.finalize()


def test_without_chunked_context_the_double_refuses_prompts_over_max_num_tokens_in_tensorrt_llms_words(tmp_path):
    trt = fake_trtllm.make_module()
    engine = fake_trtllm.write_engine_config(tmp_path / "engine", max_input_len=7168, max_seq_len=8192,
                                             max_num_tokens=8192).parent

    def last_response(prompt_len, *, paged_context_fmha=True, **config):
        fake_trtllm.write_engine_config(engine, paged_context_fmha=paged_context_fmha, max_input_len=7168,
                                        max_seq_len=8192, max_num_tokens=8192)
        executor = trt.Executor(str(engine), trt.ModelType.DECODER_ONLY, trt.ExecutorConfig(**config))
        executor.enqueue_request(trt.Request(list(range(10, 10 + prompt_len)), 4))
        return executor, executor.await_responses(timeout=timedelta(0))[-1]

    _, refused = last_response(4000, max_num_tokens=2048)
    assert refused.has_error()
    assert refused.error_msg.startswith(
        "Encountered an error when fetching new request: Prompt length (4000) exceeds maximum input length (2048). "
        "Set log level to info and check TRTGptModel logs for how maximum input length is set")
    assert not last_response(2048, max_num_tokens=2048)[1].has_error()
    assert not last_response(4000, max_num_tokens=2048, enable_chunked_context=True)[1].has_error()
    _, over = last_response(8192, enable_chunked_context=True)  # chunked: max_seq_len - 1
    assert "Prompt length (8192) exceeds maximum input length (8191)" in over.error_msg
    assert "exceeds maximum input length (8191)" in last_response(8192)[1].error_msg  # min(8191, 8192)
    # the engine's max_num_tokens is a ceiling: a larger runtime value is ignored
    assert "maximum input length (8191)" in last_response(9000, max_num_tokens=16384)[1].error_msg
    # executorImpl.cpp fixExecutorConfig: no paged context FMHA -> chunked context off, with a warning only
    executor, refused = last_response(4000, paged_context_fmha=False, max_num_tokens=2048, enable_chunked_context=True)
    assert refused.has_error() and "maximum input length (2048)" in refused.error_msg
    assert any(w.startswith("Chunked context is not supported for this configuration") for w in executor.warnings)


def test_an_engine_that_cannot_chunk_context_is_refused_when_the_spec_needs_it(tmp_path, monkeypatch):
    """Without paged context FMHA the executor turns chunked context off with a warning (executorImpl.cpp
    fixExecutorConfig) and then refuses every prompt over max_num_tokens: a pool whose max_input_len needs
    chunking must not start on such an engine (a pool with block reuse is already refused for it)."""
    data = load_bundled_spec(SPEC).model_dump(mode="json")
    data["build"]["max_num_tokens"] = 2048
    data["kv_cache"]["enable_block_reuse"] = False
    spec = parse_spec(data, source="no-reuse.yaml")
    with pytest.raises(Exception, match="chunked context") as caught:
        make_harness(tmp_path, monkeypatch, spec=spec, engine={"paged_context_fmha": False})
    assert type(caught.value).__name__ == "TritonModelException"
    assert "max_num_tokens 2048" in str(caught.value) and "max_input_len 7168" in str(caught.value)
    data["build"]["max_num_tokens"] = 8192  # >= max_input_len: no chunking needed, served
    h = make_harness(tmp_path / "fits", monkeypatch, spec=parse_spec(data, source="fits.yaml"),
                     engine={"paged_context_fmha": False})
    h.model.finalize()
