"""The model-parallel degrees of a run, in one object (torchtitan's ``ParallelDims``): how the
ranks of :attr:`memlab.step.training_step.StepConfig.world_size` split the model. Data
parallelism, and ZeRO's sharding across it, takes the ranks left: ``world_size / (tensor x
pipeline)`` replicas of the model (:func:`memlab.step.states.data_parallel_ranks`)."""
from dataclasses import dataclass

from memlab.core.errors import InputError


@dataclass(frozen=True)
class ParallelDims:
    """Tensor, pipeline and expert degrees; all 1 is plain data parallelism (see the module doc).

    Raises:
        InputError: a degree that is not a positive integer, or an imbalance below 1.
    """

    tensor: int = 1
    """Megatron-style tensor parallelism: ranks that split each layer's heads and MLP columns, with
    a vocabulary-parallel loss (divides ``world_size``; :func:`memlab.lenses.estimate.estimate_step`)."""
    pipeline: int = 1
    """Pipeline stages the layers are split into (the time lens: :func:`memlab.time.step_time.step_time`;
    memory per stage: :mod:`memlab.lenses.parallel_formulas`)."""
    expert: int = 1
    """Ranks a mixture of experts' routed experts are divided across (a decoder's run)."""
    expert_imbalance: float = 1.0
    """The busiest expert-parallel rank's tokens over the balanced share (1: balanced routing)."""

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "expert"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} parallel degree {value!r}; allowed: a positive integer")
        if isinstance(self.expert_imbalance, bool) or not self.expert_imbalance >= 1.0:
            raise InputError(f"expert_imbalance={self.expert_imbalance!r}; allowed: >= 1 (1 = balanced routing)")


__all__ = ["ParallelDims"]
