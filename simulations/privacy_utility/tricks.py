"""The search over DP tricks at epsilon 8: each trick added greedily to the recipe and kept only when
it raises the validation tau; the epsilons below 8 then use the recipe it chose."""

from __future__ import annotations

from simulations.privacy_utility.configs import TRICK_EPSILON, dp_run_config
from simulations.privacy_utility.session import Session, strip

# Each trick: (name, run-config overrides it adds to the recipe). Tried in this order, kept if it helps.
TRICKS = (
    ("large_batch", {"batch-size": 64}),  # expected batch 64 instead of 16: ~4x fewer, less noisy steps
    ("lr_clip", {"lr": 3e-4, "dp-max-grad-norm": 0.3}),  # a smaller step and a tighter clip for DP
    ("server_momentum", {"server-optimizer": "fedavgm", "server-momentum": 0.9, "server-lr": 0.5}),
    ("fusion_only", {"dp-trainable": "fusion"}),  # 1/3 of the parameters: the same noise on fewer coordinates
    # rank-8 updates of every Linear (~50k coordinates instead of ~2M), which need a larger step
    ("low_rank", {"dp-trainable": "lowrank", "dp-rank": 8, "lr": 3e-3}),
)


def choose_recipe(session: Session) -> tuple[dict, dict]:
    """DP at TRICK_EPSILON with the default recipe, then (when the scale asks) each trick in turn; fills
    result["dp"][TRICK_EPSILON] with the best run and result["tricks"] with the comparison, saving after
    each run. Returns (the chosen recipe, the best run's entry, heads included)."""
    result, timings = session.result, session.timings
    recipe: dict = {}
    best = session.run(f"dp-eps{TRICK_EPSILON}-default", dp_run_config(session.run_config, TRICK_EPSILON, recipe))
    result["dp"] = {str(TRICK_EPSILON): strip(best)}
    session.save()
    if not session.scale.tricks:
        return recipe, best
    comparison = [
        {
            "trick": "default (batch 16, lr 1e-3, clip 1.0, FedAvg, all parameters)",
            "kept": True,
            "val_tau_heads_only": best["val_tau_heads_only"],
            "tau_heads_only": best["tau_heads_only"],
            "acc": best["acc"],
            "recipe": {},
        }
    ]
    for name, change in TRICKS:
        trial = session.run(
            f"dp-eps{TRICK_EPSILON}-{name}", dp_run_config(session.run_config, TRICK_EPSILON, {**recipe, **change})
        )
        kept = trial["val_tau_heads_only"] > best["val_tau_heads_only"]
        comparison.append(
            {
                "trick": name,
                "kept": kept,
                "val_tau_heads_only": trial["val_tau_heads_only"],
                "tau_heads_only": trial["tau_heads_only"],
                "acc": trial["acc"],
                "recipe": {**recipe, **change},
                "seconds": timings[f"dp-eps{TRICK_EPSILON}-{name}"],
            }
        )
        if kept:
            recipe, best = {**recipe, **change}, trial
        result["tricks"] = {"epsilon": TRICK_EPSILON, "comparison": comparison, "chosen_recipe": recipe}
        result["dp"][str(TRICK_EPSILON)] = strip(best)
        session.save()
    return recipe, best
