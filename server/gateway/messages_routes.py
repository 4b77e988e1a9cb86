"""Anthropic Messages routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A thin dialect over the one request core: the body is converted to the chat request the
OpenAI path would build (``messages_convert``), run by the same
:class:`~server.gateway.api.completions.CompletionRunner` (admission, planning, routing,
engine call, metrics, usage), and rendered in Anthropic's shapes (``messages_render``).
Same tenants, API keys and limits as the OpenAI routes.

Headers: the API key comes from ``x-api-key`` (Anthropic's header) or ``Authorization:
Bearer`` (what the OpenAI routes take; ``x-api-key`` wins when both are sent, unless it is
empty: an empty header, as a client with an unset variable sends, names no key).
``anthropic-version`` is accepted and not required: Anthropic refuses a request without
it, kvgate serves one version of the API and is lenient so that plain HTTP clients work.
``anthropic-beta`` is ignored (no beta feature is served). A tenant's requests and tokens per
minute are reported as Anthropic does (``anthropic-ratelimit-{requests,tokens}-{limit,remaining,
reset}``, reset an RFC 3339 time), on the answer and on its 429s.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header

from engines.contract import SamplingParams
from server.gateway.rate_headers import anthropic_rate_headers
from server.gateway.api import union_guide
from server.gateway.api.completions import CompletionJob
from server.gateway.api.messages_convert import Conversation, cache_hints, convert
from server.gateway.api.messages_render import MESSAGES
from server.gateway.api.messages_schemas import CountTokensRequest, MessagesRequest
from server.gateway.api.prompting import ChatPrompter, PreparedPrompt
from server.gateway.routes import Gateway, check_model
from server.gateway.context import TenantContext
from server.gateway.errors import ServingError
from server.gateway.services import GatewayServices
from server.gateway.strict_json import StrictJsonRoute

PATH_PREFIX = "/v1/messages"  # the app renders errors under it in Anthropic's shape
router = APIRouter(prefix=PATH_PREFIX, tags=["anthropic"], route_class=StrictJsonRoute)


async def messages_tenant(services: Gateway, x_api_key: Annotated[str | None, Header()] = None,
                          authorization: Annotated[str | None, Header()] = None) -> TenantContext:
    if services.draining:
        raise ServingError(503, "shutting_down", "this gateway is shutting down; retry on another replica",
                           headers={"Retry-After": "1", "Connection": "close"})
    if x_api_key:  # an empty x-api-key names no key: the Authorization header, if any, does
        authorization = "Bearer " + x_api_key
    if not authorization:
        raise ServingError(401, "invalid_api_key", "missing API key: send 'x-api-key: kvg_...' "
                           "(or 'Authorization: Bearer kvg_...')")
    return await services.auth.authenticate(authorization)


Tenant = Annotated[TenantContext, Depends(messages_tenant)]


async def _prompt(services: GatewayServices, tenant: TenantContext, conversation: Conversation):
    prompter = await services.engines.prompter(tenant.pool)
    try:
        prompt = prompter.chat(conversation.messages, conversation.marks, scope=tenant.engine_tenant_id)
    except ValueError as exc:  # the model's chat template refused the conversation
        raise _template_refused(exc) from exc
    if prompt.total == 0:
        raise ServingError(400, "empty_prompt", "messages: the prompt is empty", param="messages")
    return prompter, prompt


def _template_refused(exc: ValueError) -> ServingError:
    return ServingError(400, "invalid_messages", f"messages: {exc}", param="messages")


def history_tokens(prompter: ChatPrompter, messages: list[dict]) -> list[int]:
    """The tokens of a conversation that ends with an assistant turn, rendered closed as the template
    renders a history turn: counting opens no generation prompt after it (the chat prompter always
    does, which is what generating needs)."""
    try:  # the messages' text is plain text, as in the chat prompter (prompting.py)
        return prompter.tokenizer.encode_chat(messages, add_generation_prompt=False)
    except ValueError as exc:
        raise _template_refused(exc) from exc


def _job(services: GatewayServices, tenant: TenantContext, body: MessagesRequest, conversation: Conversation,
         prompter, prompt: PreparedPrompt) -> CompletionJob:
    sampling = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,  # Anthropic's default
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
    )
    return CompletionJob(
        tenant=tenant, kind="chat", model=body.model, prompt=prompt, max_new_tokens=body.max_tokens,
        sampling=sampling, stop=tuple(body.stop_sequences or ()), stream=body.stream, include_usage=False,
        tokenizer=prompter.tokenizer, engine=services.routing.engine(services.engines.seen(tenant.pool)),
        quota=services.monitor.quota_state(tenant.pool.name, tenant.tenant_id), token_texts=prompter.token_texts,
        guide=conversation.guide, format_param="output_config.format", tools=conversation.tools,
        hints=cache_hints(conversation, prompt),
    )


@router.post("")
async def create_message(body: MessagesRequest, tenant: Tenant, services: Gateway):
    check_model(tenant, body.model)  # first: an unknown model is a 404, whatever the body holds
    if body.tools and body.output_config is not None and body.output_config.format is not None:
        await union_guide.ready("output_config.format")  # a format with tools: its guide is built with xgrammar
    conversation = convert(body)
    prompter, prompt = await _prompt(services, tenant, conversation)
    return await services.runner.run(_job(services, tenant, body, conversation, prompter, prompt), MESSAGES,
                                     rate_headers=anthropic_rate_headers)  # Anthropic's names and reset format


@router.post("/count_tokens")
async def count_tokens(body: CountTokensRequest, tenant: Tenant, services: Gateway) -> dict:
    """The prompt's length in the model's tokens, tool definitions included (no admission, no engine).
    A conversation ending with an assistant message is counted too (generating refuses it), that turn
    closed as a history turn (:func:`history_tokens`). An empty final assistant message (``""`` or
    ``[]``, which Anthropic allows) is the turn left open: the conversation is counted without it, as
    the prompt a create request without it reads, whose generation prompt opens that turn."""
    check_model(tenant, body.model)  # first: an unknown model is a 404, whatever the body holds
    conversation = convert(body, generate=False)
    if not conversation.messages or conversation.messages[-1]["role"] != "assistant":
        _, prompt = await _prompt(services, tenant, conversation)
        return {"input_tokens": prompt.total}
    prompter = await services.engines.prompter(tenant.pool)
    return {"input_tokens": len(history_tokens(prompter, conversation.messages))}
