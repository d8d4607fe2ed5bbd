"""The device's settings as Flower node config: written to <state>/node-config.toml and passed to
`flower-supernode --node-config <file>`; every ClientApp of a run reads them (client.client_app).

    data-dir           the device's private text folder (client.local_data reads it instead of a partition)
    state-dir          the device's state folder (client.state): ledger, heads, chunks, features
    heads-dir          where the newest global heads are also published for `fedla generate`
    device             auto | cpu | cuda (FedConfig's `device`, overriding the run config)
    base-model-dir     the device's base, prepared before joining (client.daemon.readiness)
    budget-epsilon, max-dp-delta, max-dp-grad-norm, min-dp-noise-multiplier
                       the device's privacy floor (client.training.floor.DeviceFloor): a run config can only
                       make it stricter
"""

from __future__ import annotations

from pathlib import Path

from client.daemon.checks import parse_node_config
from client.daemon.options import DaemonOptions
from client.state import StateDir
from common.procs import toml_value


def floor_values(opts: DaemonOptions) -> dict:
    """This device's privacy floor as node config keys (client.training.floor.DeviceFloor; unset options: its defaults)."""
    from client.training.floor import (
        BUDGET_KEY,
        MAX_DELTA_KEY,
        MAX_GRAD_NORM_KEY,
        MIN_CHUNK_LEN_KEY,
        MIN_NOISE_KEY,
        DeviceFloor,
    )

    defaults = DeviceFloor(Path("."))
    chosen = {
        BUDGET_KEY: (opts.budget_eps, defaults.budget_epsilon),
        MAX_DELTA_KEY: (opts.max_delta, defaults.delta),
        MAX_GRAD_NORM_KEY: (opts.max_grad_norm, defaults.max_grad_norm),
        MIN_NOISE_KEY: (opts.min_noise_multiplier, defaults.min_noise_multiplier),
    }
    values = {key: float(default if value is None else value) for key, (value, default) in chosen.items()}
    values[MIN_CHUNK_LEN_KEY] = int(defaults.min_chunk_len if opts.min_chunk_len is None else opts.min_chunk_len)
    return values


def node_config_values(opts: DaemonOptions, state_dir: Path, base_dir: Path | None = None) -> dict:
    """The node config of this device; `base_dir` is the prepared base (else --base when it is a folder)."""
    from common.model.default import NAMED_BASES

    if base_dir is None and opts.base is not None and str(opts.base) not in ("", *NAMED_BASES):
        base_dir = Path(opts.base)
    values: dict = {
        "data-dir": str(opts.data.expanduser().resolve()),
        "state-dir": str(state_dir.expanduser().resolve()),
        "device": opts.device,
        "base-model-dir": str(base_dir.expanduser().resolve()) if base_dir is not None else "",
    }
    if opts.publish_heads:
        if opts.heads_dir is None:
            from common.decoding import default_heads_dir

            values["heads-dir"] = str(default_heads_dir().resolve())
        else:
            values["heads-dir"] = str(opts.heads_dir.expanduser().resolve())
    values.update(floor_values(opts))
    values.update(parse_node_config(opts.node_config))
    return values


def write_node_config(path: Path, values: dict) -> Path:
    path.write_text("".join(f"{key} = {toml_value(value)}\n" for key, value in values.items()))
    return path


def read_node_config(state_dir: Path) -> dict:
    """The node config the daemon last wrote in `state_dir` ({} when none or unreadable)."""
    import tomllib

    try:
        return tomllib.loads(StateDir(state_dir).node_config.read_text())
    except (OSError, ValueError):
        return {}
