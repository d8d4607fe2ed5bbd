"""A population of small users (issue 27): the user partitioner, features cached once in batches, and clients
that train on them without the base's decoder layers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

import client.base_cache
import common.data.features
from client.client_app import app
from client.partitions import UserPartitioner
from client.training.local_round import train_round
from common.data.chunks import stdlib_dir
from common.data.features import base_features, compute_features, extractor_for, features_of_sets
from common.errors import FedLookaheadError
from common.federation.config import FedConfig
from common.heads.lookahead import DraftHeads
from common.model.base import load_base
from server.federation import run_federation

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # simulations/ is a folder of scripts, not installed
from simulations.inprocess import InProcessGrid  # noqa: E402
from simulations.population import prepare_population  # noqa: E402
from simulations.run import load_scenario, scenario_settings  # noqa: E402


def partitioner(groups: list[str], users: int, chunks: int = 3, seed: int = 0) -> UserPartitioner:
    built = UserPartitioner(users, chunks, seed)
    built.dataset = datasets.Dataset.from_dict({"idx": list(range(len(groups))), "group": groups})
    return built


def test_a_user_is_consecutive_chunks_of_one_package_and_users_never_share_one():
    groups = ["a"] * 10 + ["b"] * 7 + ["c"] * 2  # a: 3 users (one chunk left over), b: 2, c: none
    split = partitioner(groups, users=5)
    users = [list(split.load_partition(p)["idx"]) for p in range(5)]
    assert sorted(map(tuple, users)) == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (10, 11, 12), (13, 14, 15)]
    assert len({groups[i] for user in users for i in user[:1]}) == 2  # non-IID: each user is one package
    assert [list(partitioner(groups, 5, seed=0).load_partition(p)["idx"]) for p in range(5)] == users  # seeded
    assert users != [list(partitioner(groups, 5, seed=1).load_partition(p)["idx"]) for p in range(5)]
    with pytest.raises(FedLookaheadError, match="holds 5 users of 3 chunks, fewer than the 6 clients"):
        partitioner(groups, users=6).load_partition(0)


def test_a_base_without_its_layers_has_the_same_fingerprint_and_refuses_to_run(tiny_base_dir, tiny_base):
    skeleton = load_base(tiny_base_dir, device="cpu", body=False)
    assert skeleton.fingerprint == tiny_base.fingerprint and not skeleton.body
    assert sum(p.numel() for p in skeleton.model.parameters()) < sum(p.numel() for p in tiny_base.model.parameters())
    torch.testing.assert_close(
        skeleton.model.get_output_embeddings().weight, tiny_base.model.get_output_embeddings().weight
    )
    with pytest.raises(FedLookaheadError, match="loaded without its layers"):
        skeleton.features(torch.zeros(1, 4, dtype=torch.long))


def test_heads_train_the_same_on_a_base_without_its_layers(tiny_base_dir, tiny_base):
    chunks = torch.randint(0, tiny_base.vocab_size, (6, 16), generator=torch.Generator().manual_seed(0))
    features = base_features(tiny_base, chunks)
    config = FedConfig.from_mapping({"dp": False, "batch-size": 3, "lr": 0.01})
    trained = []
    for base in (tiny_base, load_base(tiny_base_dir, device="cpu", body=False)):
        torch.manual_seed(0)
        heads = DraftHeads.fresh(base, 2)
        torch.manual_seed(1)
        train_round(heads, features, config, None)
        trained.append([p.detach().clone() for p in heads.parameters()])
    for full, skeleton in zip(*trained):
        torch.testing.assert_close(full, skeleton, rtol=0, atol=0)


def test_features_of_many_sets_are_computed_together_and_cached_each_on_its_own(tiny_base, tmp_path, monkeypatch):
    rng = torch.Generator().manual_seed(3)
    sets = [torch.randint(0, tiny_base.vocab_size, (n, 12), generator=rng) for n in (1, 3, 2)]
    together = features_of_sets(tiny_base, sets, tmp_path, progress=False)
    assert len(list(tmp_path.glob("*.pt"))) == 3
    for chunks, features in zip(sets, together):
        alone = compute_features(extractor_for(tiny_base), chunks, progress=False)
        torch.testing.assert_close(features.hidden.float(), alone.hidden.float(), rtol=0, atol=2e-3)
        assert torch.equal(features.tokens, chunks)
    monkeypatch.setattr(common.data.features, "extractor_for", lambda base: pytest.fail("a cache hit needs no base"))
    again = base_features(tiny_base, sets[1], tmp_path)
    assert torch.equal(again.hidden, together[1].hidden)


@pytest.fixture
def population(tmp_path, tiny_base_dir) -> dict:
    """Two small 'packages' of stdlib code as the users' data, 3 chunks a user."""
    for package, module in (("pkg_a", "json"), ("pkg_b", "email")):
        (tmp_path / "data" / package).mkdir(parents=True)
        for source in sorted((stdlib_dir() / module).glob("*.py"))[:4]:
            (tmp_path / "data" / package / source.name).write_text(source.read_text())
    return {
        "base-model-dir": str(tiny_base_dir),
        "data-source": str(tmp_path / "data"),
        "partitioning": "user",
        "user-chunks": 3,
        "max-chunks-per-client": 3,
        "chunk-len": 32,
        "num-heads": 2,
        "batch-size": 2,
        "num-server-rounds": 1,
        "clients-per-round": 4,
        "min-train-clients": 4,
        "min-available-clients": 8,
        "node-wait-seconds": 0.0,
        "fraction-evaluate": 0.25,
        "client-eval-prompts": 0,
        "server-eval-chunks": 4,
        "eval-prompts": 1,
        "eval-max-new-tokens": 0,
        "dp": False,
        "init-heads": "fresh",
        "run-dir": str(tmp_path / "runs"),
    }


def test_a_population_round_trains_on_cached_features_without_the_base_layers(population, monkeypatch):
    prepared = prepare_population(population, 8, progress=False)
    assert (prepared.users, prepared.train_chunks, prepared.heldout_chunks) == (8, 16, 8)
    loaded = []
    real_load = client.base_cache.load_base
    monkeypatch.setattr(client.base_cache, "load_base", lambda *a, **k: loaded.append(k["body"]) or real_load(*a, **k))
    real_extractor = common.data.features.extractor_for

    def extractor(base):  # the server computes its own evaluation features; a client finds its own cached
        return real_extractor(base) if base.body else pytest.fail("a client computed features it had cached")

    monkeypatch.setattr(common.data.features, "extractor_for", extractor)
    client.base_cache._BASES.clear()
    grid = InProcessGrid(app, 8, population)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=population)
    run_dir = run_federation(grid, context, FedConfig.from_mapping(population))
    record = json.loads((run_dir / "rounds" / "round-1.json").read_text())
    assert record["aggregated"] and record["participation"]["succeeded"] == 4
    assert loaded == [False]  # one base per process, without its layers, for training and evaluation alike
    plan = json.loads((run_dir / "run.json").read_text())["plan"]["secagg"]
    assert plan["cohort"] == 4 and plan["modulus_range"] == 1 << 16


def test_the_population_scenario_is_a_valid_run():
    run_config, federation = scenario_settings(load_scenario("population-1k"), [])
    config = FedConfig.from_mapping(run_config)
    assert config.partitioning == "user" and config.data_source == "private-packages"
    assert federation["num-supernodes"] >= 1000 and config.clients_per_round == 256
    assert np.isclose(config.fraction_evaluate * federation["num-supernodes"], 32)
