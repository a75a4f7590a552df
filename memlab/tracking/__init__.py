"""The tracking package, layer 1 of memlab: the memory tracker, allocator snapshots, OOM messages
read into numbers.

No re-exports: import a name from the module that owns it (the module map: docs/modules.md)."""
