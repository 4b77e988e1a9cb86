"""The reference sampler's extensions for real: log probabilities against an independent
forward, penalties, min_tokens, ignore_eos, logit bias and xgrammar-guided decoding, batched."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch

from engines.contract import ContractError, Guide, SamplingParams
from engines.reference.config import ReferenceEngineConfig
from engines.reference.engine import ReferenceEngine
from engines.reference.kv_cache import KvDtype, PagedKvCache
from engines.reference.model import PrefillSpan, StepBatch
from engines.reference.scheduler import FinishReason
from tests.engines.reference.helpers import chat_ids, make_request

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(bundle):
    engine = ReferenceEngine(bundle, ReferenceEngineConfig(
        kv_dtype="fp32", primary_blocks=64, secondary_blocks=0, tokens_per_block=16,
        max_input_len=256, max_output_len=64, max_num_tokens=512,
    ))
    engine.start()
    yield engine
    engine.stop()


async def _collect(engine, request_id, request):
    tokens, log_probs, last = [], [], None
    async for output in engine.generate(request_id, request):
        tokens.extend(output.new_tokens)
        log_probs.extend(output.log_probs or ())
        last = output
    return tokens, log_probs, last


def _independent_log_softmax(bundle, ids: list[int], prompt_len: int) -> torch.Tensor:
    """log_softmax of the logits predicting ids[prompt_len:], from one fresh full prefill."""
    geometry = bundle.geometry(16)
    cache = PagedKvCache(geometry, KvDtype.FP32, primary_blocks=-(-len(ids) // 16) + 1)
    n = len(ids)
    slots = torch.arange(n)
    rows = torch.arange(prompt_len - 1, n - 1)
    batch = StepBatch(torch.tensor(ids), torch.arange(n), slots, [PrefillSpan(0, n, slots, 0)], logit_rows=rows)
    return torch.log_softmax(bundle.model.forward(batch, cache).float(), dim=-1)


async def test_log_probs_match_an_independent_forward_streaming_and_not(engine, bundle, tokenizer):
    prompt = chat_ids(tokenizer, "Name a colour.")
    request = dataclasses.replace(make_request(prompt, 6, end_id=-1), return_log_probs=True, num_top_log_probs=3)
    for streaming in (False, True):
        tokens, log_probs, _ = await _collect(engine, f"lp{streaming}", dataclasses.replace(request, streaming=streaming))
        assert len(log_probs) == len(tokens) == 6
        expected = _independent_log_softmax(bundle, list(prompt) + tokens, len(prompt))
        for step, (token, lp) in enumerate(zip(tokens, log_probs)):
            assert lp.logprob == pytest.approx(float(expected[step, token]), abs=2e-3)
            assert [t for t, _ in lp.top] == expected[step].topk(3).indices.tolist()
            assert lp.top[0][0] == token  # greedy: the chosen token is the most likely


async def test_penalties_min_tokens_ignore_eos_and_logit_bias_change_the_output(engine, tokenizer):
    prompt = chat_ids(tokenizer, "List the numbers from 1 to 10.")
    base = make_request(prompt, 12, end_id=2)
    plain, _, plain_last = await _collect(engine, "plain", base)
    assert len(set(plain)) < len(plain)  # "1, 2, 3, ...": the comma repeats, so output penalties bite
    # Greedy repeats itself; a strong repetition penalty forbids every token already seen.
    penalized_req = dataclasses.replace(base, sampling=SamplingParams(repetition_penalty=100.0))
    penalized, _, _ = await _collect(engine, "rep", penalized_req)
    assert penalized != plain
    seen = set(prompt)
    assert all(t not in seen for t in penalized[:1])
    freq, _, _ = await _collect(engine, "freq", dataclasses.replace(base, sampling=SamplingParams(frequency_penalty=2.0, presence_penalty=2.0)))
    assert freq != plain
    # Short answer ending on <|im_end|>; min_tokens pushes the end past it, ignore_eos runs to the limit.
    short = make_request(chat_ids(tokenizer, "Write yes yes yes yes yes"), 24, end_id=2)
    ended, _, ended_last = await _collect(engine, "short", short)
    assert ended_last.finish_reason is FinishReason.END_ID and len(ended) < 12
    at_least, _, _ = await _collect(engine, "min", dataclasses.replace(short, sampling=SamplingParams(min_tokens=len(ended) + 5)))
    assert len(at_least) >= len(ended) + 5
    ignored, _, ignored_last = await _collect(engine, "ign", dataclasses.replace(short, ignore_eos=True))
    assert ignored_last.finish_reason is FinishReason.LENGTH and len(ignored) == 24
    # A +100 bias makes its token certain; -100 forbids the greedy choice.
    forced, _, _ = await _collect(engine, "bias", dataclasses.replace(base, sampling=SamplingParams(logit_bias=((42, 100.0),)), max_new_tokens=3))
    assert forced == [42, 42, 42]
    banned, _, _ = await _collect(engine, "ban", dataclasses.replace(base, sampling=SamplingParams(logit_bias=((plain[0], -100.0),)), max_new_tokens=2))
    assert banned[0] != plain[0]


async def test_guided_json_schema_batched_with_unguided_rows(engine, tokenizer):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    guided = dataclasses.replace(make_request(chat_ids(tokenizer, "Describe a person as JSON."), 48, end_id=2),
                                 guide=Guide("json_schema", json.dumps(schema)))
    free = make_request(chat_ids(tokenizer, "Tell me a story."), 8, end_id=2)
    compiles_before = engine.grammars.compile(guided.guide) is engine.grammars.compile(guided.guide)
    results = await asyncio.gather(
        _collect(engine, "g1", guided), _collect(engine, "free", free),
        _collect(engine, "g2", dataclasses.replace(guided, sampling=SamplingParams(temperature=1.0, seed=3))),
    )
    for tokens, _, last in (results[0], results[2]):
        value = json.loads(tokenizer.decode(tokens))
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)
        assert last.finish_reason is FinishReason.END_ID
    assert len(results[1][0]) == 8
    assert compiles_before  # the compiler's cache returns the same compiled grammar per schema


async def test_a_guide_that_does_not_compile_is_a_contract_error(engine, tokenizer):
    bad = dataclasses.replace(make_request(chat_ids(tokenizer, "x"), 4), guide=Guide("regex", "(unclosed"))
    with pytest.raises(ContractError) as caught:
        await _collect(engine, "bad", bad)
    assert caught.value.tensor == "guided_decoding_guide"
    assert engine.in_flight() == 0


def test_log_probs_over_grpc_unary_streaming_and_stream(fp8_server, tokenizer):
    """The server's three answer paths carry output_log_probs / top_log_probs aligned with output_ids."""
    import tritonclient.grpc as grpcclient

    from engines.contract import encode_request
    from engines.response_tensors import decode_log_probs
    from tests.engines.reference.helpers import to_inputs

    request = dataclasses.replace(make_request(chat_ids(tokenizer, "Hi there"), 4, end_id=-1), return_log_probs=True,
                                  num_top_log_probs=2)
    client = grpcclient.InferenceServerClient(fp8_server.url)
    try:
        answers = []
        for streaming in (False, True):  # unary ModelInfer; with streaming true the server merges the deltas
            result = client.infer("kvgate_llm", to_inputs(encode_request(dataclasses.replace(request, streaming=streaming))))
            names = ("output_log_probs", "top_log_probs", "top_log_probs_token_ids")
            probs = decode_log_probs({n: result.as_numpy(n) for n in names})
            answers.append((result.as_numpy("output_ids").tolist(), probs))
    finally:
        client.close()
    (ids, probs), (ids_merged, probs_merged) = answers
    assert ids == ids_merged and len(probs) == len(ids) == 4
    assert [p.logprob for p in probs] == pytest.approx([p.logprob for p in probs_merged], abs=1e-5)
    assert all(len(p.top) == 2 and p.top[0][0] == t for p, t in zip(probs, ids))  # greedy: chosen = most likely


