"""The small trainable parts that sit on the frozen base: a fusion head and K lookahead heads.

    h_t        base's last hidden state at position t (its LM head already predicts x_{t+1})
    x_{t+1}    the token just chosen (the base's own choice while decoding)
    s_0 = h_t
    step k:    f_k = Fusion([E(x_{t+k}); s_{k-1}])     EAGLE-style Linear(2d, d)
               s_k = Block_k(f_k)                       Medusa-style residual block x + SiLU(Wx + b)
               logits_k = LMHead_draft(s_k)             predicts x_{t+k+1}

That is the default `recurrent` architecture: each step fuses the token drafted at the step before
(EAGLE's idea at the cost of one linear layer instead of a decoder layer), so the heads' candidates
for step k+1 depend on the candidate they extend. The `parallel` architecture is Medusa's: one fusion
with x_{t+1}, then every head k reads f_1 (s_k = Block_k(f_1)) and the drafts form a lattice. The
`eagle` architecture is EAGLE's: the fusion followed by one causal decoder layer shaped like the base's
(common/heads/eagle.py), which attends over the whole context and drafts K steps on its own predicted
features; while decoding it keeps a key/value cache of the context (`new_cache`, `commit`).

The LM head used for drafting is the base's own frozen LM head restricted to a draft vocabulary
(FR-Spec / EAGLE-3): the N most frequent tokens of the base's greedy output on public data (see
common/heads/draft_vocab.py). Verification always uses the full LM head, so decoding stays lossless. Only
the fusion and the residual blocks are parameters; embedding and LM head are referenced, never saved,
trained or sent. The draft vocabulary is part of the heads' config (and of what the server sends).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from common.errors import FedLookaheadError
from common.heads.eagle import GEOMETRY_KEYS, ContextCache, DecoderLayer, layer_geometry, layer_shapes
from common.model.base import BaseModel

WEIGHTS_FILE = "heads.safetensors"
CONFIG_FILE = "heads_config.json"
ARCHITECTURES = ("recurrent", "parallel", "eagle")
MAX_HEADS = 16  # a config asking for more is refused before anything is allocated
MAX_FFN_RATIO = 16  # eagle layer width per hidden unit: bases use 2.7-4; a larger one is refused unallocated
DraftState = torch.Tensor | tuple[torch.Tensor, ...]  # per drafted row; eagle: (feature, path keys, path values)


def base_mismatch(fingerprint: object, hidden_size: object, vocab_size: object, base: BaseModel) -> str | None:
    """Why heads made for this base fingerprint and geometry do not fit `base`; None when they fit. The one
    "do these heads fit this base?" check, for heads on disk, in memory and on the wire."""
    if fingerprint != base.fingerprint:
        return f"trained for base {fingerprint}, not for {base.path} ({base.fingerprint})"
    if (hidden_size, vocab_size) != (base.hidden_size, base.vocab_size):
        return f"of geometry {hidden_size}/{vocab_size}, which does not fit base {base.hidden_size}/{base.vocab_size}"
    return None


@dataclass
class HeadsConfig:
    num_heads: int
    hidden_size: int
    vocab_size: int
    base_fingerprint: str
    version: int = 0  # bumped by every federated round that produces these heads
    arch: str = "recurrent"
    draft_vocab: list[int] = field(default_factory=list)  # [] = the base's whole vocabulary
    layer: dict[str, float] = field(default_factory=dict)  # eagle: the decoder layer's geometry (from the base)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """One-line errors for configs that cannot describe heads (checked before any allocation)."""
        for name in ("num_heads", "hidden_size", "vocab_size", "version"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise FedLookaheadError(f"bad heads config: {name} must be an integer, got {value!r}")
        if not 1 <= self.num_heads <= MAX_HEADS:
            raise FedLookaheadError(f"bad heads config: num_heads must be in 1..{MAX_HEADS}, got {self.num_heads}")
        if self.hidden_size < 1 or self.vocab_size < 1 or self.version < 0:
            raise FedLookaheadError("bad heads config: hidden_size and vocab_size must be positive, version >= 0")
        if not isinstance(self.base_fingerprint, str):
            raise FedLookaheadError("bad heads config: base_fingerprint must be a string")
        if self.arch not in ARCHITECTURES:
            raise FedLookaheadError(
                f"bad heads config: arch must be one of {', '.join(ARCHITECTURES)}, got {self.arch!r}"
            )
        vocab = self.draft_vocab
        if not isinstance(vocab, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in vocab):
            raise FedLookaheadError("bad heads config: draft_vocab must be a list of token ids")
        if vocab and (min(vocab) < 0 or max(vocab) >= self.vocab_size or len(set(vocab)) != len(vocab)):
            raise FedLookaheadError(f"bad heads config: draft_vocab needs distinct ids in [0, {self.vocab_size})")
        layer = self.layer
        if self.arch != "eagle":
            if layer:
                raise FedLookaheadError(f"bad heads config: {self.arch} heads have no decoder layer")
            return
        if not isinstance(layer, dict) or set(layer) != set(GEOMETRY_KEYS):
            raise FedLookaheadError(f"bad heads config: eagle heads need layer {{{', '.join(GEOMETRY_KEYS)}}}")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in layer.values()):
            raise FedLookaheadError("bad heads config: the layer's geometry must be positive numbers")
        heads, kv_heads = layer["num_attention_heads"], layer["num_key_value_heads"]
        ffn = layer["intermediate_size"]
        if ffn != int(ffn) or ffn > MAX_FFN_RATIO * self.hidden_size:  # a config from the server sizes memory
            raise FedLookaheadError(
                f"bad heads config: intermediate_size must be a whole number of at most {MAX_FFN_RATIO} x the "
                f"hidden size ({MAX_FFN_RATIO * self.hidden_size}), got {ffn}"
            )
        if self.hidden_size % heads or heads % kv_heads or (self.hidden_size // heads) % 2:
            raise FedLookaheadError(
                f"bad heads config: layer geometry {layer} does not fit hidden size {self.hidden_size}"
            )

    @property
    def draft_size(self) -> int:
        return len(self.draft_vocab) or self.vocab_size

    @classmethod
    def from_json(cls, data: object) -> HeadsConfig:
        if not isinstance(data, dict):
            raise FedLookaheadError("bad heads config: expected a JSON object")
        required = {"num_heads", "hidden_size", "vocab_size", "base_fingerprint"}
        known = required | {"version", "arch", "draft_vocab", "layer"}
        if required - set(data) or set(data) - known:
            raise FedLookaheadError(
                f"bad heads config: missing {sorted(required - set(data))}, unknown {sorted(set(data) - known)}"
            )
        return cls(**data)


class FusionHead(nn.Module):
    """Linear(2d, d) over [embedding of the chosen token; hidden state].

    Initialised to pass the hidden state through, so before training head 1 reproduces the base's
    own next-token distribution rather than noise.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * hidden_size, hidden_size)
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.weight[:, hidden_size:].copy_(torch.eye(hidden_size))
            self.proj.bias.zero_()

    def forward(self, token_embedding: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([token_embedding, hidden], dim=-1))


