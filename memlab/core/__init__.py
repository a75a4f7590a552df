"""The core package, layer 0 of memlab: errors, sizes, precisions, cards and devices, quiet output,
torch's private APIs.

No re-exports: import a name from the module that owns it (the module map: docs/modules.md)."""
