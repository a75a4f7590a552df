"""Tensor and pipeline parallelism, measured per rank.

Tensor parallelism (TP, Shoeybi et al. 2019, "Megatron-LM", section 3) splits every weight
matrix of a transformer block across ``t`` ranks: the first Linear of attention (``qkv``) and
of the MLP (``fc``) column-wise, the second (``proj``, ``out``) row-wise, so each pair needs
one all-reduce in forward and one in backward. Each rank keeps ``1/t`` of the block weights
and of the activations inside attention and the MLP; LayerNorms, embeddings and the inputs
of the two sublayers stay replicated (Korthikanti et al. 2022, section 4.2.1). Grouped-query
models split their key/value heads across ranks, or replicate them when there are fewer
key/value heads than ranks (:mod:`memlab.distributed.tensor_parallel`).

Pipeline parallelism (PP, Huang et al. 2019 "GPipe"; Narayanan et al. 2021 section 2.2)
gives each of ``p`` ranks a contiguous slice of the blocks and streams ``m`` micro-batches
through them; ranks idle while the pipeline fills and drains, the *bubble*
``(p - 1) / (m + p - 1)`` of each rank's time. GPipe runs all forwards, then all backwards
(holding ``m`` micro-batches of activations); 1F1B interleaves them (holding at most ``p``).

Workers follow :func:`memlab.distributed.ranks.run_ranks`' contract ``fn(rank, world_size,
**kwargs)`` and run after ``init_process_group``; ``python -m memlab.distributed tp|pp`` runs
the same worker under ``torchrun`` (:mod:`memlab.distributed.__main__`). Figures and the
lesson's panel live in :mod:`memlab.ui`.
"""
