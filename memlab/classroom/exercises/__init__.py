"""Checkers for the learners' own code: one ``check_<name>`` per "Your turn" exercise.

Each checker runs the learner's code on the tiny model, next to a reference, and says what is
right or wrong in measured terms: gradients against the reference within a stated tolerance,
bytes saved against a formula, a DeepSpeed config against DeepSpeed itself. A correct answer
returns a :class:`CheckResult` (printed in the notebook); a wrong one raises
``AssertionError`` with a specific message, so a notebook whose solution has rotted fails
under nbval.

>>> result = check_accumulation(accumulate)      # accumulate(model, optimizer, batch, k)
>>> result.measured["max_grad_diff"]

The DeepSpeed checkers run ``deepspeed.initialize`` in this process as rank 0 of N, on a fake
process group (:func:`fake_ranks`): DeepSpeed builds exactly the partitions that rank holds,
while collectives exchange nothing. Bytes and configs are real; losses are not.
"""

from memlab.classroom.exercises.accumulation import ACC_TOLERANCE, RecordingOptimizer, check_accumulation
from memlab.classroom.exercises.amp import AMP_TOLERANCE, check_amp_step, reference_amp_step
from memlab.classroom.exercises.checkpoint import CKPT_TOLERANCE, check_checkpointed_block
from memlab.classroom.exercises.common import CheckFailed, CheckResult
from memlab.classroom.exercises.compression import PACK_TOLERANCE, check_pack_hooks
from memlab.classroom.exercises.data_parallel import DP_TOLERANCE, check_gradient_average
from memlab.classroom.exercises.diffusion import check_skip_bytes
from memlab.classroom.exercises.evaluation import STORE_TOLERANCE, check_eval_store
from memlab.classroom.exercises.experts import check_expert_states
from memlab.classroom.exercises.gqa import check_kv_cache
from memlab.classroom.exercises.leaks import check_leak_fixed
from memlab.classroom.exercises.logits import ESTIMATOR_TOLERANCE, check_estimator
from memlab.classroom.exercises.oom import check_oom_fix
from memlab.classroom.exercises.pipeline import check_in_flight
from memlab.classroom.exercises.planning import check_min_ranks, reference_min_ranks
from memlab.classroom.exercises.start import check_first_step, check_state_bytes
from memlab.classroom.exercises.table import SAVING_TOLERANCE, check_peak_saving
from memlab.classroom.exercises.tensor_parallel import TP_TOLERANCE, check_tensor_parallel
from memlab.classroom.exercises.zero import check_offload_config, check_zero_config

__all__ = ["CheckResult", "CheckFailed", "check_eval_store", "STORE_TOLERANCE",
           "check_first_step", "check_state_bytes", "check_estimator",
           "ESTIMATOR_TOLERANCE", "check_oom_fix", "check_leak_fixed", "check_amp_step", "reference_amp_step",
           "check_checkpointed_block", "check_accumulation", "RecordingOptimizer",
           "check_zero_config",
           "check_offload_config", "check_tensor_parallel", "check_pack_hooks",
           "check_gradient_average", "DP_TOLERANCE", "check_min_ranks", "reference_min_ranks",
           "check_kv_cache", "check_expert_states", "check_skip_bytes", "check_in_flight", "check_peak_saving",
           "SAVING_TOLERANCE",
           "AMP_TOLERANCE", "CKPT_TOLERANCE", "ACC_TOLERANCE", "TP_TOLERANCE", "PACK_TOLERANCE"]
