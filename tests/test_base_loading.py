"""A broken base checkpoint is named in one line (FedLookaheadError) before transformers allocates the model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from common.errors import FedLookaheadError
from common.model.base import load_base


@pytest.fixture()
def broken_copy(tmp_path, tiny_base_dir, monkeypatch) -> Path:
    """A copy of the tiny base to break; building the model from it would fail the test."""

    def never(*_args, **_kwargs):
        raise AssertionError("the model was allocated before the broken file was found")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", never)
    return Path(shutil.copytree(tiny_base_dir, tmp_path / "base"))


def _one_line_naming(caught: pytest.ExceptionInfo, path: Path) -> None:
    message = str(caught.value)
    assert "\n" not in message and str(path) in message


def test_truncated_weights_are_named(broken_copy):
    weights = broken_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # an interrupted download or copy
    with pytest.raises(FedLookaheadError, match="truncated or corrupt weight file") as caught:
        load_base(broken_copy, device="cpu")
    _one_line_naming(caught, weights)


@pytest.mark.parametrize(
    "text",
    ['{"model_type": "llama", "hidden_size": 64,', '["not", "a", "config"]', '{"hidden_size": 64}'],
    ids=["cut-json", "not-an-object", "no-model-type"],
)
def test_broken_config_is_named(broken_copy, text):
    config = broken_copy / "config.json"
    config.write_text(text)
    with pytest.raises(FedLookaheadError, match="broken model config") as caught:
        load_base(broken_copy, device="cpu")
    _one_line_naming(caught, config)
