"""Base loading, heads, save/load with fingerprints, chunking, and a short training run."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from typer.testing import CliRunner

from common.cli.app import app
from common.data.chunks import chunk_files, load_chunks, stdlib_files
from common.data.features import compute_features
from common.errors import FedLookaheadError
from common.heads.lookahead import DraftHeads
from common.model.base import load_base, resolve_device
from common.training.loop import evaluate_heads, train_heads
from tests.conftest import TINY_VOCAB, save_tiny


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_load_base_is_frozen_for_each_architecture(tmp_path, tiny_tokenizer, arch):
    base = load_base(save_tiny(tmp_path / arch, tiny_tokenizer, arch), device="cpu")
    assert not base.model.training
    assert all(not p.requires_grad for p in base.model.parameters())
    assert base.dtype == torch.float32 and base.device.type == "cpu"
    hidden = base.features(torch.tensor([[1, 2, 3]]))
    assert hidden.shape == (1, 3, base.hidden_size) and not hidden.requires_grad
    # The features are exactly what the LM head turns into the model's logits.
    logits = base.model(torch.tensor([[1, 2, 3]])).logits
    torch.testing.assert_close(base.model.get_output_embeddings()(hidden), logits)


def test_load_base_errors(tmp_path, tiny_tokenizer, tiny_base_dir):
    with pytest.raises(FedLookaheadError, match="not found"):
        load_base(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FedLookaheadError, match="no config.json"):
        load_base(tmp_path / "empty")
    t5 = tmp_path / "t5"
    t5.mkdir()
    (t5 / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(FedLookaheadError, match="not a causal language model"):
        load_base(t5)
    no_tokenizer = tmp_path / "no-tok"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((tiny_base_dir / "config.json").read_text())
    with pytest.raises(FedLookaheadError, match="no tokenizer"):
        load_base(no_tokenizer)
    with pytest.raises(FedLookaheadError, match="unknown device"):
        resolve_device("tpu")


def test_tokenizer_larger_than_vocab_is_refused(tmp_path, tiny_base_dir):
    from common.data.chunks import read_text
    from common.model.default import train_tokenizer

    big_tokenizer = train_tokenizer([read_text(p) for p in stdlib_files("train")[:60]], TINY_VOCAB * 2)
    mismatched = tmp_path / "mismatched"
    mismatched.mkdir()
    for name in ("config.json", "model.safetensors"):
        (mismatched / name).write_bytes((tiny_base_dir / name).read_bytes())
    big_tokenizer.save_pretrained(mismatched)
    with pytest.raises(FedLookaheadError, match="tokenizer .* has .* tokens"):
        load_base(mismatched)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_requested_without_gpu_is_a_clear_error():
    with pytest.raises(FedLookaheadError, match="CUDA is not available"):
        resolve_device("cuda")


@pytest.mark.parametrize("arch", ["recurrent", "parallel"])
def test_head_shapes_and_parameter_count(tiny_base, arch):
    d = tiny_base.hidden_size
    heads = DraftHeads.fresh(tiny_base, num_heads=3, arch=arch, draft_vocab=list(range(0, TINY_VOCAB, 4)))
    # Fusion Linear(2d, d) plus K residual blocks of d*d + d each; embedding and LM head are not counted.
    assert heads.num_trainable() == (2 * d * d + d) + 3 * (d * d + d)
    logits = heads(torch.randn(2, 5, d), torch.randint(0, TINY_VOCAB, (2, 5)))
    assert len(logits) == 3 and all(x.shape == (2, 4, TINY_VOCAB // 4) for x in logits)
    assert set(heads.state_dict()) == {
        "fusion.proj.weight",
        "fusion.proj.bias",
        *(f"blocks.{k}.linear.{p}" for k in range(3) for p in ("weight", "bias")),
    }


def test_fresh_heads_start_from_the_base_next_token_distribution(tiny_base):
    """Identity fusion and zero-initialised residual blocks: head 1 begins as the base's LM head on h_t,
    restricted to the draft vocabulary (and for the parallel architecture every head does)."""
    vocab = list(range(1, TINY_VOCAB, 3))
    hidden = tiny_base.features(torch.tensor([[5, 6, 7, 8]]))
    expected = tiny_base.model.get_output_embeddings()(hidden)[:, :-1][..., vocab]
    for arch in ("recurrent", "parallel"):
        logits = DraftHeads.fresh(tiny_base, num_heads=2, arch=arch, draft_vocab=vocab)(
            hidden, torch.tensor([[1, 2, 3, 4]])
        )
        torch.testing.assert_close(logits[0], expected)
    torch.testing.assert_close(logits[1], expected)


def test_recurrent_training_pass_equals_step_by_step_drafting(tiny_base):
    """The teacher-forced pass and the decoder's step() are one computation: head k at t fuses x_{t+1..t+k}."""
    torch.manual_seed(0)
    heads = DraftHeads.fresh(tiny_base, num_heads=3)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tokens = torch.randint(0, TINY_VOCAB, (1, 9))
    hidden = tiny_base.features(tokens)
    logits = heads(hidden, tokens)
    t = 2
    state = hidden[0, t : t + 1]
    for k in range(1, 4):
        state, head_state = heads.step(tokens[0, t + k : t + k + 1], state, k)
        torch.testing.assert_close(heads.draft_logits(head_state)[0], logits[k - 1][0, t])


