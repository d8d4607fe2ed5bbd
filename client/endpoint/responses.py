"""OpenAI's response pieces: error bodies, the two logprobs layouts, and server-sent event lines."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi.responses import JSONResponse

from client.endpoint.completion import TokenLogprob
from client.endpoint.errors import BaseUnavailable, QueueFull
from common.errors import FedLookaheadError, first_line

log = logging.getLogger("fedla.endpoint")


def error_response(status: int, message: str, kind: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": first_line(message), "type": kind, "code": code}}, status_code=status)


def exception_response(exc: BaseException) -> JSONResponse:
    if isinstance(exc, BaseUnavailable):
        return error_response(503, str(exc), "server_error", "base_unavailable")
    if isinstance(exc, QueueFull):
        return error_response(503, str(exc), "server_error", "queue_full")
    if isinstance(exc, FedLookaheadError):
        return error_response(400, str(exc), "invalid_request_error", "invalid_value")
    log.error("endpoint: generation failed", exc_info=exc)
    return error_response(
        500, f"generation failed: {type(exc).__name__}: {first_line(exc)}", "server_error", "internal"
    )


def completion_logprobs(logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """OpenAI's completions layout: tokens, token_logprobs, top_logprobs, text_offset."""
    offsets, at = [], 0
    for item in logprobs:
        offsets.append(at)
        at += len(item.token)
    return {
        "tokens": [item.token for item in logprobs],
        "token_logprobs": [item.logprob for item in logprobs],
        "top_logprobs": [_by_token(item.top) if item.logprob is not None else None for item in logprobs],
        "text_offset": offsets,
    }


def _by_token(top: tuple[tuple[str, float], ...]) -> dict[str, float]:
    """OpenAI's {token: logprob}; two tokens that decode alike (parts of one character) keep the likelier."""
    out: dict[str, float] = {}
    for token, logprob in top:
        out.setdefault(token, logprob)
    return out


def chat_logprobs(logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """OpenAI's chat layout: content = [{token, logprob, bytes, top_logprobs}]."""

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**entry(item.token, item.logprob), "top_logprobs": [entry(t, lp) for t, lp in item.top]}
            for item in logprobs
        ],
        "refusal": None,
    }


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
