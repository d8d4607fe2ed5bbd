"""The device's local generation endpoint: OpenAI-compatible completions for apps on the device.

    POST /v1/completions        {"prompt": "...", "max_tokens", "temperature", "top_p", "stop", "seed", "stream",
                                 "logprobs", "echo", "suffix"}
    POST /v1/chat/completions   {"messages": [{"role", "content"}, ...], same options, "logprobs", "top_logprobs"}
    GET  /v1/models             the one model served (the base's directory name)
    GET  /health                {"status", "model", "heads_version", "mode"}: is it ready, and with which heads

It listens on loopback only (127.0.0.1 / ::1): the prompts and outputs of the device's apps stay on
the device. Decoding is AMS-LD (lossless: greedy output equals the base's own greedy output) with
the newest global heads; without usable heads it is plain decoding (usage.mode says which).

- Heads: `HeadsHolder` watches a heads folder (the daemon's `<state>/heads/latest` symlink, or the
  folder the daemon publishes to) and, between requests, loads the heads it points to when its
  target changed. A request takes one immutable snapshot when it starts and decodes with it to the
  end, so a swap never happens mid-request; usage.heads_version says which heads answered.
- Queueing: one worker thread generates, requests wait in arrival order (none dropped); only past
  `max_queue` waiting or running requests is a new one answered 503.
- Streaming (`"stream": true`): server-sent events, `data: {chunk}` lines and a final
  `data: [DONE]`. The text really is streamed as the decoder accepts tokens (a Stopper subclass
  sees every accepted step), never generated first and replayed. Text is held back while it ends
  in an incomplete UTF-8 character or could be the start of a stop string, so the chunks always
  concatenate to the non-streamed text. The chunk with finish_reason also carries `usage`.
- Usage: OpenAI's prompt_tokens / completion_tokens / total_tokens, plus tokens_per_s (decoding
  time only, queueing excluded), tau (tokens per base forward), heads_version and mode.
- Stop strings follow OpenAI: the text ends before the first stop string (finish_reason "stop").
  Defaults differ from OpenAI's: temperature 0 (greedy, as `fedla generate`), max_tokens 256.
- Errors use OpenAI's shape {"error": {"message", "type", "code"}} with a one-line message: 400 for
  bad input, 503 when the base model cannot be loaded (retried on the next request, so a base
  copied in later is picked up) or the queue is full.

- Logprobs are the base's own: one teacher-forced base forward over the prompt and the answer, so
  they are the logits greedy decoding itself follows (lossless, like the text). Each token is decoded
  alone, so a token holding part of a UTF-8 character shows as U+FFFD. `echo` puts the
  prompt in front of the text (and its tokens in logprobs); `suffix` asks for fill-in-the-middle, which
  needs the base's tokenizer to have `<fim_prefix>`, `<fim_suffix>` and `<fim_middle>`.
- A field the endpoint cannot honour (tools, response_format other than text, logit_bias,
  penalties, best_of > 1, ...) is a 400 naming it, never a silent 200.
- A non-streamed request whose client has gone is cancelled at the next decoding step.

Limitations: one completion per request (n = 1); logprobs are not streamed; the request's `model`
field is ignored (one base is served).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Literal

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel as Schema
from pydantic import ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.state import read_heads_meta
from common.decoding import TREE_ATTENTION, AmsPolicy, GenerationResult, generate
from common.decoding.core import Stopper, check_prompt, check_sampling
from common.decoding.streaming import StreamingStopper, TextStream, cut_at_stop
from common.errors import FedLookaheadError
from common.heads.lookahead import CONFIG_FILE, WEIGHTS_FILE, DraftHeads
from common.loopback import host_header_is_loopback, refused_host_message
from common.model.base import BaseModel, Loading, check_text

log = logging.getLogger("fedla.endpoint")

DEFAULT_PORT = 8765
DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_QUEUE = 64
FINISH_REASONS = {
    "eos": "stop",
    "stop_string": "stop",
    "degeneration": "stop",
    "cancelled": "stop",
    "max_new_tokens": "length",
    "context": "length",
}


class BaseUnavailable(FedLookaheadError):
    """The base model cannot be loaded: every request is answered 503 until it can."""


class QueueFull(FedLookaheadError):
    """More than max_queue requests are waiting or running: this one is answered 503."""


def one_line(text: str) -> str:
    lines = str(text).strip().splitlines()
    return lines[0] if lines else "unknown error"


# ------------------------------------------------------------------------------------------- heads


@dataclass(frozen=True)
class HeadsSnapshot:
    """The heads one request decodes with; version None: no usable heads (plain decoding)."""

    version: int | None
    heads: DraftHeads | None


def _stamp(directory: Path) -> tuple | None:
    """What changes when the folder's heads change: its resolved target and its files' identities.

    A symlink swap changes the target; a published copy replaced in place gets new inodes.
    """
    try:
        files = [os.stat(directory / name) for name in (WEIGHTS_FILE, CONFIG_FILE)]
    except OSError:
        return None
    return (os.path.realpath(directory), *((s.st_ino, s.st_mtime_ns, s.st_size) for s in files))


class HeadsHolder:
    """The newest heads in `directory`, swapped atomically: readers get whole snapshots, never a mix."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else None
        self._snapshot = HeadsSnapshot(None, None)
        self._seen: tuple | None = None

    def current(self) -> HeadsSnapshot:
        return self._snapshot  # one attribute read: atomic

    def swap(self, heads: DraftHeads | None, version: int | None) -> HeadsSnapshot:
        self._snapshot = HeadsSnapshot(version, heads)
        return self._snapshot

    def refresh(self, base: BaseModel) -> HeadsSnapshot:
        """Load the folder's heads if they changed since the last look (a few stat calls otherwise).

        Heads that do not load (damaged, or for another base) are logged and the current ones kept;
        they are not retried until the folder changes again.
        """
        if self.directory is None:
            return self._snapshot
        stamp = _stamp(self.directory)
        if stamp is None or stamp == self._seen:
            return self._snapshot
        self._seen = stamp
        try:
            heads = DraftHeads.load(self.directory, base).eval()
        except FedLookaheadError as exc:
            log.warning("new heads in %s not used: %s", self.directory, one_line(str(exc)))
            return self._snapshot
        meta = read_heads_meta(self.directory) or {}
        version = int(meta.get("version", heads.config.version))
        log.info("endpoint: heads version %s from %s", version, os.path.realpath(self.directory))
        return self.swap(heads, version)


