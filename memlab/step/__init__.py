"""The step package, layer 4 of memlab: a training step and its run description (LoRA,
quantisation, the optimizer step in backward, activation offload), its report, the model states
per rank (ZeRO, low-bit, a decoder's), its DeepSpeed config.

No re-exports: import a name from the module that owns it (the module map: docs/modules.md)."""
