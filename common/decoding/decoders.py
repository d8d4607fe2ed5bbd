"""The decoding loops: AMS-LD (lossless tree speculation) and the baselines greedy, beam and fused.

All loops run batch size 1, under inference mode, with the base's body and LM head called directly
on a DynamicCache. Per step the AMS-LD loop makes exactly one host-device synchronisation: the
`.tolist()` that brings back the accepted node, the bonus token and the heads' candidates for the
next tree together. Eagle heads add one: their layer commits every accepted position to its context
before drafting, so the accepted path must be known first.
"""

from __future__ import annotations

import time

import torch

from common.decoding.calibration import CostCurve
from common.decoding.core import BaseRunner, StaticRunner, Stopper, sampling_probs
from common.decoding.datastore import Datastore
from common.decoding.drafting import AmsPolicy, HeadsTreeDrafter
from common.decoding.tree import (
    TreeSpecCache,
    greedy_verify,
    row,
    sample_accept,
    to_device,
)
from common.heads.lookahead import DraftHeads
from common.model.base import BaseModel


class UnsupportedCache(RuntimeError):
    """The base's cache has layers the tree compaction does not handle (e.g. sliding windows)."""


def _first_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(sampling_probs(logits, temperature, top_p), 1, generator=generator).view(())


@torch.inference_mode()
def greedy_decode(
    base: BaseModel, ids: torch.Tensor, stopper: Stopper, temperature: float, top_p: float, generator: torch.Generator
) -> tuple[list[int], int, str, dict]:
    """Plain decoding, one token per forward with the KV cache (sampling when temperature > 0)."""
    runner = BaseRunner(base)
    logits = runner.logits(runner.forward(ids)[:, -1])[0]
    token = _first_token(logits, temperature, top_p, generator)
    tokens: list[int] = []
    reason = stopper.admit(tokens, [int(token)])
    forwards = 0
    while reason is None:
        logits = runner.logits(runner.forward(token.view(1, 1)))[0, -1]
        forwards += 1
        token = _first_token(logits, temperature, top_p, generator)
        reason = stopper.admit(tokens, [int(token)])
    return tokens, forwards, reason, {}


@torch.inference_mode()
def ams_decode(
    base: BaseModel,
    ids: torch.Tensor,
    heads: DraftHeads,
    policy: AmsPolicy,
    stopper: Stopper,
    temperature: float,
    top_p: float,
    generator: torch.Generator,
    curve: CostCurve | None = None,
    reproducible: bool = False,
    compiled: bool = False,
    datastore: Datastore | None = None,
) -> tuple[list[int], int, str, dict]:
    """AMS-LD: draft a tree, verify it in one forward, keep the longest accepted path plus the bonus token.

    `curve` (this device's verify costs) lets the drafter size each tree; None: fixed budgets.
    `reproducible`: do not feed step wall times back into tree sizing, so that a seeded sampling run
    draws the same random numbers for the same trees every time.
    `compiled`: verify in a compiled static-cache graph (`StaticRunner`) instead of eagerly.
    `datastore`: the device's own files, a third source of drafts.
    """
    device = base.device
    width = policy.max_nodes + 1
    runner = StaticRunner.shared(base, width, ids.shape[1] + stopper.limit) if compiled else BaseRunner(base)
    drafter = HeadsTreeDrafter(heads, policy, curve, datastore)
    specs = TreeSpecCache(base.dtype, device)
    sampling = temperature > 0
    max_positions = base.max_positions

    prompt_hidden = runner.forward(ids)[0]
    if not runner.plain_cache():
        raise UnsupportedCache(f"cache layers {sorted({type(layer).__name__ for layer in runner.cache.layers})}")
    first = _first_token(runner.logits(prompt_hidden[-1]), temperature, top_p, generator)
    draft = drafter.draft_inputs(prompt_hidden, torch.cat([ids[0, 1:], first.view(1)]))
    packed = torch.cat([first.view(1).double(), draft]).tolist()
    root, values = int(packed[0]), packed[1:]
    context = ids[0].tolist()
    tokens: list[int] = []
    reason = stopper.admit(tokens, [root])
    context.append(root)
    forwards = 0
    step_started = time.perf_counter()
    while reason is None:
        past = runner.length
        tree_tokens, parents = drafter.propose(root, values, context, max_depth=max_positions - 1 - past)
        spec = specs.get(parents)
        tokens_t = to_device(tree_tokens, device)
        hidden = runner.tree_forward(tokens_t, spec)
        forwards += 1
        if sampling:
            probs = sampling_probs(runner.logits(hidden), temperature, top_p)  # (q, V)
            uniforms = torch.rand(spec.size, generator=generator, device=device, dtype=probs.dtype)
            best, bonus = sample_accept(spec, tokens_t, probs, uniforms, generator)
        else:
            one_pass = curve is not None and curve.one_lm_pass(spec.size, spec.internal.numel())
            best, bonus = greedy_verify(spec, tokens_t, hidden, runner.lm_head, one_pass)
        if heads.eagle:  # its layer reads every accepted position: the path is needed now (a second sync)
            accepted_nodes = list(spec.paths[int(best)])
            draft = drafter.draft_inputs(
                hidden[accepted_nodes], torch.cat([tokens_t[accepted_nodes[1:]], bonus.view(1)])
            )
        else:
            draft = drafter.draft_inputs(row(hidden, best).view(1, -1), bonus.view(1))
        packed = torch.cat([torch.stack([best, bonus]).double(), draft]).tolist()  # the step's one sync
        path = spec.paths[int(packed[0])]
        root, values = int(packed[1]), packed[2:]
        runner.keep_path(past, path)
        now = time.perf_counter()
        drafter.feedback(path[1:], 0.0 if reproducible else now - step_started)
        step_started = now
        accepted = [tree_tokens[i] for i in path[1:]]
        accepted.append(root)
        reason = stopper.admit(tokens, accepted)
        context.extend(accepted)
    return tokens, forwards, reason, dict(drafter.stats)


