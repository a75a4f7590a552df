"""The ZeRO paper's per-rank formula (Rajbhandari et al. 2020, "ZeRO", sec. 5.1): the
model-state bytes each of ``N_d`` data-parallel ranks keeps at stage 0-3. The accounting of
DeepSpeed's own implementation, which keeps more than the paper's minimum, is
:mod:`memlab.step.states`."""
from __future__ import annotations

from memlab.core.errors import InputError


def zero_formula(num_params: int, stage: int, world_size: int, *, param_bytes: int = 2,
                 grad_bytes: int = 2, k: int = 12) -> dict[str, float]:
    """Model-state bytes per rank from the ZeRO paper (Rajbhandari et al. 2020, sec. 5.1):
    (2 + 2 + K) psi for mixed-precision Adam (K = 12: fp32 master, momentum, variance);
    stage 1 divides K psi by N_d, stage 2 also the gradients, stage 3 also the parameters."""
    if stage not in (0, 1, 2, 3) or world_size < 1:
        raise InputError(f"stage must be 0-3 and world_size >= 1, got {stage}, {world_size}")
    n = world_size
    return {"parameters": param_bytes * num_params / (n if stage >= 3 else 1),
            "gradients": grad_bytes * num_params / (n if stage >= 2 else 1),
            "optimizer": k * num_params / (n if stage >= 1 else 1)}


def zero_saving(stage: int, n: int, k: int = 12) -> float:
    """Model-state saving of ZeRO stage ``stage`` on ``n`` ranks against stage 0, with
    mixed-precision Adam: ``1 - zero_formula(stage, n) / zero_formula(0, 1)``."""
    base = sum(zero_formula(1, 0, 1, k=k).values())
    return 1 - sum(zero_formula(1, stage, n, k=k).values()) / base
