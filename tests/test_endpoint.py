"""The device's local generation endpoint (client/endpoint/), driven by a real HTTP client against uvicorn."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from client.endpoint.api import create_endpoint_app
from client.endpoint.server import EndpointServer, check_loopback, serve_endpoint, start_endpoint
from client.kept_heads import keep_global_heads
from client.node_config import STATE_DIR_KEY
from common.decoding import generate
from common.errors import FedLookaheadError
from common.heads.lookahead import DraftHeads
from common.model.base import BaseModel, Loading, load_base, prompt_ids

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):", "# sort a list\n"]
MAX_TOKENS = 24


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tiny_base_dir) -> Path:
    """The tiny Llama with larger random weights (a fresh one only repeats a token) and a chat template."""
    directory = tmp_path_factory.mktemp("endpoint-base")
    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    model.save_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(tiny_base_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def ref_base(base_dir) -> BaseModel:
    return load_base(base_dir, device="cpu")


def versioned_heads(base: BaseModel, version: int) -> DraftHeads:
    heads = DraftHeads.fresh(base, 2)
    heads.config.version = version
    return heads


def push_heads(state: Path, base: BaseModel, version: int) -> Path:
    """Keep heads the way the ClientApp does when a round delivers them: a new folder, `latest` swapped."""
    assert keep_global_heads(
        versioned_heads(base, version), {STATE_DIR_KEY: str(state)}, run_id=7, server_round=version
    )
    return state / "heads" / "latest"


@contextmanager
def serving(base_dir: Path, heads_dir: Path | None, **options) -> Iterator[tuple[EndpointServer, httpx.Client]]:
    loading = Loading("cpu", int8=options.pop("int8", False))
    server = EndpointServer(create_endpoint_app(base_dir, heads_dir, loading=loading, **options), port=0).start()
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            yield server, client
    finally:
        server.stop()


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory, ref_base) -> Path:
    return push_heads(tmp_path_factory.mktemp("endpoint-state"), ref_base, version=1)


@pytest.fixture(scope="module")
def client(base_dir, heads_dir) -> Iterator[httpx.Client]:
    with serving(base_dir, heads_dir) as (_server, http):
        yield http


def reference(base: BaseModel, heads_dir: Path, prompt: str, chat: bool = False, **options):
    heads = DraftHeads.load(heads_dir, base)
    return generate(base, prompt_ids(base, prompt, chat), heads=heads, **{"max_new_tokens": MAX_TOKENS, **options})


def streamed(http: httpx.Client, path: str, body: dict) -> tuple[str, list[dict]]:
    """(concatenated text, chunks) of a streamed request; checks the SSE framing and the final [DONE]."""
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    choices = [chunk["choices"][0] for chunk in chunks]
    pieces = [c["delta"].get("content", "") if "delta" in c else c["text"] for c in choices]
    return "".join(pieces), chunks


def check_usage(usage: dict, prompt_tokens: int, completion_tokens: int, heads_version: int) -> None:
    assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == completion_tokens
    assert usage["total_tokens"] == prompt_tokens + completion_tokens
    assert usage["tokens_per_s"] > 0 and usage["tau"] >= 1.0
    assert usage["heads_version"] == heads_version and usage["mode"] == "ams"


def test_completion_equals_generate(client, ref_base, heads_dir):
    expected = reference(ref_base, heads_dir, PROMPTS[0])
    response = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "endpoint-base0"
    choice = body["choices"][0]
    assert choice["text"] == expected.text and choice["index"] == 0
    assert choice["finish_reason"] == ("length" if expected.stop_reason == "max_new_tokens" else "stop")
    check_usage(body["usage"], len(prompt_ids(ref_base, PROMPTS[0], False)), len(expected.tokens), heads_version=1)
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["endpoint-base0"]


def test_the_endpoint_drafts_from_the_devices_own_files_and_answers_the_same(base_dir, ref_base, heads_dir, tmp_path):
    expected = reference(ref_base, heads_dir, PROMPTS[0])
    own = tmp_path / "own"
    own.mkdir()
    (own / "notes.py").write_text((PROMPTS[0] + expected.text + "\n") * 4)  # the files hold this very answer
    cache = tmp_path / "state" / "datastore"
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
    with serving(base_dir, heads_dir, datastore_dir=own, datastore_cache=cache) as (server, http):
        endpoint = server.app.state.endpoint
        assert endpoint.datastore is not None and "drafts from 1 of your files" in endpoint.describe()
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected.text  # lossless
    assert response.json()["usage"]["tau"] > expected.tau  # the answer is in the files: drafts were accepted
    assert len(list(cache.glob("datastore-*.npz"))) == 1  # indexed once into the state folder
    with serving(base_dir, heads_dir, datastore_dir=tmp_path / "gone", datastore_cache=cache) as (server, http):
        assert server.app.state.endpoint.datastore is None  # a folder it cannot index costs only its drafts
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == expected.text


def test_an_int8_endpoint_answers_as_the_int8_base_generates(base_dir, heads_dir):
    int8 = load_base(base_dir, device="cpu", int8=True)
    expected = reference(int8, heads_dir, PROMPTS[0])
    with serving(base_dir, heads_dir, int8=True) as (server, http):
        response = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS})
        assert response.status_code == 200, response.text
        assert server.app.state.endpoint.base.int8
    assert response.json()["choices"][0]["text"] == expected.text
    assert (
        expected.tokens == generate(int8, prompt_ids(int8, PROMPTS[0], False), mode="greedy", max_new_tokens=24).tokens
    )


def test_chat_completion_equals_generate(client, ref_base, heads_dir):
    expected = reference(ref_base, heads_dir, PROMPTS[1], chat=True)
    messages = [{"role": "user", "content": PROMPTS[1]}]
    response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": MAX_TOKENS})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected.text}
    check_usage(body["usage"], len(prompt_ids(ref_base, PROMPTS[1], True)), len(expected.tokens), heads_version=1)
    halves = [{"type": "text", "text": PROMPTS[1][:5]}, {"type": "text", "text": PROMPTS[1][5:]}]
    parts = [{"role": "user", "content": halves}]
    as_parts = client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": MAX_TOKENS})
    assert as_parts.json()["choices"][0]["message"]["content"] == expected.text


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streaming_concatenates_to_the_non_streamed_text(client, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prompt = {"messages": [{"role": "user", "content": PROMPTS[2]}]} if chat else {"prompt": PROMPTS[2]}
    body = {"max_tokens": 40, **prompt}
    whole = client.post(path, json=body).json()
    text, chunks = streamed(client, path, body)
    expected = whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"]
    assert text == expected and text
    with_text = [c for c in chunks if c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content")]
    assert len(with_text) > 2  # really streamed, not one chunk
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert final["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert len({c["id"] for c in chunks}) == 1
    if chat:
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_stop_strings_and_seeded_sampling(client, ref_base, heads_dir):
    full = reference(ref_base, heads_dir, PROMPTS[0], max_new_tokens=40).text
    stop = full[10:13]
    body = {"prompt": PROMPTS[0], "max_tokens": 40, "stop": [stop, "never-seen-stop"]}
    response = client.post("/v1/completions", json=body).json()
    assert response["choices"][0]["text"] == full[: full.find(stop)]
    assert response["choices"][0]["finish_reason"] == "stop"
    assert streamed(client, "/v1/completions", body)[0] == full[: full.find(stop)]

    sampled = {"prompt": PROMPTS[3], "max_tokens": MAX_TOKENS, "temperature": 0.9, "top_p": 0.95, "seed": 5}
    first, second = (client.post("/v1/completions", json=sampled).json()["choices"][0]["text"] for _ in range(2))
    expected = reference(ref_base, heads_dir, PROMPTS[3], temperature=0.9, top_p=0.95, seed=5)
    assert first == second == expected.text


def test_concurrent_requests_are_queued_and_all_answered(client, ref_base, heads_dir):
    expected = [reference(ref_base, heads_dir, prompt).text for prompt in PROMPTS]

    def ask(prompt: str) -> httpx.Response:
        return client.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS})

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(ask, PROMPTS))
    assert [r.status_code for r in responses] == [200] * len(PROMPTS)
    assert [r.json()["choices"][0]["text"] for r in responses] == expected


class ForwardGate:
    """Blocks the server's base at its n-th forward until released: a request held in flight."""

    def __init__(self, base: BaseModel, at: int) -> None:
        self.at, self.calls = at, 0
        self.reached, self.release = threading.Event(), threading.Event()
        self.handle = base.model.base_model.register_forward_hook(self._hook)

    def _hook(self, *_args: object) -> None:
        self.calls += 1
        if self.calls == self.at:
            self.reached.set()
            assert self.release.wait(60)


