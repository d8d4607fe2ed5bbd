"""Drafting for AMS-LD: the adaptive policy, the heads' tree drafter and the n-gram (prompt-lookup) source.

The decoder talks to a drafter through a small interface, in the spirit of transformers'
`CandidateGenerator` (`get_candidates` / `update_candidate_strategy`), split in two so that the
device work runs before the one host-device synchronisation of a step:

    draft_inputs(hidden, token) -> device tensor   queued on the device before the acceptance sync
    propose(root, values, context) -> (tokens, parents)   on the host, from the synced values
    feedback(accepted_tokens)                      after verification: adapt the tree for the next step
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from common.heads import DraftHeads


@dataclass(frozen=True)
class AmsPolicy:
    """Every knob of the adaptive multi-step lookahead controller, in one place.

    Tree growth (EAGLE-2 style): the heads' top `top_k` tokens per lookahead step span a lattice;
    nodes are added best-first by cumulative confidence (product of head probabilities along the
    path) until the node budget is spent or the best remaining node's confidence falls below
    `min_path_prob`, which is where confidence predicts rejection: that stops extending a branch, so
    the number of lookahead steps varies per step and per branch.

    Adaptation (every step): after a full acceptance (the whole deepest drafted path matched) the
    node budget grows by `grow`, after a rejection at the first step it shrinks by `shrink`, within
    [`min_nodes`, `max_nodes`]. The n-gram source (prompt lookup over the prompt and the output so
    far) adds one chain of candidates when the first head is unsure (top-1 probability below
    `ngram_trigger`; 1.0 = always); its length follows transformers' heuristic schedule (+2 after
    full acceptance, -1 otherwise) within [`ngram_min_len`, `ngram_max_len`]. Right after the n-gram
    chain was accepted in full (typically inside a repetition) the heads get only
    `ngram_confident_nodes` nodes (0: the heads are not even run): the chain is the likely path and
    extra nodes cost compute.

    Defaults were chosen by measurement on the embedded default base with centrally trained heads
    (stdlib held-out prompts, batch 1, CPU): verifying q tree nodes costs about 1 + 0.05-0.1 (q - 1)
    single-token forwards there, so only nodes with a fair chance of acceptance (cumulative
    confidence >= 8%) pay for themselves, and small trees (8-24 nodes) beat large ones.

    `fused_alpha` and `fused_top_m` belong to the separate, output-changing "fused" mode, and
    `beam_width` to the beam-search baseline.
    """

    top_k: int = 4
    heads: bool = True  # draw candidates from the lookahead heads (False: n-gram source only, an ablation)
    max_depth: int = 0  # cap on head lookahead steps; 0 = as many as there are heads
    init_nodes: int = 8
    min_nodes: int = 2
    max_nodes: int = 24
    grow: float = 1.25
    shrink: float = 0.8
    min_path_prob: float = 0.08
    ngram: bool = True
    ngram_sizes: tuple[int, ...] = (4, 3, 2, 1)
    ngram_trigger: float = 1.0
    ngram_init_len: int = 8
    ngram_min_len: int = 2
    ngram_max_len: int = 24
    ngram_confident_nodes: int = 0
    fused_alpha: float = 0.5
    fused_top_m: int = 4
    beam_width: int = 4

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.min_nodes < 0 or not self.min_nodes <= self.init_nodes <= self.max_nodes:
            raise ValueError("AmsPolicy needs top_k >= 1 and 0 <= min_nodes <= init_nodes <= max_nodes")
        if not 0.0 <= self.min_path_prob < 1.0 or self.grow < 1.0 or not 0.0 < self.shrink <= 1.0:
            raise ValueError("AmsPolicy needs 0 <= min_path_prob < 1, grow >= 1 and 0 < shrink <= 1")
        if not 1 <= self.ngram_min_len <= self.ngram_init_len <= self.ngram_max_len or not self.ngram_sizes:
            raise ValueError("AmsPolicy needs 1 <= ngram_min_len <= ngram_init_len <= ngram_max_len and ngram sizes")


class Drafter(Protocol):
    """What the AMS-LD decoder needs from a source of draft trees."""

    def reset(self, context: Sequence[int]) -> None: ...

    def draft_inputs(self, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor: ...

    def propose(
        self, root: int, values: list[float], context: Sequence[int], max_depth: int
    ) -> tuple[list[int], tuple[int, ...]]: ...

    def feedback(self, accepted: Sequence[int]) -> None: ...


class NgramIndex:
    """Prompt lookup: continue the context's last n tokens the way their most recent earlier occurrence did.

    Tables map every n-gram (n in `sizes`) to the position where it last ended; they are updated
    incrementally as the context grows, so a lookup costs a few dict accesses, not a scan. A match
    that runs into the end of the context continues periodically (a repetition loop predicts itself).
    """

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = sorted(set(sizes), reverse=True)
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # n-grams ending at positions < indexed are in the tables

    def _extend(self, context: Sequence[int]) -> None:
        last = len(context) - 1  # the n-grams ending at the last position are the ones we look up
        if last < self.indexed:  # not the context this index was built on (contexts only grow)
            self.tables = {n: {} for n in self.sizes}
            self.indexed = 0
        for end in range(self.indexed, last):
            for n in self.sizes:
                if end + 1 >= n:
                    self.tables[n][tuple(context[end + 1 - n : end + 1])] = end
        self.indexed = max(self.indexed, last)

    def lookup(self, context: Sequence[int], length: int) -> list[int]:
        self._extend(context)
        total = len(context)
        for n in self.sizes:
            if total <= n:
                continue
            end = self.tables[n].get(tuple(context[total - n :]))
            if end is None:
                continue
            continuation: list[int] = []
            for i in range(length):
                j = end + 1 + i
                continuation.append(context[j] if j < total else continuation[j - total])
            return continuation
        return []


class HeadsTreeDrafter:
    """Draft trees from the lookahead heads (plus the n-gram source), sized by an adaptive policy.

    Head k (fused with the root token x_{t+1}) proposes x_{t+k+1}, so depth-k nodes are head k's
    candidates. The heads do not see the tokens drafted between, so every node at depth k draws its
    children from the same top-k list of head k+1; the best-first search below is EAGLE-2's dynamic
    tree over that lattice.
    """

    def __init__(self, heads: DraftHeads | None, policy: AmsPolicy) -> None:
        self.heads = heads
        self.policy = policy
        self.num_heads = heads.num_heads if heads is not None and policy.heads else 0
        depth = self.num_heads if policy.max_depth <= 0 else min(policy.max_depth, self.num_heads)
        self.head_depth = depth
        self.top_k = policy.top_k
        self.log_min = math.log(policy.min_path_prob) if policy.min_path_prob > 0 else -math.inf
        self.ngram = NgramIndex(policy.ngram_sizes) if policy.ngram else None
        self.nodes = float(policy.init_nodes)
        self.ngram_len = policy.ngram_init_len
        self._tree_depth = 0
        self._chain: list[int] = []
        self._chain_hit = False
        self.stats = {"steps": 0, "accepted": 0, "nodes": 0, "ngram_steps": 0}
        self._packed = self._pack_heads(heads, depth) if heads is not None and depth > 0 else None

    @staticmethod
    def _pack_heads(heads: DraftHeads, depth: int) -> tuple[torch.Tensor, ...]:
        """The heads' weights rearranged so one step costs a handful of kernels instead of one per head.

        fused = W_f [E(x); h] + b_f;  states_k = fused + SiLU(W_k fused + b_k) for k < depth, as
        DraftHeads.forward computes them, with the K residual blocks stacked into one matrix.
        """
        with torch.no_grad():
            proj = heads.fusion.proj
            blocks = list(heads.lookahead.blocks)[:depth]
            stacked_w = torch.cat([b.linear.weight for b in blocks], dim=0)  # (depth*d, d)
            stacked_b = torch.cat([b.linear.bias for b in blocks], dim=0)
            return (proj.weight.detach(), proj.bias.detach(), stacked_w.detach(), stacked_b.detach())

    def _head_logits(self, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """(depth, V) logits of the first `depth` heads for one position (same maths as DraftHeads.forward)."""
        heads = self.heads
        w_f, b_f, w_k, b_k = self._packed
        dtype = w_f.dtype
        x = torch.cat([heads.embed(token.view(1)).to(dtype)[0], hidden.to(dtype)])
        fused = torch.addmv(b_f, w_f, x)  # (d,)
        states = fused + torch.nn.functional.silu(torch.addmv(b_k, w_k, fused)).view(self.head_depth, -1)
        return heads.lm_head(states.to(heads.lm_head.weight.dtype))

    def reset(self, context: Sequence[int]) -> None:
        self.nodes = float(self.policy.init_nodes)
        self.ngram_len = self.policy.ngram_init_len
        self._chain, self._chain_hit, self._tree_depth = [], False, 0
        if self.ngram is not None:
            self.ngram = NgramIndex(self.policy.ngram_sizes)
        self.stats = {"steps": 0, "accepted": 0, "nodes": 0, "ngram_steps": 0}

    def draft_inputs(self, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Device tensor [K*k tokens, K*k log-probs] of the heads' top candidates (no sync)."""
        if self.heads is None or self.head_depth == 0 or (self._chain_hit and self.policy.ngram_confident_nodes == 0):
            return hidden.new_zeros(0, dtype=torch.float64)
        logits = self._head_logits(hidden, token).float()  # (K, V)
        top = torch.topk(logits, self.top_k, dim=-1)
        logp = top.values - torch.logsumexp(logits, dim=-1, keepdim=True)
        return torch.cat([top.indices.flatten().double(), logp.flatten().double()])

    def propose(
        self, root: int, values: list[float], context: Sequence[int], max_depth: int
    ) -> tuple[list[int], tuple[int, ...]]:
        """Tokens and parent indices of the next tree (node 0 is `root`), at most `max_depth` deep."""
        k = self.top_k
        depth_limit = min(self.head_depth, max_depth)
        tokens = [root]
        parents = [-1]
        children: dict[tuple[int, int], int] = {}
        head_top1 = 0.0
        if depth_limit > 0 and values:
            n_values = self.head_depth * k
            tok = [int(v) for v in values[:n_values]]
            lp = values[n_values:]
            head_top1 = math.exp(lp[0])
            budget = int(self.nodes) if not self._chain_hit else min(int(self.nodes), self.policy.ngram_confident_nodes)
            log_min = self.log_min
            # Best-first over the lattice: entries (-score, parent node, depth of the candidate, rank).
            heap = [(-lp[0], 0, 1, 0)]
            while heap and len(tokens) <= budget:
                neg, parent, d, r = heapq.heappop(heap)
                if -neg < log_min:
                    break
                base = (d - 1) * k
                token = tok[base + r]
                node = len(tokens)
                tokens.append(token)
                parents.append(parent)
                children[(parent, token)] = node
                if r + 1 < k:  # next sibling: same parent, next-best candidate of the same head
                    heapq.heappush(heap, (neg + lp[base + r] - lp[base + r + 1], parent, d, r + 1))
                if d < depth_limit:  # first child: best candidate of the next head
                    heapq.heappush(heap, (neg - lp[base + k], node, d + 1, 0))
        self._chain = []
        if self.ngram is not None and head_top1 < self.policy.ngram_trigger and max_depth > 0:
            chain = self.ngram.lookup(context, min(self.ngram_len, max_depth))
            self._chain = chain
            node = 0
            for token in chain:
                nxt = children.get((node, token))
                if nxt is None:
                    nxt = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                    children[(node, token)] = nxt
                node = nxt
            if chain:
                self.stats["ngram_steps"] += 1
        self._tree_depth = self._depth_of(parents)
        self.stats["steps"] += 1
        self.stats["nodes"] += len(tokens) - 1
        return tokens, tuple(parents)

    @staticmethod
    def _depth_of(parents: Sequence[int]) -> int:
        depth = [0] * len(parents)
        for i in range(1, len(parents)):
            depth[i] = depth[parents[i]] + 1
        return max(depth)

    def feedback(self, accepted: Sequence[int]) -> None:
        """`accepted`: the drafted tokens the base accepted this step (root and bonus excluded)."""
        n = len(accepted)
        self.stats["accepted"] += n
        policy = self.policy
        if n >= self._tree_depth and n > 0:
            self.nodes = min(float(policy.max_nodes), self.nodes * policy.grow)
        elif n == 0:
            self.nodes = max(float(policy.min_nodes), self.nodes * policy.shrink)
        chain = self._chain
        self._chain_hit = bool(chain) and list(accepted[: len(chain)]) == chain
        if chain:
            if self._chain_hit:
                self.ngram_len = min(policy.ngram_max_len, self.ngram_len + 2)
            else:
                self.ngram_len = max(policy.ngram_min_len, self.ngram_len - 1)