def test_save_load_round_trip_and_fingerprint_refusal(tmp_path, tiny_base, tiny_tokenizer):
    heads = DraftHeads.fresh(tiny_base, num_heads=2)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    heads.save(tmp_path / "heads")
    loaded = DraftHeads.load(tmp_path / "heads", tiny_base)
    for name, tensor in heads.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    assert loaded.config == heads.config

    other = load_base(save_tiny(tmp_path / "other", tiny_tokenizer, seed=1), device="cpu")
    assert other.fingerprint != tiny_base.fingerprint
    with pytest.raises(FedLookaheadError, match="trained for base"):
        DraftHeads.load(tmp_path / "heads", other)
    with pytest.raises(FedLookaheadError, match="no heads"):
        DraftHeads.load(tmp_path / "missing", tiny_base)


def test_mismatched_weights_are_refused(tiny_base):
    heads = DraftHeads.fresh(tiny_base, num_heads=2)
    state = heads.state_dict()
    state["fusion.proj.bias"] = torch.zeros(3)
    with pytest.raises(FedLookaheadError, match="has shape"):
        heads.load_state_dict_checked(state)
    state.pop("fusion.proj.bias")
    with pytest.raises(FedLookaheadError, match="missing"):
        heads.load_state_dict_checked(state)


def test_fingerprint_is_stable_across_loads_and_dtypes(tiny_base_dir, tiny_base):
    again = load_base(tiny_base_dir, device="cpu", dtype=torch.bfloat16)
    assert again.fingerprint == tiny_base.fingerprint


def test_chunking_edge_cases(tmp_path, tiny_tokenizer, caplog):
    (tmp_path / "empty.py").write_text("")
    (tmp_path / "binary.py").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "short.py").write_text("x = 1\n")
    (tmp_path / "long.py").write_text("def f(x):\n    return x + 1\n" * 40)
    (tmp_path / "image.png").write_bytes(b"\x89PNG")  # not a text suffix: never read
    with caplog.at_level(logging.WARNING):
        chunks = load_chunks(tmp_path, tiny_tokenizer, chunk_len=16)
    assert chunks.dtype == torch.long and chunks.shape[1] == 16 and len(chunks) > 0
    ids = tiny_tokenizer((tmp_path / "long.py").read_text(), add_special_tokens=False)["input_ids"]
    assert len(chunks) == len(ids) // 16
    assert chunks.flatten().tolist() == ids[: len(chunks) * 16]  # no chunk crosses a file boundary
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "empty" in messages and "binary" in messages and "shorter than a chunk" in messages
    assert "short.py" in messages


def test_chunking_errors(tmp_path, tiny_tokenizer):
    with pytest.raises(FedLookaheadError, match="not found"):
        load_chunks(tmp_path / "missing", tiny_tokenizer, 16)
    with pytest.raises(FedLookaheadError, match="no text files"):
        load_chunks(tmp_path, tiny_tokenizer, 16)
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(FedLookaheadError, match="at least 512 tokens"):
        load_chunks(tmp_path, tiny_tokenizer, 512)
    with pytest.raises(FedLookaheadError, match="at least 2"):
        chunk_files([tmp_path / "a.py"], tiny_tokenizer, 1)


