"""The multi-rank names lessons 09-11 use, kept in one place for ``from memlab import
distributed``: the rank launcher (:mod:`memlab.ranks`), ZeRO with real DeepSpeed
(:mod:`memlab.zero`), offload (:mod:`memlab.offload`) and FSDP2 on a fake process group
(:mod:`memlab.sharded`). Each lives in its own module; this one only re-exports them."""
from .offload import OFFLOAD_CASES, cpu_adam_buildable, measure_offload
from .ranks import (RankError, allreduce_worker, default_backend, fake_process_group,
                    resolve_placement, run_ranks, set_cache_env, set_dist_env)
from .sharded import SHARDED_PRECISIONS, fsdp_worker, simulate_sharded
from .zero import (ACCOUNTS, deepspeed_config, host_gradient_bytes, measure_distributed,
                   measure_zero, zero_accounting, zero_formula, zero_rank_step, zero_worker)

__all__ = ["ACCOUNTS", "OFFLOAD_CASES", "RankError", "SHARDED_PRECISIONS", "allreduce_worker",
           "cpu_adam_buildable", "deepspeed_config", "default_backend", "fake_process_group",
           "fsdp_worker", "host_gradient_bytes", "measure_distributed", "measure_offload",
           "measure_zero", "resolve_placement", "run_ranks", "set_cache_env", "set_dist_env",
           "simulate_sharded", "zero_accounting", "zero_formula", "zero_rank_step", "zero_worker"]