# ------------------------------------------------------------------------------------- decoding


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    logprobs: int | None = None  # None: none; k: each token's logprob and the k most likely
    echo: bool = False  # the prompt's tokens in logprobs too (the text is echoed by the HTTP layer)


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float | None  # None: the first prompt token (nothing predicts it)
    top: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str
    prompt_tokens: int
    heads_version: int | None
    result: GenerationResult
    logprobs: tuple[TokenLogprob, ...] | None = None  # echoed prompt tokens first, then the answer's

    def usage(self) -> dict[str, Any]:
        completion = len(self.result.tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "tokens_per_s": round(self.result.tokens_per_s, 3),
            "tau": round(self.result.tau, 4),
            "heads_version": self.heads_version,
            "mode": self.result.mode,
        }


def decode(
    base: BaseModel,
    ids: torch.Tensor,
    heads: DraftHeads | None,
    sampling: Sampling,
    stopper: Stopper,
    policy: AmsPolicy,
) -> GenerationResult:
    """AMS-LD with the heads (plain decoding without them), ended by the endpoint's own Stopper."""
    tree_attention = getattr(base.model.config, "_attn_implementation", "eager") in TREE_ATTENTION
    return generate(
        base,
        ids,
        mode="ams" if heads is not None and tree_attention else "greedy",
        heads=heads,
        max_new_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        policy=policy,
        seed=sampling.seed,
        stopper=stopper,
    )


Prompt = str | list[dict[str, str]]  # completion text, or chat messages
Event = tuple[str, Any]  # ("start", heads_version) | ("delta", text) | ("done", Completion) | ("error", exc)


def prompt_token_ids(base: BaseModel, prompt: Prompt) -> list[int]:
    """Raw text as `fedla generate` tokenizes it; chat messages through the tokenizer's chat template."""
    tokenizer = base.tokenizer
    if isinstance(prompt, str):
        return list(tokenizer(check_text(prompt, "prompt"), add_special_tokens=False)["input_ids"])
    for index, message in enumerate(prompt):
        check_text(message["content"], f"messages[{index}].content")
    if not getattr(tokenizer, "chat_template", None):
        raise FedLookaheadError(f"the base's tokenizer ({base.path.name}) has no chat template: use /v1/completions")
    try:
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # jinja2 raises its own errors (e.g. a role the template refuses)
        raise FedLookaheadError(f"the chat template refused these messages: {one_line(str(exc))}") from exc
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


