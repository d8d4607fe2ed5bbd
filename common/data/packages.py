"""Third-party code on this machine, split by rule into public training data, held-out benchmark code
and the simulations' private users.

The packages are the top-level Python packages installed in this environment's site-packages with at
least MIN_SOURCE_BYTES of source (test folders excluded). Each belongs to exactly one split:

- private: PRIVATE_PACKAGES, the users' code in the federated simulations (never public, never a
  benchmark);
- heldout: the rest whose name hashes (crc32) into bucket 0 of HELDOUT_BUCKETS, the third-party
  benchmark set no training path reads (`fedla bench-decode`'s default);
- public: all others, which `fedla train-heads` adds to the stdlib's training split (public_chunks).

The rule hashes names, so a package keeps its split on every machine that installs it; which packages
a split holds depends on what is installed (the JSON of a benchmark lists them).
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from common.data.chunks import chunk_files, drawn_chunks, stdlib_files
from common.errors import FedLookaheadError

PRIVATE_PACKAGES = (
    "click",
    "attr",
    "requests",
    "yaml",
    "httpx",
    "dateutil",
    "urllib3",
    "pyparsing",
    "anyio",
    "starlette",
    "markdown_it",
    "tqdm",
)
SPLITS = ("public", "heldout", "private")
HELDOUT_BUCKETS = 10
MIN_SOURCE_BYTES = 100_000  # smaller packages are mostly stubs and re-exports
EXCLUDED_PARTS = {"tests", "test", "testing", "__pycache__", "_vendor", "vendor"}
# This project's own code is neither public data nor a benchmark of itself.
OWN_PACKAGES = {"client", "common", "server", "simulations"}


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def package_sources(name: str, root: Path | None = None) -> list[Path]:
    """The package's .py files, sorted, without its tests and vendored copies."""
    folder = (root or site_packages()) / name
    return sorted(
        path for path in folder.rglob("*.py") if not EXCLUDED_PARTS.intersection(path.relative_to(folder).parts)
    )


def split_of(name: str) -> str:
    """The split a package belongs to, by name alone (see the module docstring)."""
    if name in PRIVATE_PACKAGES:
        return "private"
    return "heldout" if zlib.crc32(name.encode()) % HELDOUT_BUCKETS == 0 else "public"


def installed_packages(root: Path | None = None) -> list[str]:
    """Top-level packages in site-packages with at least MIN_SOURCE_BYTES of source, sorted by name."""
    root = root or site_packages()
    names = []
    for folder in sorted(root.iterdir()):
        if folder.name.startswith("_") or folder.name in OWN_PACKAGES or not (folder / "__init__.py").is_file():
            continue
        if sum(path.stat().st_size for path in package_sources(folder.name, root)) >= MIN_SOURCE_BYTES:
            names.append(folder.name)
    return names


def packages(split: str, root: Path | None = None) -> list[str]:
    """The installed packages of one split."""
    if split not in SPLITS:
        raise FedLookaheadError(f"unknown package split {split!r}: use {', '.join(SPLITS)}")
    return [name for name in installed_packages(root) if split_of(name) == split]


def interleaved_sources(names: list[str], root: Path | None = None) -> list[Path]:
    """The packages' sources, one file of each package in turn, so that any prefix of the list (a
    benchmark's first N prompts, a training budget's first N chunks) spreads over every package rather
    than exhausting the first one alphabetically."""
    queues = [package_sources(name, root) for name in names]
    files: list[Path] = []
    for rank in range(max((len(queue) for queue in queues), default=0)):
        files.extend(queue[rank] for queue in queues if rank < len(queue))
    if not files:
        raise FedLookaheadError(f"no installed package sources for {', '.join(names) or 'an empty package list'}")
    return files


BENCHMARK_SETS = ("third-party", "stdlib")


def benchmark_set(name: str) -> tuple[list[Path], dict]:
    """A held-out benchmark set's files, and its description for a benchmark's JSON (name, rule, what it
    holds). "third-party": the held-out installed packages; "stdlib": the standard library's held-out split."""
    if name == "third-party":
        names = packages("heldout")
        if not names:
            raise FedLookaheadError("no installed package falls in the held-out split: use --set stdlib or --data")
        rule = (
            f"installed top-level packages with >= {MIN_SOURCE_BYTES // 1000} KB of source (tests excluded) whose "
            f"name's crc32 % {HELDOUT_BUCKETS} == 0, minus the simulations' private packages; no training path reads them"
        )
        return interleaved_sources(names), {"name": "third-party held-out", "rule": rule, "packages": names}
    if name == "stdlib":
        rule = "the standard library's held-out split (crc32 of the top-level name), which no training path reads"
        return stdlib_files("heldout"), {"name": "stdlib held-out", "rule": rule}
    raise FedLookaheadError(f"unknown benchmark set {name!r}: use {', '.join(BENCHMARK_SETS)}")


PUBLIC_SOURCES = ("stdlib", "stdlib+packages")
PACKAGE_FILES_PER_BATCH = 64  # tokenise public package files this many at a time, until enough chunks are in hand


def public_chunks(
    sources: str, tokenizer: PreTrainedTokenizerBase, chunk_len: int, count: int, generator: torch.Generator
) -> torch.Tensor:
    """`count` public training chunks drawn with `generator` (0: every chunk of the stdlib's train split, and
    as many from the packages).

    "stdlib": the standard library's train split. "stdlib+packages": half the chunks from it, half from the
    public installed packages (the split no benchmark holds out and no simulation treats as private), read
    one package's file at a time in turn so every package contributes and torch's size does not dominate.
    Files are tokenised only until twice the chunks needed are in hand, and the chunks drawn from those."""
    if sources not in PUBLIC_SOURCES:
        raise FedLookaheadError(f"unknown public sources {sources!r}: use {', '.join(PUBLIC_SOURCES)}")

    def draw(files: list[Path], need: int | None) -> torch.Tensor:
        if need is not None:
            return drawn_chunks(files, tokenizer, chunk_len, need, generator, PACKAGE_FILES_PER_BATCH)
        pool = chunk_files(files, tokenizer, chunk_len)
        return pool[torch.randperm(len(pool), generator=generator)]

    stdlib = stdlib_files("train")
    stdlib = [stdlib[i] for i in torch.randperm(len(stdlib), generator=generator).tolist()]
    if sources == "stdlib":
        return draw(stdlib, count or None)
    from_stdlib = draw(stdlib, count // 2 if count else None)
    from_packages = draw(interleaved_sources(packages("public")), count - count // 2 if count else len(from_stdlib))
    return torch.cat([from_stdlib, from_packages])
