"""One request's decoding: sampling options, prompt tokens (chat template, fill-in-the-middle), AMS-LD or
plain decoding, the base's logprobs, and the Completion with its usage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from common.decoding import TREE_ATTENTION, AmsPolicy, GenerationResult, generate
from common.decoding.core import Stopper
from common.decoding.datastore import Datastore
from common.errors import FedLookaheadError, first_line
from common.heads.lookahead import DraftHeads
from common.model.base import BaseModel, check_text


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
    datastore: Datastore | None = None,
) -> GenerationResult:
    """AMS-LD with the heads and the device's datastore (plain decoding without heads), ended by the
    endpoint's own Stopper."""
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
        datastore=datastore,
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
        raise FedLookaheadError(f"the chat template refused these messages: {first_line(exc)}") from exc
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