def test_heads_swap_during_a_stream(base_dir, ref_base, tmp_path):
    heads_dir = push_heads(tmp_path / "state", ref_base, version=1)
    body = {"prompt": PROMPTS[0], "max_tokens": 40}
    expected = reference(ref_base, heads_dir, PROMPTS[0], max_new_tokens=40).text
    with serving(base_dir, heads_dir) as (server, http):
        gate = ForwardGate(server.app.state.endpoint.base, at=3)  # prefill, one step, then held
        results: dict[str, object] = {}
        in_flight = threading.Thread(target=lambda: results.update(old=streamed(http, "/v1/completions", body)))
        in_flight.start()
        assert gate.reached.wait(60)
        push_heads(tmp_path / "state", ref_base, version=2)  # a round delivers new heads mid-stream
        after = threading.Thread(target=lambda: results.update(new=http.post("/v1/completions", json=body)))
        after.start()
        gate.release.set()
        in_flight.join(60)
        after.join(60)
        gate.handle.remove()
    old_text, old_chunks = results["old"]
    assert old_text == expected and old_chunks[-1]["usage"]["heads_version"] == 1
    assert gate.calls > gate.at  # the stream went on decoding after the swap, with its own snapshot
    new = results["new"].json()
    assert new["usage"]["heads_version"] == 2 and new["choices"][0]["text"] == expected


