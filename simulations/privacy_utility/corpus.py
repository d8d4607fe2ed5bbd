"""The clients' private data: third-party package sources (site-packages) split by package, and each
client's train / validation / test features as its ClientApp sees them."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from client.node_config import NUM_PARTITIONS_KEY, PARTITION_ID_KEY
from common.data.packages import package_sources, site_packages


def private_corpus(packages: tuple[str, ...], max_files: int, root: Path) -> Path:
    """A folder with one sub-folder per package holding its .py sources (copied once, then reused)."""
    tag = f"{'-'.join(packages)}-{max_files}-no-tests"
    import hashlib

    folder = root / f"private-{hashlib.sha256(tag.encode()).hexdigest()[:12]}"
    if (folder / ".complete").exists():
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    source = site_packages()
    for package in packages:
        files = package_sources(package)
        if max_files:
            files = sorted(files, key=lambda p: (-p.stat().st_size, str(p)))[:max_files]
        for path in files:
            target = folder / package / path.relative_to(source / package)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    (folder / ".complete").write_text("\n".join(packages))
    return folder


@dataclass
class ClientSplit:
    train: object  # Features
    val: object
    test: object


def client_splits(run_config: dict, base, clients: int) -> list[ClientSplit]:
    """Each client's train chunks and held-out chunks (as the ClientApp sees them), with base features."""
    from client.local_data import client_data, client_features
    from common.federation.config import FedConfig

    config = FedConfig.from_mapping(run_config)
    splits = []
    for partition in range(clients):
        node_config = {PARTITION_ID_KEY: partition, NUM_PARTITIONS_KEY: clients}
        data = client_data(config, base, node_config)
        train = client_features(config, base, data.train, node_config)
        heldout = client_features(config, base, data.heldout, node_config)
        half = len(heldout) // 2
        splits.append(ClientSplit(train, heldout.subset(slice(0, half)), heldout.subset(slice(half, None))))
    return splits
