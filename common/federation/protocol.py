"""The wire protocol between the ServerApp and the ClientApps: every key, and the one validation of a reply.

A client's reply is untrusted input. `TrainReply.from_content` and `EvalReply.from_content` turn the
Flower records of a train (legacy FitRes layout, see client/client_app.py) or evaluate reply into a
typed, checked value, or raise `ReplyError` with a one-line reason. The server's guard calls them
once per reply; everything downstream (aggregation, the round record, the store) reads the typed
fields and never re-parses the records.

What is checked, per value: its type (a number is an int or float, never a bool, str or list unless
the field is a list), that it is finite (epsilon may be +inf: no DP), and its range (accuracies and
q in [0, 1], delta in [0, 1), counts and seconds >= 0, one accuracy per head). Unknown metric keys
are ignored (never stored). Weight policy (caps) is the server's, not the protocol's.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, NoReturn

# ------------------------------------------------------------------------------------------ keys

ROUND_KEY = "server-round"  # train/evaluate config: the server round
RUN_KEY = "fedla-run-id"  # train config: the run id (keys the client's privacy accountant)
HEADS_CODEC = "heads-codec"  # train config: how fitins.parameters are encoded (common/federation/wire.py)
# train config under dp-level=user with user-dp-noise=device (common/federation/user_dp.py): the run's noise
# multiplier, the fewest shares its sum is sized for, and the sampling rate its accounting claims
USER_DP_NOISE_MULTIPLIER = "user-dp-noise-multiplier"
USER_DP_NOISE_COHORT = "user-dp-noise-cohort"
USER_DP_SAMPLE_RATE = "user-dp-sample-rate"
# ... and under adaptive clipping (user-dp-clip-quantile > 0): the noise on the sum of centred clip bits, and the
# scale that fits a bit and its noise share into SecAgg+'s range (the bit travels as the update's last array)
USER_DP_BIT_NOISE = "user-dp-bit-noise"
USER_DP_BIT_SCALE = "user-dp-bit-scale"
CLIP_BIT_SHAPE = ("clip-bit", (1,))  # its (name, shape) after the heads' in the masked vector
PUBLIC_PRECONDITIONER = "public-preconditioner"  # train config, client-optimizer=public-sgd: Preconditioner.to_bytes
BAD_SHARE_SOURCES = "fedla-bad-share-sources"  # SecAgg+ collect reply: peers whose key shares did not decrypt
EVALUATE = "evaluate"  # evaluate config: measure the heads on held-out chunks (false: a push, only keep them)
HEADS_RECORD = "heads"  # ArrayRecord name in native (evaluate) messages
HEADS_CONFIG_RECORD = "heads-config"  # ConfigRecord name in native (evaluate) messages
EVAL_METRICS_RECORD = "metrics"  # MetricRecord name of an evaluate reply

# heads-config ConfigRecord keys (kebab-case like Flower's own run-config keys)
FINGERPRINT = "base-fingerprint"
VERSION = "head-version"
NUM_HEADS = "num-heads"
HIDDEN = "hidden-size"
VOCAB = "vocab-size"
NAMES = "param-names"
ARCH = "heads-arch"
DRAFT_VOCAB = "draft-vocab"  # the heads' draft vocabulary (token ids, from public data); [] = whole vocabulary
LAYER = "heads-layer"  # eagle heads: the decoder layer's geometry as a JSON object ("" for other architectures)

# Flower's legacy FitIns/FitRes layout (flwr.compat.common.recorddict_compat)
FITINS_PARAMETERS = "fitins.parameters"
FITRES_PARAMETERS = "fitres.parameters"
FITRES_METRICS = "fitres.metrics"
FITRES_NUM_EXAMPLES = "fitres.num_examples"
FITRES_STATUS = "fitres.status"

# train metrics (FitRes.metrics), kebab-case like Flower's run-config keys
SKIPPED = "skipped"
SKIP_REASON = "skip-reason"
EPSILON = "epsilon"
DELTA = "delta"
DP = "dp"
Q = "q"
NO_AMPLIFICATION = "no-amplification"
NOISE_MULTIPLIER = "noise-multiplier"
STEPS = "steps"
NUM_TRAIN_CHUNKS = "num-train-chunks"
TRAIN_SECONDS = "train-seconds"
LOSS = "loss"
ACC_PREFIX = "acc-"  # acc-1 .. acc-K: training top-1 accuracy of head k

# evaluate metrics (MetricRecord "metrics")
NUM_EXAMPLES = "num-examples"
HEAD_ACCURACY = "head-accuracy"
TAU = "tau"
EVAL_SECONDS = "eval-seconds"
WITHHELD = "withheld"  # 1: a device that reveals no evaluation of its private data (client/client_app.py)

MAX_REASON = 300  # characters of a client-given skip reason that are kept


class ReplyError(ValueError):
    """A client reply that breaks the protocol; the message is one line naming the value."""


# ------------------------------------------------------------------------------------ value checks


def fail(message: str) -> NoReturn:
    """Refuse a value: a ReplyError whose message is one line, whatever the value held."""
    raise ReplyError(" ".join(str(message).split()))


def show(value: Any) -> str:
    """A value as an error message quotes it: its repr, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def number(
    value: Any,
    name: str,
    *,
    lo: float | None = 0.0,
    hi: float | None = None,
    allow_inf: bool = False,
    hi_open: bool = False,
) -> float:
    """A finite real number (not a bool) within [lo, hi]; +inf only with `allow_inf`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(f"{name} must be a number, got {type(value).__name__} {show(value)}")
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not (allow_inf and value > 0)):
        fail(f"non-finite {name}={value}")
    if lo is not None and value < lo:
        fail(f"out-of-range {name}={value:g}: below {lo:g}")
    if hi is not None and (value >= hi if hi_open else value > hi):
        fail(f"out-of-range {name}={value:g}: above {hi:g}")
    return value


def integer(value: Any, name: str, *, lo: int = 0) -> int:
    """An integer (an int, or a float with an integral finite value; never a bool) >= lo."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(f"{name} must be an integer, got {type(value).__name__} {show(value)}")
    if isinstance(value, numbers.Integral):
        result = int(value)
    else:
        if not math.isfinite(float(value)):
            fail(f"non-finite {name}={float(value)}")
        if not float(value).is_integer():
            fail(f"{name} must be an integer, got {float(value)}")
        result = int(value)
    if result < lo:
        fail(f"out-of-range {name}={result}: below {lo}")
    return result


