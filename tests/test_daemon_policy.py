"""The daemon's restart policy, Flower-log reading and lifecycle lines, without any process
(client.daemon.policy, client.daemon.supernode, client.daemon.reporter)."""

from __future__ import annotations

import json

import pytest

from client.daemon.options import EXIT_BAD_INPUT, EXIT_REFUSED, EXIT_TLS, EXIT_UNREACHABLE
from client.daemon.policy import MAX_BACKOFF, Outcome, RestartPolicy
from client.daemon.reporter import RoundLogger, decision_line, final_error, server_gone
from client.daemon.supernode import classify, parse_line

LINK = "10.0.0.1:9092"


def policy(restarts: int = 5, patience: float = 75.0) -> RestartPolicy:
    return RestartPolicy(restarts, patience, jitter=lambda: 1.0)


def test_unreachable_backs_off_exponentially_then_gives_up():
    rules = policy(restarts=8)
    delays = []
    for k in range(1, 8):
        decision = rules.decide(Outcome("unreachable", False, began=10.0 * k, ended=10.0 * k + 5))
        assert not decision.stop and decision.state == "unreachable" and decision.attempt == k
        assert decision.first == (k == 1)
        delays.append(decision.delay)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, MAX_BACKOFF]
    final = rules.decide(Outcome("unreachable", False, began=80.0, ended=85.0))
    assert final.stop and final.code == EXIT_UNREACHABLE and final.state == "unreachable"
    assert (final.attempt, final.limit, final.seconds) == (8, 8, 75.0)  # since the first failed start began
    line = final_error(final, LINK, "[Errno 111] Connection refused", None, None)
    assert line.startswith(f"cannot reach the SuperLink at {LINK}: 8 attempt(s) over 75s failed")


def test_zero_restarts_never_gives_up():
    rules = policy(restarts=0)
    for k in range(1, 50):
        decision = rules.decide(Outcome("unreachable", False, began=k, ended=k + 1))
        assert not decision.stop and decision.delay <= MAX_BACKOFF
    assert "retry 49/unlimited" in decision_line(decision, LINK, "", 75, None)


def test_a_lost_connection_is_the_server_gone_counted_from_one():
    rules = policy(restarts=3)
    lost = rules.decide(Outcome("lost", True, began=0.0, ended=100.0, detail="stream closed"))
    # try 1 was the SuperNode that lost the connection (it retried on its own); this restart is try 2
    assert (lost.stop, lost.state, lost.attempt, lost.limit, lost.first) == (False, "server-gone", 2, 3, True)
    assert decision_line(lost, LINK, "", 75, None) == "server gone; retrying (2/3) in 1.0s"
    second = rules.decide(Outcome("unreachable", False, began=101.0, ended=160.0))
    assert (second.state, second.attempt, second.delay) == ("server-gone", 3, 2.0)
    final = rules.decide(Outcome("unreachable", False, began=162.0, ended=220.0))
    assert final.stop and final.state == "gone" and final.code == EXIT_UNREACHABLE
    assert final_error(final, LINK, "", None, None).startswith("server gone: cannot reach the SuperLink")
    assert server_gone(1, 3) == "server gone; retrying (1/3)"  # what the daemon says when Flower starts retrying


def test_connecting_again_resets_every_count():
    rules = policy(restarts=2)
    rules.decide(Outcome("lost", True, began=0.0, ended=10.0))
    again = rules.decide(Outcome("lost", True, began=11.0, ended=50.0))  # it reconnected, then lost it again
    assert not again.stop and again.attempt == 2
    fresh = policy(restarts=2)
    fresh.decide(Outcome("unreachable", False, began=0.0, ended=1.0))
    after = fresh.decide(Outcome("lost", True, began=2.0, ended=3.0))
    assert not after.stop  # the start that connected wiped the unreachable count