def test_a_client_gone_mid_stream_frees_the_worker(base_dir, ref_base, heads_dir):
    full = reference(ref_base, heads_dir, PROMPTS[3], max_new_tokens=200)
    assert full.base_forwards > 20
    with serving(base_dir, heads_dir) as (server, http):
        gate = ForwardGate(server.app.state.endpoint.base, at=3)
        body = {"prompt": PROMPTS[3], "max_tokens": 200, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200 and gate.reached.wait(60)
        gate.release.set()  # the connection is closed: the decode ends at its next step
        assert http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 1}).status_code == 200
        gate.handle.remove()
    assert gate.calls - 1 < full.base_forwards // 2  # the queued request only prefilled (one forward)


def test_queue_over_its_limit_is_answered_503(base_dir, heads_dir):
    with serving(base_dir, heads_dir, max_queue=1) as (server, http):
        gate = ForwardGate(server.app.state.endpoint.base, at=2)
        body = {"prompt": PROMPTS[0], "max_tokens": 8}
        held = threading.Thread(target=lambda: http.post("/v1/completions", json=body))
        held.start()
        assert gate.reached.wait(60)
        refused = http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 8})
        gate.release.set()
        held.join(60)
        gate.handle.remove()
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
        assert http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 8}).status_code == 200


def test_missing_base_is_a_clear_503_until_it_appears(base_dir, tmp_path):
    missing = tmp_path / "no-base-here"
    with serving(missing, None) as (_server, http):
        for path, body in (
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ):
            response = http.post(path, json=body)
            assert response.status_code == 503
            error = response.json()["error"]
            assert error["code"] == "base_unavailable" and error["type"] == "server_error"
            assert error["message"] == f"base model unavailable: base model directory not found: {missing}"
        shutil.copytree(base_dir, missing)  # the base is copied in later: the next request loads it
        response = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4})
        assert response.status_code == 200 and response.json()["usage"]["mode"] == "greedy"
        assert response.json()["usage"]["heads_version"] is None


