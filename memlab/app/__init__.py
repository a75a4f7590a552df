"""The app package, layer 12 of memlab: the memlab command, doctor, the GPU check; and memlab's
front door.

No re-exports: import a name from the module that owns it (the module map: docs/modules.md)."""
