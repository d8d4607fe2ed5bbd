"""SecAgg+ that one hostile client cannot break: what the server sees of an exchange, and Flower's workflow
with the two changes that lets it drop a client before its masks exist.

Flower 1.42's `SecAggPlusWorkflow` asks, at the unmask stage, for key shares of every sampled node that is
not active, and removes pairwise masks with all of a dead node's neighbours. Both are wrong for a node that
left (or was dropped) before its key shares went out, and for a peer an honest client refused to mask with
(client/secagg.py): nobody holds such shares, so honest clients failed with `KeyError` and the round aborted.
`TolerantSecAggPlusWorkflow` forgets those nodes and edges before the unmask stage; everything else is
Flower's.
"""

from __future__ import annotations

import logging

from flwr.app import Message
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.common.secure_aggregation.secaggplus_constants import Key as SecAggKey
from flwr.common.secure_aggregation.secaggplus_constants import Stage as SecAggStage
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState
from flwr.serverapp.grid import Grid

from common.federation.protocol import BAD_SHARE_SOURCES

log = logging.getLogger("flwr.fedla.server")


class SecAggWitness:
    """What the server learns of one SecAgg+ exchange from its own messages, to find a hostile client that no
    single reply shows: a public key two nodes sent (a replayed setup reply), a peer an honest client names for
    a key share that does not decrypt, and key shares that do not lie on one Shamir polynomial.

    Shares are checked for consistency where there is redundancy: the secret combined from all of an owner's
    shares must equal the one combined without the first. With at least threshold + 2 shares one bad share is
    found by leaving each out in turn; with fewer, or with several bad shares, nobody can be named and the round
    aborts (server/rounds.py), the run goes on. A well-formed but wrong share among exactly `threshold` shares
    cannot be seen at all: it corrupts the sum, which the range check on the aggregate then refuses.
    """

    def __init__(self) -> None:
        self.neighbours: dict[int, set[int]] = {}  # node -> its neighbours (itself included), from share-keys
        self.threshold = 0
        self.num_shares = 0
        self.accusations: set[tuple[int, int]] = set()  # (honest node, peer whose key share it could not use)
        self.asked: dict[int, set[int]] = {}  # node -> the nodes whose shares the unmask stage asks it for

    def sent(self, stage: str | None, messages: list[Message]) -> None:
        for msg in messages:
            cfg = msg.content.config_records.get(RECORD_KEY_CONFIGS) if msg.has_content() else None
            if cfg is None:
                continue
            if stage == SecAggStage.SETUP:
                self.threshold = int(cfg.get(SecAggKey.THRESHOLD, 0))
                self.num_shares = int(cfg.get(SecAggKey.SHARE_NUMBER, 0))
            elif stage == SecAggStage.SHARE_KEYS:  # the keys of its neighbours, by node id
                self.neighbours[msg.metadata.dst_node_id] = {int(k) for k in cfg if k.isdigit()}
            elif stage == SecAggStage.UNMASK:  # whose shares it is asked for
                asked = [*cfg.get(SecAggKey.ACTIVE_NODE_ID_LIST, []), *cfg.get(SecAggKey.DEAD_NODE_ID_LIST, [])]
                self.asked[msg.metadata.dst_node_id] = set(asked)

    def malformed_share(self, share: bytes) -> str:
        """Why `share` cannot be a Flower Shamir share (4-byte index, then 16-byte chunks), or ""."""
        if len(share) < 20 or (len(share) - 4) % 16:
            return f"malformed ({len(share)} bytes)"
        index = int.from_bytes(share[:4], "little")
        if not 1 <= index <= max(self.num_shares, 1):
            return f"malformed (index {index} outside 1..{self.num_shares})"
        return ""

    def culprits(self, stage: str | None, replies: list[Message]) -> dict[int, str]:
        """node -> why it is dropped, from what this stage's (individually valid) replies show together."""
        if stage == SecAggStage.SETUP:
            return self._shared_keys(replies)
        if stage == SecAggStage.COLLECT_MASKED_VECTORS:
            return self._accused(replies)
        if stage == SecAggStage.UNMASK:
            return self._bad_shares(replies)
        return {}

    @staticmethod
    def _shared_keys(replies: list[Message]) -> dict[int, str]:
        owners: dict[bytes, list[int]] = {}
        for reply in replies:
            cfg = reply.content.config_records[RECORD_KEY_CONFIGS]
            for key in {cfg[SecAggKey.PUBLIC_KEY_1], cfg[SecAggKey.PUBLIC_KEY_2]}:
                owners.setdefault(key, []).append(reply.metadata.src_node_id)
        culprits = {}
        for nodes in owners.values():
            for node in nodes if len(nodes) > 1 else ():
                others = ", ".join(str(n) for n in nodes if n != node)
                culprits[node] = f"SecAgg+ public key identical to node {others}'s (a replayed setup reply)"
        return culprits

    def _accused(self, replies: list[Message]) -> dict[int, str]:
        culprits = {}
        for reply in replies:
            for source in reply.content.config_records[RECORD_KEY_CONFIGS].get(BAD_SHARE_SOURCES, []):
                accuser = reply.metadata.src_node_id
                self.accusations.add((accuser, int(source)))
                culprits[int(source)] = (
                    f"its encrypted SecAgg+ key share for node {accuser} does not decrypt (named by node {accuser})"
                )
        return culprits

    def _bad_shares(self, replies: list[Message]) -> dict[int, str]:
        held: dict[int, dict[int, bytes]] = {}  # holder -> owner -> share
        for reply in replies:
            cfg = reply.content.config_records[RECORD_KEY_CONFIGS]
            held[reply.metadata.src_node_id] = dict(zip(cfg[SecAggKey.NODE_ID_LIST], cfg[SecAggKey.SHARE_LIST]))
        culprits: dict[int, str] = {}
        while True:  # dropping a holder removes all its shares: check again until nothing changes
            found = self._next_culprit({h: s for h, s in held.items() if h not in culprits})
            if found is None:
                return culprits
            culprits[found[0]] = found[1]

    def _next_culprit(self, held: dict[int, dict[int, bytes]]) -> tuple[int, str] | None:
        by_owner: dict[int, list[tuple[int, bytes]]] = {}
        for holder, shares in held.items():
            for owner, share in shares.items():
                by_owner.setdefault(owner, []).append((holder, share))
        for owner, entries in sorted(by_owner.items()):
            lengths = [len(share) for _, share in entries]
            usual = max(set(lengths), key=lengths.count)
            for holder, share in entries:
                if len(share) != usual:
                    return (
                        holder,
                        f"SecAgg+ share for node {owner} has {len(share)} bytes where the others have {usual}",
                    )
            first: dict[bytes, int] = {}
            for holder, share in entries:
                if share[:4] in first:
                    return (
                        holder,
                        f"SecAgg+ share for node {owner} repeats node {first[share[:4]]}'s (a duplicated share)",
                    )
                first[share[:4]] = holder
            shares = [share for _, share in entries]
            if len(shares) < self.threshold + 1 or _consistent(shares):
                continue
            if len(shares) >= self.threshold + 2:
                for index, (holder, _) in enumerate(entries):
                    if _consistent(shares[:index] + shares[index + 1 :]):
                        return holder, f"SecAgg+ share for node {owner} does not match the others' (a forged share)"
            log.error("SecAgg+ shares of node %s are inconsistent and no single holder explains it", owner)
        return None


