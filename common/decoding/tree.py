"""Draft trees: their attention mask, the acceptance rule (greedy and sampling) and KV-cache compaction.

A tree is a list of nodes in topological order (parents before children). Node 0 is the root: the
token the base has already chosen (the previous step's bonus token), not yet fed to the model. Every
other node is a drafted token, a candidate continuation of its parent. One base forward over all
nodes, with each node attending to the cached prefix plus its own ancestors only, gives the base's
next-token distribution after every node at once.

Everything derived from the *shape* of a tree (its parent list) is computed once and cached in a
`TreeSpec`: masks, depths, ancestor paths. Only the tokens change from step to step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import Cache, DynamicCache


@dataclass(frozen=True)
class TreeSpec:
    """Shape-only data of one tree, on the decoding device.

    parents    parent index of every node (root: -1)
    depths     root 0, its children 1, ...
    paths      for every node, the node indices from the root down to it (root included)
    bias       (q, q) additive attention mask among tree nodes: 0 where node i may see node j, dtype min elsewhere
    ancestors  (q, q) bool: j is i or an ancestor of i
    parent_t   (q,) parent index with the root pointing to itself
    depth_t    (q,) depths as a long tensor
    is_root    (q,) bool, true for node 0 only
    earlier_sibling  (q, q) bool: j is a sibling of i that comes before i in the node order
    internal   (n,) indices of the nodes that have children (the only ones whose next-token choice
               verification needs); parent_slot (q,) each node's parent's position in `internal`
    """

    parents: tuple[int, ...]
    depths: tuple[int, ...]
    paths: tuple[tuple[int, ...], ...]
    bias: torch.Tensor
    ancestors: torch.Tensor
    parent_t: torch.Tensor
    depth_t: torch.Tensor
    is_root: torch.Tensor
    earlier_sibling: torch.Tensor
    internal: torch.Tensor
    parent_slot: torch.Tensor

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)


def tree_paths(parents: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Root-to-node index paths; raises ValueError unless parents come before their children."""
    if not parents or parents[0] != -1:
        raise ValueError("node 0 must be the root (parent -1)")
    paths: list[tuple[int, ...]] = [(0,)]
    for i, p in enumerate(parents[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must precede their children")
        paths.append(paths[p] + (i,))
    return tuple(paths)


def build_tree_spec(parents: Sequence[int], dtype: torch.dtype, device: torch.device) -> TreeSpec:
    """Masks and indices of the tree given by `parents` (see TreeSpec)."""
    parents = tuple(int(p) for p in parents)
    paths = tree_paths(parents)
    q = len(parents)
    rows = [i for i, path in enumerate(paths) for _ in path]
    cols = [j for path in paths for j in path]
    ancestors = torch.zeros(q, q, dtype=torch.bool)
    ancestors[rows, cols] = True
    bias = torch.full((q, q), torch.finfo(dtype).min, dtype=dtype)
    bias.masked_fill_(ancestors, 0.0)
    depths = tuple(len(path) - 1 for path in paths)
    parent_t = torch.tensor((0,) + parents[1:], dtype=torch.long)
    is_root = torch.zeros(q, dtype=torch.bool)
    is_root[0] = True
    siblings = (parent_t.view(1, q) == parent_t.view(q, 1)) & ~is_root.view(1, q) & ~is_root.view(q, 1)
    earlier_sibling = siblings & torch.ones(q, q, dtype=torch.bool).tril(-1)
    internal = sorted(set(parents[1:]))
    slot = {node: i for i, node in enumerate(internal)}
    parent_slot = [0] + [slot[p] for p in parents[1:]]

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(device, non_blocking=True)

    return TreeSpec(
        parents=parents,
        depths=depths,
        paths=paths,
        bias=move(bias),
        ancestors=move(ancestors),
        parent_t=move(parent_t),
        depth_t=move(torch.tensor(depths, dtype=torch.long)),
        is_root=move(is_root),
        earlier_sibling=move(earlier_sibling),
        internal=move(torch.tensor(internal, dtype=torch.long)),
        parent_slot=move(torch.tensor(parent_slot, dtype=torch.long)),
    )


class TreeSpecCache:
    """LRU cache of TreeSpecs keyed by the parent tuple: a repeated tree shape costs one dict lookup."""

    def __init__(self, dtype: torch.dtype, device: torch.device, capacity: int = 1024) -> None:
        self.dtype, self.device, self.capacity = dtype, device, capacity
        self._specs: OrderedDict[tuple[int, ...], TreeSpec] = OrderedDict()

    def get(self, parents: tuple[int, ...]) -> TreeSpec:
        spec = self._specs.get(parents)
        if spec is None:
            spec = build_tree_spec(parents, self.dtype, self.device)
            self._specs[parents] = spec
            if len(self._specs) > self.capacity:
                self._specs.popitem(last=False)
        else:
            self._specs.move_to_end(parents)
        return spec


def row(matrix: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """matrix[index] for a 0-d device index tensor without a host sync (plain indexing may sync on CUDA)."""
    return matrix.index_select(0, index.view(1))[0]


def to_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """A long tensor on `device`; on CUDA copied from pinned memory asynchronously (no stream sync)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=torch.long)
    return torch.tensor(values, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)


def attention_mask_4d(spec: TreeSpec, past: int) -> torch.Tensor:
    """The float additive mask (1, 1, q, past + q): every node sees the whole cached prefix and its ancestors."""
    q = spec.size
    if past == 0:
        return spec.bias.view(1, 1, q, q)
    prefix = spec.bias.new_zeros(q, past)
    return torch.cat([prefix, spec.bias], dim=1).view(1, 1, q, past + q)


def position_ids(spec: TreeSpec, past: int) -> torch.Tensor:
    """Position of every node: the prefix length plus its depth, (1, q)."""
    return (spec.depth_t + past).view(1, -1)


def greedy_accept(spec: TreeSpec, tokens: torch.Tensor, parent_choices: torch.Tensor) -> torch.Tensor:
    """Deepest node whose whole path agrees with the base's argmax choices (device tensor, no sync).

    tokens          (q,) drafted token of every node (root included)
    parent_choices  (q,) the base's argmax after each node's parent (the root's entry is ignored)
    A node is accepted when every non-root node on its path carries the token the base chose after
    that node's parent. Siblings carry distinct tokens, so at most one node per depth is accepted
    and the deepest accepted node is unique.
    """
    agrees = (tokens == parent_choices) | spec.is_root
    accepted = ~(spec.ancestors & ~agrees).any(dim=-1)
    return (accepted * (spec.depth_t + 1)).argmax()


def greedy_verify(
    spec: TreeSpec, tokens: torch.Tensor, hidden: torch.Tensor, lm_head: torch.nn.Module, one_pass: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of a tree from the base's hidden states (q, d): (deepest accepted node, bonus token).

    Only nodes with children need the base's choice to check their children, so the LM head runs on
    those rows, plus one row for the bonus token after the accepted node: leaves cost no LM-head
    work unless accepted. `one_pass` runs it once over every row instead, which is cheaper where a
    few rows cost what one does (CostCurve.one_lm_pass decides). All device tensors, no synchronisation.
    """
    if one_pass:
        choices = lm_head(hidden).argmax(-1)
        best = greedy_accept(spec, tokens, choices[spec.parent_t])
        return best, choices[best]
    if spec.size == 1:
        best = spec.depth_t[0]  # the root (index 0) as a device scalar
    else:
        choices = lm_head(hidden.index_select(0, spec.internal)).argmax(-1)
        best = greedy_accept(spec, tokens, choices[spec.parent_slot])
    bonus = lm_head(row(hidden, best)).argmax(-1)
    return best, bonus


def sample_accept(
    spec: TreeSpec, tokens: torch.Tensor, probs: torch.Tensor, uniforms: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless tree speculative sampling; returns (deepest accepted node, bonus token), both device tensors.

    probs     (q, V) the base's (temperature / top-p processed) next-token distribution after every node
    uniforms  (q,) independent U(0, 1) draws, one per node

    The drafter proposes deterministic candidates (a point-mass draft distribution), so speculative
    rejection reduces to sequential sampling without replacement: at a node with children c1..cm in
    order, child cj is accepted with probability p(cj) / (1 - p(c1) - ... - p(c_{j-1})) given that
    the earlier siblings were rejected, i.e. with probability exactly p(cj) overall. When every child
    is rejected the bonus token is drawn from p with the children's tokens removed (renormalised), so
    each token x is emitted with probability p(x), as plain sampling from the base would. Descending
    into the accepted child repeats the argument with the base's distribution at that child.
    (SpecInfer's multi-step speculative sampling with a point-mass draft.)
    """
    q = spec.size
    parent = spec.parent_t
    p_child = probs[parent, tokens]  # probability the parent's distribution gives to each node's token
    p_child = torch.where(spec.is_root, torch.zeros_like(p_child), p_child)
    # Mass of the earlier siblings of every node (siblings share a parent, earlier in the node order).
    before = spec.earlier_sibling.to(probs.dtype) @ p_child
    remaining = (1.0 - before).clamp_min(0.0)
    chosen = uniforms * remaining < p_child
    # A node is taken if it is chosen and no earlier sibling was chosen (the first success wins).
    earlier_chosen = (spec.earlier_sibling & chosen.view(1, q)).any(dim=-1)
    taken = (chosen & ~earlier_chosen) | spec.is_root
    on_path = ~(spec.ancestors & ~taken).any(dim=-1)
    best = (on_path * (spec.depth_t + 1)).argmax()
    # Bonus token: from the distribution at `best` with its children's tokens removed (all were rejected).
    children_of_best = (parent == best) & ~spec.is_root
    removed = torch.zeros_like(probs[0]).index_add_(0, tokens, children_of_best.to(probs.dtype)).clamp_max_(1.0)
    at_best = row(probs, best)
    residual = at_best * (1.0 - removed)
    total = residual.sum()
    residual = torch.where(total > 0, residual, at_best)  # rounding guard: cannot happen in exact arithmetic
    bonus = torch.multinomial(residual, 1, generator=generator).view(())
    return best, bonus


def move_path_entries(cache: Cache, past: int, path: Sequence[int]) -> None:
    """Move the accepted path's KV entries (in place) to follow the prefix, at past, past + 1, ...

    `path` lists tree-node offsets (relative to `past`) in order, root first. A path that is
    already 0, 1, 2, ... stays where it is.
    """
    if all(node == i for i, node in enumerate(path)):
        return
    m = len(path)
    index = to_device(path, cache.layers[0].keys.device) + past
    for layer in cache.layers:
        layer.keys[..., past : past + m, :] = layer.keys.index_select(-2, index)
        layer.values[..., past : past + m, :] = layer.values.index_select(-2, index)


def keep_cache_path(cache: DynamicCache, past: int, path: Sequence[int]) -> None:
    """Compact the KV cache after a tree forward: keep the prefix and the accepted path only.

    The cache holds `past + q` entries after the forward; afterwards it holds `past + len(path)`, the
    accepted nodes moved to be contiguous (`move_path_entries`). A path 0, 1, 2, ... costs only a crop.
    """
    move_path_entries(cache, past, path)
    end = past + len(path)
    for layer in cache.layers:
        layer.keys = layer.keys[..., :end, :]
        layer.values = layer.values[..., :end, :]
