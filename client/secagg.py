"""An honest client's defence against a hostile peer in Flower's SecAgg+ (`secaggplus_mod`).

In the collect-masked-vectors stage each client decrypts the key shares its neighbours sent it. Flower's
mod raises on the first one that does not decrypt (garbage, or a ciphertext replayed from another node),
so one hostile peer made every honest neighbour fail, after training, and was never named. Here the
ciphertexts are checked first, with the pairwise key the mod already derived. A bad one is left out, so
the mod neither keeps a share of that peer nor masks with it, and the peer is named in the reply
(`BAD_SHARE_SOURCES`): the server drops it and forgets the pair (server/secagg.py).
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message
from flwr.app.message_type import MessageType
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
from flwr.common import bytes_to_ndarray, ndarray_to_bytes
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key
from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate

from common.federation.protocol import BAD_SHARE_SOURCES
from common.federation.wire import pack_masked


def secagg_stage(msg: Message) -> str | None:
    """The SecAgg+ stage a train message is in; None for a plain FedAvg train message or any other message."""
    if msg.metadata.message_type != MessageType.TRAIN or RECORD_KEY_CONFIGS not in msg.content.config_records:
        return None
    return msg.content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE)


def screen_ciphertexts(msg: Message, context: Context) -> list[int]:
    """Leave out of the collect-stage message every key share that does not decrypt to one from its source for
    this node; returns those sources, sorted."""
    configs = msg.content.config_records[RECORD_KEY_CONFIGS]
    state = SecAggPlusState(**context.state.config_records.get(RECORD_KEY_STATE, ConfigRecord({})))
    me = msg.metadata.dst_node_id
    kept, bad = [], set()
    for source, ciphertext in zip(configs.get(Key.SOURCE_LIST, []), configs.get(Key.CIPHERTEXT_LIST, [])):
        key = state.ss2_dict.get(source)
        try:
            actual_source, destination, _, _ = share_keys_plaintext_separate(decrypt(key, ciphertext))
            good = (actual_source, destination) == (source, me)
        except Exception:  # noqa: BLE001 - no key, or whatever fails to decrypt or parse, is a bad share
            good = False
        if good:
            kept.append((source, ciphertext))
        else:
            bad.add(source)
    configs[Key.SOURCE_LIST] = [source for source, _ in kept]
    configs[Key.CIPHERTEXT_LIST] = [ciphertext for _, ciphertext in kept]
    return sorted(bad)


def name_bad_sources(reply: Message, bad: list[int]) -> Message:
    if bad and not reply.has_error():
        reply.content.config_records[RECORD_KEY_CONFIGS][BAD_SHARE_SOURCES] = bad
    return reply


def packed(reply: Message, context: Context) -> Message:
    """The masked vector of a collect-stage reply in the narrowest type its modulus allows (Flower sends int64)."""
    if reply.has_error() or RECORD_KEY_CONFIGS not in reply.content.config_records:
        return reply
    configs = reply.content.config_records[RECORD_KEY_CONFIGS]
    if Key.MASKED_PARAMETERS in configs:
        state = SecAggPlusState(**context.state.config_records[RECORD_KEY_STATE])
        arrays = [bytes_to_ndarray(b) for b in configs[Key.MASKED_PARAMETERS]]
        configs[Key.MASKED_PARAMETERS] = [ndarray_to_bytes(a) for a in pack_masked(arrays, state.mod_range)]
    return reply
