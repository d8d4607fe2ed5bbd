"""The datastore (drafts from the device's own files): its suffix array against brute force, the longest
match and the continuation trie, files kept apart, the cached index, and AMS-LD with it: exact, and
drafting from it when the files hold what the base will write."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.data.chunks import text_files
from common.decoding import AmsPolicy, Datastore, generate
from common.decoding.datastore import SEPARATOR, SORTED_PREFIX, datastore_for, reversed_suffix_array
from common.errors import FedLookaheadError
from common.model.base import load_base
from tests.conftest import save_tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.mark.parametrize("seed", range(4))
def test_suffix_array_sorts_suffixes_by_their_first_tokens(seed):
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, 3 + seed, size=300).astype(np.int32)  # a small alphabet: long shared prefixes
    stream[rng.integers(0, 300, size=5)] = SEPARATOR
    order = reversed_suffix_array(stream)
    assert sorted(order.tolist()) == list(range(300))
    keys = [tuple(stream[i : i + SORTED_PREFIX].tolist()) for i in order]
    assert keys == sorted(keys)  # a shorter suffix (one that ends) sorts before its extensions


def brute_force_match(stream: list[int], context: list[int], max_length: int) -> tuple[int, list[int]]:
    """The longest suffix of `context` in `stream`, and the stream index just after each occurrence."""
    for length in range(min(max_length, len(context)), 0, -1):
        pattern = context[-length:]
        ends = [i + length for i in range(len(stream) - length + 1) if stream[i : i + length] == pattern]
        if ends:
            return length, ends
    return 0, []


@pytest.mark.parametrize("seed", range(6))
def test_longest_match_and_continuations_equal_brute_force(seed):
    rng = np.random.default_rng(seed)
    documents = [rng.integers(0, 4, size=int(rng.integers(5, 60))).tolist() for _ in range(5)]
    store = Datastore.from_token_lists(documents)
    stream = store.stream.tolist()
    for _ in range(20):
        context = rng.integers(0, 4, size=int(rng.integers(1, 12))).tolist()
        length, lo, hi = store.longest_match(context, max_length=8)
        expected_length, ends = brute_force_match(stream, context, 8)
        assert length == expected_length
        assert hi - lo == len(ends)
        draft = store.draft(context, depth=3, samples=1000, min_match=1)
        # the trie's first level counts what followed each occurrence (a file's end continues nothing)
        following = [stream[e] for e in ends if e < len(stream) and stream[e] != SEPARATOR]
        if not following:
            assert draft is None
            continue
        first_level = {t: s for t, p, s in zip(draft.tokens, draft.parents, draft.shares) if p == -1}
        assert first_level == {t: following.count(t) / len(ends) for t in set(following)}
        for parent, share in zip(draft.parents, draft.shares):
            assert parent < 0 or draft.shares[parent] >= share  # shares only fall along a path


def test_no_match_or_continuation_crosses_files():
    store = Datastore.from_token_lists([[1, 2, 3], [4, 5, 6]])
    assert store.longest_match([3, 4], max_length=8)[0] == 1  # "3 4" spans the two files: only "4" matches
    draft = store.draft([2, 3], depth=4, samples=8, min_match=2)
    assert draft is None  # "2 3" ends the first file: nothing follows it
    draft = store.draft([4, 5], depth=4, samples=8, min_match=2)
    assert (draft.tokens, draft.parents, draft.shares, draft.match_length) == ([6], [-1], [1.0], 2)


def test_draft_samples_occurrences_evenly():
    store = Datastore.from_token_lists([[7, 1]] * 50 + [[7, 2]] * 50)
    draft = store.draft([7], depth=1, samples=10, min_match=1)
    assert draft.occurrences == 100
    assert sorted(zip(draft.tokens, draft.shares)) == [(1, 0.5), (2, 0.5)]


def test_datastore_is_cached_per_file_state_and_a_damaged_cache_is_rebuilt(tmp_path, tiny_tokenizer):
    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "a.py").write_text("def f(x):\n    return x + 1\n" * 20)
    cache = tmp_path / "cache"
    store = datastore_for(text_files(folder), tiny_tokenizer, cache, progress=False)
    (index,) = cache.iterdir()
    again = datastore_for(text_files(folder), tiny_tokenizer, cache, progress=False)
    assert np.array_equal(again.stream, store.stream) and np.array_equal(again.suffixes, store.suffixes)
    (folder / "b.py").write_text("import os\n")  # another file: another index
    datastore_for(text_files(folder), tiny_tokenizer, cache, progress=False)
    assert len(list(cache.iterdir())) == 2
    (folder / "b.py").unlink()
    index.write_bytes(b"not an index")  # a damaged cache is rebuilt, not trusted
    with pytest.raises(FedLookaheadError, match="unreadable"):
        Datastore.load(index)
    rebuilt = datastore_for(text_files(folder), tiny_tokenizer, cache, progress=False)
    assert np.array_equal(rebuilt.suffixes, store.suffixes)
    Datastore.load(index)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("   \n")
    with pytest.raises(FedLookaheadError, match="no readable text"):
        datastore_for(text_files(empty), tiny_tokenizer, cache, progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_tokenizer):
    from tests.test_decoding import noisy_heads, perturb

    base = perturb(load_base(save_tiny(tmp_path_factory.mktemp("store"), tiny_tokenizer), device="cpu"), seed=3)
    return base, noisy_heads(base, 0)


def test_ams_with_a_datastore_is_exact_and_drafts_from_it(tiny):
    """Files that hold the base's own continuation let the datastore alone draft most tokens; with any
    policy the output stays the base's greedy output."""
    base, heads = tiny
    prompt = list(range(3, 19))
    greedy = generate(base, torch.tensor(prompt), mode="greedy", max_new_tokens=48, degeneration_guard=False).tokens
    store = Datastore.from_token_lists([list(range(40, 90)), prompt + greedy, [5, 6, 7, 8]])
    store_only = AmsPolicy(heads=False, ngram=False, cost_aware=False)

    def decode(policy: AmsPolicy, datastore: Datastore):
        return generate(
            base,
            torch.tensor(prompt),
            heads=heads,
            policy=policy,
            max_new_tokens=48,
            degeneration_guard=False,
            datastore=datastore,
        )

    result = decode(store_only, store)
    assert result.tokens == greedy
    assert result.stats["store_steps"] > 0 and result.tau > 3
    unrelated = Datastore.from_token_lists([[1, 2, 3, 4] * 10, list(range(20, 60))])
    policies = (
        AmsPolicy(),
        AmsPolicy(cost_aware=False, max_nodes=8),
        AmsPolicy(datastore_depth=2),
        AmsPolicy(prior_steps=0),
    )
    for policy in policies:
        for datastore in (store, unrelated):
            assert decode(policy, datastore).tokens == greedy
