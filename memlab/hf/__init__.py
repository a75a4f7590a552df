"""The hf package, layer 9 of memlab: Hugging Face configs checked, read, shaped, estimated,
measured; run configs read; callbacks.

No re-exports: import a name from the module that owns it (the module map: docs/modules.md)."""
