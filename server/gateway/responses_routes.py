"""OpenAI Responses routes: ``POST /v1/responses`` and the stored responses
(``GET`` / ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``).

A thin dialect over the one request core: the body (and, with ``previous_response_id``,
the stored chain before it) is converted to the chat request the OpenAI chat path would
build (``responses_convert``), run by the same
:class:`~server.gateway.api.completions.CompletionRunner`, and rendered in the Responses
shapes (``responses_render``). Same tenants, API keys, limits and OpenAI error shape as the
chat routes. Stored responses live in the registry's database (``tenants.responses``,
through :class:`~server.gateway.response_store.ResponseStore`), so they outlive a gateway
restart and every gateway of the deployment sees them.

``store`` defaults to true, as OpenAI's does. Before the engine runs, a stored request
whose row may take the tenant past its byte cap is refused (400 ``response_store_full``):
the row is bounded by its input items, its response body and its output as
``max_output_tokens`` (or the tenant's default) allows (``ResponsesDialect.stored_bound``).
If the cap is reached anyway while it runs (another request stored meanwhile, or an output
over the bound), the answer is still delivered, not stored, says ``store: false`` and is
counted in ``kvgate_responses_not_stored_total``. A stored continuation keeps its chain's
responses alive as long as itself (``tenants.responses``). A ``previous_response_id`` that
cannot be continued is OpenAI's 400 ``previous_response_not_found`` (``ResponseStore.chain``).

``input`` may be left out of a continuation (``previous_response_id``). A prompt over the
tenant's ``max_prompt_tokens`` (admission's refusal) or the model's input limit (the
engine's: the gateway knows the model's limit from it alone) is OpenAI's 400
``context_length_exceeded`` naming ``input``: the route translates the core's refusal
(``responses_convert.in_responses_words``).

``GET /v1/responses/{id}`` returns the stored JSON only: ``stream=true`` and
``starting_after`` (replaying a stored response's events) are refused by name.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from engines.contract import SamplingParams
from retention.hashing import block_hashes
from retention.policy.conversation import ConversationRequest
from server.gateway.api import union_guide
from server.gateway.api.completions import REPLICA_HEADER, CompletionJob
from server.gateway.api.conversation_demote import DeletedPrompt, doomed_prompts
from server.gateway.api.responses_convert import (check_items, conversation_hints, convert, in_responses_words,
                                                  refuse_unservable, request_items)
from server.gateway.api.responses_render import ResponsesDialect
from server.gateway.api.responses_schemas import INCLUDABLE, OUTPUT_LOGPROBS, ResponsesRequest
from server.gateway.routes import Gateway, Tenant, check_model
from server.gateway.errors import ServingError
from server.gateway.response_store import ResponseStore
from server.gateway.strict_json import StrictJsonRoute
from tenants.responses import row_size

router = APIRouter(prefix="/v1/responses", tags=["responses"], route_class=StrictJsonRoute)


def _store(services) -> ResponseStore:
    if services.responses is None:
        raise ServingError(503, "responses_store_unavailable", "this gateway has no response store")
    return services.responses


def _ended_run(response: dict) -> bool:
    """A tool-offering request answered with no function call: its run most likely ended."""
    return not any(item.get("type") == "function_call" for item in response.get("output") or ())


@router.post("")
async def create_response(body: ResponsesRequest, tenant: Tenant, services: Gateway):
    refuse_unservable(body)
    check_model(tenant, body.model)
    items = request_items(body)
    store = body.store is not False
    history: list[dict] = []
    root_id: str | None = None  # the stored conversation's first response (its routing key)
    ancestors: tuple[str, ...] = ()
    if body.previous_response_id is not None:
        chain = await _store(services).chain(tenant_id=tenant.tenant_id, response_id=body.previous_response_id)
        history, root_id, ancestors = chain.items, chain.root_id, chain.ids
    check_items(history, items)
    if body.tools and body.text is not None and body.text.format is not None:
        await union_guide.ready("text.format")  # a format with tools: its guide is built with xgrammar
    conversation = convert(body, history + items)
    prompter = await services.engines.prompter(tenant.pool)
    try:
        prompt = prompter.chat(conversation.messages)
    except ValueError as exc:  # the model's chat template refused the conversation
        raise ServingError(400, "invalid_input", f"input: {exc}", param="input") from exc
    if prompt.total == 0:
        raise ServingError(400, "empty_prompt", "input: the prompt is empty", param="input")
    dialect = ResponsesDialect(body, previous_response_id=body.previous_response_id, store=None)
    if store:
        responses = _store(services)
        # The prompt's full blocks as the engine sees them, kept with the row: a delete on any gateway
        # reads from them which blocks the conversation's other live responses hold (conversation_demote.py).
        blocks = block_hashes(prompt.input_ids, tenant.pool.tokens_per_block, salt=tenant.engine_salt)
        # The whole row's bound, not the input's alone: a request that may not fit is refused before it runs and
        # is billed, rather than answered unstored.
        bound = dialect.stored_bound(body.max_output_tokens or tenant.limits.default_output_tokens)
        await responses.check_room(tenant_id=tenant.tenant_id,
                                   incoming=row_size(input_items=items, output_items=[], body={}) + bound)

        async def callback(response: dict) -> bool:
            # root_id is read when the answer is stored: by then it names this conversation's first response.
            kept = await responses.store(tenant_id=tenant.tenant_id, response=response, input_items=items,
                                         root_id=root_id, prompt_blocks=blocks, ancestor_ids=ancestors)
            if not kept:  # answered with store: false (the store logged why)
                services.metrics.responses_not_stored.labels(tenant.slug, tenant.pool.name).inc()
            # The run ended in a message: its own blocks are demoted, in the background (conversation_demote.py),
            # by the class's own switch alone: neither the hold's switch nor its duel gates it.
            if kept and tenant.conversation_end_demote and body.tools and root_id is not None and _ended_run(response):
                services.demotes.spawn_end(services, tenant, DeletedPrompt(body.model, prompt, prompter.tokenizer,
                                                                           tuple(blocks)), root_id)
            return kept

        dialect.store = callback

    sampling = SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p)
    max_new = body.max_output_tokens  # None: the tenant's default, as admission reads the tenant's limits
    if root_id is None and store:
        root_id = dialect.id  # a new stored conversation starts here: its first turn is routed by its own id
    hints = conversation_hints(body, total=prompt.total, context=tenant.retention.context,
                               conversation=store or body.previous_response_id is not None, root_id=root_id)
    job = CompletionJob(
        tenant=tenant, kind="chat", model=body.model, prompt=prompt, max_new_tokens=max_new, sampling=sampling,
        stop=(), stream=body.stream, include_usage=False, tokenizer=prompter.tokenizer,
        engine=services.routing.engine(services.engines.seen(tenant.pool)),
        quota=services.monitor.quota_state(tenant.pool.name, tenant.tenant_id), token_texts=prompter.token_texts,
        guide=conversation.guide, output_param="max_output_tokens", format_param="text.format",
        tools=conversation.tools, hints=hints,
        logprobs=(body.top_logprobs or 0) if OUTPUT_LOGPROBS in (body.include or ()) else None,
        conversation=ConversationRequest(dialect.id, body.previous_response_id, store, conversation.tools is not None),
    )
    try:
        answer = await services.runner.run(job, dialect)
    except ServingError as exc:  # a prompt over the tenant's or the model's limit, in this API's words
        translated = in_responses_words(exc)
        if translated is exc:
            raise
        raise translated from exc
    if body.stream:
        return answer
    final = await dialect.finalize()
    # The core's own headers (the replica, the rate-limit figures) on the finalized body.
    headers = {k: v for k, v in answer.headers.items() if k == REPLICA_HEADER or k.startswith("x-ratelimit-")}
    return JSONResponse(final, headers=headers or None)


@router.get("/{response_id}")
async def retrieve_response(response_id: str, tenant: Tenant, services: Gateway, stream: bool | None = None,
                            starting_after: str | None = None) -> dict:
    """The stored response as JSON: ``stream`` false or absent, no ``starting_after``."""
    if stream:
        raise ServingError(400, "unsupported_parameter", "stream: streaming a stored response is not supported; "
                           "omit stream (or send stream=false) for its JSON", param="stream")
    if starting_after is not None:
        raise ServingError(400, "unsupported_parameter", "starting_after: streaming a stored response is not "
                           "supported, so there is no event to start after", param="starting_after")
    return await _store(services).get(tenant_id=tenant.tenant_id, response_id=response_id)


@router.delete("/{response_id}")
async def delete_response(response_id: str, tenant: Tenant, services: Gateway) -> dict:
    store = _store(services)
    # Demote on delete (conversation_demote.py): the prompt and what the conversation's other live
    # responses hold are read from the store before the row is gone.
    doomed = await doomed_prompts(services, tenant, response_id) if tenant.conversation_hold else []
    await store.delete(tenant_id=tenant.tenant_id, response_id=response_id)
    # The conversation hold is no longer measured or renewed (what the engine holds runs out on its own) ...
    holds = services.holds
    holds.deleted(tenant.pool.name, tenant.engine_tenant_id, response_id)
    local = holds.demote_start(tenant.pool.name, tenant.engine_tenant_id, response_id)
    for prompt in doomed:  # ... but what is still cached of it (and of its orphans) goes back to priority 0
        start = prompt.start_block(tenant.pool.tokens_per_block, local)
        if start is not None:
            services.demotes.spawn(services, tenant, prompt, start)
    return {"id": response_id, "object": "response", "deleted": True}  # OpenAI's answer


@router.get("/{response_id}/input_items")
async def list_input_items(response_id: str, tenant: Tenant, services: Gateway,
                           limit: Annotated[int, Query(ge=1, le=100)] = 20,
                           order: Literal["asc", "desc"] = "desc",
                           after: Annotated[str | None, Query(max_length=64)] = None,
                           before: Annotated[str | None, Query(max_length=64)] = None,
                           include: Annotated[list[str] | None, Query()] = None) -> dict:
    """One page of the response's own input items: after ``after`` and/or before ``before``
    (``tenants.responses.list_input_items``). ``include``: OpenAI's values are accepted and change
    nothing (``INCLUDABLE``: none applies to a stored input item); any other is a 400 naming it."""
    for value in include or ():
        if value not in INCLUDABLE:
            raise ServingError(400, "invalid_request", f"include: {value[:80]!r} is not a value OpenAI defines; "
                               f"accepted: {', '.join(INCLUDABLE)}", param="include")
    return await _store(services).input_items(tenant_id=tenant.tenant_id, response_id=response_id, limit=limit,
                                              order=order, after=after, before=before)
