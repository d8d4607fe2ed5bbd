"""Self-distilled training text: the base's own greedy continuations of public prompts (Medusa-2).

While decoding, heads draft continuations of what the base itself writes, not of human text, and a
small base writes differently (it repeats itself, it prefers its own idioms). Training chunks made of
a public prompt followed by the base's greedy continuation show the heads that distribution. The
continuation is generated in batches with a KV cache, in the feature dtype (bf16 where the CPU has
it), so the targets match the cached features the heads train on.
"""

from __future__ import annotations

import torch
from tqdm import tqdm
from transformers import DynamicCache

from common.data.features import extractor_for
from common.model.attention import cache_kwarg
from common.model.base import BaseModel


@torch.inference_mode()
def greedy_continuations(
    base: BaseModel, prompts: torch.Tensor, new_tokens: int, batch_size: int = 16, progress: bool = True
) -> torch.Tensor:
    """`prompts` (N, P) followed by the base's greedy continuation: an (N, P + new_tokens) tensor.

    All prompts have the same length, so batches need no padding. End-of-text tokens are kept and
    generation goes on past them: whatever the base chooses is a valid target for its heads.
    """
    if prompts.ndim != 2 or len(prompts) == 0:
        raise ValueError(f"prompts must be a non-empty (N, P) tensor, got shape {tuple(prompts.shape)}")
    model = extractor_for(base)
    out = []
    for start in tqdm(
        range(0, len(prompts), batch_size), desc="self-distilling", unit="batch", disable=not progress, leave=False
    ):
        ids = prompts[start : start + batch_size].to(model.device)
        cache = {cache_kwarg(model.model): DynamicCache(config=model.model.config)}
        logits = model.model(input_ids=ids, **cache, use_cache=True).logits[:, -1]
        generated = []
        for _ in range(new_tokens):
            next_ids = logits.argmax(-1, keepdim=True)
            generated.append(next_ids)
            logits = model.model(input_ids=next_ids, **cache, use_cache=True).logits[:, -1]
        out.append(torch.cat([ids, *generated], dim=1).cpu())
    return torch.cat(out)
