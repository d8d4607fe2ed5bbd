"""What the commands of every side share: the one-line error exit, the base and dtype options.

A module of its own so that `client.cli` and `server.cli` can import it while `common.cli.app` is still
loading their plug-ins (importing `common.cli.app` from them would be circular).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import NoReturn, Optional

import torch
import typer

from common.errors import FedLookaheadError
from common.model.base import DTYPES as base_dtypes
from common.model.base import BaseModel, Loading


def fail(message: str) -> NoReturn:
    """Print a one-line error and exit non-zero."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


DTYPES = {"auto": None, **base_dtypes, "int8": torch.float32}  # int8: linear layers in int8, the rest fp32
DTYPE_HELP = (
    "auto (fp32 on CPU, bf16/fp16 on CUDA) | fp32 | bf16 | fp16 | int8 (CPU: int8 linear layers, "
    "exact integer products; said when it is not faster than fp32 here). The output is the base's own "
    "greedy output in that format."
)
BENCH_DTYPE_HELP = DTYPE_HELP + " The baselines run on the same weights, and losslessness is judged against them."
BASE_HELP = "Base model: a Hugging Face model directory, or `smollm2` (the default) / `toy` by name."


def base_loading(device: str = "auto", dtype: str = "auto") -> Loading:
    """How the --device and --dtype options load a base (int8 is a CPU option)."""
    if dtype not in DTYPES:
        raise FedLookaheadError(f"unknown --dtype {dtype!r}: use {' | '.join(DTYPES)}")
    int8 = dtype == "int8"
    return Loading("cpu" if int8 and device == "auto" else device, DTYPES[dtype], int8)


def open_base(base: Optional[str], device: str = "auto", dtype: str = "auto") -> BaseModel:
    """The given base (a model directory, or `smollm2` / `toy` by name), else the embedded default. An int8
    base that is slower here than fp32 says so in one line."""
    from common.model.default import resolve_base

    model = base_loading(device, dtype).load(resolve_base(base))
    if model.int8 and (note := model.int8_kernel.slower_than_fp32()):
        typer.echo(f"warning: {note}", err=True)
    return model


def check_output_path(path: Path, kind: str) -> None:
    """Fail before the work starts when its output could not be written."""
    if kind == "dir" and path.exists() and not path.is_dir():
        fail(f"--out {path} exists and is not a directory")
    if kind == "file" and path.is_dir():
        fail(f"--json {path} is a directory, not a file")
    parent = path.parent if kind == "file" or not path.exists() else path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        fail(f"cannot write {path}: {parent} is not a writable directory")


def exit_cleanly_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the daemons this process started are stopped by pid."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
