"""The embedded default base model: a small Llama-style code LM the project builds itself.

No model can be downloaded, so `fedla bootstrap` trains a byte-level BPE tokenizer and pretrains a
~4M-parameter Llama on the Python standard library's sources (train split), seeded, in a few minutes
on two CPU cores, and saves both with `save_pretrained`. Everything is derived from RECIPE, whose hash
names the cache folder: changing the recipe builds a new model instead of reusing a stale one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from common.data import read_text, stdlib_files

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
RECIPE = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "max_position_embeddings": 1024,
    "seq_len": 256,
    "batch_size": 16,
    "steps": 450,
    "lr": 3e-3,
    "warmup": 30,
    "seed": 0,
}


def cache_root() -> Path:
    """Where built models live: $FEDLA_HOME, else ~/.cache/fedlookahead."""
    return Path(os.environ.get("FEDLA_HOME", Path.home() / ".cache" / "fedlookahead")).expanduser()


def default_base_dir() -> Path:
    recipe_hash = hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:8]
    return cache_root() / f"base-stdlib-llama-{recipe_hash}"


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style: every byte string is encodable)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS)


def pretrain(model: LlamaForCausalLM, stream: torch.Tensor, recipe: dict, heldout: torch.Tensor) -> float:
    """Next-token pretraining on random crops of the token stream; returns held-out loss (nats/token)."""
    generator = torch.Generator().manual_seed(recipe["seed"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    seq, steps, warmup = recipe["seq_len"], recipe["steps"], recipe["warmup"]
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model.train()
    progress = tqdm(range(steps), desc="pretraining base", unit="step")
    for _ in progress:
        starts = torch.randint(0, len(stream) - seq - 1, (recipe["batch_size"],), generator=generator)
        batch = torch.stack([stream[s : s + seq] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        progress.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    with torch.no_grad():
        windows = heldout[: len(heldout) // seq * seq].view(-1, seq)[:64]
        return float(model(input_ids=windows, labels=windows).loss)


def build_default_base(out: Path | None = None, steps: int | None = None) -> Path:
    """Build the default base deterministically and save it; returns its directory."""
    out = out or default_base_dir()
    recipe = dict(RECIPE, steps=steps or RECIPE["steps"])
    torch.manual_seed(recipe["seed"])
    started = time.perf_counter()
    train_texts = [t for t in map(read_text, stdlib_files("train")) if t]
    heldout_texts = [t for t in map(read_text, stdlib_files("heldout")) if t]
    tokenizer = train_tokenizer(train_texts, recipe["vocab_size"])
    log.info("tokenizer trained in %.0fs", time.perf_counter() - started)

    def stream(texts: list[str]) -> torch.Tensor:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return torch.tensor([t for doc in ids for t in doc + [tokenizer.eos_token_id]], dtype=torch.long)

    train_stream, heldout_stream = stream(train_texts), stream(heldout_texts)
    config = LlamaConfig(
        vocab_size=recipe["vocab_size"],
        hidden_size=recipe["hidden_size"],
        intermediate_size=recipe["intermediate_size"],
        num_hidden_layers=recipe["num_hidden_layers"],
        num_attention_heads=recipe["num_attention_heads"],
        num_key_value_heads=recipe["num_attention_heads"],
        max_position_embeddings=recipe["max_position_embeddings"],
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    heldout_loss = pretrain(model, train_stream, recipe, heldout_stream)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    report = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": len(train_stream),
        "heldout_tokens": len(heldout_stream),
        "heldout_loss": round(heldout_loss, 4),
        "build_seconds": round(time.perf_counter() - started, 1),
        "recipe": recipe,
    }
    (staging / "fedla_build.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)  # atomic: a crash never leaves a half-written model where loaders look
    log.info("default base built in %.0fs: %s", report["build_seconds"], report)
    return out


def ensure_default_base() -> Path:
    """The default base directory, built on first use."""
    out = default_base_dir()
    if not (out / "config.json").is_file():
        log.warning("no default base model in %s yet: building it (a few minutes, once)", out)
        build_default_base(out)
    return out