def test_only_loopback_hosts_are_served(base_dir, tmp_path):
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        check_loopback(host)
    for host in ("0.0.0.0", "::", "192.168.1.20", "example.com", ""):
        with pytest.raises(FedLookaheadError, match="loopback only"):
            check_loopback(host)
    never_loaded = tmp_path / "never-loaded"  # the host is refused before any base is looked for
    with pytest.raises(FedLookaheadError, match=r"loopback only \(127.0.0.1 or ::1\), not '0.0.0.0'"):
        start_endpoint(never_loaded, None, host="0.0.0.0", port=0)
    with pytest.raises(FedLookaheadError, match="loopback only"):
        start_endpoint(never_loaded, None, host="10.0.0.1", port=0)


def test_a_foreign_host_header_is_refused(client):
    """DNS rebinding: a page from evil.example.com resolved to 127.0.0.1 reaches the port, with its own Host."""
    port = client.base_url.port
    for host in ("evil.example.com", f"evil.example.com:{port}", "127.0.0.1.evil.example.com", ""):
        response = client.get("/v1/models", headers={"Host": host})
        assert response.status_code == 400, (host, response.text)
        error = response.json()["error"]
        assert error["code"] == "invalid_host" and "answers only loopback host names" in error["message"]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]:8765", "localhost"):
        assert client.get("/v1/models", headers={"Host": host}).status_code == 200, host


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/v1/completions", {"prompt": ""}, "prompt: empty prompt"),
        ("/v1/completions", {}, "prompt: Field required"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens: Input should be a valid integer"),
        ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature: Input should be greater than or equal"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p: Input should be greater than 0"),
        ("/v1/completions", {"prompt": "x", "n": 2}, "n: Input should be less than or equal to 1"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "give one prompt string"),
        ("/v1/completions", {"prompt": "x " * 600}, "but the base's context is 512"),
        ("/v1/completions", {"prompt": "x", "seed": 2**70}, "seed must be an integer from -2**63 to 2**64 - 1"),
        ("/v1/completions", {"prompt": "def f(\ud800):"}, "prompt is not valid Unicode text: '\\ud800' at character 6"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\udcff"}]},
            "messages[1].content is not valid Unicode text",
        ),
        ("/v1/chat/completions", {"messages": []}, "messages: List should have at least 1 item"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content: Field required"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]}, "every message is empty"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "only text content parts are supported",
        ),
    ],
)
def test_bad_input_is_a_one_line_400(client, path, body, fragment):
    # json.dumps escapes a lone surrogate as JSON allows ("\\ud800"); httpx's json= could not encode it
    response = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and "\n" not in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"


def test_malformed_json_and_missing_chat_template(client, tiny_base_dir):
    response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and message.startswith("the request body is not valid JSON: "), message
    assert "at character 1" in message
    missing = client.get("/v1/engines")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Not Found"
    with serving(tiny_base_dir, None) as (_server, http):
        response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 400
        assert response.json()["error"]["message"].endswith("has no chat template: use /v1/completions")


def test_serve_keeps_the_server_in_the_foreground_and_stops_it_when_it_ends(base_dir, heads_dir, capsys):
    server = start_endpoint(base_dir, heads_dir, port=0, loading=Loading("cpu"))
    url = server.url
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    foreground = threading.Thread(target=serve_endpoint, args=(server,))
    foreground.start()
    server.server.should_exit = True  # as Ctrl-C ends uvicorn
    foreground.join(timeout=30)
    assert not foreground.is_alive() and not server.thread.is_alive()
    assert f"fedla serve: {url}/v1" in capsys.readouterr().out


