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

Where each job lives: api.py (this file: the app and its routes), schemas.py (request bodies, refused
fields), answer.py (one request: queued, then a JSON body or an event stream), responses.py (error
bodies, logprobs layouts, event lines), worker.py (the base, the FIFO worker), heads.py (heads
hot-swap), completion.py (one request's decoding and usage), errors.py (the 503s), server.py (uvicorn).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.endpoint.answer import answer
from client.endpoint.completion import Sampling
from client.endpoint.defaults import DEFAULT_MAX_QUEUE
from client.endpoint.responses import error_response, exception_response
from client.endpoint.schemas import ChatMessage, ChatRequest, CompletionRequest, Options, unsupported_field
from client.endpoint.worker import Endpoint
from common.decoding import AmsPolicy
from common.errors import FedLookaheadError
from common.loopback import host_header_is_loopback, refused_host_message
from common.model.base import Loading

DEFAULT_MAX_TOKENS = 256


def sampling_of(request: Options, max_tokens: int | None, logprobs: int | None = None, echo: bool = False) -> Sampling:
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


def refusal(request: Options, logprobs: bool) -> JSONResponse | None:
    """A 400 for a field the endpoint would otherwise ignore, or for logprobs on a stream."""
    reason = unsupported_field(request.model_extra or {})
    if reason is None and logprobs and request.stream:
        reason = "logprobs: not available on a stream (ask without stream)"
    return error_response(400, reason, "invalid_request_error", "unsupported_field") if reason else None


def message_text(message: ChatMessage) -> dict[str, str]:
    """OpenAI content parts ([{"type": "text", "text": ...}]) joined into the plain string templates expect."""
    content = message.content
    if isinstance(content, list):
        if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
            raise FedLookaheadError("only text content parts are supported")
        content = "".join(part["text"] for part in content)
    return {"role": message.role, "content": content}


def create_endpoint_app(
    base_dir: Path,
    heads_dir: Path | None,
    *,
    loading: Loading = Loading(),
    max_queue: int = DEFAULT_MAX_QUEUE,
    policy: AmsPolicy | None = None,
    datastore_dir: Path | None = None,
    datastore_cache: Path | None = None,
) -> FastAPI:
    """The endpoint's FastAPI app; `app.state.endpoint` is its Endpoint (base, heads holder, worker).

    `heads_dir`: the folder to watch for the newest heads (None: plain decoding only). A missing
    base directory does not fail here: requests get 503 until the base can be loaded.
    `datastore_dir`: the device's own files, which AMS-LD also drafts from (indexed into `datastore_cache`).
    """
    endpoint = Endpoint(base_dir, heads_dir, loading, max_queue, policy, datastore_dir, datastore_cache)
    app = FastAPI(title="FedLookahead local endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.endpoint = endpoint

    @app.middleware("http")
    async def loopback_hosts_only(request: Request, call_next):
        host = request.headers.get("host")
        if not host_header_is_loopback(host):
            return error_response(400, refused_host_message(host, "endpoint"), "invalid_request_error", "invalid_host")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            where = first.get("loc", ("body", "?"))[-1]
            why = (first.get("ctx") or {}).get("error", "invalid")
            message = f"the request body is not valid JSON: {why} at character {where}"
            return error_response(400, message, "invalid_request_error", "invalid_json")
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or "body"
        return error_response(
            400, f"{where}: {first.get('msg', 'invalid value')}", "invalid_request_error", "invalid_value"
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error", f"http_{exc.status_code}")

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
        refused = refusal(request, request.logprobs is not None)
        if refused is not None:
            return refused
        prompt = request.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                return error_response(
                    400, "prompt: give one prompt string (n = 1 only)", "invalid_request_error", "invalid_value"
                )
            prompt = prompt[0]
        if not prompt:
            return error_response(400, "prompt: empty prompt", "invalid_request_error", "invalid_value")
        sampling = sampling_of(request, request.max_tokens, request.logprobs, request.echo)
        echo = prompt if request.echo else ""
        return await answer(
            endpoint, prompt, sampling, request.stream, chat=False, http=http, echo=echo, suffix=request.suffix or ""
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: ChatRequest, http: Request) -> JSONResponse | StreamingResponse:
        refused = refusal(request, request.logprobs)
        if refused is not None:
            return refused
        try:
            messages = [message_text(m) for m in request.messages]
        except FedLookaheadError as exc:
            return exception_response(exc)
        if not any(m["content"] for m in messages):
            return error_response(400, "messages: every message is empty", "invalid_request_error", "invalid_value")
        top = (request.top_logprobs or 0) if request.logprobs else None
        sampling = sampling_of(request, request.max_completion_tokens or request.max_tokens, top)
        return await answer(endpoint, messages, sampling, request.stream, chat=True, http=http)

    return app
