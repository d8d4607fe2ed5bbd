"""Drafting for AMS-LD: the policy, the tree drafter over its three sources (the heads, prompt lookup and
the device's datastore), and the cost model.

The decoder talks to a drafter through a small interface, in the spirit of transformers'
`CandidateGenerator` (`get_candidates` / `update_candidate_strategy`), split in two so that the
device work runs before the one host-device synchronisation of a step:

    draft_inputs(hidden, tokens) -> device tensor  the newly verified rows in; the heads' candidate
                                                   lattice out, queued on the device
    propose(root, values, context, max_depth) -> (tokens, parents)   on the host: choose the tree
    feedback(accepted, seconds)                    after verification: update the acceptance estimates

Choosing the tree (Sequoia's and EAGLE-2's argument, made hardware-aware): every candidate node i
has an estimated probability a_i that the base accepts the whole path to it, so a tree T yields
1 + sum_{i in T} a_i tokens in expectation (the bonus token included), and costs
c(|T| + 1 nodes, LM-head rows) seconds to verify, measured on this device (calibration.py), plus the
fixed cost of a step. AMS-LD takes the candidates in order of a_i (an order in which parents come
before children, since a path's probability can only fall along it) and keeps the prefix that
maximises expected tokens per second. Where no tree pays (a steep c(n) or unsure heads) the best
prefix is empty, the step is plain decoding, and the heads are only consulted again every
`probe_every` steps until a tree pays again.

The estimates a_i: the heads' path probability (product of softmax probabilities along the path),
scaled per depth by how often drafts at that depth were accepted so far in this generation
(observed / predicted, with a prior of `prior_steps` steps at face value); the n-gram chain's j-th
token is estimated by how often its chains reached length j in this generation; a datastore node by
the share of the matched occurrences that continued that way, scaled per depth like the heads'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from common.decoding.calibration import CostCurve
from common.decoding.datastore import Datastore
from common.decoding.prompt_lookup import NgramIndex
from common.heads.lookahead import DraftHeads, DraftState


def _take(states: DraftState, index: torch.Tensor) -> DraftState:
    """Rows `index` of a drafting state (a tensor, or eagle's tuple whose path may still be None)."""
    if isinstance(states, tuple):
        return tuple(None if s is None else s[index] for s in states)
    return states[index]


@dataclass(frozen=True)
class AmsPolicy:
    """Every knob of the adaptive multi-step lookahead controller, in one place.

    Drafting (EAGLE-2's dynamic tree): at each lookahead depth the `beam` most confident nodes
    are expanded by their `top_k` best next tokens, up to `max_depth` (0: as many steps as there
    are heads). The n-gram source (prompt lookup over prompt and output) adds one chain whose
    length follows transformers' heuristic schedule (+2 after full acceptance, -1 otherwise) within
    [`ngram_min_len`, `ngram_max_len`]. A datastore (the device's own files, given to the drafter) adds
    the trie of what followed the longest match of the context's end there (at least
    `datastore_min_match` tokens), `datastore_depth` deep over at most `datastore_samples` occurrences.

    Tree size: with `cost_aware` the cost model above picks the size (at most `max_nodes` drafted
    nodes); without it, every candidate whose path probability is at least `min_path_prob` is
    verified, up to `max_nodes` (a fixed budget, for tests and ablations).

    `fused_alpha` and `fused_top_m` belong to the separate, output-changing "fused" mode, and
    `beam_width` to the beam-search baseline.
    """

    top_k: int = 4
    beam: int = 4
    heads: bool = True  # draw candidates from the lookahead heads (False: n-gram source only, an ablation)
    max_depth: int = 0
    max_nodes: int = 32
    cost_aware: bool = True
    min_path_prob: float = 0.0
    prior_steps: float = 4.0
    probe_every: int = 8
    ngram: bool = True
    ngram_sizes: tuple[int, ...] = (4, 3, 2, 1)
    ngram_init_len: int = 6
    ngram_min_len: int = 2
    ngram_max_len: int = 16
    datastore_min_match: int = 2
    datastore_depth: int = 12
    datastore_samples: int = 64
    fused_alpha: float = 0.5
    fused_top_m: int = 4
    beam_width: int = 4

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.beam < 1 or self.max_nodes < 0 or self.max_depth < 0:
            raise ValueError("AmsPolicy needs top_k >= 1, beam >= 1, max_nodes >= 0 and max_depth >= 0")
        if not 0.0 <= self.min_path_prob < 1.0 or self.prior_steps < 0 or self.probe_every < 1:
            raise ValueError("AmsPolicy needs 0 <= min_path_prob < 1, prior_steps >= 0 and probe_every >= 1")
        if not 1 <= self.ngram_min_len <= self.ngram_init_len <= self.ngram_max_len or not self.ngram_sizes:
            raise ValueError("AmsPolicy needs 1 <= ngram_min_len <= ngram_init_len <= ngram_max_len and ngram sizes")
        if self.datastore_min_match < 1 or self.datastore_depth < 1 or self.datastore_samples < 1:
            raise ValueError("AmsPolicy needs datastore_min_match, datastore_depth and datastore_samples >= 1")


@dataclass
class Candidate:
    token: int
    parent: int  # index into the candidate list; -1 = the root
    depth: int
    estimate: float  # estimated probability that the base accepts the whole path to this node
    head_p: float = 0.0  # the heads' own path probability (0: not a head candidate)
    chain_pos: int = 0  # position in the n-gram chain (0: not on it)
    store_share: float = 0.0  # share of the datastore's occurrences that continue along this path (0: none)


def choose_tree(
    candidates: list[Candidate], curve: CostCurve | None, max_nodes: int, min_prob: float, fixed_seconds: float
) -> list[int]:
    """Indices of the candidates to verify, parents before children (see the module docstring).

    `candidates` must list parents before children. With a cost curve, the prefix (in order of
    estimate) maximising (1 + sum a_i) / (c(n + 1, LM rows) + fixed_seconds); without one, every
    candidate with estimate >= min_prob, up to max_nodes.
    """
    order = sorted(range(len(candidates)), key=lambda i: (-candidates[i].estimate, candidates[i].depth))
    order = [i for i in order if candidates[i].estimate > 0][:max_nodes]
    if curve is None:
        return [i for i in order if candidates[i].estimate >= min_prob]
    has_child: set[int] = set()
    internal = 0  # nodes with children need a row of the LM head; the root does once it has a child
    expected, best_value, best_n = 1.0, 1.0 / (curve.tree_step(1, 0) + fixed_seconds), 0
    for n, i in enumerate(order, start=1):
        parent = candidates[i].parent
        if parent not in has_child:
            has_child.add(parent)
            internal += 1
        expected += candidates[i].estimate
        value = expected / (curve.tree_step(n + 1, internal) + fixed_seconds)
        if value > best_value:
            best_value, best_n = value, n
    return order[:best_n]


class AcceptanceModel:
    """Per-depth calibration of the heads' confidence and the datastore's shares, and the n-gram chain's hit
    rates, in one generation."""

    def __init__(self, depth: int, chain_len: int, store_depth: int, prior: float) -> None:
        self.predicted = [prior] * (depth + 1)  # sum of head path probabilities proposed at each depth
        self.observed = [prior] * (depth + 1)  # accepted head nodes at each depth
        self.store_predicted = [prior] * (store_depth + 1)  # the same for the datastore's shares
        self.store_observed = [prior] * (store_depth + 1)
        self.chain_tries = [0.0] * (chain_len + 1)
        self.chain_hits = [0.0] * (chain_len + 1)

    @staticmethod
    def _scale(observed: float, predicted: float) -> float:
        return observed / predicted if predicted > 0 else 1.0  # no evidence (prior_steps 0): face value

    def head_scale(self, depth: int) -> float:
        return self._scale(self.observed[depth], self.predicted[depth])

    def store_scale(self, depth: int) -> float:
        return self._scale(self.store_observed[depth], self.store_predicted[depth])

    def chain_rate(self, position: int) -> float:
        """P(a chain reaches this position | proposed), Laplace-smoothed."""
        return (self.chain_hits[position] + 1.0) / (self.chain_tries[position] + 2.0)

    def update(self, tree: list[Candidate], accepted: set[int]) -> None:
        """`tree`: the verified candidates; `accepted`: the indices (into `tree`) on the accepted path."""
        for i, node in enumerate(tree):
            hit = 1.0 if i in accepted else 0.0
            if node.head_p > 0:
                self.predicted[node.depth] += node.head_p
                self.observed[node.depth] += hit
            if node.chain_pos:
                self.chain_tries[node.chain_pos] += 1.0
                self.chain_hits[node.chain_pos] += hit
            if node.store_share > 0:
                self.store_predicted[node.depth] += node.store_share
                self.store_observed[node.depth] += hit


class HeadsTreeDrafter:
    """Draft trees from the lookahead heads, prompt lookup and the datastore, sized by the cost model."""

    def __init__(
        self,
        heads: DraftHeads | None,
        policy: AmsPolicy,
        curve: CostCurve | None = None,
        datastore: Datastore | None = None,
    ) -> None:
        self.heads = heads
        self.policy = policy
        self.datastore = datastore
        num_heads = heads.num_heads if heads is not None and policy.heads else 0
        self.head_depth = num_heads if policy.max_depth <= 0 else min(policy.max_depth, num_heads)
        self.curve = curve if policy.cost_aware else None
        self.reset(())

    def reset(self, context: Sequence[int]) -> None:
        policy = self.policy
        self.ngram = NgramIndex(policy.ngram_sizes) if policy.ngram else None
        self.ngram_len = policy.ngram_init_len
        self.acceptance = AcceptanceModel(
            max(self.head_depth, 1), policy.ngram_max_len, policy.datastore_depth, policy.prior_steps
        )
        self.cache = self.heads.new_cache() if self.heads is not None else None  # eagle: the drafter's context
        self._tree: list[Candidate] = []
        self._chain: list[int] = []
        self._idle = 0  # steps since the last tree that paid; the heads are skipped while idle
        # heads drafted per step: one beyond the deepest head node the last tree verified, since deeper
        # drafts that no tree takes only cost time (on a CPU the heads' vocab products are ~10% of a step)
        self.depth_in_use = self.head_depth
        self.fixed_seconds = 0.0  # EMA of a step's cost beyond the verify forward (drafting, bookkeeping)
        self.stats = {"steps": 0, "accepted": 0, "nodes": 0, "ngram_steps": 0, "store_steps": 0, "plain_steps": 0}

    # -------------------------------------------------------------------- device side
    def _heads_due(self) -> bool:
        return self._idle == 0 or self._idle % self.policy.probe_every == 0

    def draft_inputs(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Device tensor [tokens | parents | log path probabilities] of the heads' candidates (no sync).

        `hidden` (n, d): the base's states at the positions verified since the last call (the prompt,
        then each accepted path); `tokens` (n,): the token chosen after each. Heads with a context
        (eagle) commit them all; the others read only the last row. Depth 1 expands the last row by its
        top_k; every further depth expands the `beam` best candidates of the depth before (by path
        probability), each by its own top_k.
        """
        heads, depth_limit = self.heads, self.depth_in_use
        if heads is None or depth_limit == 0:
            return hidden.new_zeros(0, dtype=torch.float64)
        if heads.eagle:  # the context must stay whole even on steps that draft nothing
            head_state = heads.commit(self.cache, hidden, tokens)[-1:]
        if not self._heads_due():
            return hidden.new_zeros(0, dtype=torch.float64)
        states: DraftState
        if heads.eagle:
            states = (head_state, None, None)
        else:
            states, head_state = heads.step(tokens[-1:], hidden[-1:], 1)
        k = self.policy.top_k
        draft_ids = heads.draft_ids
        cum = hidden.new_zeros(1, dtype=torch.float32)
        parents = torch.full((1,), -1, dtype=torch.long, device=hidden.device)
        offset, out_tokens, out_parents, out_logp = 0, [], [], []
        for depth in range(1, depth_limit + 1):
            if depth > 1:
                states, head_state = heads.step(tokens, states, depth, self.cache)
            logp = torch.log_softmax(heads.draft_logits(head_state).float(), dim=-1)
            top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
            width = top.indices.shape[1]
            cand_logp = (cum.view(-1, 1) + top.values).flatten()  # (w * k,)
            cand_tokens = draft_ids[top.indices.flatten()]
            cand_parents = parents.repeat_interleave(width)
            out_tokens.append(cand_tokens)
            out_parents.append(cand_parents)
            out_logp.append(cand_logp)
            if depth == depth_limit:
                break
            keep = torch.topk(cand_logp, min(self.policy.beam, len(cand_logp))).indices
            tokens, cum = cand_tokens[keep], cand_logp[keep]
            states = _take(states, keep // width)  # each kept candidate continues its parent's state
            parents = keep + offset  # global candidate index of each kept node
            offset += len(cand_logp)
        return torch.cat(
            [torch.cat(out_tokens).double(), torch.cat(out_parents).double(), torch.cat(out_logp).double()]
        )

    # -------------------------------------------------------------------- host side
    def propose(
        self, root: int, values: list[float], context: Sequence[int], max_depth: int
    ) -> tuple[list[int], tuple[int, ...]]:
        """Tokens and parent indices of the next tree (node 0 is `root`), at most `max_depth` deep."""
        candidates: list[Candidate] = []
        children: dict[tuple[int, int], int] = {}
        index_of: dict[int, int] = {-1: -1}  # the heads' candidate index -> position in `candidates`
        acceptance = self.acceptance
        m = len(values) // 3
        for i in range(m):
            parent = index_of.get(int(values[m + i]))
            if parent is None:  # its parent lay beyond max_depth
                continue
            depth = 1 if parent < 0 else candidates[parent].depth + 1
            if depth > max_depth:
                continue
            p = math.exp(values[2 * m + i])
            estimate = min(1.0, p * acceptance.head_scale(depth))
            if parent >= 0:
                estimate = min(estimate, candidates[parent].estimate)
            index_of[i] = len(candidates)
            children[(parent, int(values[i]))] = len(candidates)
            candidates.append(Candidate(int(values[i]), parent, depth, estimate, head_p=p))
        self._chain = []
        if self.ngram is not None and max_depth > 0:
            self._chain = self.ngram.lookup(context, min(self.ngram_len, max_depth))
            node = -1
            for pos, token in enumerate(self._chain, start=1):
                rate = acceptance.chain_rate(pos)
                index = children.get((node, token))
                if index is None:
                    index = len(candidates)
                    children[(node, token)] = index
                    depth = pos
                    candidates.append(Candidate(token, node, depth, 0.0))
                cand = candidates[index]
                cand.chain_pos = pos
                cand.estimate = max(cand.estimate, rate if node < 0 else min(rate, candidates[node].estimate))
                node = index
        store_nodes = self._merge_store_draft(candidates, children, context, max_depth)
        chosen = choose_tree(
            candidates, self.curve, self.policy.max_nodes, self.policy.min_path_prob, self.fixed_seconds
        )
        if self._chain and any(candidates[i].chain_pos for i in chosen):
            self.stats["ngram_steps"] += 1
        if store_nodes and any(candidates[i].store_share for i in chosen):
            self.stats["store_steps"] += 1
        position = {c: n for n, c in enumerate(chosen, start=1)}
        tokens = [root] + [candidates[i].token for i in chosen]
        parents = [-1] + [0 if candidates[i].parent < 0 else position[candidates[i].parent] for i in chosen]
        self._tree = [candidates[i] for i in chosen]
        deepest = max((c.depth for c in self._tree if c.head_p > 0), default=0)
        self.depth_in_use = min(self.head_depth, deepest + 1)
        self.stats["steps"] += 1
        self.stats["nodes"] += len(chosen)
        if not chosen:
            self.stats["plain_steps"] += 1
        return tokens, tuple(parents)

    def _merge_store_draft(
        self,
        candidates: list[Candidate],
        children: dict[tuple[int, int], int],
        context: Sequence[int],
        max_depth: int,
    ) -> int:
        """Add the datastore's trie to `candidates` (merging nodes the other sources drafted); returns how many
        of its nodes it added or marked."""
        policy = self.policy
        if self.datastore is None or max_depth < 1:
            return 0
        draft = self.datastore.draft(
            context, min(policy.datastore_depth, max_depth), policy.datastore_samples, policy.datastore_min_match
        )
        if draft is None:
            return 0
        acceptance = self.acceptance
        position: list[int] = []  # the trie's node -> its index in `candidates`
        for token, parent, share in zip(draft.tokens, draft.parents, draft.shares):
            node = -1 if parent < 0 else position[parent]
            depth = 1 if node < 0 else candidates[node].depth + 1
            estimate = min(1.0, share * acceptance.store_scale(depth))
            if node >= 0:
                estimate = min(estimate, candidates[node].estimate)
            index = children.get((node, token))
            if index is None:
                index = children[(node, token)] = len(candidates)
                candidates.append(Candidate(token, node, depth, 0.0))
            cand = candidates[index]
            cand.store_share = share
            cand.estimate = max(cand.estimate, estimate)
            position.append(index)
        return len(position)

    def feedback(self, accepted_path: Sequence[int], step_seconds: float = 0.0) -> None:
        """`accepted_path`: tree-node indices of the accepted drafted nodes (root excluded), in order;
        `step_seconds`: the step's wall time, which calibrates the cost beyond the verify forward."""
        tree = self._tree
        n = len(accepted_path)
        self.stats["accepted"] += n
        self.acceptance.update(tree, {node - 1 for node in accepted_path})
        if self.curve is not None and step_seconds > 0:
            internal = len({c.parent for c in tree})
            extra = max(0.0, step_seconds - self.curve.tree_step(len(tree) + 1, internal))
            self.fixed_seconds = 0.8 * self.fixed_seconds + 0.2 * extra if self.stats["steps"] > 1 else extra
        self._idle = 0 if tree else self._idle + 1  # idle: no tree paid; the heads are probed now and then
        chain = self._chain
        if chain:
            hit = n >= len(chain) and [tree[i - 1].token for i in accepted_path[: len(chain)]] == chain
            policy = self.policy
            self.ngram_len = (
                min(policy.ngram_max_len, self.ngram_len + 2) if hit else max(policy.ngram_min_len, self.ngram_len - 1)
            )
