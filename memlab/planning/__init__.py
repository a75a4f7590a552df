"""The planning package, layer 10 of memlab: the advisor, the fastest plan that fits, the OOM
ladder.

No re-exports: import a name from the module that owns it (the module map: docs/modules.md)."""
