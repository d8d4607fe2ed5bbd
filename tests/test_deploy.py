"""Deployment: `fedla server` (SuperLink with TLS + SuperNode authentication) and `fedla client` daemons.

The end-to-end test runs everything as real processes on loopback: one SuperLink, three device
daemons (each a Flower SuperNode running the FedLookahead ClientApp), two rounds of SecAgg+ with
Opacus DP on a tiny model. During round 1 one daemon is killed (SIGKILL) in the middle of its local
training, after the SecAgg+ key exchange: the round completes from the other two (3 clients,
shares 3, threshold 2: one dropout tolerated) and the daemon is started again for round 2. Another
device has a privacy budget that round 2 would exceed: it stays connected and declines. A fourth
node whose key was never registered is refused; a device that trusts another CA is refused. In the
end every daemon holds the same global heads, version 2, byte-identical to the server's checkpoint,
and `fedla generate` picks them up by default. Then the SuperLink restarts and the daemons reconnect.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client.daemon import (
    EXIT_BAD_INPUT,
    EXIT_REFUSED,
    EXIT_TLS,
    EXIT_UNREACHABLE,
    DaemonError,
    DaemonOptions,
    RoundLogger,
    check_auth_key,
    node_config_values,
    preflight,
)
from client.kept_heads import keep_global_heads, latest_heads
from client.node_config import (
    BUDGET_KEY,
    DATA_DIR_KEY,
    HEADS_DIR_KEY,
    MAX_DELTA_KEY,
    MAX_GRAD_NORM_KEY,
    MIN_NOISE_KEY,
    STATE_DIR_KEY,
)
from common.data.chunks import stdlib_dir
from common.procs import alive, descendants, free_port, start_time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # simulations/ is a folder of scripts
from simulations.make_certs import make_certs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FEDLA = str(Path(sys.executable).parent / "fedla")

pytestmark = pytest.mark.skipif(
    shutil.which("flower-supernode", path=os.path.dirname(sys.executable)) is None,
    reason="flower-supernode is not installed in this environment",
)


# ------------------------------------------------------------------------------------------ helpers


def device_data(folder: Path, package: str, files: int = 4) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for source in sorted((stdlib_dir() / package).glob("*.py"))[:files]:
        shutil.copy(source, folder / source.name)
    return folder


class Procs:
    """Every process a test starts, with every descendant seen; all terminated by pid at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[subprocess.Popen] = []
        self.seen: dict[int, int] = {}  # pid -> start time (pids get recycled)

    def start(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        out = open(self.root / f"{name}.out", "w")  # noqa: SIM115 - the child owns it
        err = open(self.root / f"{name}.err", "w")  # noqa: SIM115
        process = subprocess.Popen(args, stdout=out, stderr=err, env={**os.environ, **(env or {})}, cwd=self.root)
        out.close()
        err.close()
        process.name = name  # type: ignore[attr-defined]
        self.started.append(process)
        return process

    def note(self) -> None:
        for process in self.started:
            if process.poll() is None:
                for pid in descendants(process.pid):
                    if (started := start_time(pid)) is not None:
                        self.seen.setdefault(pid, started)

    def out(self, name: str) -> str:
        return (self.root / f"{name}.out").read_text() + (self.root / f"{name}.err").read_text()

    def wait_for(self, predicate, timeout: float, what: str, poll: float = 0.5, note: bool = True):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if note:
                self.note()
            value = predicate()
            if value:
                return value
            time.sleep(poll)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n" + self.summary())

    def summary(self) -> str:
        parts = []
        for process in self.started:
            text = self.out(process.name)  # type: ignore[attr-defined]
            parts.append(f"--- {process.name} (rc {process.poll()}):\n{text[-2500:]}")
        return "\n".join(parts)

    def stop(self, process: subprocess.Popen, timeout: float = 60) -> int:
        self.note()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()

    def close(self) -> list[int]:
        """Terminate whatever is left (by pid); returns the pids that were still alive."""
        self.note()
        leftovers = [p.pid for p in self.started if p.poll() is None] + [
            pid for pid, started in self.seen.items() if alive(pid) and start_time(pid) == started
        ]
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for process in self.started:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        return leftovers


def events(state: Path) -> list[dict]:
    path = state / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------ fast tests


def test_make_certs_gives_flower_compatible_files(tmp_path):
    from cryptography import x509
    from flwr.cli.supernode.register import try_load_public_key

    out = make_certs(tmp_path / "certs", nodes=2, sans=["10.0.0.7", "link.example"])
    cert = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} >= {"127.0.0.1", "10.0.0.7"}
    assert set(san.get_values_for_type(x509.DNSName)) >= {"localhost", "link.example"}
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    assert check_auth_key(out / "node-1").startswith("ecdsa-sha2-nistp384 ")
    assert try_load_public_key(out / "node-2.pub")  # what `flwr supernode register` accepts
    assert oct((out / "node-1").stat().st_mode & 0o777) == "0o600"


