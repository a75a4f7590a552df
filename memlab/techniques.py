"""The single-device techniques lessons 04-06 measure, under one name for ``from memlab
import techniques``: sweeps and report readings (:mod:`memlab.sweeps`), mixed precision
(:mod:`memlab.mixed_precision`), gradient accumulation (:mod:`memlab.accumulation`) and the
largest batch that fits (:mod:`memlab.max_batch`). This module only re-exports them."""
from .accumulation import AccumulationCheck, accumulation_check
from .max_batch import BatchPrediction, BatchSearch, find_max_batch_search, predict_max_batch
from .mixed_precision import FP16_TINY, UnderflowResult, fp16_underflow, master_weight_states
from .sweeps import (LENSES, activations_by_module, category_max, lens_fn, relative_error,
                     step_flops, sweep)

__all__ = ["LENSES", "FP16_TINY", "lens_fn", "sweep", "category_max", "activations_by_module",
           "step_flops", "relative_error", "UnderflowResult", "fp16_underflow",
           "master_weight_states", "AccumulationCheck", "accumulation_check", "BatchSearch",
           "find_max_batch_search", "BatchPrediction", "predict_max_batch"]