def test_stdlib_split_is_disjoint_by_top_level_name():
    from common.data.chunks import stdlib_dir

    def top_level_names(paths):
        return {p.relative_to(stdlib_dir()).parts[0].removesuffix(".py") for p in paths}

    train, heldout = stdlib_files("train"), stdlib_files("heldout")
    assert len(train) > 5 * len(heldout) > 0
    assert not top_level_names(train) & top_level_names(heldout)


def test_short_training_beats_chance_by_a_wide_margin(tiny_base):
    torch.manual_seed(0)
    chunks = chunk_files(stdlib_files("train")[:25], tiny_base.tokenizer, 32)[:256]
    features = compute_features(tiny_base, chunks, progress=False)
    heads = DraftHeads.fresh(tiny_base, num_heads=2)
    history = train_heads(heads, features, epochs=6, lr=1e-2, batch_size=32, show_progress=False)
    report = evaluate_heads(heads, features.subset(slice(0, 128)))
    chance = 1 / tiny_base.vocab_size
    assert report["head_accuracy"][0] > 20 * chance
    assert history[-1]["loss"] < history[0]["loss"]


def test_train_heads_command(tmp_path, tiny_base_dir):
    data = tmp_path / "data"
    data.mkdir()
    for path in stdlib_files("train")[:6]:
        (data / path.name).write_text(path.read_text())
    out = tmp_path / "heads"
    result = CliRunner().invoke(
        app,
        [
            "train-heads",
            "--data",
            str(data),
            "--eval-data",
            str(data),
            "--out",
            str(out),
            "--base",
            str(tiny_base_dir),
            "--num-heads",
            "2",
            "--chunk-len",
            "32",
            "--max-chunks",
            "64",
            "--device",
            "cpu",
            "--draft-vocab",
            "128",
            "--distill-chunks",
            "4",
        ],
        env={"FEDLA_HOME": str(tmp_path / "home")},
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "train_report.json").read_text())
    assert len(report["heldout"]["head_accuracy"]) == 2 and report["draft_vocab"] == 128
    assert report["distill_chunks"] == 4 and report["train_chunks"] == 68
    assert (out / "heads.safetensors").is_file()
    assert len(DraftHeads.load(out, load_base(tiny_base_dir, device="cpu")).config.draft_vocab) == 128


def test_outputs_are_checked_before_the_work(tmp_path, tiny_base_dir):
    """An unwritable output fails at once, not after minutes of training or benchmarking."""
    taken = tmp_path / "file"
    taken.write_text("x")
    result = CliRunner().invoke(app, ["train-heads", "--out", str(taken), "--base", str(tiny_base_dir)])
    assert result.exit_code == 2 and "not a directory" in result.output
    result = CliRunner().invoke(app, ["bench-decode", "--json", str(tmp_path), "--base", str(tiny_base_dir)])
    assert result.exit_code == 2 and "is a directory" in result.output