def test_cli_serve_refuses_other_hosts_and_bad_dtypes(tiny_base_dir):
    from typer.testing import CliRunner

    from common.cli.app import app

    for extra, message in ((["--host", "0.0.0.0"], "loopback only"), (["--dtype", "int3"], "unknown --dtype")):
        result = CliRunner().invoke(app, ["client", "serve", "--base", str(tiny_base_dir), *extra])
        assert result.exit_code == 2 and result.output.strip().count("\n") == 0 and message in result.output


# ------------------------------------------------------------------ through the official openai SDK


@pytest.fixture(scope="module")
def sdk(base_dir, heads_dir) -> Iterator[openai.OpenAI]:
    """What users use: the official client against the endpoint (no retries, so an error is seen as it is)."""
    with serving(base_dir, heads_dir) as (server, _http):
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_sdk_reads_completions_chat_and_streams(sdk, ref_base, heads_dir):
    expected = reference(ref_base, heads_dir, PROMPTS[0])
    completion = sdk.completions.create(model="any", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert completion.choices[0].text == expected.text
    assert completion.usage.completion_tokens == len(expected.tokens)
    streamed_text = "".join(
        c.choices[0].text
        for c in sdk.completions.create(model="any", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, stream=True)
    )
    assert streamed_text == expected.text
    chat_expected = reference(ref_base, heads_dir, PROMPTS[1], chat=True)
    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat = sdk.chat.completions.create(model="any", messages=messages, max_tokens=MAX_TOKENS)
    assert chat.choices[0].message.content == chat_expected.text and chat.choices[0].message.role == "assistant"
    pieces = sdk.chat.completions.create(model="any", messages=messages, max_tokens=MAX_TOKENS, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == chat_expected.text


def test_the_sdk_sees_stop_strings_and_seeds(sdk, ref_base, heads_dir):
    full = reference(ref_base, heads_dir, PROMPTS[2]).text
    stop = full[3:5]
    cut = sdk.completions.create(model="any", prompt=PROMPTS[2], max_tokens=MAX_TOKENS, stop=[stop])
    assert cut.choices[0].text == full[: full.find(stop)] and cut.choices[0].finish_reason == "stop"
    samples = [
        sdk.completions.create(model="any", prompt=PROMPTS[3], max_tokens=12, temperature=0.9, seed=seed)
        .choices[0]
        .text
        for seed in (5, 5, 6)
    ]
    assert samples[0] == samples[1]


def test_logprobs_are_the_bases_own(sdk, ref_base, heads_dir):
    """Greedy decoding takes the most likely token each step: its logprob is the top one, from the base's logits."""
    expected = reference(ref_base, heads_dir, PROMPTS[0])
    completion = sdk.completions.create(model="any", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, logprobs=2)
    logprobs = completion.choices[0].logprobs
    decode = ref_base.tokenizer.decode
    assert logprobs.tokens == [decode([t]) for t in expected.tokens]  # one entry per token, as the base split it
    ids = prompt_ids(ref_base, PROMPTS[0], False).tolist() + list(expected.tokens)
    with torch.no_grad():
        logp = torch.log_softmax(ref_base.model(torch.tensor([ids])).logits[0].float(), dim=-1)
    start = len(ids) - len(expected.tokens)
    for k, (token_logprob, top) in enumerate(zip(logprobs.token_logprobs, logprobs.top_logprobs)):
        assert token_logprob == pytest.approx(float(logp[start + k - 1, ids[start + k]]), abs=1e-4)
        # two top tokens may decode alike (parts of one UTF-8 character): the dict keeps the likelier
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(token_logprob, abs=1e-6)
    echoed = sdk.completions.create(model="any", prompt=PROMPTS[0], max_tokens=4, echo=True, logprobs=0)
    assert echoed.choices[0].text.startswith(PROMPTS[0])
    assert echoed.choices[0].logprobs.token_logprobs[0] is None  # nothing predicts the first prompt token
    four = reference(ref_base, heads_dir, PROMPTS[0], max_new_tokens=4)
    assert echoed.choices[0].text == PROMPTS[0] + four.text
    assert len(echoed.choices[0].logprobs.tokens) == start + len(four.tokens)
    chat = sdk.chat.completions.create(
        model="any", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    answer = reference(ref_base, heads_dir, PROMPTS[1], chat=True, max_new_tokens=8)
    assert [t.token for t in content] == [decode([t]) for t in answer.tokens]
    assert all(t.bytes == list(t.token.encode("utf-8")) for t in content)
    assert all(
        len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-6) for t in content
    )


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda c: c.completions.create(model="m", prompt="x", max_tokens=0), "max_tokens: Input should be greater"),
        (
            lambda c: c.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "x"}],
                tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            ),
            "tools: not supported by this endpoint",
        ),
        (
            lambda c: c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], response_format={"type": "json_object"}
            ),
            "response_format: not supported",
        ),
        (lambda c: c.completions.create(model="m", prompt="x", frequency_penalty=0.5), "frequency_penalty: not"),
        (
            lambda c: c.completions.create(model="m", prompt="x", logprobs=1, stream=True),
            "logprobs: not available on a stream",
        ),
        (
            lambda c: c.completions.create(model="m", prompt="def f(", suffix="    return x"),
            "no fill-in-the-middle tokens",
        ),
    ],
)
def test_the_sdk_gets_a_400_naming_what_is_not_supported(sdk, call, fragment):
    with pytest.raises(openai.BadRequestError) as raised:
        result = call(sdk)
        for _ in result if hasattr(result, "__iter__") else ():
            pass
    assert fragment in raised.value.message, raised.value.message
    assert raised.value.status_code == 400


