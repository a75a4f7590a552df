"""The models package, layer 3 of memlab: memlab's own GPT and UNet, a decoder's shape (the one the
lenses read), the chunked loss head, the UNet's activations.

No re-exports: import a name from the module that owns it (the module map: docs/modules.md)."""
