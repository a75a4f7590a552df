"""The time package, layer 5 of memlab: a step's FLOPs, elementwise bytes, communication and its
time on a card.

No re-exports: import a name from the module that owns it (the module map: docs/modules.md)."""
