"""The generation worker: the base (loaded on first use), the heads holder and one thread that answers
requests in arrival order (FIFO), refusing past max_queue."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from client.endpoint.completion import (
    Completion,
    Event,
    Prompt,
    Sampling,
    answer_tokens,
    base_logprobs,
    decode,
    fill_in_the_middle,
    prompt_token_ids,
)
from client.endpoint.defaults import DEFAULT_MAX_QUEUE
from client.endpoint.errors import BaseUnavailable, QueueFull
from client.endpoint.heads import HeadsHolder
from common.data.chunks import text_files
from common.decoding import AmsPolicy
from common.decoding.core import check_prompt, check_sampling
from common.decoding.datastore import Datastore, datastore_for
from common.decoding.streaming import StreamingStopper, TextStream, cut_at_stop
from common.errors import FedLookaheadError, first_line
from common.model.base import BaseModel, Loading

log = logging.getLogger("fedla.endpoint")

FINISH_REASONS = {
    "eos": "stop",
    "stop_string": "stop",
    "degeneration": "stop",
    "cancelled": "stop",
    "max_new_tokens": "length",
    "context": "length",
}


class Endpoint:
    """The base, the heads holder and the single generation worker behind the HTTP routes."""

    def __init__(
        self,
        base_dir: Path,
        heads_dir: Path | None,
        loading: Loading = Loading(),
        max_queue: int = DEFAULT_MAX_QUEUE,
        policy: AmsPolicy | None = None,
        datastore_dir: Path | None = None,
        datastore_cache: Path | None = None,
    ) -> None:
        self.base_dir = Path(base_dir).expanduser()
        self.loading, self.max_queue = loading, max_queue
        self.policy = policy or AmsPolicy()
        self.heads = HeadsHolder(heads_dir)
        self.datastore_dir, self.datastore_cache = datastore_dir, datastore_cache
        self.datastore: Datastore | None = None
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
                raise BaseUnavailable(f"base model unavailable: {first_line(exc)}") from exc
            self.heads.refresh(self.base)
            self.datastore = self._index(self.base)
        return self.base

    def _index(self, base: BaseModel) -> Datastore | None:
        """The device's own files as a datastore to draft from, indexed once into the state folder; a
        folder that cannot be indexed only costs the drafts it would have made (warned)."""
        if self.datastore_dir is None or self.datastore_cache is None:
            return None
        try:
            return datastore_for(text_files(self.datastore_dir), base.tokenizer, self.datastore_cache)
        except FedLookaheadError as exc:
            log.warning("endpoint: no datastore drafts: %s", first_line(exc))
            return None

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
        result = decode(base, prompt_ids, snapshot.heads, sampling, stopper, self.policy, self.datastore)
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
        drafts = f"; drafts from {self.datastore.files} of your files too" if self.datastore is not None else ""
        return f"AMS-LD with heads v{snapshot.version} from {self.heads.directory}{drafts}"
