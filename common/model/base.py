"""Loading the frozen base model: any local Hugging Face causal-LM checkpoint directory."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging as hf_logging

from common.errors import FedLookaheadError
from common.model.attention import GQA_ATTENTION
from common.model.int8_kernels import KernelReport
from common.model.quant import quantize_base_int8

hf_logging.disable_progress_bar()  # loading a few-MB checkpoint needs no progress bar of its own


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


@dataclass
class BaseModel:
    """A frozen causal LM, its tokenizer and the fingerprint heads are bound to."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    fingerprint: str
    path: Path
    int8_kernel: KernelReport | None = (
        None  # int8 linear layers (common.model.quant): the kernel in use, as measured here
    )
    body: bool = True  # False: embeddings, final norm and LM head only (load_base(body=False))

    @property
    def int8(self) -> bool:
        """Whether the linear layers are in int8 (the rest of the model in `dtype`)."""
        return self.int8_kernel is not None

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def precision(self) -> str:
        """The weights' number format: int8, or the floating-point dtype's name (float32, bfloat16, ...)."""
        return "int8" if self.int8 else str(self.dtype).removeprefix("torch.")

    @property
    def hidden_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().out_features

    @property
    def max_positions(self) -> int:
        cfg = self.model.config
        return int(getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 2048))

    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Last hidden states (after the final norm, as the LM head sees them), without gradients."""
        if not self.body:
            raise FedLookaheadError(f"the base in {self.path} was loaded without its layers: it cannot run")
        with torch.no_grad():
            return self.model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def resolve_device(device: str) -> torch.device:
    """'auto' means CUDA when present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise FedLookaheadError(f"unknown device {device!r}: use auto, cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise FedLookaheadError(f"device {device!r} requested but CUDA is not available on this machine")
    return torch.device(device)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # the names commands accept


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU; bf16 on CUDA where supported, else fp16."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def fingerprint_dir(path: Path) -> str:
    """A stable id of a checkpoint: architecture config plus samples of every weight file's bytes.

    Computed from the files, not from tensors in memory, so the same checkpoint loaded in fp32 on a
    CPU and in bf16 on a GPU has one fingerprint; reading only 1 MiB at each end of each weight file
    keeps it instant for multi-GB models.
    """
    digest = hashlib.sha256()
    config = json.loads((path / "config.json").read_text())
    for volatile in ("transformers_version", "torch_dtype", "dtype", "_name_or_path", "use_cache"):
        config.pop(volatile, None)
    digest.update(json.dumps(config, sort_keys=True).encode())
    weight_files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
    for weights in weight_files:
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with weights.open("rb") as handle:
            digest.update(handle.read(1 << 20))
            handle.seek(max(0, size - (1 << 20)))
            digest.update(handle.read(1 << 20))
    return digest.hexdigest()[:16]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_weight_files(path: Path) -> None:
    """Every safetensors file's header against its size (memory-mapped, nothing loaded): a truncated or
    corrupt weight file is named in one line instead of failing deep inside transformers."""
    for weights in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(weights, framework="pt"):
                pass
        except (SafetensorError, OSError) as exc:
            raise FedLookaheadError(f"truncated or corrupt weight file {weights}: {_first_line(exc)}") from exc


@dataclass(frozen=True)
class Loading:
    """How to load a base: the device, the float dtype (None: the device's default), int8 linear layers."""

    device: str = "auto"
    dtype: torch.dtype | None = None
    int8: bool = False

    def load(self, path: str | Path) -> BaseModel:
        return load_base(path, self.device, self.dtype, self.int8)


def load_base(
    path: str | Path, device: str = "auto", dtype: torch.dtype | None = None, int8: bool = False, body: bool = True
) -> BaseModel:
    """Load a local causal LM directory with its tokenizer, frozen and in eval mode.

    `int8` quantizes its linear layers for a CPU device (see common.model.quant), with the integer product measured
    fastest among the exact ones here (common.model.int8_kernels); the rest stays in fp32. `body=False` loads
    no decoder layer: what training heads on cached features needs (the embeddings and the LM head, a fifth
    of SmolLM2-135M), with the same fingerprint; such a base refuses to run (`features`).
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FedLookaheadError(f"base model directory not found: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FedLookaheadError(f"not a Hugging Face model directory (no config.json): {path}")
    try:
        json.loads(config_file.read_text())
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # JSONDecodeError: a ValueError
        raise FedLookaheadError(f"broken model config {config_file}: {_first_line(exc)}") from exc
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise FedLookaheadError(f"model type {config.model_type!r} in {path} is not a causal language model")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FedLookaheadError(f"no tokenizer in {path} (expected one of {', '.join(TOKENIZER_FILES)})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise FedLookaheadError(f"no usable tokenizer in {path}: {str(exc).splitlines()[0]}") from exc
    if len(tokenizer) > config.vocab_size:
        raise FedLookaheadError(
            f"tokenizer in {path} has {len(tokenizer)} tokens but the model's vocabulary has {config.vocab_size}"
        )
    check_weight_files(path)
    torch_device = resolve_device(device)
    if int8 and (torch_device.type != "cpu" or dtype not in (None, torch.float32)):
        raise FedLookaheadError("int8 weights are a CPU option: use --device cpu (on CUDA use bf16 or fp16)")
    try:
        layers = {} if body else {"num_hidden_layers": 0}
        verbosity = hf_logging.get_verbosity()
        if not body:  # its load report would list every layer's weights as unexpected
            hf_logging.set_verbosity_error()
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or default_dtype(torch_device), **layers)
        finally:
            hf_logging.set_verbosity(verbosity)
    except OSError as exc:
        raise FedLookaheadError(f"cannot load model weights from {path}: {str(exc).splitlines()[0]}") from exc
    model.to(torch_device).eval().requires_grad_(False)
    if torch_device.type == "cpu" and model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(
            GQA_ATTENTION
        )  # trees verify without copying keys per head (common.model.attention)
    fingerprint = fingerprint_dir(path)
    int8_kernel = quantize_base_int8(model, tokenizer, fingerprint) if int8 else None
    return BaseModel(
        model=model, tokenizer=tokenizer, fingerprint=fingerprint, path=path, int8_kernel=int8_kernel, body=body
    )


def check_text(text: str, what: str) -> str:
    """`text` when it is valid Unicode, else a one-line error. A JSON "\\ud800" escape, or bytes that are
    not UTF-8 in a command-line argument (Python decodes them to lone surrogates), reach the tokenizer as
    strings it cannot encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FedLookaheadError(
            f"{what} is not valid Unicode text: {text[exc.start]!r} at character {exc.start} "
            "(a lone surrogate, or bytes that are not UTF-8)"
        ) from None
    return text


def prompt_ids(model: BaseModel, prompt: str, chat: bool) -> torch.Tensor:
    """Token ids of a raw completion prompt, or of one user turn in the tokenizer's chat template."""
    tokenizer = model.tokenizer
    check_text(prompt, "the prompt")
    if not chat:
        return torch.tensor(tokenizer(prompt, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if not getattr(tokenizer, "chat_template", None):
        raise FedLookaheadError(f"--chat needs a chat template, and the tokenizer in {model.path} has none")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return torch.tensor(ids, dtype=torch.long)
