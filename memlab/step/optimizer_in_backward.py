"""The optimizer step fused into backward: each parameter updated, and its gradient freed, as
soon as its gradient is ready.

PyTorch's tutorial "How to save memory by fusing the optimizer step into the backward pass"
(``intermediate/optimizer_step_in_backward_tutorial``) gives every parameter its own optimizer
and steps it from a ``register_post_accumulate_grad_hook``; torchtune's ``optimizer_in_bwd``
does the same (``torchtune/training/memory.py``, ``register_optim_in_bwd_hooks``). The
gradients never all exist at once: at any moment only the gradient being applied, and those
autograd still holds in flight, are alive. The optimizer state is per parameter too, allocated
at each parameter's first update; in steady state it is the same bytes as one optimizer's.

The price: no gradient accumulation (a micro-batch's gradient would be applied before the next
one adds to it), no gradient clipping by the global norm, no loss scaler (fp16's unscale and
inf check need every gradient first).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class OptimizerInBackward:
    """One optimizer per parameter, each stepped (and its gradient dropped) by a
    post-accumulate-grad hook; it reads like one optimizer to the tracker and the step loop.

    Args:
        params: the trainable parameters.
        make: builds one parameter's optimizer from a one-element list (``lambda ps:
            torch.optim.AdamW(ps, fused=True)``).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.optimizers = {p: make([p]) for p in params}
        self._handles = [p.register_post_accumulate_grad_hook(self._apply) for p in self.optimizers]

    def _apply(self, param: torch.nn.Parameter) -> None:
        opt = self.optimizers[param]
        opt.step()
        opt.zero_grad(set_to_none=True)

    @property
    def param_groups(self) -> list[dict]:
        """Every per-parameter optimizer's groups, in parameter order.

        A dict because it is torch's ``Optimizer.param_groups``, which callers read as such.
        """
        return [g for o in self.optimizers.values() for g in o.param_groups]

    @property
    def state(self) -> dict:
        """Every parameter's optimizer state, by parameter.

        A dict because it is torch's ``Optimizer.state``, which callers read as such.
        """
        return {p: s for o in self.optimizers.values() for p, s in o.state.items()}

    def step(self) -> None:
        """Step the parameters that still hold a gradient: none after a backward (the hooks
        applied them); every one after a warm-up that set them by hand."""
        for p, opt in self.optimizers.items():
            if p.grad is not None:
                opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop any gradient left (the hooks leave none)."""
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def remove(self) -> None:
        """Unregister the hooks (the parameters go back to plain accumulation)."""
        for h in self._handles:
            h.remove()
        self._handles = []


__all__ = ["OptimizerInBackward"]
