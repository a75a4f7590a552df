"""The techniques package, layer 7 of memlab: sweeps, mixed precision, accumulation, batch search,
compression, batching, LoRA, leaks.

No re-exports: import a name from the module that owns it (the module map: docs/modules.md)."""