def _consistent(shares: list[bytes]) -> bool:
    """Do these Shamir shares lie on one polynomial of degree < len(shares) - 1 (given one to spare)?"""
    try:
        return combine_shares(shares) == combine_shares(shares[1:])
    except Exception:  # noqa: BLE001 - garbage that does not even combine is inconsistent
        return False


class TolerantSecAggPlusWorkflow(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow, forgetting before the unmask stage what holds no key shares (module docstring)."""

    def share_keys_stage(self, grid: Grid, context: LegacyContext, state: WorkflowState) -> bool:
        super().share_keys_stage(grid, context, state)
        # a node that did not hand out key shares took part in no mask: it is not a dropout to recover
        _forget(state, keep=set(state.active_node_ids), edges=set())
        return self._check_threshold(state)

    def collect_masked_vectors_stage(self, grid: Grid, context: LegacyContext, state: WorkflowState) -> bool:
        super().collect_masked_vectors_stage(grid, context, state)
        witness = getattr(grid, "secagg", None)
        refused = witness.accusations if witness is not None else set()
        # an honest node did not mask with a peer whose share it refused, and holds no share of it
        _forget(state, keep=set(state.sampled_node_ids), edges=refused)
        linked = {
            n for n in state.sampled_node_ids if n in state.active_node_ids or len(state.nid_to_neighbours[n]) > 1
        }
        _forget(state, keep=linked, edges=set())  # a dropped peer nobody masked with leaves nothing to remove
        return self._check_threshold(state)


def _forget(state: WorkflowState, keep: set[int], edges: set[tuple[int, int]]) -> None:
    state.sampled_node_ids = set(keep)
    state.nid_to_neighbours = {
        node: {n for n in neighbours if n in keep and (node, n) not in edges and (n, node) not in edges}
        for node, neighbours in state.nid_to_neighbours.items()
        if node in keep
    }