class ResBlock(nn.Module):
    """x + SiLU(W x + b) with W zero-initialised (Medusa): starts as the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class DraftHeads(nn.Module):
    """Fusion + K lookahead heads bound to one base model (by reference to its embedding and LM head)."""

    def __init__(self, config: HeadsConfig, base: BaseModel) -> None:
        super().__init__()
        if (config.hidden_size, config.vocab_size) != (base.hidden_size, base.vocab_size):
            raise FedLookaheadError(
                f"mismatched heads: built for hidden size {config.hidden_size} / vocab {config.vocab_size}, "
                f"base has {base.hidden_size} / {base.vocab_size}"
            )
        self.config = config
        self.fusion = FusionHead(config.hidden_size)
        if self.eagle:
            self.layer = DecoderLayer(config.hidden_size, config.layer)
        else:
            self.blocks = nn.ModuleList(ResBlock(config.hidden_size) for _ in range(config.num_heads))
        self.to(device=base.device, dtype=base.dtype)
        self.bind(base)

    def bind(self, base: BaseModel) -> None:
        """Reference the base's frozen embedding and the draft rows of its LM head.

        Plain attributes, not parameters or buffers: never in state_dict, invisible to Opacus.
        """
        lm_head = base.model.get_output_embeddings()
        ids = torch.tensor(
            self.config.draft_vocab or range(self.config.vocab_size), dtype=torch.long, device=base.device
        )
        to_draft = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=base.device)
        to_draft[ids] = torch.arange(len(ids), device=base.device)
        bias = getattr(lm_head, "bias", None)
        object.__setattr__(self, "base_lm_head", lm_head)
        object.__setattr__(self, "embed", base.model.get_input_embeddings())
        object.__setattr__(self, "draft_ids", ids)  # draft index -> token id
        object.__setattr__(self, "to_draft", to_draft)  # token id -> draft index, -1 outside the draft vocabulary
        weight = lm_head.weight.detach()
        if self.config.draft_vocab:  # a copy of N rows; the whole vocabulary needs none
            weight, bias = weight[ids], None if bias is None else bias.detach()[ids]
        object.__setattr__(self, "draft_weight", weight)
        object.__setattr__(self, "draft_bias", None if bias is None else bias.detach())

    @classmethod
    def fresh(
        cls, base: BaseModel, num_heads: int = 4, arch: str = "recurrent", draft_vocab: list[int] | None = None
    ) -> DraftHeads:
        config = HeadsConfig(
            num_heads,
            base.hidden_size,
            base.vocab_size,
            base.fingerprint,
            arch=arch,
            draft_vocab=list(draft_vocab or []),
            layer=layer_geometry(base.model.config) if arch == "eagle" else {},
        )
        return cls(config, base)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def recurrent(self) -> bool:
        return self.config.arch == "recurrent"

    @property
    def eagle(self) -> bool:
        return self.config.arch == "eagle"

    def draft_logits(self, states: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (..., N) of head states (..., d)."""
        weight = self.draft_weight
        return nn.functional.linear(states.to(weight.dtype), weight, self.draft_bias)

    def _fuse(self, tokens: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        dtype = self.fusion.proj.weight.dtype
        return self.fusion(self.embed(tokens).to(dtype), states.to(dtype))

    def step(
        self, tokens: torch.Tensor, states: DraftState, k: int, cache: ContextCache | None = None
    ) -> tuple[DraftState, torch.Tensor]:
        """Lookahead step k (1-based) of B drafted rows: the tokens at t+k and the states before them ->
        (next states, head states (B, d)). The head state s_k gives the logits for x_{t+k+1}.

        For k = 1 the states are the base's h_t (B, d). The next state is what step k+1 reads: s_k
        (recurrent), f_1 (parallel, every head reads f_1), or for eagle (s_k, path keys, path values),
        the layer's output and each row's speculative ancestors in the `cache`d context.
        """
        if self.eagle:
            feature, path_keys, path_values = states if isinstance(states, tuple) else (states, None, None)
            fused = self._fuse(tokens, feature).unsqueeze(0)
            path = (None, None) if path_keys is None else (path_keys.unsqueeze(0), path_values.unsqueeze(0))
            out, path_keys, path_values = self.layer.speculative(fused, cache.keys, cache.values, None, *path)
            return (out[0], path_keys[0], path_values[0]), out[0]
        fused = self._fuse(tokens, states) if k == 1 or self.recurrent else states
        head_state = self.blocks[k - 1](fused)
        return (head_state if self.recurrent else fused), head_state

    def new_cache(self) -> ContextCache | None:
        """An empty context cache for one generation (None: these heads read no context)."""
        return self.layer.empty_cache() if self.eagle else None

    def commit(self, cache: ContextCache, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Eagle: add real rows (the base's h_t (n, d) and the chosen x_{t+1} (n,)) to the context.

        Returns their states (n, d); the last row's is the first lookahead step from it.
        """
        out, cache.keys, cache.values = self.layer.real(
            self._fuse(tokens, hidden).unsqueeze(0), cache.keys, cache.values
        )
        return out[0]

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced training pass: hidden (B, L, d) and tokens (B, L) -> K logits (B, L-1, N).

        Entry k-1 at position t predicts x_{t+k+1} after fusing x_{t+1}, ..., x_{t+k}; positions with
        t + k > L - 1 read a clamped token and must be masked by the loss.
        """
        length = tokens.shape[1]
        positions = torch.arange(length - 1, device=tokens.device)
        if self.eagle:
            return self._eagle_forward(hidden, tokens, positions)
        states = hidden[:, :-1]
        logits = []
        for k in range(1, self.num_heads + 1):
            step_tokens = tokens[:, (positions + k).clamp_max(length - 1)]
            states, head_state = self.step(step_tokens, states, k)
            logits.append(self.draft_logits(head_state))
        return logits

    def _eagle_forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Step 1 is real rows under a causal mask; step k >= 2 is speculative rows that see the real rows
        <= t and their own steps 2..k (training-time test: the same view as drafting depth k)."""
        length = tokens.shape[1]
        state, keys, values = self.layer.real(self._fuse(tokens[:, 1:], hidden[:, :-1]))
        visible = positions.view(1, -1) <= positions.view(-1, 1)
        logits, path_keys, path_values = [self.draft_logits(state)], None, None
        for k in range(2, self.num_heads + 1):
            fused = self._fuse(tokens[:, (positions + k).clamp_max(length - 1)], state)
            state, path_keys, path_values = self.layer.speculative(fused, keys, values, visible, path_keys, path_values)
            logits.append(self.draft_logits(state))
        return logits

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, directory / WEIGHTS_FILE)
        (directory / CONFIG_FILE).write_text(json.dumps(asdict(self.config)))
        return directory

    @classmethod
    def load(cls, directory: str | Path, base: BaseModel) -> DraftHeads:
        """Load heads saved by `save`; refuses heads for another base, and damaged files, in one line."""
        directory = Path(directory).expanduser()
        if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
            raise FedLookaheadError(f"no heads in {directory} (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
        try:
            config = HeadsConfig.from_json(json.loads((directory / CONFIG_FILE).read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise FedLookaheadError(f"bad heads config {directory / CONFIG_FILE}: not valid JSON ({exc})") from exc
        except TypeError as exc:
            raise FedLookaheadError(f"bad heads config {directory / CONFIG_FILE}: {exc}") from exc
        reason = base_mismatch(config.base_fingerprint, config.hidden_size, config.vocab_size, base)
        if reason:
            raise FedLookaheadError(f"heads in {directory} were {reason}")
        state = read_weights(directory / WEIGHTS_FILE, expected_shapes(config))
        heads = cls(config, base)
        heads.load_state_dict_checked(state)
        return heads

    def load_state_dict_checked(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights after checking names and shapes, with a one-line error on any mismatch."""
        check_shapes({k: tuple(v.shape) for k, v in state.items()}, expected_shapes(self.config))
        expected = self.state_dict()
        self.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})


def expected_shapes(config: HeadsConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape for a config, without building the heads."""
    d = config.hidden_size
    shapes = {"fusion.proj.weight": (d, 2 * d), "fusion.proj.bias": (d,)}
    if config.arch == "eagle":
        return shapes | {f"layer.{name}": shape for name, shape in layer_shapes(d, config.layer).items()}
    for k in range(config.num_heads):
        shapes[f"blocks.{k}.linear.weight"] = (d, d)
        shapes[f"blocks.{k}.linear.bias"] = (d,)
    return shapes


def check_shapes(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    if set(found) != set(expected):
        missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
        raise FedLookaheadError(f"mismatched heads: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in found.items():
        if tuple(shape) != tuple(expected[name]):
            raise FedLookaheadError(f"mismatched heads: {name} has shape {tuple(shape)}, expected {expected[name]}")


def read_weights(path: Path, expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The tensors of a heads file, after checking names and shapes from its header (before reading data)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            check_shapes({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}, expected)
            return {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        if isinstance(exc, FedLookaheadError):
            raise
        raise FedLookaheadError(f"damaged heads file {path}: {str(exc).splitlines()[0]}") from exc
