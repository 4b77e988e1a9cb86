"""OpenAI-compatible routes: thin handlers over :class:`CompletionRunner`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request

from engines.contract import SamplingParams
from server.gateway.completions import CompletionJob
from server.gateway.context import TenantContext
from server.gateway.errors import ServingError
from server.gateway.openai_schemas import ChatCompletionRequest, CompletionRequest
from server.gateway.services import GatewayServices

router = APIRouter(prefix="/v1", tags=["serving"])


async def gateway(request: Request) -> GatewayServices:
    return request.app.state.gateway


Gateway = Annotated[GatewayServices, Depends(gateway)]


async def current_tenant(services: Gateway, authorization: Annotated[str | None, Header()] = None) -> TenantContext:
    if services.draining:
        raise ServingError(503, "shutting_down", "this gateway is shutting down; retry on another replica",
                           headers={"Retry-After": "1", "Connection": "close"})
    return await services.auth.authenticate(authorization)


Tenant = Annotated[TenantContext, Depends(current_tenant)]


def _check_model(tenant: TenantContext, model: str) -> None:
    if model != tenant.pool.model_name:
        raise ServingError(404, "model_not_found",
                           f"model '{model}' is not available to this API key; use '{tenant.pool.model_name}'",
                           param="model")


async def _job(services: GatewayServices, tenant: TenantContext, body, kind: str, prompt_for) -> CompletionJob:
    _check_model(tenant, body.model)
    prompter = await services.engines.prompter(tenant.pool)
    tokenizer = prompter.tokenizer
    try:
        prompt = prompt_for(prompter)
    except ValueError as exc:  # the model's chat template refused the conversation
        raise ServingError(400, "invalid_messages", str(exc), param="messages") from exc
    if prompt.total == 0:
        raise ServingError(400, "empty_prompt", "the prompt is empty", param="messages" if kind == "chat" else "prompt")
    requested = body.requested_max_tokens()
    max_new = requested if requested is not None else tenant.limits.max_output_tokens or 256
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return CompletionJob(
        tenant=tenant, kind=kind, model=body.model, prompt=prompt, max_new_tokens=max_new,
        sampling=SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                                top_p=1.0 if body.top_p is None else body.top_p, top_k=0, seed=body.seed),
        stop=body.stop_strings(), stream=body.stream, include_usage=include_usage, tokenizer=tokenizer,
        engine=services.routing.engine(services.engines.seen(tenant.pool)),
        quota=services.monitor.quota_state(tenant.pool.name, tenant.tenant_id),
    )


@router.get("/models")
async def list_models(tenant: Tenant) -> dict:
    return {"object": "list", "data": [
        {"id": tenant.pool.model_name, "object": "model", "created": 0, "owned_by": f"kvgate:{tenant.pool.name}"}
    ]}


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, tenant: Tenant, services: Gateway):
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    job = await _job(services, tenant, body, "chat", lambda p: p.chat(messages))
    return await services.runner.run(job)


@router.post("/completions")
async def completions(body: CompletionRequest, tenant: Tenant, services: Gateway):
    assert isinstance(body.prompt, str)
    job = await _job(services, tenant, body, "text", lambda p: p.completion(body.prompt))  # type: ignore[arg-type]
    return await services.runner.run(job)