def test_cli_errors_are_one_line(tmp_path, tiny_base_dir):
    result = CliRunner().invoke(
        app,
        [
            "train-heads",
            "--data",
            str(tmp_path / "nope"),
            "--out",
            str(tmp_path / "h"),
            "--base",
            str(tiny_base_dir),
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and "data directory not found" in result.output
    for command in (["generate", "--prompt", "x"], ["bench-decode"]):
        result = CliRunner().invoke(app, [*command, "--base", str(tiny_base_dir), "--dtype", "int4", "--device", "cpu"])
        assert result.exit_code == 2 and result.output.strip().count("\n") == 0 and "unknown --dtype" in result.output


def test_public_draft_vocab_is_seeded_public_and_keeps_eos(tiny_base):
    from common.decoding.core import eos_ids
    from common.heads.draft_vocab import public_draft_vocab

    vocab = public_draft_vocab(tiny_base, 64, chunks=8, chunk_len=32)
    assert len(vocab) == len(set(vocab)) == 64 and vocab == sorted(vocab)
    assert eos_ids(tiny_base) <= set(vocab) and vocab == public_draft_vocab(tiny_base, 64, chunks=8, chunk_len=32)
    assert public_draft_vocab(tiny_base, tiny_base.vocab_size, chunks=8, chunk_len=32) == []  # whole vocabulary


def test_cli_generate_refuses_text_that_is_not_unicode_and_an_oversized_seed_in_one_line(tiny_base_dir):
    runner = CliRunner()
    command = ["generate", "--base", str(tiny_base_dir), "--max-new-tokens", "2", "--mode", "greedy"]
    # bytes \xff\xfe in an argument reach Python as lone surrogates (os.fsdecode's surrogateescape)
    result = runner.invoke(app, command + ["--prompt", "def f(\udcff\udcfe x):"])
    assert result.exit_code == 2
    assert (
        result.output.strip() == "error: the prompt is not valid Unicode text: '\\udcff' at character 6 (a lone "
        "surrogate, or bytes that are not UTF-8)"
    )
    result = runner.invoke(app, command + ["--prompt", "x", "--temperature", "0.8", "--seed", str(2**70)])
    assert result.exit_code == 2 and result.output.strip().startswith("error: seed must be an integer from -2**63")


def test_the_cli_says_its_version_and_explains_its_options():
    """Issue 30 item 4: no --version; "keys of )." where Rich read a [table] name as markup; --top-p and --seed
    without help; beam and fused unexplained."""
    from importlib.metadata import version

    runner = CliRunner()

    def help_text(*command: str) -> str:  # Rich's boxes unwrapped into one line of words
        return " ".join(runner.invoke(app, [*command, "--help"]).output.replace("\u2502", " ").split())

    assert runner.invoke(app, ["--version"]).output.strip() == f"fedla {version('fedlookahead')}"
    server_help = help_text("server")
    assert "keys of the app config in pyproject.toml" in server_help and "keys of )" not in server_help
    generate_help = help_text("generate")
    for said in ("Nucleus sampling", "the same seed gives the same text", "beam search", "re-ranking", "lossless"):
        assert said in generate_help, said
    assert "baselines" not in generate_help  # generate has no baselines; bench-decode's help says so
    assert "baselines" in help_text("bench-decode")


def test_a_bad_option_value_is_one_line_from_the_installed_command(tiny_base_dir):
    import subprocess
    import sys
    from pathlib import Path

    fedla = str(Path(sys.executable).parent / "fedla")
    result = subprocess.run(
        [fedla, "generate", "--base", str(tiny_base_dir), "--prompt", "x", "--max-new-tokens", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("error: Invalid value for '--max-new-tokens': -1 is not in the range x>=1")
    assert "see `fedla generate --help`" in result.stderr


def test_public_heads_are_trained_once_per_base_and_setting(tiny_base, tmp_path, monkeypatch, capsys):
    """Issue 30 item 5: `flwr run .` with its defaults trained DP heads from scratch (head-1 accuracy 0.04); now
    init-heads="public" starts from heads trained on public code, built once and then reused."""
    from common.federation.config import FedConfig
    from common.heads.lookahead import WEIGHTS_FILE
    from common.training.public_heads import ensure_public_heads

    monkeypatch.setenv("FEDLA_HOME", str(tmp_path))
    folder = ensure_public_heads(tiny_base, 2, 32, 0.02)
    assert "training them once" in capsys.readouterr().out
    stamp = (folder / WEIGHTS_FILE).stat().st_mtime_ns
    assert ensure_public_heads(tiny_base, 2, 32, 0.02) == folder
    assert (folder / WEIGHTS_FILE).stat().st_mtime_ns == stamp and "training" not in capsys.readouterr().out
    assert DraftHeads.load(folder, tiny_base).num_heads == 2
    assert not list(folder.parent.glob(".*")) and folder.parent == tmp_path / "heads"
    assert FedConfig.from_mapping({}).init_heads == "public"
    with pytest.raises(FedLookaheadError, match='init-heads must be "public", "fresh" or a heads folder'):
        FedConfig.from_mapping({"init-heads": ""})
