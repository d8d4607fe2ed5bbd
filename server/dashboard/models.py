"""The JSON API's response models (pydantic): what /api/... returns, documented at /openapi.json."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Optional

from pydantic import BaseModel, Field


class RunSummaryOut(BaseModel):
    run_id: str
    status: str = Field(description='"running", "finished" or "failed"')
    started_at: datetime
    updated_at: datetime
    finished_at: Optional[datetime] = None
    num_rounds: int
    last_round: Optional[int] = None
    last_train_loss: Optional[float] = None
    last_tau: Optional[float] = None
    last_epsilon_max: Optional[float] = Field(None, description="null when unbounded (no DP) or no rounds yet")
    epsilon_budget: Optional[float] = Field(
        None, description="epsilon each client may spend in the run (null: no DP, a fixed noise multiplier, or no plan)"
    )


class CheckpointOut(BaseModel):
    round: int
    head_version: int
    path: str
    size_bytes: int
    sha256: str
    created_at: datetime


class StartingHeadsOut(BaseModel):
    head_accuracy: list[float] = Field(description="server-side held-out top-1 accuracy per head before round 1")
    tau: Optional[float] = None
    tau_heads_only: Optional[float] = None
    loss: Optional[float] = None


class RunOut(BaseModel):
    run_id: str
    status: str
    config: dict[str, Any]
    secagg: dict[str, Any] = Field(description="SecAgg+ settings the run used")
    plan: Optional[dict[str, Any]] = Field(
        None, description="known before round 1: nodes, clients per round, SecAgg+ shares, privacy (budget, verdict)"
    )
    starting_heads: Optional[StartingHeadsOut] = Field(
        None, description="the round-0 point: the heads the run starts from"
    )
    started_at: datetime
    updated_at: datetime
    finished_at: Optional[datetime] = None
    num_rounds: int
    last_round: Optional[int] = None
    latest_checkpoint: Optional[CheckpointOut] = None


class MetricsOut(BaseModel):
    train_loss: float = Field(description="aggregated training loss of the round")
    head_accuracy: list[float] = Field(description="server-side held-out top-1 accuracy per lookahead head")
    tau: Optional[float] = Field(None, description="server-side mean accepted tokens per decoding step")
    client_head_accuracy: Optional[list[float]] = None
    client_tau: Optional[float] = None


class RejectedOut(BaseModel):
    reason: str


class ParticipationOut(BaseModel):
    sampled: int
    succeeded: int
    dropped: int
    rejected: list[RejectedOut]


class PrivacyOut(BaseModel):
    epsilon_max: Optional[float] = Field(None, description="null when unbounded (no DP)")
    epsilon_mean: Optional[float] = None
    delta: Optional[float] = None


class BytesOut(BaseModel):
    down_per_client: int = Field(description="heads sent to one sampled client")
    up_per_client: int = Field(description="one client's (masked) update")
    eval_push_per_client: int = Field(description="heads pushed to one client for evaluation")


class SecondsOut(BaseModel):
    fit: Optional[float] = Field(None, description="the train exchange (SecAgg+ stages and aggregation)")
    server_eval: Optional[float] = None
    client_eval: Optional[float] = None
    client_train_sum: Optional[float] = Field(None, description="the clients' own training time, summed")


class RoundOut(BaseModel):
    round: int
    metrics: MetricsOut
    tau_heads_only: Optional[float] = Field(
        None, description="server-side tau of the heads alone, without the n-gram drafter (measured on the last round)"
    )
    participation: ParticipationOut
    privacy: PrivacyOut
    wall_seconds: float
    bytes_per_client: int
    bytes: Optional[BytesOut] = Field(None, description="null for rounds recorded before schema v3")
    seconds: Optional[SecondsOut] = Field(None, description="null for rounds recorded before schema v3")
    recorded_at: datetime


class ErrorOut(BaseModel):
    detail: str


class BenchmarkRunOut(BaseModel):
    kind: str = Field(description="federated_nodp or dp")
    epsilon: Optional[float] = Field(description="the run's target epsilon (null: no DP)")
    tau: float


class PrivacyUtilityOut(BaseModel):
    epsilon: list[float] = Field(description="target epsilons of the DP runs (delta 1e-5, all rounds)")
    dp: list[float] = Field(description="heads-only tau on the clients' held-out code at each epsilon")
    references: dict[str, float] = Field(description="public_only, federated_nodp, central_nodp tau")
    clients: Optional[int]
    rounds: Optional[int]
    this_run: Optional[BenchmarkRunOut] = Field(description="where this run sits on the curve")
