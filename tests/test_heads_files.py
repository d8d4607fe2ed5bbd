"""Hostile or broken heads files: one-line errors, before any large allocation."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from common.cli.app import app
from common.errors import FedLookaheadError
from common.heads.lookahead import CONFIG_FILE, WEIGHTS_FILE, DraftHeads


@pytest.fixture()
def saved(tmp_path, tiny_base):
    return DraftHeads.fresh(tiny_base, 2, draft_vocab=list(range(0, 64))).save(tmp_path / "heads")


def _config(folder) -> dict:
    return json.loads((folder / CONFIG_FILE).read_text())


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_damaged_weights_file(saved, tiny_base, damage):
    path = saved / WEIGHTS_FILE
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x00garbage" * 100, "empty": b""}[damage])
    with pytest.raises(FedLookaheadError, match="damaged heads file") as info:
        DraftHeads.load(saved, tiny_base)
    assert "\n" not in str(info.value)


def test_weights_with_wrong_names_or_shapes(saved, tiny_base):
    state = DraftHeads.load(saved, tiny_base).state_dict()
    save_file(
        {k: (torch.zeros(3, 3) if k == "fusion.proj.weight" else v.contiguous()) for k, v in state.items()},
        saved / WEIGHTS_FILE,
    )
    with pytest.raises(FedLookaheadError, match="fusion.proj.weight has shape"):
        DraftHeads.load(saved, tiny_base)
    save_file({"other": torch.zeros(1)}, saved / WEIGHTS_FILE)
    with pytest.raises(FedLookaheadError, match="mismatched heads: missing"):
        DraftHeads.load(saved, tiny_base)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: "{not json", "not valid JSON"),
        (lambda c: json.dumps([1, 2]), "expected a JSON object"),
        (lambda c: json.dumps({k: v for k, v in c.items() if k != "num_heads"}), "missing \\['num_heads'\\]"),
        (lambda c: json.dumps(dict(c, num_heads="4")), "num_heads must be an integer"),
        (lambda c: json.dumps(dict(c, num_heads=100_000_000)), "num_heads must be in 1..16"),
        (lambda c: json.dumps(dict(c, arch="transformer")), "arch must be one of"),
        (lambda c: json.dumps(dict(c, draft_vocab=[1, 1])), "draft_vocab needs distinct ids"),
        (lambda c: json.dumps(dict(c, draft_vocab=[10**9])), "draft_vocab needs distinct ids"),
        (lambda c: json.dumps(dict(c, surprise=1)), "unknown \\['surprise'\\]"),
        (lambda c: json.dumps(dict(c, hidden_size=10**6)), "which does not fit base"),
    ],
)
def test_bad_config_is_one_line_and_fast(saved, tiny_base, edit, message):
    (saved / CONFIG_FILE).write_text(edit(_config(saved)))
    started = time.perf_counter()
    with pytest.raises(FedLookaheadError, match=message) as info:
        DraftHeads.load(saved, tiny_base)
    assert time.perf_counter() - started < 5  # refused before allocating anything large
    assert "\n" not in str(info.value)


def test_generate_with_broken_heads_is_one_line(saved, tiny_base_dir):
    (saved / CONFIG_FILE).write_text(json.dumps(dict(_config(saved), num_heads=100_000_000)))
    result = CliRunner().invoke(
        app,
        [
            "generate",
            "--prompt",
            "def f(",
            "--base",
            str(tiny_base_dir),
            "--heads",
            str(saved),
            "--device",
            "cpu",
            "--max-new-tokens",
            "4",
        ],
    )
    assert result.exit_code == 2 and result.output.strip().count("\n") == 0 and "num_heads" in result.output
