"""A request that ends on its end id: what TensorRT-LLM 1.2's executor returns and keeps, and what the
kvgate_llm model answers from it (engines/contract.py: the end token is never in ``output_ids`` and never
counted in ``sequence_length``).

TensorRT-LLM (C++ decoder, beam width 1), read at source:

* ``kernels/samplingTopKKernels.cu`` (03961722) ``topKStage2Sampling`` writes the sampled id at
  ``outputIds[seqLen]`` but, when it is the end id, only ``setFinishedEOS()``: "Do not increase seq len
  when EOS is generated. Seq len should always contain only tokens to be outputted" (the top-p and air
  top-p kernels do the same; ``stopCriteriaKernels.cu`` ``explicitEOSCriterion`` sets the length to the
  end id's position).
* ``batch_manager/trtGptModelInflightBatching.cpp`` (b35ac1b6) ``updateRequests``: ``numNewOutputTokens =
  seqLen - llmReq->getNumTokens(beam)``; only those go through ``LlmRequest::addNewToken`` (which appends to
  ``mTokens`` and ``mUniqueTokens``, llmRequest.h); the end id is a dropped token (``numDroppedTokens``), and
  log probabilities are set for ``seqLen - mPromptLen`` tokens, so not for it either.
* ``batch_manager/llmRequest.cpp`` (119c6e60) ``LlmRequest::createResult``: ``outputTokenIds`` are slices
  of ``getTokens(beam)`` (from the prompt's end with ``excludeInputFromOutput``; streaming: since the last
  response), so the end id is never in ``Result.output_token_ids``; a streaming request that ends on it
  gets a final Result with no token (``isFinished()`` alone makes it send one), finish reason ``END_ID``.
* ``batch_manager/kvCacheManager.cpp`` (b35ac1b6) ``WindowBlockManager::releaseBlocks`` stores
  ``chopVectorIntoBlocks(getUniqueTokens(0), size - 1, ...)``: the end id is in no stored block.
"""

from __future__ import annotations

import numpy as np
import pytest

import engines.contract as contract
import engines.response_tensors as response_tensors
from tests.engines.triton.test_bindings_and_ledger import _executor
from tests.engines.triton.test_model import FINAL, PROMPT, outputs, request

END = 5  # below the double's greedy tokens, (t * 7 + 3) % 1000 + 10 >= 10: only ever the end id


def greedy(prompt):
    return [(t * 7 + 3) % 1000 + 10 for t in prompt]


def stored_token_lists(manager):
    return [[t.token_id for t in b.tokens] for e in manager.get_latest_events(timeout_ms=0.0)
            if type(e.data).__name__ == "KVCacheStoredData" for b in e.data.blocks]


@pytest.mark.parametrize("streaming", [False, True])
def test_the_end_id_is_not_an_output_token_and_a_streamed_request_ends_with_an_empty_final_result(tmp_path,
                                                                                                   streaming):
    module, executor = _executor(tmp_path)
    prompt = list(range(100, 130))
    output_config = module.OutputConfig(exclude_input_from_output=True, return_log_probs=True)
    executor.enqueue_request(module.Request(input_token_ids=prompt, max_tokens=40, streaming=streaming,
                                            end_id=END, output_config=output_config))
    responses = executor.await_responses()
    results = [r.result for r in responses]
    tokens = [t for r in results for t in r.output_token_ids[0]]
    assert tokens == greedy(prompt) and END not in tokens
    assert [r.is_final for r in results][-1] and not any(r.is_final for r in results[:-1])
    assert results[-1].finish_reasons == [module.FinishReason.END_ID]
    # log probabilities only for the tokens the sequence kept (updateRequests: seqLen - mPromptLen of them)
    assert sum(len(r.log_probs[0]) for r in results) == len(tokens)
    if streaming:
        # one Result per iteration: 30 kept tokens, then the iteration that sampled the end id adds none
        assert [len(r.output_token_ids[0]) for r in results] == [1] * 30 + [0]


def test_the_end_id_never_joins_the_request_tokens_nor_a_stored_block(tmp_path):
    module, executor = _executor(tmp_path)
    manager = executor.get_kv_cache_event_manager()
    manager.get_latest_events(timeout_ms=0.0)
    executor.auto_run = False
    prompt = list(range(100, 130))  # 30 tokens, 30 generated, then the end id: 31 iterations
    [request_id] = [executor.enqueue_request(module.Request(input_token_ids=prompt, max_tokens=40, end_id=END))]
    stored, iterations = [], 0
    while executor.active:
        executor.step()
        iterations += 1
        if request_id in executor.blocks.sequences:
            assert END not in executor.blocks.sequences[request_id].tokens
        stored.extend(stored_token_lists(manager))
    assert iterations == 31
    tokens = prompt + greedy(prompt)  # the request's tokens at release: 60, the end id not among them
    # storeNewBlock at the step feeding token 33 (32 usable), releaseBlocks the first 59 tokens (partial)
    assert stored == [tokens[:32], tokens[32:59]]
    assert all(END not in block for block in stored)
    # KV slots: the prompt's 30, then one per generation step for the token it feeds (30 steps, the last one
    # feeding token 30 and sampling the end id): 60, as many as the request's tokens; one generation block (slot 33)
    assert executor.blocks.sequences == {} and executor.kv_counters.generation_total == 1


def test_an_end_id_sampled_first_ends_the_request_with_no_token(tmp_path):
    module, executor = _executor(tmp_path)
    prompt = [1]  # the double's greedy token for it: 20
    executor.enqueue_request(module.Request(input_token_ids=prompt, max_tokens=8, end_id=greedy(prompt)[0]))
    [response] = executor.await_responses()
    assert response.result.output_token_ids == [[]] and response.result.is_final
    assert response.result.finish_reasons == [module.FinishReason.END_ID]


@pytest.mark.parametrize("streaming", [False, True])
def test_the_model_answers_without_the_end_token_and_counts_only_kept_tokens(harness, streaming):
    tensors = request(streaming=streaming, max_new=6, ids=PROMPT[:3])
    tensors[contract.END_ID.name] = np.array([END], np.int32)
    tensors[contract.RETURN_LOG_PROBS.name] = np.array([True])
    responses = outputs(harness.send(tensors))
    ids = [t for r, _ in responses for t in r[response_tensors.OUTPUT_IDS.name].tolist()]
    log_probs = [v for r, _ in responses for v in r.get(response_tensors.OUTPUT_LOG_PROBS.name, np.zeros(0)).tolist()]
    assert ids == greedy(PROMPT[:3]) and END not in ids
    # fewer tokens than request_output_len: the request stopped on its end id (the contract's reading)
    assert responses[-1][0][response_tensors.SEQUENCE_LENGTH.name].tolist() == [3] and responses[-1][1] == FINAL
    assert log_probs == pytest.approx([-0.5 - 0.01 * t for t in ids])