def flag(value: Any, name: str) -> bool:
    """0/1 (or a bool): the way flags travel in records."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(value)
    fail(f"{name} must be 0 or 1, got {type(value).__name__} {show(value)}")


def text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        fail(f"{name} must be a string, got {type(value).__name__}")
    return " ".join(value.split())[:MAX_REASON]


def _mapping(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        fail(f"{name} is missing or not a record")
    return value


# ------------------------------------------------------------------------------------------ train


@dataclass(frozen=True)
class TrainReply:
    """One client's plaintext train result (FitRes.num_examples + metrics), checked."""

    num_examples: int  # the aggregation weight the client claims (0: it did not train)
    skipped: bool = False
    skip_reason: str = ""
    epsilon: float | None = None  # cumulative; +inf without DP; None: not reported
    delta: float = 0.0
    dp: bool = False
    q: float = 0.0
    no_amplification: bool = False
    noise_multiplier: float = 0.0
    steps: int = 0
    num_train_chunks: int = 0
    train_seconds: float = 0.0
    loss: float | None = None  # None: it did not train
    head_accuracy: tuple[float, ...] = ()  # acc-1 .. acc-K, empty when it did not train

    @property
    def trained(self) -> bool:
        return not self.skipped and self.loss is not None

    @classmethod
    def from_metrics(cls, num_examples: Any, metrics: Mapping[str, Any], num_heads: int | None = None) -> TrainReply:
        """Check a weight and a metrics mapping; `num_heads` bounds the acc-k keys."""
        metrics = _mapping(metrics, "train metrics")
        weight = integer(num_examples, "num_examples")
        skipped = flag(metrics.get(SKIPPED, 0), SKIPPED)
        accuracies: dict[int, float] = {}
        for key, value in metrics.items():
            if not isinstance(key, str):
                fail(f"metric key {show(key)} is not a string")
            if key.startswith(ACC_PREFIX):
                suffix = key[len(ACC_PREFIX) :]
                if not suffix.isdigit() or int(suffix) < 1 or (num_heads is not None and int(suffix) > num_heads):
                    fail(f"unknown metric {key}" + (f" for {num_heads} heads" if num_heads is not None else ""))
                accuracies[int(suffix)] = number(value, key, hi=1.0)
        loss = None if metrics.get(LOSS) is None else number(metrics[LOSS], LOSS)
        if accuracies and sorted(accuracies) != list(range(1, len(accuracies) + 1)):
            fail(f"head accuracies {sorted(accuracies)} are not acc-1..acc-{len(accuracies)}")
        if num_heads is not None and loss is not None and accuracies and len(accuracies) != num_heads:
            fail(f"{len(accuracies)} head accuracies for {num_heads} heads")
        reply = cls(
            num_examples=weight,
            skipped=skipped,
            skip_reason=text(metrics.get(SKIP_REASON, ""), SKIP_REASON),
            epsilon=None if metrics.get(EPSILON) is None else number(metrics[EPSILON], EPSILON, allow_inf=True),
            delta=number(metrics.get(DELTA, 0.0), DELTA, hi=1.0, hi_open=True),
            dp=flag(metrics.get(DP, 0), DP),
            q=number(metrics.get(Q, 0.0), Q, hi=1.0),
            no_amplification=flag(metrics.get(NO_AMPLIFICATION, 0), NO_AMPLIFICATION),
            noise_multiplier=number(metrics.get(NOISE_MULTIPLIER, 0.0), NOISE_MULTIPLIER),
            steps=integer(metrics.get(STEPS, 0), STEPS),
            num_train_chunks=integer(metrics.get(NUM_TRAIN_CHUNKS, 0), NUM_TRAIN_CHUNKS),
            train_seconds=number(metrics.get(TRAIN_SECONDS, 0.0), TRAIN_SECONDS),
            loss=loss,
            head_accuracy=tuple(accuracies[k] for k in sorted(accuracies)),
        )
        if reply.skipped and reply.num_examples:
            fail(f"a skipped client claims weight {reply.num_examples}")
        if not reply.skipped and reply.num_examples == 0:
            fail("weight 0 without skipped=1")
        return reply

    @classmethod
    def from_content(cls, content: Any, num_heads: int | None = None) -> TrainReply:
        """From the records of a legacy FitRes reply (plain FedAvg, or SecAgg+'s masked-vector stage)."""
        try:
            count = content.metric_records[FITRES_NUM_EXAMPLES]["num_examples"]
        except (KeyError, TypeError, AttributeError):
            fail("reply has no num_examples")
        try:
            metrics = content.config_records[FITRES_METRICS]
        except (KeyError, TypeError, AttributeError):
            fail("reply has no metrics")
        return cls.from_metrics(count, dict(metrics), num_heads)

    def to_metrics(self) -> dict[str, Any]:
        """The FitRes.metrics a client sends (Flower scalars only)."""
        out: dict[str, Any] = {
            SKIPPED: int(self.skipped),
            SKIP_REASON: self.skip_reason,
            DELTA: float(self.delta),
            DP: int(self.dp),
            Q: float(self.q),
            NO_AMPLIFICATION: int(self.no_amplification),
            NOISE_MULTIPLIER: float(self.noise_multiplier),
            STEPS: int(self.steps),
            NUM_TRAIN_CHUNKS: int(self.num_train_chunks),
            TRAIN_SECONDS: float(self.train_seconds),
        }
        if self.epsilon is not None:
            out[EPSILON] = float(self.epsilon)
        if self.loss is not None:
            out[LOSS] = float(self.loss)
        out.update({f"{ACC_PREFIX}{k}": float(a) for k, a in enumerate(self.head_accuracy, start=1)})
        return out


