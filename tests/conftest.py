"""Tiny models built in seconds: tests never depend on the embedded default base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from common.base import BaseModel, load_base
from common.data import read_text, stdlib_files
from common.default_model import train_tokenizer

TINY_VOCAB = 512


@pytest.fixture(scope="session", autouse=True)
def private_fedla_home(tmp_path_factory):
    """Caches the code writes (cost curves, features, chunks) go to a temporary FedLookahead home."""
    import os

    previous = os.environ.get("FEDLA_HOME")
    os.environ["FEDLA_HOME"] = str(tmp_path_factory.mktemp("fedla-home"))
    yield
    if previous is None:
        os.environ.pop("FEDLA_HOME", None)
    else:
        os.environ["FEDLA_HOME"] = previous


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models decode fastest on one thread, and far faster than two on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    texts = [t for t in map(read_text, stdlib_files("train")[:40]) if t]
    return train_tokenizer(texts, TINY_VOCAB)


def save_tiny(directory: Path, tokenizer, arch: str = "llama", seed: int = 0) -> Path:
    """A randomly initialised tiny causal LM of the given architecture, saved with its tokenizer."""
    torch.manual_seed(seed)
    common = dict(vocab_size=TINY_VOCAB, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if arch == "llama":
        model = LlamaForCausalLM(
            LlamaConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=512,
                tie_word_embeddings=True,
                **common,
            )
        )
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(
            Qwen2Config(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=512,
                **common,
            )
        )
    elif arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common))
    else:
        raise ValueError(arch)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"), tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_base(tiny_base_dir) -> BaseModel:
    return load_base(tiny_base_dir, device="cpu")
