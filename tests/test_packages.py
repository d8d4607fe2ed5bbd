"""The third-party package splits: the rule, the benchmark set and the public training chunks."""

from __future__ import annotations

import itertools

import pytest
import torch

from common.data import packages as pk
from common.data.chunks import chunk_files
from common.errors import FedLookaheadError


def name_in(split: str) -> str:
    return next(n for n in (f"pkg{i}" for i in itertools.count()) if pk.split_of(n) == split)


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site-packages with one public and one held-out package, a private one, and ones the rule skips."""
    public, heldout = name_in("public"), name_in("heldout")
    for name, line in [(public, "public_value = 1\n"), (heldout, "held_out = 2\n"), ("click", "private = 3\n")]:
        for module in ("__init__", "a", "b"):
            (tmp_path / name).mkdir(exist_ok=True)
            (tmp_path / name / f"{module}.py").write_text(line * (pk.MIN_SOURCE_BYTES // len(line) // 2))
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "__init__.py").write_text("x = 1\n")  # too little source
    (tmp_path / "_hidden").mkdir()
    (tmp_path / "_hidden" / "__init__.py").write_text("y = 2\n" * 50_000)
    (tmp_path / "tested" / "tests").mkdir(parents=True)
    (tmp_path / "tested" / "__init__.py").write_text("")
    (tmp_path / "tested" / "tests" / "test_x.py").write_text("z = 3\n" * 50_000)  # tests do not count
    monkeypatch.setattr(pk, "site_packages", lambda: tmp_path)
    return public, heldout


def test_packages_split_by_rule_and_the_benchmark_set_lists_them(site):
    public, heldout = site
    assert pk.installed_packages() == sorted([public, heldout, "click"])
    assert pk.packages("public") == [public] and pk.packages("heldout") == [heldout]
    assert pk.packages("private") == ["click"]
    files, described = pk.benchmark_set("third-party")
    assert described["packages"] == [heldout] and {f.parent.name for f in files} == {heldout}
    assert "crc32" in described["rule"]
    files, described = pk.benchmark_set("stdlib")
    assert described["name"] == "stdlib held-out" and files
    with pytest.raises(FedLookaheadError, match="unknown benchmark set"):
        pk.benchmark_set("mine")


def test_interleaved_sources_take_one_file_of_each_package_in_turn(site):
    public, heldout = site
    files = pk.interleaved_sources([heldout, public])
    assert [f.parent.name for f in files] == [heldout, public] * 3


def test_public_chunks_are_half_stdlib_half_public_packages(site, tiny_tokenizer):
    public, _ = site
    chunks = pk.public_chunks("stdlib+packages", tiny_tokenizer, 32, 10, torch.Generator().manual_seed(0))
    assert chunks.shape == (10, 32)
    package_rows = {tuple(row) for row in chunk_files(pk.package_sources(public), tiny_tokenizer, 32).tolist()}
    assert [tuple(row) in package_rows for row in chunks.tolist()] == [False] * 5 + [True] * 5
    again = pk.public_chunks("stdlib+packages", tiny_tokenizer, 32, 10, torch.Generator().manual_seed(0))
    assert torch.equal(chunks, again)  # seeded
    stdlib_only = pk.public_chunks("stdlib", tiny_tokenizer, 32, 10, torch.Generator().manual_seed(0))
    assert not any(tuple(row) in package_rows for row in stdlib_only.tolist())
    with pytest.raises(FedLookaheadError, match="unknown public sources"):
        pk.public_chunks("web", tiny_tokenizer, 32, 10, torch.Generator())
