"""Text corpora and fixed-length token chunks (one chunk = one privacy unit for DP-SGD)."""

from __future__ import annotations

import logging
import sysconfig
import zlib
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from common.errors import FedLookaheadError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = {
    ".py",
    ".txt",
    ".md",
    ".rst",
    ".c",
    ".h",
    ".js",
    ".ts",
    ".java",
    ".go",
    ".rs",
    ".json",
    ".toml",
    ".cfg",
}
# Parts of the standard library that are test suites or vendored data rather than ordinary code.
STDLIB_EXCLUDED = {"site-packages", "test", "tests", "idle_test", "__pycache__", "config-3.11-x86_64-linux-gnu"}
HELDOUT_BUCKETS = 10  # one top-level stdlib name in ten is held out for evaluation


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(split: str = "train") -> list[Path]:
    """Python standard-library sources, split by top-level package/module so held-out code is unseen.

    `split` is "train", "heldout" or "all". The split hashes the top-level name (crc32), so it is the
    same on every machine with the same Python version.
    """
    if split not in ("train", "heldout", "all"):
        raise FedLookaheadError(f"unknown split {split!r}: use train, heldout or all")
    root = stdlib_dir()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if STDLIB_EXCLUDED.intersection(relative.parts):
            continue
        top = relative.parts[0].removesuffix(".py")
        heldout = zlib.crc32(top.encode()) % HELDOUT_BUCKETS == 0
        if split == "all" or (split == "heldout") == heldout:
            files.append(path)
    return files


def text_files(directory: str | Path) -> list[Path]:
    """Every file under `directory` with a text-like suffix, sorted for determinism."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise FedLookaheadError(f"data directory not found: {directory}")
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise FedLookaheadError(f"no text files ({', '.join(sorted(TEXT_SUFFIXES))}) under {directory}")
    return files


def read_text(path: Path) -> str | None:
    """The file's text, or None for binary or undecodable files."""
    raw = path.read_bytes()
    if b"\x00" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def chunk_files(files: list[Path], tokenizer: PreTrainedTokenizerBase, chunk_len: int) -> torch.Tensor:
    """Tokenize each file and cut it into non-overlapping chunks of `chunk_len` tokens.

    Chunks never cross files, so each one is a piece of a single document: the unit DP-SGD protects.
    Empty, binary and too-short files are skipped, with one warning that names them.
    """
    if chunk_len < 2:
        raise FedLookaheadError(f"chunk length must be at least 2 tokens, got {chunk_len}")
    chunks: list[torch.Tensor] = []
    skipped: dict[str, list[str]] = {"empty": [], "binary": [], "shorter than a chunk": []}
    for path in files:
        text = read_text(path)
        if text is None:
            skipped["binary"].append(path.name)
            continue
        if not text.strip():
            skipped["empty"].append(path.name)
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < chunk_len:
            skipped["shorter than a chunk"].append(path.name)
            continue
        usable = len(ids) - len(ids) % chunk_len
        chunks.extend(torch.tensor(ids[:usable], dtype=torch.long).view(-1, chunk_len))
    for reason, names in skipped.items():
        if names:
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            log.warning("skipped %d %s file(s): %s", len(names), reason, shown)
    if not chunks:
        return torch.empty(0, chunk_len, dtype=torch.long)
    return torch.stack(chunks)


def first_chunks(
    files: list[Path], tokenizer: PreTrainedTokenizerBase, chunk_len: int, count: int, files_per_batch: int
) -> torch.Tensor:
    """`chunk_files` over `files` in order, `files_per_batch` files at a time, stopping once at least `count`
    chunks are in hand (all of them if the files run out): a sample of a large split without tokenizing all
    of it."""
    chunks = torch.empty(0, chunk_len, dtype=torch.long)
    for start in range(0, len(files), files_per_batch):
        chunks = torch.cat([chunks, chunk_files(files[start : start + files_per_batch], tokenizer, chunk_len)])
        if len(chunks) >= count:
            break
    return chunks


def drawn_chunks(
    files: list[Path],
    tokenizer: PreTrainedTokenizerBase,
    chunk_len: int,
    count: int,
    generator: torch.Generator,
    files_per_batch: int,
) -> torch.Tensor:
    """`count` chunks drawn with `generator` from the first twice-as-many chunks of `files` (in their order):
    a seeded sample of a large set of files without tokenizing all of them."""
    pool = first_chunks(files, tokenizer, chunk_len, 2 * count, files_per_batch)
    return pool[torch.randperm(len(pool), generator=generator)[:count]]


def load_chunks(directory: str | Path, tokenizer: PreTrainedTokenizerBase, chunk_len: int) -> torch.Tensor:
    """All chunks of the text files under `directory`; an error if there are none."""
    chunks = chunk_files(text_files(directory), tokenizer, chunk_len)
    if len(chunks) == 0:
        raise FedLookaheadError(f"no file under {directory} is at least {chunk_len} tokens long")
    return chunks


def prompt_sources(
    files: list[Path], tokenizer: PreTrainedTokenizerBase, count: int, prompt_tokens: int
) -> list[tuple[Path, torch.Tensor]]:
    """`count` prompts with the file each comes from: the first `prompt_tokens` tokens of files (or of
    successive chunks of long files). A file gives a prompt only with room for twice as many tokens."""
    prompts: list[tuple[Path, torch.Tensor]] = []
    per_file = max(1, -(-count // max(1, len(files))))
    for path in files:
        text = read_text(path)
        if not text:
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        stride = max(prompt_tokens * 4, len(ids) // per_file)
        for start in range(0, len(ids) - prompt_tokens * 2, stride)[:per_file]:
            prompts.append((path, torch.tensor(ids[start : start + prompt_tokens], dtype=torch.long)))
            if len(prompts) == count:
                return prompts
    return prompts


def prompts_from_files(
    files: list[Path], tokenizer: PreTrainedTokenizerBase, count: int, prompt_tokens: int
) -> list[torch.Tensor]:
    """The prompts of `prompt_sources`, without their files."""
    return [prompt for _, prompt in prompt_sources(files, tokenizer, count, prompt_tokens)]