def test_refused_is_waiting_for_registration_until_patience_runs_out():
    rules = policy(patience=30.0)
    first = rules.decide(Outcome("refused", False, began=100.0, ended=101.0))
    assert (first.stop, first.state, first.first, first.delay) == (False, "waiting-registration", True, 10.0)
    line = decision_line(first, LINK, "", 30.0, auth_key=None)
    assert line.startswith("waiting for registration: ") and "flwr supernode register" in line
    later = rules.decide(Outcome("refused", False, began=111.0, ended=125.0))
    assert not later.stop and not later.first and later.delay == 5.0  # never waits past the patience
    assert decision_line(later, LINK, "", 30.0, None) is None  # said once per streak
    final = rules.decide(Outcome("refused", False, began=126.0, ended=131.0))
    assert final.stop and final.code == EXIT_REFUSED and final.seconds == 31.0
    assert "not registered" in final_error(final, LINK, "", None, None)
    # an unreachable start in between ends the refusal streak
    rules = policy(patience=30.0)
    rules.decide(Outcome("refused", False, began=0.0, ended=1.0))
    rules.decide(Outcome("unreachable", False, began=2.0, ended=3.0))
    assert rules.decide(Outcome("refused", False, began=40.0, ended=41.0)).first


@pytest.mark.parametrize("kind, code", [("tls", EXIT_TLS), ("key", EXIT_BAD_INPUT)])
def test_tls_and_key_errors_are_final(kind, code):
    decision = policy().decide(Outcome(kind, False, began=0.0, ended=1.0, detail="x"))
    assert decision.stop and decision.code == code


def test_flower_log_lines():
    assert parse_line("INFO :      SuperNode ID: 1234") == ("node-id", "1234")
    assert parse_line("INFO :      Connection successful after 3.10 seconds and 2 tries.")[0] == "reconnected"
    assert parse_line("WARNING :   Connection attempt failed, retrying in 1.72 seconds") == ("retrying", "")
    assert parse_line("WARNING :   Giving up reconnection after 61.00 seconds and 10 tries.")[0] == "gave-up"
    assert parse_line("ERROR :     something broke")[0] == "error"
    assert parse_line("ERROR :     Exit Code: 1") is None and parse_line("INFO :      hello") is None
    refused = ["ERROR :     Failed to initialize the connection", "ERROR :     Failed to activate SuperNode."]
    assert classify(refused, connected=False)[0] == "refused"
    assert classify(["ERROR :     SSL/TLS handshake error detected."], False)[0] == "tls"
    assert classify(["ERROR :     Unable to parse the private key file."], False)[0] == "key"
    assert classify(["WARNING :   Giving up reconnection"], connected=True)[0] == "lost"
    kind, detail = classify(["Failed to initialize the connection", "[Errno 111] Connection refused"], False)
    assert (kind, detail) == ("unreachable", "[Errno 111] Connection refused")


def test_the_last_round_says_the_run_finished(tmp_path):
    path = tmp_path / "events.jsonl"
    lines: list[str] = []
    logger = RoundLogger(path, lines.append, budget=4.0)
    rows = [
        {"event": "heads", "run": 9, "round": 2, "version": 1, "sha256": "ab" * 32},
        {"event": "train-start", "run": 9, "fedla_run": "deploy-x", "round": 2, "version": 1},
        {
            "event": "train-done",
            "run": 9,
            "round": 2,
            "metrics": {"skipped": 0, "dp": 1, "epsilon": 1.0, "delta": 1e-5, "num-train-chunks": 3},
        },
        {"event": "heads", "run": 9, "round": 2, "version": 2, "sha256": "cd" * 32},
        {"event": "eval", "run": 9, "round": 2, "version": 2, "final": 1, "metrics": {"head-accuracy": [0.5]}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    logger.poll()
    assert lines[0].startswith("round 2 (run 9): trained 3 chunks")
    assert lines[1] == "run deploy-x finished: heads v2 kept"
    assert len(lines) == 2