async def test_ignore_eos_with_a_guide_is_refused_as_on_the_gpu_engine(engine, tokenizer):
    """One contract: TensorRT-LLM would never end a completed guide under end_id -1, so neither engine takes it."""
    request = dataclasses.replace(make_request(chat_ids(tokenizer, "x"), 4), ignore_eos=True, guide=Guide("json"))
    with pytest.raises(ContractError) as caught:
        await _collect(engine, "eos-guide", request)
    assert caught.value.tensor == "ignore_eos" and "guided_decoding_guide_type" in str(caught.value)
    assert engine.in_flight() == 0


@pytest.mark.parametrize("temperature", [0.0, 0.7])
async def test_a_completed_guide_under_min_tokens_ends_and_its_bystander_is_untouched(engine, tokenizer, temperature):
    """min_tokens masks the end id with TensorRT-LLM's finite MASK_VAL (-FLT_MAX); once the regex is
    complete the guide allows only the end id, so it is the one candidate left and the request ends
    (the grammar wins over min_tokens). A request sharing the batch runs as if alone."""
    other = make_request(chat_ids(tokenizer, "Name a colour."), 6, end_id=2)
    bystander = dataclasses.replace(other, sampling=SamplingParams(temperature=0.7, seed=3))
    alone, _, _ = await _collect(engine, f"alone{temperature}", bystander)
    guided = dataclasses.replace(make_request(chat_ids(tokenizer, "Say yes."), 10, end_id=2),
                                 sampling=SamplingParams(temperature=temperature, seed=1, min_tokens=5),
                                 guide=Guide("regex", "yes"), return_log_probs=True)
    (tokens, log_probs, last), (by_tokens, _, by_last) = await asyncio.gather(
        _collect(engine, f"gmin{temperature}", guided), _collect(engine, f"by{temperature}", bystander))
    assert last.error is None and last.finish_reason is FinishReason.END_ID
    assert tokenizer.decode(tokens) == "yes" and 2 not in tokens
    assert all(lp.logprob == lp.logprob for lp in log_probs)  # no NaN
    assert by_last.error is None and by_tokens == alone