def fill_in_the_middle(base: BaseModel, prefix: str, suffix: str) -> str:
    """The prompt that asks the base for the text between `prefix` and `suffix` (StarCoder's FIM layout)."""
    vocab = base.tokenizer.get_vocab()
    missing = [token for token in FIM_TOKENS if token not in vocab]
    if missing:
        raise FedLookaheadError(
            f"suffix: the base's tokenizer ({base.path.name}) has no fill-in-the-middle tokens ({', '.join(missing)})"
        )
    check_text(suffix, "suffix")
    return f"{FIM_TOKENS[0]}{prefix}{FIM_TOKENS[1]}{suffix}{FIM_TOKENS[2]}"


@torch.no_grad()
def base_logprobs(
    base: BaseModel, prompt: list[int], answer: list[int], top: int, echo: bool
) -> tuple[TokenLogprob, ...]:
    """Each answer token's log-probability under the base (and, with `echo`, each prompt token's), with the
    `top` most likely tokens at its position: one base forward over prompt + answer."""
    ids = prompt + answer
    logits = base.model(torch.tensor([ids], device=base.device)).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    decode = base.tokenizer.decode
    first = 0 if echo else len(prompt)
    out = []
    for position in range(first, len(ids)):
        if position == 0:
            out.append(TokenLogprob(decode([ids[0]]), None, ()))
            continue
        row = logp[position - 1]
        best = torch.topk(row, top).indices.tolist() if top else []
        out.append(
            TokenLogprob(
                decode([ids[position]]), float(row[ids[position]]), tuple((decode([t]), float(row[t])) for t in best)
            )
        )
    return tuple(out)


def answer_tokens(tokenizer, tokens: list[int], text: str) -> list[int]:
    """The generated tokens that make up `text` (the answer cut before its stop string)."""
    kept = list(tokens)
    while kept and len(tokenizer.decode(kept, skip_special_tokens=True)) > len(text):
        kept.pop()
    return kept


class Endpoint:
    """The base, the heads holder and the single generation worker behind the HTTP routes."""

    def __init__(
        self,
        base_dir: Path,
        heads_dir: Path | None,
        loading: Loading = Loading(),
        max_queue: int = DEFAULT_MAX_QUEUE,
        policy: AmsPolicy | None = None,
    ) -> None:
        self.base_dir = Path(base_dir).expanduser()
        self.loading, self.max_queue = loading, max_queue
        self.policy = policy or AmsPolicy()
        self.heads = HeadsHolder(heads_dir)
        self.base: BaseModel | None = None
        self.model_name = self.base_dir.name or "base"
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedla-endpoint")
        self._pending = 0
        self._lock = threading.Lock()
        try:
            self.load()  # now, so that the first request does not pay for it
        except BaseUnavailable as exc:
            log.warning("endpoint: %s", exc)

    def load(self) -> BaseModel:
        """The base, loaded on first use; only ever called by the worker (or before it starts)."""
        if self.base is None:
            try:
                self.base = self.loading.load(self.base_dir)
            except FedLookaheadError as exc:
                raise BaseUnavailable(f"base model unavailable: {one_line(str(exc))}") from exc
            self.heads.refresh(self.base)
        return self.base

    def submit(self, job: Callable[[], None]) -> Future:
        """Queue a job behind the ones already waiting (FIFO); QueueFull past max_queue."""
        with self._lock:
            if self._pending >= self.max_queue:
                raise QueueFull(f"the endpoint already has {self._pending} requests waiting or running: retry later")
            self._pending += 1
        future = self._executor.submit(job)
        future.add_done_callback(self._done)
        return future

    def _done(self, _future: Future) -> None:
        with self._lock:
            self._pending -= 1

    def complete(
        self,
        prompt: Prompt,
        sampling: Sampling,
        emit: Callable[[Event], None],
        stream: bool,
        cancelled: threading.Event,
        suffix: str = "",
    ) -> Completion:
        """One request, start to end, in the worker thread; emits start (and, streaming, text deltas).
        `suffix`: fill in the middle between the (text) prompt and it."""
        base = self.load()
        if suffix:
            prompt = fill_in_the_middle(base, str(prompt), suffix)
        ids = prompt_token_ids(base, prompt)
        if not ids:
            raise FedLookaheadError("the prompt is empty after tokenization")
        check_sampling(sampling.temperature, sampling.top_p, sampling.max_tokens, sampling.seed)
        prompt_ids = check_prompt(base, ids)
        snapshot = self.heads.refresh(base)  # between requests: the only place heads change
        emit(("start", snapshot.version))
        text_stream = TextStream(base.tokenizer, sampling.stop, lambda d: emit(("delta", d))) if stream else None
        stopper = StreamingStopper(
            base,
            sampling.max_tokens,
            sampling.stop,
            True,
            base.max_positions - len(ids),
            on_tokens=text_stream.update if text_stream else None,
            cancelled=cancelled,
        )
        result = decode(base, prompt_ids, snapshot.heads, sampling, stopper, self.policy)
        text, stopped = cut_at_stop(result.text, sampling.stop)
        if text_stream is not None:
            text_stream.finish(text)
        reason = "stop" if stopped else FINISH_REASONS.get(result.stop_reason, "stop")
        logprobs = None
        if sampling.logprobs is not None:
            answer = answer_tokens(base.tokenizer, list(result.tokens), text)
            logprobs = base_logprobs(base, ids, answer, sampling.logprobs, sampling.echo)
        return Completion(text, reason, len(ids), snapshot.version, result, logprobs)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def describe(self) -> str:
        """What it serves now, for the line printed on start (a missing base or missing heads said plainly)."""
        if self.base is None:
            return f"base {self.base_dir} not loaded yet: requests get 503 until it can be"
        snapshot = self.heads.current()
        if snapshot.heads is None:
            return f"WARNING: no heads in {self.heads.directory}: plain decoding (no speed-up) until a round delivers heads"
        return f"AMS-LD with heads v{snapshot.version} from {self.heads.directory}"