def test_daemon_checks_input_before_connecting(tmp_path):
    certs = make_certs(tmp_path / "certs", nodes=1)
    good = device_data(tmp_path / "data", "json")
    empty = tmp_path / "empty"
    empty.mkdir()
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "blob.py").write_bytes(b"\x00\x01\x02")
    (binary / "empty.txt").write_text("  \n")
    base = dict(
        superlink="127.0.0.1:9092",
        root_certificates=certs / "ca.crt",
        auth_key=certs / "node-1",
        state_dir=tmp_path / "state",
    )
    assert preflight(DaemonOptions(data=good, **base))["data_files"] == 4
    cases = {
        "data folder not found": DaemonOptions(data=tmp_path / "missing", **base),
        "no usable text": DaemonOptions(data=empty, **base),
        "no readable text": DaemonOptions(data=binary, **base),
        "--superlink must be HOST:PORT": DaemonOptions(**{**base, "superlink": "localhost"}, data=good),
        "--auth-key: no such file": DaemonOptions(**{**base, "auth_key": tmp_path / "nokey"}, data=good),
        "not a PEM certificate": DaemonOptions(**{**base, "root_certificates": certs / "node-1.pub"}, data=good),
        "NIST curve": None,
        "--budget-eps must be positive": DaemonOptions(data=good, budget_eps=0.0, **base),
        "cannot be combined": DaemonOptions(data=good, insecure=True, **base),
    }
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    ed_key = tmp_path / "ed25519"
    ed_key.write_bytes(
        ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        )
    )
    cases["NIST curve"] = DaemonOptions(**{**base, "auth_key": ed_key}, data=good)
    for expected, opts in cases.items():
        with pytest.raises(DaemonError, match=expected) as caught:
            preflight(opts)
        assert "\n" not in str(caught.value)
        assert caught.value.code == EXIT_BAD_INPUT
    # the command line: one line on stderr, exit code 2, and no SuperNode was ever started
    done = subprocess.run(
        [
            FEDLA,
            "client",
            "--superlink",
            "127.0.0.1:9",
            "--data",
            str(empty),
            "--state-dir",
            str(tmp_path / "cli-state"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_BAD_INPUT
    assert done.stderr.strip().startswith("error: data folder has no usable text") and done.stderr.count("\n") == 1
    assert not (tmp_path / "cli-state" / "supernode.log").exists()


def test_node_config_carries_the_device_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLA_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FEDLA_HEADS", raising=False)
    opts = DaemonOptions(
        superlink="h:1",
        data=tmp_path / "d",
        base=tmp_path / "b",
        device="cpu",
        budget_eps=3.5,
        node_config='max-chunks-per-client=7 partitioning="iid"',
    )
    values = node_config_values(opts, tmp_path / "state")
    assert values[DATA_DIR_KEY] == str((tmp_path / "d").resolve())
    assert values[STATE_DIR_KEY] == str((tmp_path / "state").resolve())
    assert values[HEADS_DIR_KEY] == str((tmp_path / "home" / "heads" / "latest").resolve())  # = default_heads_dir()
    assert values["device"] == "cpu" and values["max-chunks-per-client"] == 7
    assert (
        values[BUDGET_KEY],
        values[MAX_DELTA_KEY],
        values[MAX_GRAD_NORM_KEY],
        values[MIN_NOISE_KEY],
    ) == (3.5, 1e-5, 1.0, 0.5)  # the privacy floor, defaults but the budget
    from flwr.app import Context, RecordDict

    from client.client_app import client_config

    context = Context(
        run_id=1, node_id=1, node_config=values, state=RecordDict(), run_config={"dp-target-epsilon": 8.0, "dp": False}
    )
    config = client_config(context)  # what the ClientApp computes: the device's floor wins
    assert (config.dp, config.dp_target_epsilon, config.device, config.base_model_dir) == (
        True,
        3.5,
        "cpu",
        str((tmp_path / "b").resolve()),
    )


def test_global_heads_are_kept_by_version_and_published(tmp_path, tiny_base):
    from common.decoding import load_heads
    from common.heads.lookahead import DraftHeads

    state, published = tmp_path / "state", tmp_path / "pub" / "latest"
    node_config = {STATE_DIR_KEY: str(state), HEADS_DIR_KEY: str(published)}
    heads = DraftHeads.fresh(tiny_base, 2)
    assert keep_global_heads(heads, node_config, run_id=7, server_round=1) is None  # version 0: untrained
    for version in (1, 2):
        heads.config.version = version
        assert keep_global_heads(heads, node_config, run_id=7, server_round=version) is not None
    heads.config.version = 1
    assert keep_global_heads(heads, node_config, run_id=7, server_round=3) is None  # older: ignored
    folder, meta = latest_heads(state)
    assert (meta["version"], meta["run"], folder.name) == (2, 7, "run-7-v2")
    assert meta["sha256"] == sha256(folder / "heads.safetensors")
    assert load_heads(published, tiny_base).config.version == 2  # what `fedla generate` loads
    # a new run replaces the kept heads even at a lower version; a real folder is replaced by a copy
    published.unlink()
    published.mkdir()
    heads.config.version = 1
    keep_global_heads(heads, node_config, run_id=8, server_round=1)
    assert latest_heads(state)[1]["run"] == 8 and not published.is_symlink()
    assert json.loads((published / "heads_config.json").read_text())["version"] == 1
    for version in range(2, 6):
        heads.config.version = version
        keep_global_heads(heads, node_config, run_id=8, server_round=version)
    assert len(list((state / "heads").glob("run-*"))) == 3  # pruned to the newest three
    kinds = [e["event"] for e in events(state)]
    assert kinds.count("heads") == 7


def test_round_logger_one_line_per_round(tmp_path):
    path = tmp_path / "events.jsonl"
    lines: list[str] = []
    logger = RoundLogger(path, lines.append, budget=2.0)
    rows = [
        {"event": "heads", "run": 5, "round": 2, "version": 1, "sha256": "ab" * 32},
        {"event": "train-start", "run": 5, "round": 2, "version": 1},
        {
            "event": "train-done",
            "run": 5,
            "round": 2,
            "metrics": {
                "skipped": 1,
                "skip-reason": "privacy budget: ... above 2",
                "dp": 1,
                "epsilon": 1.8,
                "num-train-chunks": 11,
            },
        },
        {"event": "heads", "run": 5, "round": 2, "version": 2, "sha256": "cd" * 32},
        {"event": "eval", "run": 5, "round": 2, "metrics": {"head-accuracy": [0.5, 0.25], "tau": 1.5}},
        {"event": "train-start", "run": 5, "round": 3, "version": 2},
        {
            "event": "train-done",
            "run": 5,
            "round": 3,
            "metrics": {
                "skipped": 0,
                "dp": 1,
                "epsilon": 1.9,
                "delta": 1e-5,
                "num-train-chunks": 11,
                "loss": 2.5,
                "acc-1": 0.3,
                "train-seconds": 1.25,
            },
        },
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:5]) + json.dumps(rows[5]))  # last line partial
    logger.poll()
    assert lines == [
        "round 2 (run 5): declined training (privacy budget: ... above 2); still connected; "
        "global heads v2 kept (sha256 cdcdcdcdcdcd); local eval acc [0.50, 0.25] tau 1.50"
    ]
    with open(path, "a") as handle:
        handle.write("\n" + json.dumps(rows[6]) + "\n")
    logger.poll()
    logger.flush()
    assert lines[1] == (
        "round 3 (run 5): trained 11 chunks, loss 2.500, head-1 acc 0.300, epsilon 1.900/2 (delta 1e-05), 1.2s"
    )


def test_unreachable_superlink_retries_then_gives_up(tmp_path, tiny_base_dir):
    certs = make_certs(tmp_path / "certs", nodes=1)
    data = device_data(tmp_path / "data", "json")
    port = free_port()  # nothing listens there
    started = time.monotonic()
    done = subprocess.run(
        [
            FEDLA,
            "client",
            "--superlink",
            f"127.0.0.1:{port}",
            "--data",
            str(data),
            "--root-certificates",
            str(certs / "ca.crt"),
            "--auth-key",
            str(certs / "node-1"),
            "--state-dir",
            str(tmp_path / "state"),
            "--no-publish",
            "--base",
            str(tiny_base_dir),
            "--max-retries",
            "1",
            "--max-wait-time",
            "3",
            "--restarts",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == EXIT_UNREACHABLE, done.stdout + done.stderr
    assert f"cannot reach the SuperLink at 127.0.0.1:{port}: 2 attempt(s)" in done.stderr
    assert "retry 1/2" in done.stdout  # the daemon's own backoff between SuperNode starts
    assert done.stdout.index("tokenised: ") < done.stdout.index("retry 1/2")  # ready before joining
    assert list((tmp_path / "state" / "chunks").glob("*.pt"))  # the private text stays in the state folder
    assert (tmp_path / "state" / "supernode.log").read_text().count("Giving up reconnection") == 2
    assert time.monotonic() - started < 200


# ------------------------------------------------------------------------------------------ end to end


@pytest.mark.slow(minutes=5)
def test_deployment_end_to_end(tmp_path, tiny_base_dir):
    certs = make_certs(tmp_path / "certs", nodes=4)  # node-4 is never registered
    other_ca = make_certs(tmp_path / "other-ca", nodes=0)
    port = free_port()
    run_id = "deploy-e2e"
    runs = tmp_path / "runs"
    run_config = " ".join(
        [
            f'base-model-dir="{tiny_base_dir}"',
            "num-server-rounds=2",
            'init-heads="fresh"',
            "chunk-len=32",
            "max-chunks-per-client=12",
            "num-heads=2",
            "batch-size=4",
            "min-train-clients=3",
            "min-available-clients=3",
            "node-wait-seconds=300.0",
            "round-timeout=300.0",
            "server-eval-chunks=8",
            "eval-prompts=1",
            "eval-max-new-tokens=4",
            "client-eval-prompts=1",
            "secagg=true",
            "dp=true",
            "dp-noise-multiplier=2.0",
            f'run-dir="{runs}"',
            f'run-id="{run_id}"',
        ]
    )
    # sigma 2, q = 1/3 (11 train chunks, batch 4), 3 steps a round: epsilon 1.80 after one round, 2.39 after two.
    # min-train-clients=3: a round samples all three (and round 2 waits for the restarted daemon); SecAgg+
    # (3 shares, threshold 2) still completes a round from two of them.
    server_args = [FEDLA, "server", "--certs", str(certs), "--port", str(port), "--state-dir", str(tmp_path / "server")]
    procs = Procs(tmp_path)
    link_env = {"FEDLA_HOME": str(tmp_path / "home-server")}
    homes = [tmp_path / f"home-{i}" for i in (1, 2, 3)]
    states = [tmp_path / f"state-{i}" for i in (1, 2, 3)]
    datas = [device_data(tmp_path / f"data-{i}", pkg) for i, pkg in zip((1, 2, 3), ("json", "email", "logging"))]

    def client_args(i: int, key: str | None = None, ca: Path | None = None, state: Path | None = None) -> list[str]:
        args = [
            FEDLA,
            "client",
            "--superlink",
            f"127.0.0.1:{port}",
            "--data",
            str(datas[i - 1]),
            "--base",
            str(tiny_base_dir),
            "--device",
            "cpu",
            "--root-certificates",
            str(ca or certs / "ca.crt"),
            "--auth-key",
            str(certs / (key or f"node-{i}")),
            "--state-dir",
            str(state or states[i - 1]),
            "--max-retries",
            "3",
            "--max-wait-time",
            "10",
            "--restarts",
            "0",
        ]
        return args + (["--budget-eps", "2.0"] if i == 2 else [])

    def round_file(n: int) -> Path:
        return runs / run_id / "rounds" / f"round-{n}.json"

    started = time.monotonic()
    try:
        server = procs.start(
            "server",
            server_args + [f"--register={certs / f'node-{i}.pub'}" for i in (1, 2, 3)] + ["--run-config", run_config],
            env=link_env,
        )
        procs.wait_for(
            lambda: procs.out("server").count(" as node ") >= 3, 120, "the SuperLink and three registrations"
        )
        daemons = {
            i: procs.start(f"client-{i}", client_args(i), env={"FEDLA_HOME": str(homes[i - 1])}) for i in (1, 2, 3)
        }
        for i in (1, 2, 3):
            procs.wait_for(lambda i=i: "connected to the SuperLink" in procs.out(f"client-{i}"), 180, f"daemon {i}")

        # an unregistered key and a foreign CA are refused with a clear error, and exit
        stranger = procs.start(
            "stranger",
            client_args(1, key="node-4", state=tmp_path / "state-x") + ["--refused-patience", "15"],
            env={"FEDLA_HOME": str(tmp_path / "home-x")},
        )
        wrong_ca = procs.start(
            "wrong-ca",
            client_args(1, ca=other_ca / "ca.crt", state=tmp_path / "state-y"),
            env={"FEDLA_HOME": str(tmp_path / "home-y")},
        )

        # kill daemon 3 (SIGKILL) while it trains in round 1, i.e. after the SecAgg+ key exchange
        procs.note()
        procs.wait_for(
            lambda: any(e["event"] == "train-start" and e["round"] == 1 for e in events(states[2])),
            400,
            "daemon 3 to start training in round 1",
            poll=0.05,
            note=False,
        )
        tree3 = [daemons[3].pid, *descendants(daemons[3].pid)]
        daemons[3].kill()
        daemons[3].wait()
        procs.wait_for(lambda: not any(alive(pid) for pid in tree3), 60, "daemon 3's SuperNode and ClientApp to exit")
        trained = any(e["event"] == "train-done" and e["round"] == 1 for e in events(states[2]))
        print(f"\ndaemon 3 killed {'after' if trained else 'during'} its local training in round 1")

        assert stranger.wait(timeout=180) == EXIT_REFUSED, procs.out("stranger")
        assert "refused this node" in procs.out("stranger") and "not registered" in procs.out("stranger")
        assert wrong_ca.wait(timeout=180) == EXIT_TLS, procs.out("wrong-ca")
        assert "certificate" in procs.out("wrong-ca") and "TLS" in procs.out("wrong-ca")

        # round 1 completes without it; then it comes back (same key, same state) for round 2
        procs.wait_for(lambda: round_file(1).is_file(), 400, "round 1 to complete")
        daemons[3] = procs.start("client-3b", client_args(3), env={"FEDLA_HOME": str(homes[2])})
        assert server.wait(timeout=600) == 0, procs.summary()
        run_seconds = time.monotonic() - started
        procs.note()

        summary = json.loads((runs / run_id / "summary.json").read_text())
        assert summary["run"]["status"] == "finished"
        round1, round2 = (json.loads(round_file(n).read_text()) for n in (1, 2))
        assert round1["aggregated"] and round2["aggregated"]
        p1, p2 = round1["participation"], round2["participation"]
        assert (p1["sampled"], p1["succeeded"], p1["dropped"]) == (3, 2, 1), p1
        assert (p2["sampled"], p2["succeeded"], p2["dropped"]) == (3, 3, 0), p2
        assert len(p2["skipped_budget"]) == 1 and "privacy budget" in next(iter(p2["skipped_budget"].values()))
        assert procs.out("server").count("Secure aggregation completed") == 2
        assert 1.7 < round1["privacy"]["epsilon_max"] < 1.9 and 2.3 < round2["privacy"]["epsilon_max"] < 2.5

        # every daemon holds the same global heads: version 2, byte-identical to the server's checkpoint
        checkpoint = sha256(runs / run_id / "checkpoints" / "round-2" / "heads.safetensors")
        for state in states:
            folder, meta = latest_heads(state)
            assert (meta["version"], meta["sha256"]) == (2, checkpoint), (state, meta)
            assert sha256(folder / "heads.safetensors") == checkpoint
        # one line per round on each daemon; the budget-limited one says why it declined, and stayed
        assert "round 1 (run" in procs.out("client-1") and "round 2 (run" in procs.out("client-1")
        assert "global heads v2 kept" in procs.out("client-1")
        assert "declined training (privacy budget" in procs.out("client-2")
        assert daemons[2].poll() is None
        assert "round 2 (run" in procs.out("client-3b") and "trained" in procs.out("client-3b")

        # `fedla generate` on device 1 uses its newest heads without being told where they are
        generated = subprocess.run(
            [
                FEDLA,
                "generate",
                "--base",
                str(tiny_base_dir),
                "--prompt",
                "import json\n",
                "--max-new-tokens",
                "8",
                "--device",
                "cpu",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**{k: v for k, v in os.environ.items() if k != "FEDLA_HEADS"}, "FEDLA_HOME": str(homes[0])},
        )
        assert generated.returncode == 0, generated.stderr
        assert "[ams]" in generated.stderr and "falling back" not in generated.stderr
        assert (homes[0] / "heads" / "latest").resolve() == latest_heads(states[0])[0]

        # the SuperLink went away with the run; a new one on the same port and database: daemons reconnect
        relink = procs.start("relink", server_args + ["--no-run"], env=link_env)
        for name in ("client-1", "client-2", "client-3b"):
            procs.wait_for(
                lambda name=name: procs.out(name).count("connected to the SuperLink") >= 2, 180, f"{name} to reconnect"
            )
        assert "server gone; retrying (1)" in procs.out("client-1")  # --restarts 0: no limit
        for process in (daemons[1], daemons[2], daemons[3], relink):
            assert procs.stop(process) == 0, procs.summary()
    finally:
        leftovers = procs.close()
    assert not leftovers, f"processes left running: {leftovers}"
    print(f"\nend-to-end deployment: run {run_seconds:.0f}s, total {time.monotonic() - started:.0f}s")