@pytest.mark.parametrize("temperature", [0.0, 0.7])
async def test_a_tiny_repetition_penalty_is_clamped_and_fails_nobody(engine, tokenizer, temperature):
    """repetition_penalty 1e-38 would overflow seen positive logits to +inf; the kernel clamps to
    ±FLT_MAX, so the request gets finite log probabilities and its bystander its usual tokens."""
    bystander = dataclasses.replace(make_request(chat_ids(tokenizer, "Name a colour."), 6, end_id=-1),
                                    sampling=SamplingParams(temperature=0.7, seed=3))
    alone, _, _ = await _collect(engine, f"rp-alone{temperature}", bystander)
    tiny = dataclasses.replace(make_request(chat_ids(tokenizer, "Say yes."), 6, end_id=-1), return_log_probs=True,
                               sampling=SamplingParams(temperature=temperature, seed=1, repetition_penalty=1e-38))
    (tokens, log_probs, last), (by_tokens, _, by_last) = await asyncio.gather(
        _collect(engine, f"rp{temperature}", tiny), _collect(engine, f"rp-by{temperature}", bystander))
    assert last.error is None and len(tokens) == len(log_probs) == 6
    assert all(-100.0 < lp.logprob <= 0.0 for lp in log_probs)
    assert by_last.error is None and by_tokens == alone


async def test_an_end_id_outside_the_vocabulary_is_refused_in_process(engine, tokenizer):
    """parse_request refuses it for gRPC callers; in-process callers get the same ContractError
    (with min_tokens it would index past the logits row, with a guide xgrammar would raise)."""
    prompt = chat_ids(tokenizer, "Say yes.")
    for request in (dataclasses.replace(make_request(prompt, 4, end_id=engine.vocab_size + 10),
                                        sampling=SamplingParams(min_tokens=2)),
                    dataclasses.replace(make_request(prompt, 4, end_id=engine.vocab_size), guide=Guide("json"))):
        with pytest.raises(ContractError) as caught:
            await _collect(engine, "bad-end", request)
        assert caught.value.tensor == "end_id"
    assert engine.in_flight() == 0
