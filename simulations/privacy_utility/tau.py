"""Heads-only tau without decoding: the teacher-forced chain estimate, its mean over clients, and its
check against a real heads-only AMS-LD decode.

At each position of a chunk the heads' chain (head k fusing the tokens before it) is accepted up to the
first head that misses the base's greedy token, so tau = 1 + the mean accepted length (the bonus token
included), i.e. the expected tokens per base forward of chain drafting under greedy verification.
"""

from __future__ import annotations

import torch

from simulations.privacy_utility.corpus import ClientSplit


@torch.no_grad()
def chain_acceptance(heads, features, batch_size: int = 16) -> dict:
    """Per-head top-1 accuracy and teacher-forced chain tau (module docstring) on `features`."""
    heads.eval()
    k_max = heads.num_heads
    correct = [0] * k_max
    total = [0] * k_max
    accepted_sum, positions = 0, 0
    for start in range(0, len(features), batch_size):
        part = features.subset(slice(start, start + batch_size))
        tokens, greedy = part.tokens, part.greedy
        length = tokens.shape[1]
        logits = heads(part.hidden.float(), tokens)
        hits = []
        for k in range(1, k_max + 1):
            predicted = heads.draft_ids[logits[k - 1][:, : length - k].argmax(-1)]
            hit = predicted == greedy[:, k:]
            correct[k - 1] += int(hit.sum())
            total[k - 1] += hit.numel()
            hits.append(hit[:, : length - k_max])  # positions where every head has a target
        chain = torch.stack(hits).long().cumprod(dim=0)  # (K, B, T): 1 while heads 1..k all hit
        accepted_sum += int(chain.sum())
        positions += chain.shape[1] * chain.shape[2]
    return {
        "acc": [c / t if t else 0.0 for c, t in zip(correct, total)],
        "tau_heads_only": 1.0 + accepted_sum / positions if positions else 1.0,
    }


def evaluate(heads, splits: list[ClientSplit], part: str = "test") -> dict:
    """Mean over clients (each client's held-out `part`), and the per-client values."""
    per_client = [chain_acceptance(heads, getattr(s, part)) for s in splits]
    k = heads.num_heads
    return {
        "tau_heads_only": sum(c["tau_heads_only"] for c in per_client) / len(per_client),
        "acc": [sum(c["acc"][i] for c in per_client) / len(per_client) for i in range(k)],
        "per_client": [
            {"tau_heads_only": round(c["tau_heads_only"], 4), "acc": [round(a, 4) for a in c["acc"]]}
            for c in per_client
        ],
    }


def validate_tau(base, heads_by_name: dict, splits: list[ClientSplit], prompts: int, tokens: int) -> dict:
    """The chain estimate against a real heads-only AMS-LD decode, on the first chunks of each client's test half."""
    from common.decoding.tau import chunk_prompts, decode_tau

    out = {}
    for name, heads in heads_by_name.items():
        taus, estimates = [], []
        for split in splits:
            chosen = chunk_prompts(split.test.tokens, prompts, split.test.tokens.shape[1] // 2)
            tau = decode_tau(base, heads, chosen, tokens, ngram=False)
            if tau is not None:
                taus.append(tau)
            estimates.append(chain_acceptance(heads, split.test.subset(slice(0, prompts)))["tau_heads_only"])
        out[name] = {
            "decoded_ams_heads_only": sum(taus) / len(taus) if taus else None,
            "chain_estimate_same_chunks": sum(estimates) / len(estimates),
            "prompts": prompts * len(splits),
            "max_new_tokens": tokens,
        }
    return out
