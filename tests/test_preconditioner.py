"""The public-sgd client optimizer (common/training/preconditioner.py): its public statistics, what the
server sends of them, and the step it takes on a client."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.common import parameters_to_ndarrays
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from client.client_app import train_handler
from client.node_config import NUM_PARTITIONS_KEY, PARTITION_ID_KEY
from common.data.chunks import chunk_files, stdlib_dir, text_files
from common.data.features import base_features
from common.errors import FedLookaheadError
from common.federation.config import FedConfig
from common.federation.protocol import PUBLIC_PRECONDITIONER
from common.federation.records import heads_config_dict, heads_to_ndarrays, wire_shapes
from common.heads.lookahead import DraftHeads
from common.training.preconditioner import (
    PreconditionedSGD,
    Preconditioner,
    public_preconditioner,
    unwhitened,
    whitened,
)


@pytest.fixture(scope="module")
def public(tiny_base):
    chunks = chunk_files(text_files(stdlib_dir() / "json"), tiny_base.tokenizer, 32)[:16]
    return base_features(tiny_base, chunks)


def test_the_preconditioner_is_factored_floored_and_travels_as_bytes(tiny_base, public, one_thread):
    heads = DraftHeads.fresh(tiny_base, 2)
    pre = public_preconditioner(heads, public, batches=8)
    for name, p in heads.named_parameters():  # a row and a column mean per matrix, vectors whole
        assert [f.numel() for f in pre.factors[name]] == (list(p.shape) if p.dim() == 2 else [p.numel()])
    rms = pre.denominators()
    assert all(
        d.shape == p.shape and d.min() >= pre.floor > 0 for (_, p), d in zip(heads.named_parameters(), rms.values())
    )
    back = Preconditioner.from_bytes(pre.to_bytes(), heads)
    assert back.floor == pytest.approx(pre.floor)
    assert all(torch.allclose(back.denominators()[n], d) for n, d in rms.items())
    with pytest.raises(FedLookaheadError, match="does not fit these heads"):
        Preconditioner.from_bytes(pre.to_bytes()[:-8], heads)
    with pytest.raises(FedLookaheadError, match="does not fit these heads"):
        Preconditioner.from_bytes(pre.to_bytes(), DraftHeads.fresh(tiny_base, 3))


def test_updates_travel_in_the_scaled_coordinates_and_come_back_exactly(tiny_base, public, one_thread):
    """A client sends received + update / scale, the server maps the mean back: the identity on one update; the
    scale is smaller where the public rms is larger (less noise there) and ignores the rms's overall size."""
    heads = DraftHeads.fresh(tiny_base, 2)
    pre = public_preconditioner(heads, public, batches=8)
    names = [name for name, _ in heads.named_parameters()]
    scale = pre.update_scale()
    assert [s.shape for s in scale] == [shape for _, shape in wire_shapes(heads)]  # the wire order
    louder = Preconditioner({n: tuple(f * 50 for f in fs) for n, fs in pre.factors.items()}, pre.floor * 50**0.5)
    assert all(np.allclose(a, b, rtol=1e-5) for a, b in zip(scale, louder.update_scale()))
    rms = np.concatenate([pre.denominators()[n].numpy().ravel() for n in names])
    flat = np.concatenate([s.ravel() for s in scale])
    assert flat[rms.argmax()] < 1 < flat[rms.argmin()]
    rng = np.random.default_rng(0)
    received = [rng.normal(size=s.shape).astype(np.float32) for s in scale]
    trained = [r + rng.normal(scale=1e-3, size=r.shape).astype(np.float32) for r in received]
    sent = whitened(received, trained, scale)
    assert all(np.allclose(b, t, atol=1e-6) for b, t in zip(unwhitened(received, sent, scale), trained))


def test_a_step_divides_the_gradient_by_the_public_rms():
    p = torch.nn.Parameter(torch.tensor([1.0, 1.0, 1.0]))
    rms = torch.tensor([1.0, 2.0, 4.0])
    optimizer = PreconditionedSGD([("w", p)], {"w": rms}, lr=0.5)
    p.grad = torch.tensor([4.0, 4.0, 4.0])
    optimizer.step()
    assert torch.allclose(p.detach(), torch.tensor([1 - 2.0, 1 - 1.0, 1 - 0.5]))
    with pytest.raises(FedLookaheadError, match="no entry for w"):
        PreconditionedSGD([("w", p)], {}, lr=0.5)


@pytest.mark.parametrize(
    "overrides, problem",
    [
        ({"dp": True, "dp-level": "example"}, "without per-chunk DP"),
        ({"dp": False, "dp-trainable": "lowrank"}, "lowrank"),
        ({"dp": False, "update-max-norm": 0.0}, "update-max-norm > 0"),
    ],
)
def test_public_sgd_is_refused_where_its_step_has_no_bound_or_no_meaning(overrides, problem):
    with pytest.raises(FedLookaheadError, match=problem):
        FedConfig.from_mapping({"client-optimizer": "public-sgd", "update-max-norm": 0.5, **overrides})


def test_a_client_steps_with_the_preconditioner_the_server_sent(tiny_base, tiny_base_dir, public, one_thread):
    """A larger public rms means a smaller step: the client's update shrinks as the sent rms grows (its scaled
    coordinates do not change with the rms's size), and a public-sgd train config without a preconditioner is
    refused with the reason."""
    run_config = {
        "base-model-dir": str(tiny_base_dir),
        "data-source": str(stdlib_dir() / "json"),
        "chunk-len": 32,
        "max-chunks-per-client": 8,
        "num-heads": 2,
        "batch-size": 4,
        "dp": False,
        "client-optimizer": "public-sgd",
        "update-max-norm": 10.0,
        "lr": 1e-3,
    }
    heads = DraftHeads.fresh(tiny_base, 2)
    pre = public_preconditioner(heads, public, batches=8)
    moves = []
    for scale in (1.0, 100.0):
        scaled = Preconditioner(
            {n: tuple(f * scale for f in fs) for n, fs in pre.factors.items()}, pre.floor * scale**0.5
        )
        context = Context(
            run_id=1,
            node_id=1,
            node_config={PARTITION_ID_KEY: 0, NUM_PARTITIONS_KEY: 1},
            state=RecordDict(),
            run_config=run_config,
        )
        fit_config = {
            **heads_config_dict(heads),
            "fedla-run-id": "r",
            KEY_CLIPPING_NORM: 10.0,
            PUBLIC_PRECONDITIONER: scaled.to_bytes(),
        }
        sent = parameters_to_ndarrays(train_handler(fit_config, heads_to_ndarrays(heads), context).parameters)
        moves.append(sum(float(((a - b) ** 2).sum()) for a, b in zip(sent, heads_to_ndarrays(heads))) ** 0.5)
    assert moves[0] > 0 and moves[1] == pytest.approx(moves[0] / 10, rel=0.05)  # rms x10: a tenth of the step
    fit_config.pop(PUBLIC_PRECONDITIONER)
    with pytest.raises(FedLookaheadError, match="no public preconditioner"):
        train_handler(fit_config, heads_to_ndarrays(heads), context)
