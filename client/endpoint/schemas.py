"""The OpenAI request bodies the endpoint accepts, and the check that refuses a field it cannot honour."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel as Schema
from pydantic import ConfigDict, Field

# OpenAI fields that change nothing here and are accepted as they come (user, metadata, ...); any other
# field this endpoint cannot honour gets a 400 naming it (`unsupported_field`), never a silent 200
HARMLESS_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls"})


def unsupported_field(extra: dict[str, Any]) -> str | None:
    """A one-line reason naming the first field of `extra` (fields outside the schema) that would be ignored."""
    neutral = {
        "logit_bias": lambda v: not v,
        "presence_penalty": lambda v: v in (0, 0.0, None),
        "frequency_penalty": lambda v: v in (0, 0.0, None),
        "best_of": lambda v: v in (1, None),
        "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
        "modalities": lambda v: v in (None, ["text"]),
        "tool_choice": lambda v: v in (None, "none"),
    }
    for name, value in extra.items():
        if name in HARMLESS_FIELDS or (name in neutral and neutral[name](value)):
            continue
        return f"{name}: not supported by this endpoint (only text completion with the fields in its documentation)"
    return None


class Options(Schema):
    model_config = ConfigDict(extra="allow")  # kept aside, then refused or accepted by `unsupported_field`

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)


class CompletionRequest(Options):
    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=5)  # the answer tokens' logprobs, with this many top ones
    echo: bool = False
    suffix: str | None = None


class ChatMessage(Schema):
    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]


class ChatRequest(Options):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=5)