def test_harmless_openai_fields_are_accepted(client):
    body = {"prompt": PROMPTS[0], "max_tokens": 2, "user": "me", "presence_penalty": 0, "logit_bias": {}, "best_of": 1}
    assert client.post("/v1/completions", json=body).status_code == 200


def test_fill_in_the_middle_uses_the_tokenizers_fim_tokens(ref_base):
    from types import SimpleNamespace

    from client.endpoint.completion import fill_in_the_middle

    tokenizer = SimpleNamespace(get_vocab=lambda: {"<fim_prefix>": 1, "<fim_suffix>": 2, "<fim_middle>": 3})
    fake = SimpleNamespace(tokenizer=tokenizer, path=ref_base.path)
    assert fill_in_the_middle(fake, "def f(x):\n", "\n    return y") == (
        "<fim_prefix>def f(x):\n<fim_suffix>\n    return y<fim_middle>"
    )
    with pytest.raises(FedLookaheadError, match="no fill-in-the-middle tokens"):
        fill_in_the_middle(ref_base, "a", "b")


def test_health_says_what_it_serves(client, base_dir):
    assert client.get("/health").json() == {
        "status": "ok",
        "model": "endpoint-base0",
        "heads_version": 1,
        "mode": "ams",
    }
    bare = create_endpoint_app(base_dir, None).state.endpoint
    assert bare.describe().startswith("WARNING: no heads in None: plain decoding")
    bare.close()


def test_a_client_gone_before_a_non_streamed_answer_frees_the_worker(base_dir, ref_base, heads_dir):
    full = reference(ref_base, heads_dir, PROMPTS[3], max_new_tokens=200)
    with serving(base_dir, heads_dir) as (server, http):
        gate = ForwardGate(server.app.state.endpoint.base, at=3)
        body = json.dumps({"prompt": PROMPTS[3], "max_tokens": 200}).encode()
        request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as connection:
            connection.sendall(request + body)
            assert gate.reached.wait(60)  # decoding, held at its third forward
        time.sleep(1.0)  # the client has gone: the server hears of it (http.disconnect) and cancels
        gate.release.set()
        assert http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 1}).status_code == 200
        gate.handle.remove()
    assert gate.calls - 1 < full.base_forwards // 2