@torch.inference_mode()
def fused_decode(
    base: BaseModel,
    ids: torch.Tensor,
    heads: DraftHeads,
    policy: AmsPolicy,
    stopper: Stopper,
    temperature: float,
    top_p: float,
    generator: torch.Generator,
) -> tuple[list[int], int, str, dict]:
    """The seed article's "fused" lookahead decoding. NOT lossless: it changes the output.

    Among the base's top-m next tokens y, pick by P'(y) ∝ P(y) · exp(α · L(y)), where L(y) is the
    first lookahead head's log-confidence (log-probability of its own top token) after fusing y:
    a candidate after which the future looks predictable is favoured. Greedy takes the argmax of
    P'; with temperature > 0 it samples from P' (P being the temperature / top-p distribution).
    One base forward per token (tau = 1): a quality heuristic, not a speed-up.
    """
    runner = BaseRunner(base)
    m, alpha = max(1, policy.fused_top_m), policy.fused_alpha
    tokens: list[int] = []
    forwards = 0
    prompt_hidden = runner.forward(ids)[0]
    hidden = prompt_hidden[-1]
    cache = heads.new_cache()  # eagle: the context before position t, which the candidates for x_{t+1} attend
    if cache is not None:
        heads.commit(cache, prompt_hidden[:-1], ids[0, 1:])
    reason = None
    while True:
        logits = runner.logits(hidden).float()
        if temperature > 0:
            logp = sampling_probs(logits, temperature, top_p).log()
        else:
            logp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logp, m)
        _, head_state = heads.step(top.indices, hidden.view(1, -1).expand(m, -1), 1, cache)
        head_logits = heads.draft_logits(head_state).float()  # (m, N): head 1 after fusing each candidate
        confidence = head_logits.max(-1).values - torch.logsumexp(head_logits, dim=-1)  # log p_head1(top token)
        score = top.values + alpha * confidence
        if temperature > 0:
            choice = torch.multinomial(torch.softmax(score, dim=-1), 1, generator=generator)[0]
        else:
            choice = score.argmax()
        token = top.indices[choice]
        reason = stopper.admit(tokens, [int(token)])
        if reason is not None:
            break
        if cache is not None:
            heads.commit(cache, hidden.view(1, -1), token.view(1))
        hidden = runner.forward(token.view(1, 1))[0, -1]
        forwards += 1
    return tokens, forwards, reason, {}


class ForwardCounter:
    """Counts forward calls of a module (used for transformers' generate, whose loop we do not own)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.calls = module, 0

    def __enter__(self) -> ForwardCounter:
        self.handle = self.module.register_forward_hook(self._hook)
        return self

    def _hook(self, *args: object) -> None:
        self.calls += 1

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()


@torch.no_grad()
def beam_decode(
    base: BaseModel,
    ids: torch.Tensor,
    policy: AmsPolicy,
    stopper: Stopper,
    temperature: float,
    top_p: float,
    generator: torch.Generator,
    seed: int | None,
) -> tuple[list[int], int, str, dict]:
    """Beam search via transformers' generate (num_beams = policy.beam_width); stop rules applied after."""
    kwargs: dict = dict(num_beams=max(1, policy.beam_width), early_stopping=True)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p)
        if seed is not None:
            torch.manual_seed(seed)
    else:
        kwargs.update(do_sample=False)
    if stopper.stop_strings:
        kwargs.update(stop_strings=list(stopper.stop_strings), tokenizer=base.tokenizer)
    pad = base.tokenizer.pad_token_id if base.tokenizer.pad_token_id is not None else next(iter(stopper.eos), 0)
    with ForwardCounter(base.model) as counter:
        out = base.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=stopper.limit, pad_token_id=pad, **kwargs
        )
    generated = out[0, ids.shape[1] :].tolist()
    tokens: list[int] = []
    reason = stopper.admit(tokens, generated) or "max_new_tokens"
    if reason == "max_new_tokens" and len(tokens) < stopper.limit:
        reason = "eos"
    return tokens, max(0, counter.calls - 1), reason, {}
