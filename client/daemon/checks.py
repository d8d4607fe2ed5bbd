"""Every check `fedla client` makes before it connects: one-line DaemonError on the first problem.

Nothing here touches the network or starts a process; nothing stored is changed (the state folder
is created when missing and probed with a temporary file).
"""

from __future__ import annotations

import os
from pathlib import Path

from client.daemon.options import DaemonError, DaemonOptions, floor_values, parse_node_config
from client.node_config import STATE_DIR_KEY
from common.errors import FedLookaheadError
from common.model.base import resolve_device
from common.paths import default_state_dir


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DaemonError(f"--superlink must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def check_data(folder: Path) -> int:
    """Number of readable, non-empty text files in `folder`; a one-line error when there are none."""
    from common.data.chunks import read_text, text_files

    folder = folder.expanduser()
    if not folder.exists():
        raise DaemonError(f"data folder not found: {folder}")
    if not folder.is_dir():
        raise DaemonError(f"data folder is not a folder: {folder}")
    if not os.access(folder, os.R_OK | os.X_OK):
        raise DaemonError(f"data folder is not readable: {folder}")
    try:
        files = text_files(folder)
    except PermissionError as exc:
        raise DaemonError(f"data folder is not readable: {exc}") from exc
    except FedLookaheadError as exc:
        raise DaemonError(f"data folder has no usable text: {exc}") from exc
    usable, unreadable = 0, 0
    for path in files:
        try:
            text = read_text(path)
        except OSError:
            unreadable += 1
            continue
        if text and text.strip():
            usable += 1
    if not usable:
        detail = f"{unreadable} unreadable, {len(files) - unreadable} empty or binary"
        raise DaemonError(f"data folder has no readable text: {len(files)} file(s) under {folder} ({detail})")
    return usable


def check_base(base: str | Path | None) -> None:
    """A named embedded base (built before joining) or a model folder with a config.json."""
    from common.model.default import NAMED_BASES

    if base is None or str(base) == "" or str(base) in NAMED_BASES:
        return
    if not (Path(base).expanduser() / "config.json").is_file():
        raise DaemonError(f"--base {base} is not a model folder (no config.json) nor one of {', '.join(NAMED_BASES)}")


def check_certificate(path: Path) -> None:
    from cryptography import x509

    if not path.expanduser().is_file():
        raise DaemonError(f"--root-certificates: no such file: {path}")
    try:
        x509.load_pem_x509_certificates(path.expanduser().read_bytes())
    except (ValueError, OSError) as exc:
        raise DaemonError(f"--root-certificates: {path} is not a PEM certificate ({exc})") from exc


def check_auth_key(path: Path) -> str:
    """The key's public half in OpenSSH format (what the operator registers)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if not path.expanduser().is_file():
        raise DaemonError(f"--auth-key: no such file: {path}")
    try:
        key = serialization.load_ssh_private_key(path.expanduser().read_bytes(), password=None)
    except (ValueError, TypeError, OSError) as exc:
        raise DaemonError(f"--auth-key: {path} is not an unencrypted OpenSSH private key ({exc})") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name not in ("secp256r1", "secp384r1", "secp521r1"):
        raise DaemonError(
            f"--auth-key: Flower's node authentication needs an ECDSA key on a NIST curve "
            f"(e.g. `ssh-keygen -t ecdsa -b 384`), {path} is not one"
        )
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def check_device(device: str) -> None:
    """common.model.base.resolve_device's rules (auto | cpu | cuda[:i], CUDA present), as a daemon error."""
    try:
        resolve_device(device)
    except FedLookaheadError as exc:
        raise DaemonError(f"--device: {exc}") from None


def check_state_dir(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise DaemonError(f"state folder {folder} is not writable: {exc}") from exc


def check_privacy(node_config: dict) -> None:
    """The privacy floor is valid and the ledger can be trusted (else the device would decline every round)."""
    from client.training.floor import DeviceFloor
    from client.training.ledger import load_ledger

    try:
        DeviceFloor.from_node_config(node_config)
        load_ledger(Path(node_config[STATE_DIR_KEY]))
    except FedLookaheadError as exc:
        raise DaemonError(str(exc)) from exc


def preflight(opts: DaemonOptions) -> dict:
    """Every check that needs no network; raises DaemonError (one line) on the first problem."""
    parse_address(opts.superlink)
    files = check_data(opts.data)
    check_base(opts.base)
    check_device(opts.device)
    if opts.budget_eps is not None and not opts.budget_eps > 0:
        raise DaemonError(f"--budget-eps must be positive, got {opts.budget_eps}")
    if opts.insecure and (opts.root_certificates or opts.auth_key):
        raise DaemonError(
            "--insecure cannot be combined with --root-certificates or --auth-key (node authentication requires TLS)"
        )
    if opts.root_certificates is not None:
        check_certificate(opts.root_certificates)
    public_key = check_auth_key(opts.auth_key) if opts.auth_key is not None else None
    state_dir = (opts.state_dir or default_state_dir()).expanduser()
    check_state_dir(state_dir)
    extra = parse_node_config(opts.node_config)
    check_privacy({**floor_values(opts), **extra, STATE_DIR_KEY: str(state_dir)})
    return {"data_files": files, "public_key": public_key}
