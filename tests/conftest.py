"""Tiny models built in seconds: tests never depend on the embedded default base."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from common.data.chunks import read_text, stdlib_dir, stdlib_files
from common.decoding import calibration
from common.decoding.calibration import CostCurve, calibration_key
from common.model.base import BaseModel, load_base
from common.model.default import train_tokenizer

TINY_VOCAB = 512
LOOPBACK_URL = "http://127.0.0.1"  # TestClient's default Host, "testserver", is not loopback: refused


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files with the longest tests first (`slow(minutes=N)`): `make test` runs files on two workers
    (pytest-xdist, --dist loadfile --no-loadscope-reorder), and the minutes-long deployment test must be
    the first one started, not the last."""
    minutes: dict[Path, float] = {}
    for item in items:
        if marker := item.get_closest_marker("slow"):
            minutes[item.path] = max(minutes.get(item.path, 0.0), marker.kwargs.get("minutes", 1.0))
    items.sort(key=lambda item: -minutes.get(item.path, 0.0))  # stable: order within a file is kept


@pytest.fixture(scope="session", autouse=True)
def private_fedla_home(tmp_path_factory):
    """Caches the code writes (cost curves, features, chunks) go to a temporary FedLookahead home."""
    import os

    previous = os.environ.get("FEDLA_HOME")
    os.environ["FEDLA_HOME"] = str(tmp_path_factory.mktemp("fedla-home"))
    yield
    if previous is None:
        os.environ.pop("FEDLA_HOME", None)
    else:
        os.environ["FEDLA_HOME"] = previous


# A verify cost curve shaped like the 2-core CPU's fp32 one (3 tokens cost about what 1 does, 8 cost 1.6x).
CPU_LIKE_CURVE = CostCurve(
    (1, 2, 3, 4, 8, 16, 64), (1.0, 1.03, 1.06, 1.3, 1.6, 2.4, 7.0), (0.25, 0.26, 0.26, 0.3, 0.4, 0.6, 2.0)
)


@pytest.fixture(autouse=True)
def synthetic_cost_curve(request, monkeypatch):
    """Trees are priced with CPU_LIKE_CURVE, not with this machine's timings, so that what a decoding test
    asserts does not depend on the CPU it runs on. Tests of the measurement itself are marked
    `measured_cost_curve`."""
    if request.node.get_closest_marker("measured_cost_curve") is None:
        monkeypatch.setattr(
            calibration,
            "measure_cost_curve",
            lambda base, *args, **kwargs: dataclasses.replace(CPU_LIKE_CURVE, key=calibration_key(base)),
        )


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models decode fastest on one thread, and far faster than two on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    texts = [t for t in map(read_text, stdlib_files("train")[:40]) if t]
    return train_tokenizer(texts, TINY_VOCAB)


def save_tiny(directory: Path, tokenizer, arch: str = "llama", seed: int = 0) -> Path:
    """A randomly initialised tiny causal LM of the given architecture, saved with its tokenizer."""
    torch.manual_seed(seed)
    common = dict(vocab_size=TINY_VOCAB, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if arch == "llama":
        model = LlamaForCausalLM(
            LlamaConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=512,
                tie_word_embeddings=True,
                **common,
            )
        )
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(
            Qwen2Config(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=512,
                **common,
            )
        )
    elif arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common))
    else:
        raise ValueError(arch)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"), tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_base(tiny_base_dir) -> BaseModel:
    return load_base(tiny_base_dir, device="cpu")


@pytest.fixture
def run_config(tiny_base_dir, tmp_path):
    """A 1-round federation of the tiny base over stdlib json code, small enough for tests of the real loop."""
    return {
        "base-model-dir": str(tiny_base_dir),
        "data-source": str(stdlib_dir() / "json"),
        "num-server-rounds": 1,
        "chunk-len": 32,
        "max-chunks-per-client": 12,
        "num-heads": 2,
        "batch-size": 4,
        "lr": 0.01,
        "min-train-clients": 3,
        "min-available-clients": 3,
        "node-wait-seconds": 0.0,
        "server-eval-chunks": 8,
        "eval-prompts": 1,
        "eval-max-new-tokens": 0,
        "fraction-evaluate": 0.5,
        "run-dir": str(tmp_path / "runs"),
        "init-heads": "fresh",
    }
