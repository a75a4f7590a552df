"""Mixed precision, measured: fp16 gradient underflow and what loss scaling recovers
(Micikevicius et al. 2018, "Mixed Precision Training", sec. 3.2), and where an autocast step
keeps its 16 bytes per parameter (fp32 master weights, gradients and Adam's moments).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from memlab.core.errors import InputError
from memlab.step.training_step import StepConfig, batch_to, build_trainer, make_batch
from memlab.techniques.sweeps import relative_error

# The smallest positive fp16 value (a subnormal): anything below rounds to zero.
FP16_TINY = 2.0 ** -24


@dataclass
class UnderflowResult:
    """Gradients of one fp16-autocast backward compared with the fp32 reference."""

    loss_scale: float | None
    zero_fraction: float      # entries exactly 0 in fp16 whose fp32 reference is not 0
    rel_error: float          # ||g - g_ref|| / ||g_ref|| over all parameters
    reference: torch.Tensor = field(repr=False)  # fp32 gradients, flattened
    grads: torch.Tensor = field(repr=False)      # fp16-autocast gradients, unscaled

    @property
    def below_fp16(self) -> float:
        """Fraction of reference gradient entries smaller than fp16 can hold at all."""
        return (self.reference.abs() < FP16_TINY).float().mean().item()


def _underflow_model(seed: int, width: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                          nn.Linear(width, 1))
    x = torch.randn(256, width, generator=g)
    y = torch.randn(256, 1, generator=g)
    return model, x, y


def fp16_underflow(loss_scale: float | None = None, *, loss_weight: float = 1e-4,
                   seed: int = 0, width: int = 64) -> UnderflowResult:
    """Backward of a small MLP under fp16 autocast, with or without loss scaling.

    ``loss_weight`` makes the gradients small, as late in training or for a weighted loss
    term; fp16 then flushes many of them to zero. With ``loss_scale`` the loss is multiplied
    before backward and the gradients divided after it, in fp32, as ``GradScaler`` does
    (``torch.amp.GradScaler("cpu", init_scale=loss_scale)``, ``scale`` / ``unscale_``).
    """
    if loss_scale is not None and not loss_scale > 0:
        raise InputError(f"loss_scale={loss_scale!r}; give a positive number or None")
    model, x, y = _underflow_model(seed, width)

    def grads(fp16: bool, scale: float | None) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale) if scale else None
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = loss_weight * ((model(x).float() - y) ** 2).mean()
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)  # divides the fp32 gradients by the scale
        return torch.cat([p.grad.detach().flatten().float() for p in model.parameters()])

    ref = grads(False, None)
    got = grads(True, loss_scale)
    zero = ((got == 0) & (ref != 0)).float().mean().item()
    err = relative_error([got], [ref])
    return UnderflowResult(loss_scale, zero, err, ref, got)


# --------------------------------------------------------------------------------------
# Where mixed precision keeps its 16 bytes per parameter
# --------------------------------------------------------------------------------------
def master_weight_states(step: StepConfig | None = None, *, device: str = "cpu") -> dict[str, float]:
    """Bytes per parameter of each model state when the model itself is bf16 and AdamW
    updates an fp32 master copy: the mixed-precision Adam of ZeRO (Rajbhandari et al. 2020,
    sec. 3.1: 2 + 2 + 12) and of Micikevicius et al. 2018 (sec. 3.1), built in plain torch.

    One real step: bf16 forward and backward; then, one parameter at a time, its bf16 gradient
    becomes an fp32 master gradient, the master takes an AdamW step (fp32 moments) and the
    bf16 weight is overwritten from it, so only one fp32 gradient exists at a time (DeepSpeed
    works partition by partition). The bytes are read from the tensors themselves: the bf16
    weights, their gradients right after backward, the masters and AdamW's state.
    """
    step = replace(step or StepConfig(), precision="pure-bf16", micro_batches=1)
    model = build_trainer(step, device).model
    params = list(model.parameters())
    master = [p.detach().float() for p in params]
    opts = [torch.optim.AdamW([m], lr=1e-4) for m in master]
    model(*batch_to(make_batch(step, device), step)).backward()
    grads = sum(p.grad.nbytes for p in params)
    with torch.no_grad():
        for p, m, opt in zip(params, master, opts, strict=True):
            m.grad = p.grad.float()
            p.grad = None
            opt.step()
            m.grad = None
            p.copy_(m)
    n = sum(p.numel() for p in params)
    moments = sum(t.nbytes for opt in opts for st in opt.state.values() for t in st.values()
                  if t.dim() > 0)  # exp_avg and exp_avg_sq; the scalar step counters aside
    return {"bf16 parameters": sum(p.nbytes for p in params) / n, "bf16 gradients": grads / n,
            "fp32 master": sum(m.nbytes for m in master) / n, "Adam moments": moments / n}


__all__ = ["FP16_TINY", "UnderflowResult", "fp16_underflow", "master_weight_states"]
