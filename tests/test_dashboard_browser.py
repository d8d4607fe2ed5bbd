"""The dashboard in a real headless Chromium: plots render with one point per round (and a round-0 point for
the starting heads), live updates arrive by polling, the token travels with every request the page makes, and
a real run's page answers "is the federation working, and what has it cost?"."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from server.dashboard.screenshot import chromium_page, find_chromium, run_page_url, serve_in_thread

if find_chromium() is None:
    pytest.skip(
        "no Chromium at /usr/bin/chromium (CI installs Debian's `chromium`); set $FEDLA_CHROMIUM to run "
        "the browser test",
        allow_module_level=True,
    )
pytest.importorskip("playwright.sync_api", reason="playwright (Python) is not installed")

from dashboard_data import fill_realistic_run, write_privacy_utility  # noqa: E402

from client import client_app as client_module  # noqa: E402
from server.dashboard.app import create_app  # noqa: E402
from server.federation import FRESH_DP_VERDICT  # noqa: E402
from server.run.record import RoundRecord  # noqa: E402
from server.store.run_store import RunStore  # noqa: E402
from tests.test_federated_inprocess import run  # noqa: E402

TOKEN = "browser-test-token-0123456789"
PER_ROUND = ["chart-loss", "chart-participation", "chart-bytes"]
FROM_ROUND_0 = ["chart-accuracy", "chart-tau", "chart-epsilon"]  # the starting heads' point first
ROUNDS = 12

# Pixels of a canvas that are not fully transparent: a rendered chart has thousands.
INK = """id => { const c = document.getElementById(id); const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
               let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; }"""
POINTS = """id => { const ch = window.fedla.charts[id];
                    return {labels: ch.data.labels.length, points: ch.data.datasets.map(d => d.data.length)}; }"""


def test_run_page_in_chromium(tmp_path):
    store = RunStore(f"sqlite:///{tmp_path / 'fedla.db'}")
    fill_realistic_run(store, "live-run", rounds=ROUNDS, run_dir=tmp_path, finish=False)
    write_privacy_utility(tmp_path / "live-run")
    errors: list[str] = []
    with serve_in_thread(create_app(store, token=TOKEN)) as base_url, chromium_page() as page:
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))

        page.goto(f"{base_url}/?token={TOKEN}")
        page.wait_for_selector('body[data-ready="1"]', timeout=20_000)
        assert page.locator('tr[data-run-id="live-run"] a').get_attribute("href") == f"/runs/live-run?token={TOKEN}"

        page.goto(run_page_url(base_url, "live-run", TOKEN))
        page.wait_for_selector('body[data-ready="1"]', timeout=20_000)
        assert "never stored" in page.locator("#privacy-note").inner_text()
        assert page.evaluate("window.fedla.pollErrors") == 0 and page.evaluate("document.body.dataset.poll") == "ok"
        for canvas in PER_ROUND + FROM_ROUND_0:
            points = ROUNDS + (canvas in FROM_ROUND_0)
            assert page.locator(f"#{canvas}").get_attribute("data-rounds") == str(points), canvas
            counts = page.evaluate(POINTS, canvas)
            assert counts["labels"] == points and set(counts["points"]) == {points}, (canvas, counts)
            assert page.evaluate(INK, canvas) > 2000, f"{canvas} looks blank"
        # 4 heads, each with a server and a client-side accuracy line.
        assert len(page.evaluate("window.fedla.charts['chart-accuracy'].data.datasets")) == 8
        assert page.locator("#rounds-table tbody tr").count() == ROUNDS
        # the privacy-utility benchmark this run was part of: the DP curve, 3 references and this run
        assert page.evaluate(INK, "chart-privacy-utility") > 2000
        shown = page.evaluate("window.fedla.charts['chart-privacy-utility'].data.datasets.map(d => d.label)")
        assert shown == ["federated DP", "public_only", "federated_nodp", "central_nodp", "this run"]
        assert "reconstruction_threshold" in page.locator("#secagg").inner_text()

        # Live update: the server records a round and a checkpoint; the page picks them up by polling.
        store.record_round(
            "live-run",
            RoundRecord(
                round=ROUNDS + 1,
                train_loss=3.2,
                head_accuracy=[0.6, 0.4, 0.3, 0.2],
                tau=1.9,
                sampled=8,
                succeeded=7,
                dropped=1,
                epsilon_max=2.9,
                epsilon_mean=2.7,
                delta=1e-5,
                wall_seconds=40.0,
                bytes_down_per_client=1_082_368,
                bytes_up_per_client=1_082_368,
            ),
        )
        store.finish_run("live-run", "finished")
        page.wait_for_selector(f'body[data-rounds="{ROUNDS + 1}"]', timeout=10_000)
        for canvas in PER_ROUND + FROM_ROUND_0:
            assert page.locator(f"#{canvas}").get_attribute("data-rounds") == str(ROUNDS + 1 + (canvas in FROM_ROUND_0))
        assert page.locator("#run-status").inner_text() == "finished"

        # The download link carries the token and serves the recorded checkpoint.
        link = page.locator("#checkpoint-download").get_attribute("href")
        assert link == f"/runs/live-run/checkpoint?token={TOKEN}"
        with page.expect_download() as info:
            page.locator("#checkpoint-download").click()
        zipped = tmp_path / "download.zip"
        info.value.save_as(zipped)
        heads = zipfile.ZipFile(zipped).read("heads.safetensors")
        assert hashlib.sha256(heads).hexdigest() == store.latest_checkpoint("live-run")["sha256"]

        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 50_000
    store.close()
    assert not errors, errors


DATASETS = "id => window.fedla.charts[id].data.datasets.map(d => ({label: d.label, data: d.data}))"


def test_a_real_runs_page_says_whether_it_works_and_what_it_cost(run_config, tmp_path):
    """Two SecAgg+ DP rounds of 3 real ClientApps from fresh heads, through the real ServerApp loop; then its
    pages in Chromium: the budget line, epsilon spent and left, the round-0 point, traffic per round, the
    plan's verdict and a readable privacy title."""
    config = dict(run_config, **{"num-server-rounds": 2, "run-id": "real-run"})
    run_dir, summary, _ = run(config, client_module.app, nodes=3)
    store = RunStore(f"sqlite:///{run_dir.parent / 'fedla.db'}", read_only=True)
    recorded, rounds = store.get_run("real-run"), store.get_rounds("real-run")
    spent = rounds[-1]["privacy"]["epsilon_max"]
    assert recorded["plan"]["privacy"]["epsilon_budget"] == 8.0 and 0 < spent <= 8.0
    errors: list[str] = []
    with serve_in_thread(create_app(store)) as base_url, chromium_page() as page:
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(base_url + "/")
        page.wait_for_selector('body[data-ready="1"]', timeout=20_000)
        cells = page.locator('tr[data-run-id="real-run"] td').all_inner_texts()
        assert cells[5:7] == [f"{spent:.3f} of 8.00", f"{8.0 - spent:.3f}"], cells

        page.goto(run_page_url(base_url, "real-run"))
        page.wait_for_selector('body[data-ready="1"]', timeout=20_000)
        start = recorded["starting_heads"]
        accuracy = page.evaluate(DATASETS, "chart-accuracy")
        assert page.evaluate("window.fedla.charts['chart-accuracy'].data.labels") == [0, 1, 2]
        assert accuracy[0]["label"] == "head 1"
        assert accuracy[0]["data"] == [start["head_accuracy"][0]] + [r["metrics"]["head_accuracy"][0] for r in rounds]
        assert page.evaluate(DATASETS, "chart-tau")[0]["data"][0] == start["tau"]

        epsilon = {d["label"]: d["data"] for d in page.evaluate(DATASETS, "chart-epsilon")}
        assert epsilon["budget ε = 8.00"] == [8.0, 8.0, 8.0]
        assert epsilon["ε max over clients"] == [0, *(r["privacy"]["epsilon_max"] for r in rounds)]
        title = page.locator("#chart-epsilon").locator("xpath=../..").locator("figcaption").inner_text()
        assert title == f"Privacy: ε spent per client (δ = 1e-5, budget 8.00, spent {spent:.3f}, left {8 - spent:.3f})"
        assert page.locator("#epsilon-left").inner_text() == f"{spent:.3f} of 8.00 · left {8 - spent:.3f}"

        traffic = {d["label"]: d["data"] for d in page.evaluate(DATASETS, "chart-bytes")}
        assert traffic["heads down"] == [r["bytes"]["down_per_client"] / 1e6 for r in rounds]
        assert (
            traffic["update up"] == [r["bytes"]["up_per_client"] / 1e6 for r in rounds] and traffic["update up"][0] > 0
        )
        assert page.evaluate(INK, "chart-bytes") > 2000

        assert page.locator("#plan-verdict").inner_text() == FRESH_DP_VERDICT  # fresh heads under DP
        glance = page.locator("#glance").inner_text()
        assert glance.startswith("Since the starting heads, after round 2: head-1 accuracy ")
        assert f"ε {spent:.3f} of 8.00" in glance
        shot = tmp_path / "real-run.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 50_000
    store.close()
    assert not errors, errors
