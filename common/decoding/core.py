"""Shared pieces of every decoder: the result type, input checks, stopping rules, sampling and the base forward."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

import torch
from transformers import Cache, DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from common.decoding.tree import TreeSpec, attention_mask_4d, keep_cache_path, move_path_entries, position_ids
from common.errors import FedLookaheadError
from common.model.attention import cache_kwarg
from common.model.base import BaseModel


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only
    text: str  # decoded new text
    base_forwards: int  # base-model forward passes after the prompt prefill
    seconds: float
    stop_reason: str = "max_new_tokens"  # eos | max_new_tokens | stop_string | degeneration | context
    mode: str = ""
    stats: dict = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """New tokens per base forward after the prefill (each forward's bonus token included)."""
        return len(self.tokens) / max(1, self.base_forwards)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def check_prompt(base: BaseModel, prompt_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """The prompt as a (1, L) long tensor on the base's device; one-line errors for unusable prompts."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise FedLookaheadError(f"batch size 1 only: got {ids.shape[0]} prompts")
        ids = ids[0]
    if ids.dim() != 1:
        raise FedLookaheadError(f"prompt ids must be 1-D or (1, L), got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise FedLookaheadError("empty prompt: give at least one token")
    if ids.numel() >= base.max_positions:
        raise FedLookaheadError(
            f"prompt has {ids.numel()} tokens but the base's context is {base.max_positions}: shorten it"
        )
    if int(ids.min()) < 0 or int(ids.max()) >= base.vocab_size:
        raise FedLookaheadError(f"prompt has token ids outside the base's vocabulary of {base.vocab_size}")
    return ids.view(1, -1).to(base.device)


def eos_ids(base: BaseModel) -> set[int]:
    """End-of-sequence ids as transformers' `generate` uses them: the model's generation config."""
    ids = getattr(base.model.generation_config, "eos_token_id", None)
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}


@dataclass(frozen=True)
class DegenerationGuard:
    """Stop when the output ends in a loop: the last `span` tokens repeat with a period of at most
    `max_period`, where span = max(min_span, repeats * period). Code legitimately repeats short
    things (indentation, separator lines), hence a minimum span rather than a minimum repeat count only.
    """

    max_period: int = 32
    repeats: int = 3
    min_span: int = 48

    def looping(self, tokens: list[int]) -> bool:
        total = len(tokens)
        if total < self.min_span:
            return False
        for period in range(1, self.max_period + 1):
            span = max(self.min_span, self.repeats * period)
            if span > total:
                break
            # p-periodic tail: the tail equals itself shifted by the period.
            if tokens[total - span : total - period] == tokens[total - span + period :]:
                return True
        return False


class Stopper:
    """EOS, max tokens, stop strings, the context length and the degeneration guard, checked after each step.

    `admit(tokens, new)` appends the new tokens one at a time, applying every rule in order, and
    returns the stop reason or None. Stop strings behave as in transformers: generation ends once the
    text contains one, and the output keeps it.
    """

    def __init__(
        self,
        base: BaseModel,
        max_new_tokens: int,
        stop_strings: Sequence[str],
        degeneration_guard: bool,
        room: int,
    ) -> None:
        self.eos = eos_ids(base)
        self.limit = min(max_new_tokens, room)
        self.limit_reason = "max_new_tokens" if max_new_tokens <= room else "context"
        self.stop_strings = [s for s in stop_strings if s]
        self.tokenizer = base.tokenizer
        self.guard = DegenerationGuard() if degeneration_guard else None
        self.tail_tokens = 8 + 2 * max((len(s) for s in self.stop_strings), default=0)

    def admit(self, tokens: list[int], new: Sequence[int]) -> str | None:
        eos, limit = self.eos, self.limit
        if not self.stop_strings and self.guard is None:  # fast path: no per-token decoding needed
            for token in new:
                tokens.append(token)
                if token in eos:
                    return "eos"
                if len(tokens) >= limit:
                    return self.limit_reason
            return None
        for token in new:
            tokens.append(token)
            if token in eos:
                return "eos"
            if self.stop_strings and self._has_stop_string(tokens):
                return "stop_string"
            if self.guard is not None and self.guard.looping(tokens):
                return "degeneration"
            if len(tokens) >= limit:
                return self.limit_reason
        return None

    def _has_stop_string(self, tokens: list[int]) -> bool:
        # Checked after every token, so only the tail can hold a string the last token just completed.
        tail = self.tokenizer.decode(tokens[-self.tail_tokens :], skip_special_tokens=True)
        return any(s in tail for s in self.stop_strings)


SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


def check_sampling(temperature: float, top_p: float, max_new_tokens: int, seed: int | None = None) -> None:
    if temperature < 0 or not 0.0 < top_p <= 1.0:
        raise FedLookaheadError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature} and {top_p}")
    if max_new_tokens < 0:
        raise FedLookaheadError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise FedLookaheadError(f"seed must be an integer from -2**63 to 2**64 - 1, got {seed}")


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / T), then nucleus (top-p) filtering.

    Same rule as transformers' TemperatureLogitsWarper + TopPLogitsWarper (min_tokens_to_keep=1):
    sort ascending, drop the tokens whose cumulative probability stays <= 1 - top_p.
    """
    scores = logits.float() / temperature
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, -float("inf"))
    return scores.softmax(dim=-1)


def make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


class BaseRunner:
    """The base model's body + LM head driven directly with a DynamicCache (no `generate` machinery)."""

    def __init__(self, base: BaseModel, cache: Cache | None = None) -> None:
        self.device = base.device
        self.body = base.model.base_model
        self.lm_head = base.model.get_output_embeddings()
        self.cache_kw = cache_kwarg(self.body)
        self.cache = cache if cache is not None else DynamicCache(config=base.model.config)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def plain_cache(self) -> bool:
        """True when every cache layer is a full (non-sliding) DynamicLayer: tree compaction is supported."""
        return all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Last hidden states (1, q, d) of the new tokens; the cache grows by q."""
        kwargs = {self.cache_kw: self.cache}
        out = self.body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, **kwargs
        )
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def tree_forward(self, tokens: torch.Tensor, spec: TreeSpec) -> torch.Tensor:
        """Hidden states (q, d) of a tree's nodes, each seeing the cached prefix and its own ancestors."""
        past = self.length
        return self.forward(tokens.view(1, -1), attention_mask_4d(spec, past), position_ids(spec, past))[0]

    def keep_path(self, past: int, path: Sequence[int]) -> None:
        """After a tree forward, keep the prefix (`past` entries) and the accepted `path` of nodes only."""
        keep_cache_path(self.cache, past, path)


class StaticRunner(BaseRunner):
    """The tree forward as one compiled graph: transformers' StaticCache plus `torch.compile` (CUDA graphs
    on CUDA), the configuration `generate`'s compiled static-cache step uses.

    Every tree is padded to `width` nodes, so that one graph serves every step. A padding node sees the
    prefix and itself, and its cache slot is overwritten by the next step. The prompt's prefill runs
    eagerly (its length varies). One runner per base and width (`shared`) keeps its cache and graph
    across calls, as `generate` keeps its static cache.
    """

    # base model -> {(width, capacity): runner}; a runner holds the model's body, not the model itself,
    # so an entry goes when its model does
    _shared: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()

    def __init__(self, base: BaseModel, width: int, capacity: int) -> None:
        super().__init__(base, StaticCache(config=base.model.config, max_cache_len=capacity))
        self.width = width
        self.capacity = capacity  # cache slots: the longest sequence plus one padded tree
        self._length = 0
        self._padding = torch.arange(width, device=base.device)
        mode = "reduce-overhead" if base.device.type == "cuda" else None
        self.step = torch.compile(self.body, mode=mode)

    @classmethod
    def shared(cls, base: BaseModel, width: int, longest: int) -> StaticRunner:
        """This base's runner for trees of up to `width` nodes and sequences of up to `longest` tokens,
        emptied for a new generation. Capacities are powers of two (at least 256), so that a few
        graphs serve every length, and attention does not read thousands of unused slots."""
        capacity = min(max(256, 1 << (longest + width - 1).bit_length()), base.max_positions + width)
        runners = cls._shared.setdefault(base.model, {})
        runner = runners.get((width, capacity)) or runners.setdefault((width, capacity), cls(base, width, capacity))
        runner.cache.reset()
        runner._length = 0
        return runner

    @property
    def length(self) -> int:
        return self._length

    def plain_cache(self) -> bool:
        return all(type(layer) is StaticLayer for layer in self.cache.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = super().forward(input_ids, attention_mask, position_ids)
        self._length += input_ids.shape[1]
        return hidden

    def tree_forward(self, tokens: torch.Tensor, spec: TreeSpec) -> torch.Tensor:
        past, q = self._length, spec.size
        if q > self.width:
            raise ValueError(f"a tree of {q} nodes does not fit this runner's width of {self.width}")
        ids = tokens.new_zeros(1, self.width)
        ids[0, :q] = tokens
        positions = torch.full_like(ids, past)
        positions[0, :q] += spec.depth_t
        mask = spec.bias.new_full((self.width, self.capacity), torch.finfo(spec.bias.dtype).min)
        mask[:, :past] = 0
        mask[:q, past : past + q] = spec.bias
        pad = self._padding[q:]
        mask[pad, pad + past] = 0
        kwargs = {self.cache_kw: self.cache}
        out = self.step(input_ids=ids, attention_mask=mask.view(1, 1, *mask.shape), position_ids=positions, **kwargs)
        self._length += self.width
        return out.last_hidden_state[0, :q].clone()  # a CUDA graph's output buffer is reused by its next replay

    def keep_path(self, past: int, path: Sequence[int]) -> None:
        move_path_entries(self.cache, past, path)  # in place: the graph reads these tensors at fixed addresses
        self._length = past + len(path)
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(self._length)  # where the next forward writes


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> Timer:
        self._sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sync()
        self.seconds = time.perf_counter() - self.start

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
