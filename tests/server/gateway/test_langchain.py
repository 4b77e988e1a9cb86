"""langchain-openai's ChatOpenAI (a client we did not write) against the live stack."""

from __future__ import annotations

import secrets

import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.server.gateway.stack import MODEL, Stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chat(stack: Stack) -> ChatOpenAI:
    key = stack.add_tenant("lc-" + secrets.token_hex(4), rpm_limit=100000, tpm_limit=100000000)
    return ChatOpenAI(model=MODEL, base_url=stack.gateway.base_url + "/v1", api_key=key, temperature=0,
                      max_tokens=64, max_retries=0, timeout=300)


class GetWeather(BaseModel):
    """Current weather for a city."""

    city: str = Field(description="the city", max_length=40)


class Capital(BaseModel):
    country: str
    capital: str


def test_invoke_and_stream_agree(chat: ChatOpenAI) -> None:
    prompt = [("user", "What is the capital of France? Answer in one word.")]
    answer = chat.invoke(prompt)
    assert "Paris" in answer.content
    assert answer.usage_metadata["output_tokens"] > 0
    streamed = "".join(chunk.content for chunk in chat.stream(prompt))
    assert streamed == answer.content


def test_bind_tools_with_a_forced_tool(chat: ChatOpenAI) -> None:
    message = chat.bind_tools([GetWeather], tool_choice="GetWeather").invoke([("user", "Is it raining in Oslo?")])
    [call] = message.tool_calls
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(chat: ChatOpenAI, method: str) -> None:
    structured = chat.with_structured_output(Capital, method=method)
    result = structured.invoke([("system", "Answer with one JSON object."), ("user", "Italy: which country, which capital?")])
    assert isinstance(result, Capital)