# ------------------------------------------------------------------------------------------- eval


@dataclass(frozen=True)
class EvalReply:
    """One client's evaluation of the global heads on its local held-out chunks, checked."""

    num_examples: int
    loss: float | None = None
    head_accuracy: tuple[float, ...] = ()
    tau: float | None = None
    eval_seconds: float = 0.0
    withheld: bool = False  # a device that reveals nothing measured on its data

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any], num_heads: int | None = None) -> EvalReply:
        metrics = _mapping(metrics, "evaluation metrics")
        if NUM_EXAMPLES not in metrics:
            fail(f"evaluation reply has no {NUM_EXAMPLES}")
        count = integer(metrics[NUM_EXAMPLES], NUM_EXAMPLES)
        withheld = flag(metrics.get(WITHHELD, 0), WITHHELD)
        if withheld and (count or set(metrics) - {NUM_EXAMPLES, WITHHELD}):
            fail("a withheld evaluation reply carries measurements")
        raw = metrics.get(HEAD_ACCURACY)
        accuracy: tuple[float, ...] = ()
        if raw is not None:
            if not isinstance(raw, (list, tuple)):
                fail(f"{HEAD_ACCURACY} must be a list of numbers, got {type(raw).__name__} {show(raw)}")
            accuracy = tuple(number(a, f"{HEAD_ACCURACY}[{i}]", hi=1.0) for i, a in enumerate(raw))
            if num_heads is not None and len(accuracy) != num_heads:
                fail(f"{len(accuracy)} head accuracies for {num_heads} heads")
        if count and not accuracy:
            fail(f"{count} evaluation examples but no {HEAD_ACCURACY}")
        loss = None if metrics.get(LOSS) is None else number(metrics[LOSS], LOSS)
        tau = None if metrics.get(TAU) is None else number(metrics[TAU], TAU)
        return cls(
            num_examples=count,
            loss=loss,
            head_accuracy=accuracy,
            tau=tau,
            eval_seconds=number(metrics.get(EVAL_SECONDS, 0.0), EVAL_SECONDS),
            withheld=withheld,
        )

    @classmethod
    def from_content(cls, content: Any, num_heads: int | None = None) -> EvalReply:
        try:
            metrics = content.metric_records[EVAL_METRICS_RECORD]
        except (KeyError, TypeError, AttributeError):
            fail(f"evaluation reply has no {EVAL_METRICS_RECORD!r} record")
        return cls.from_metrics(dict(metrics), num_heads)

    def to_metrics(self) -> dict[str, Any]:
        """The evaluate reply's MetricRecord a client sends; a withheld reply carries nothing measured."""
        if self.withheld:
            return {NUM_EXAMPLES: 0, WITHHELD: 1}
        out: dict[str, Any] = {NUM_EXAMPLES: int(self.num_examples), EVAL_SECONDS: float(self.eval_seconds)}
        if self.loss is not None:
            out[LOSS] = float(self.loss)
        if self.head_accuracy:
            out[HEAD_ACCURACY] = [float(a) for a in self.head_accuracy]
        if self.tau is not None:
            out[TAU] = float(self.tau)
        return out


# ------------------------------------------------------------------------------------------ round


def finite_or_none(value: Any) -> Any:
    """`value` as strict JSON: a non-finite float (an unbounded epsilon: no DP) becomes None, in any
    nesting of dicts, lists and tuples. The one JSON cleaner of round records, run files and the store."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(key): finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return value