# ------------------------------------------------------------------------------------- HTTP API


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


class _Options(Schema):
    model_config = ConfigDict(extra="allow")  # kept aside, then refused or accepted by `unsupported_field`

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)


class CompletionRequest(_Options):
    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=5)  # the answer tokens' logprobs, with this many top ones
    echo: bool = False
    suffix: str | None = None


class ChatMessage(Schema):
    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]


class ChatRequest(_Options):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=5)


def _error(status: int, message: str, kind: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": one_line(message), "type": kind, "code": code}}, status_code=status)


def _error_response(exc: BaseException) -> JSONResponse:
    if isinstance(exc, BaseUnavailable):
        return _error(503, str(exc), "server_error", "base_unavailable")
    if isinstance(exc, QueueFull):
        return _error(503, str(exc), "server_error", "queue_full")
    if isinstance(exc, FedLookaheadError):
        return _error(400, str(exc), "invalid_request_error", "invalid_value")
    log.error("endpoint: generation failed", exc_info=exc)
    return _error(500, f"generation failed: {type(exc).__name__}: {one_line(str(exc))}", "server_error", "internal")


def _sampling(request: _Options, max_tokens: int | None, logprobs: int | None = None, echo: bool = False) -> Sampling:
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    return Sampling(
        max_tokens or DEFAULT_MAX_TOKENS,
        request.temperature,
        request.top_p,
        tuple(s for s in stop if s),
        request.seed,
        logprobs,
        echo,
    )


def _refusal(request: _Options, logprobs: bool) -> JSONResponse | None:
    """A 400 for a field the endpoint would otherwise ignore, or for logprobs on a stream."""
    reason = unsupported_field(request.model_extra or {})
    if reason is None and logprobs and request.stream:
        reason = "logprobs: not available on a stream (ask without stream)"
    return _error(400, reason, "invalid_request_error", "unsupported_field") if reason else None


def _completion_logprobs(logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
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


def _chat_logprobs(logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
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


def _message_text(message: ChatMessage) -> dict[str, str]:
    """OpenAI content parts ([{"type": "text", "text": ...}]) joined into the plain string templates expect."""
    content = message.content
    if isinstance(content, list):
        if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
            raise FedLookaheadError("only text content parts are supported")
        content = "".join(part["text"] for part in content)
    return {"role": message.role, "content": content}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def create_endpoint_app(
    base_dir: Path,
    heads_dir: Path | None,
    *,
    loading: Loading = Loading(),
    max_queue: int = DEFAULT_MAX_QUEUE,
    policy: AmsPolicy | None = None,
) -> FastAPI:
    """The endpoint's FastAPI app; `app.state.endpoint` is its Endpoint (base, heads holder, worker).

    `heads_dir`: the folder to watch for the newest heads (None: plain decoding only). A missing
    base directory does not fail here: requests get 503 until the base can be loaded.
    """
    endpoint = Endpoint(base_dir, heads_dir, loading, max_queue, policy)
    app = FastAPI(title="FedLookahead local endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.endpoint = endpoint

    @app.middleware("http")
    async def loopback_hosts_only(request: Request, call_next):
        host = request.headers.get("host")
        if not host_header_is_loopback(host):
            return _error(400, refused_host_message(host, "endpoint"), "invalid_request_error", "invalid_host")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            where = first.get("loc", ("body", "?"))[-1]
            why = (first.get("ctx") or {}).get("error", "invalid")
            message = f"the request body is not valid JSON: {why} at character {where}"
            return _error(400, message, "invalid_request_error", "invalid_json")
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or "body"
        return _error(400, f"{where}: {first.get('msg', 'invalid value')}", "invalid_request_error", "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "invalid_request_error", f"http_{exc.status_code}")

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": endpoint.model_name, "object": "model", "created": 0, "owned_by": "fedlookahead"}],
        }

    @app.get("/health")
    async def health() -> dict:
        snapshot = endpoint.heads.current()
        return {
            "status": "ok" if endpoint.base is not None else "base_unavailable",
            "model": endpoint.model_name,
            "heads_version": snapshot.version,
            "mode": "ams" if snapshot.heads is not None else "greedy",
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(request: CompletionRequest, http: Request) -> JSONResponse | StreamingResponse:
        refused = _refusal(request, request.logprobs is not None)
        if refused is not None:
            return refused
        prompt = request.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                return _error(
                    400, "prompt: give one prompt string (n = 1 only)", "invalid_request_error", "invalid_value"
                )
            prompt = prompt[0]
        if not prompt:
            return _error(400, "prompt: empty prompt", "invalid_request_error", "invalid_value")
        sampling = _sampling(request, request.max_tokens, request.logprobs, request.echo)
        echo = prompt if request.echo else ""
        return await _answer(
            endpoint, prompt, sampling, request.stream, chat=False, http=http, echo=echo, suffix=request.suffix or ""
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: ChatRequest, http: Request) -> JSONResponse | StreamingResponse:
        refused = _refusal(request, request.logprobs)
        if refused is not None:
            return refused
        try:
            messages = [_message_text(m) for m in request.messages]
        except FedLookaheadError as exc:
            return _error_response(exc)
        if not any(m["content"] for m in messages):
            return _error(400, "messages: every message is empty", "invalid_request_error", "invalid_value")
        top = (request.top_logprobs or 0) if request.logprobs else None
        sampling = _sampling(request, request.max_completion_tokens or request.max_tokens, top)
        return await _answer(endpoint, messages, sampling, request.stream, chat=True, http=http)

    return app


async def _answer(
    endpoint: Endpoint,
    prompt: Prompt,
    sampling: Sampling,
    stream: bool,
    chat: bool,
    http: Request | None = None,
    echo: str = "",
    suffix: str = "",
) -> JSONResponse | StreamingResponse:
    """Queue the request, then answer with one JSON body or an event stream once decoding has started.
    `echo`: text put in front of the answer (completions' echo); `suffix`: fill-in-the-middle's end."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()
    cancelled = threading.Event()

    def emit(event: Event) -> None:
        loop.call_soon_threadsafe(events.put_nowait, event)

    def job() -> None:
        if cancelled.is_set():  # its client left while it waited in the queue
            return
        try:
            emit(("done", endpoint.complete(prompt, sampling, emit, stream, cancelled, suffix)))
        except Exception as exc:  # every failure becomes the request's error response
            emit(("error", exc))

    async def client_gone() -> None:
        """Returns when the client disconnects: the next ASGI message after the body is http.disconnect."""
        while http is not None and (await http.receive())["type"] != "http.disconnect":
            pass
        if http is None:
            await asyncio.Event().wait()  # no request to watch: never

    async def next_event(watcher: asyncio.Task) -> Event:
        """The next event, or ("gone", None) once the client has disconnected (the decode is then cancelled)."""
        getter = asyncio.ensure_future(events.get())
        done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            return getter.result()
        getter.cancel()
        cancelled.set()
        return ("gone", None)

    try:
        endpoint.submit(job)
    except QueueFull as exc:
        return _error_response(exc)
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": endpoint.model_name,
    }
    if not stream:
        watcher = asyncio.ensure_future(client_gone())
        try:
            kind, value = await next_event(watcher)
            while kind not in ("done", "gone", "error"):
                kind, value = await next_event(watcher)
        finally:
            watcher.cancel()
        if kind == "error":
            return _error_response(value)
        if kind == "gone":  # nobody reads this answer
            return _error(499, "the client closed the connection", "invalid_request_error", "client_gone")
        choice: dict[str, Any] = {"index": 0, "finish_reason": value.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": value.text}
            choice["logprobs"] = _chat_logprobs(value.logprobs) if value.logprobs is not None else None
        else:
            logprobs = _completion_logprobs(value.logprobs) if value.logprobs is not None else None
            choice.update(text=echo + value.text, logprobs=logprobs)
        body = {
            **head,
            "object": "chat.completion" if chat else "text_completion",
            "choices": [choice],
            "usage": value.usage(),
        }
        return JSONResponse(body)

    kind, value = await events.get()
    if kind == "error":
        return _error_response(value)

    def chunk(delta: str | None, finish: str | None, role: bool = False) -> dict:
        if chat:
            content = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": content, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        return {**head, "object": "chat.completion.chunk" if chat else "text_completion", "choices": [choice]}

    async def body() -> AsyncIterator[str]:
        try:
            if chat:
                yield _sse(chunk(None, None, role=True))
            elif echo:
                yield _sse(chunk(echo, None))
            while True:
                kind, value = await events.get()
                if kind == "delta":
                    yield _sse(chunk(value, None))
                elif kind == "done":
                    yield _sse({**chunk(None, value.finish_reason), "usage": value.usage()})
                    yield _sse("[DONE]")
                    return
                else:
                    error = json.loads(_error_response(value).body)
                    yield _sse(error)
                    return
        finally:
            cancelled.set()  # a client gone mid-stream frees the worker at the next decoding step

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ----------------------------------------------------------------------------------- serving


def check_loopback(host: str) -> None:
    """Refuse any address other apps on the network could reach: the endpoint is for this device only."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise FedLookaheadError(f"the generation endpoint listens on loopback only (127.0.0.1 or ::1), not {host!r}")


class EndpointServer:
    """uvicorn serving an endpoint app in a background thread (for the daemon and tests)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
        check_loopback(host)
        self.app, self.host = app, host
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="off", ws="none", timeout_graceful_shutdown=5
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="fedla-endpoint-http", daemon=True)

    def start(self, timeout: float = 30.0) -> EndpointServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise FedLookaheadError(
                    f"the generation endpoint could not listen on {self.host}:{self.server.config.port} (port in use?)"
                )
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        """The bound port (the real one when asked for port 0)."""
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.app.state.endpoint.close()


def start_endpoint(
    base_dir: Path,
    heads_dir: Path | None,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    loading: Loading = Loading(),
    max_queue: int = DEFAULT_MAX_QUEUE,
) -> EndpointServer:
    """Serve in a background thread (the daemon's hook); the host is checked before the base loads."""
    check_loopback(host)
    app = create_endpoint_app(base_dir, heads_dir, loading=loading, max_queue=max_queue)
    return EndpointServer(app, host, port).start()


def serve_endpoint(
    base_dir: Path,
    heads_dir: Path | None,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    loading: Loading = Loading(),
    max_queue: int = DEFAULT_MAX_QUEUE,
) -> None:
    """Serve in the foreground until interrupted (a standalone command)."""
    check_loopback(host)
    app = create_endpoint_app(base_dir, heads_dir, loading=loading, max_queue=max_queue)
    shown = f"[{host}]" if ":" in host else host
    print(f"fedla serve: http://{shown}:{port}/v1 ({app.state.endpoint.describe()}); Ctrl-C stops", flush=True)
    try:
        uvicorn.run(
            app, host=host, port=port, log_level="warning", lifespan="off", ws="none", timeout_graceful_shutdown=5
        )
    finally:
        app.state.endpoint.close()
