"""One request's answer: queued to the worker, then one JSON body or an event stream of text deltas."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from client.endpoint.completion import Event, Prompt, Sampling
from client.endpoint.errors import QueueFull
from client.endpoint.responses import chat_logprobs, completion_logprobs, error_response, exception_response, sse
from client.endpoint.worker import Endpoint


async def answer(
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
        return exception_response(exc)
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
            return exception_response(value)
        if kind == "gone":  # nobody reads this answer
            return error_response(499, "the client closed the connection", "invalid_request_error", "client_gone")
        choice: dict[str, Any] = {"index": 0, "finish_reason": value.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": value.text}
            choice["logprobs"] = chat_logprobs(value.logprobs) if value.logprobs is not None else None
        else:
            logprobs = completion_logprobs(value.logprobs) if value.logprobs is not None else None
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
        return exception_response(value)

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
                yield sse(chunk(None, None, role=True))
            elif echo:
                yield sse(chunk(echo, None))
            while True:
                kind, value = await events.get()
                if kind == "delta":
                    yield sse(chunk(value, None))
                elif kind == "done":
                    yield sse({**chunk(None, value.finish_reason), "usage": value.usage()})
                    yield sse("[DONE]")
                    return
                else:
                    error = json.loads(exception_response(value).body)
                    yield sse(error)
                    return
        finally:
            cancelled.set()  # a client gone mid-stream frees the worker at the next decoding step

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
