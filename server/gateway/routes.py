"""OpenAI-compatible routes: thin handlers over :class:`CompletionRunner`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request

import json

from engines.contract import Guide, SamplingParams
from server.gateway.api.completions import CompletionJob
from server.gateway.api.openai_render import OPENAI
from server.gateway.context import TenantContext
from server.gateway.errors import ServingError
from server.gateway.api.openai_schemas import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from server.gateway.api.tools import ToolPlan, check_schema, forced_call_guide, render_messages
from server.gateway.api import union_guide
from server.gateway.services import GatewayServices
from server.gateway.strict_json import StrictJsonRoute

router = APIRouter(prefix="/v1", tags=["serving"], route_class=StrictJsonRoute)


async def gateway(request: Request) -> GatewayServices:
    return request.app.state.gateway


Gateway = Annotated[GatewayServices, Depends(gateway)]


async def current_tenant(services: Gateway, authorization: Annotated[str | None, Header()] = None) -> TenantContext:
    if services.draining:
        raise ServingError(503, "shutting_down", "this gateway is shutting down; retry on another replica",
                           headers={"Retry-After": "1", "Connection": "close"})
    return await services.auth.authenticate(authorization)


Tenant = Annotated[TenantContext, Depends(current_tenant)]


def check_model(tenant: TenantContext, model: str) -> None:
    if model != tenant.pool.model_name:
        raise ServingError(404, "model_not_found",
                           f"model '{model}' is not available to this API key; use '{tenant.pool.model_name}'",
                           param="model")


async def _job(services: GatewayServices, tenant: TenantContext, body, kind: str, prompt_for) -> CompletionJob:
    check_model(tenant, body.model)
    prompter = await services.engines.prompter(tenant.pool)
    tokenizer = prompter.tokenizer
    try:
        prompt = prompt_for(prompter)
    except ValueError as exc:  # the model's chat template refused the conversation
        raise ServingError(400, "invalid_messages", str(exc), param="messages") from exc
    if prompt.total == 0:
        raise ServingError(400, "empty_prompt", "the prompt is empty", param="messages" if kind == "chat" else "prompt")
    max_new = body.requested_max_tokens()  # None: the tenant's default, as admission reads the tenant's limits
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    min_tokens = body.min_tokens or 0
    limit = max_new if max_new is not None else tenant.limits.default_output_tokens
    if min_tokens > limit:
        raise ServingError(400, "invalid_request", f"min_tokens ({min_tokens}) exceeds the output limit ({limit})",
                           param="min_tokens")
    try:
        logit_bias = body.logit_bias_pairs()
    except ValueError as exc:
        raise ServingError(400, "invalid_request", str(exc), param="logit_bias") from exc
    if any(token >= tokenizer.vocab_size for token, _ in logit_bias):
        raise ServingError(400, "invalid_request", f"logit_bias token ids must be below {tokenizer.vocab_size}",
                           param="logit_bias")
    sampling = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0), seed=body.seed,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        min_tokens=min_tokens, logit_bias=logit_bias,
    )
    return CompletionJob(
        tenant=tenant, kind=kind, model=body.model, prompt=prompt, max_new_tokens=max_new,
        sampling=sampling,
        stop=body.stop_strings(), stream=body.stream, include_usage=include_usage, tokenizer=tokenizer,
        engine=services.routing.engine(services.engines.seen(tenant.pool)),
        quota=services.monitor.quota_state(tenant.pool.name, tenant.tenant_id),
        ignore_eos=bool(body.ignore_eos), token_texts=prompter.token_texts,
        continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats),
        output_param="max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens",
    )


@router.get("/models")
async def list_models(tenant: Tenant) -> dict:
    return {"object": "list", "data": [
        {"id": tenant.pool.model_name, "object": "model", "created": 0, "owned_by": f"kvgate:{tenant.pool.name}"}
    ]}


def _structure(body: ChatCompletionRequest) -> tuple[ToolPlan | None, Guide | None]:
    """The request's tool plan and output guide: a forced tool call's, else response_format's; with
    tools the model may call (auto) too, the guide allows the format's JSON or tool calls
    (:mod:`~server.gateway.api.union_guide`)."""
    defined = [t.function.model_dump(exclude_none=True) for t in body.tools or ()]
    functions = {f["name"]: f for f in defined}
    plan = None
    guide = None
    if functions:
        choice = body.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            plan = ToolPlan(functions, "forced", parallel=False)
            guide = forced_call_guide([functions[choice.function.name]])
        elif choice == "required":
            plan = ToolPlan(functions, "forced", parallel=False)
            guide = forced_call_guide(list(functions.values()))
        else:
            plan = ToolPlan(functions, choice, parallel=body.parallel_tool_calls is not False)
    for name, function in functions.items():
        check_schema(function.get("parameters"), "tools")
    fmt = body.response_format
    if fmt is not None and fmt.json_schema is not None:
        check_schema(fmt.json_schema.schema_, "response_format")
    if guide is None and fmt is not None and fmt.type != "text":
        schema = {"type": "object"} if fmt.type == "json_object" else (fmt.json_schema.schema_ or {"type": "object"})  # type: ignore[union-attr]
        if plan is not None and plan.mode == "auto":
            guide = union_guide.format_or_calls_guide(
                schema, defined, parallel=plan.parallel, field="response_format",
                tool_fields=[f"tools.{i}.function.parameters" for i in range(len(defined))])
        else:
            # property order is kept: it is the order the model writes the fields in
            guide = Guide("json_schema", json.dumps(schema, separators=(",", ":")))
    return plan, guide


def _messages(body: ChatCompletionRequest) -> list[dict]:
    out = []
    for m in body.messages:
        message: dict = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls]
        out.append(message)
    functions = [t.function.model_dump(exclude_none=True) for t in body.tools or ()]
    if functions or any("tool_calls" in m for m in out):
        return render_messages(out, functions)
    return out


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, tenant: Tenant, services: Gateway):
    messages = _messages(body)
    job = await _job(services, tenant, body, "chat", lambda p: p.chat(messages, scope=tenant.engine_tenant_id))
    if body.tools and body.response_format is not None and body.response_format.type != "text":
        await union_guide.ready("response_format")  # the format-or-calls guide is built with xgrammar
    job.tools, job.guide = _structure(body)
    if job.guide is not None and job.ignore_eos:
        # The engine contract refuses the pair (engines/contract.py check_combinations): a guided request
        # ends when its grammar completes, which ignore_eos would prevent on the GPU engine.
        raise ServingError(400, "invalid_request", "ignore_eos cannot be combined with response_format or a forced "
                           "tool call (the output would never end when its structure completes)", param="ignore_eos")
    job.hints = body.cache_hints()
    if body.logprobs:
        job.logprobs = body.top_logprobs or 0
    return await services.runner.run(job, OPENAI)


@router.post("/completions")
async def completions(body: CompletionRequest, tenant: Tenant, services: Gateway):
    assert isinstance(body.prompt, str)
    job = await _job(services, tenant, body, "text", lambda p: p.completion(body.prompt))  # type: ignore[arg-type]
    job.logprobs = body.logprobs
    return await services.runner.run(job, OPENAI)


