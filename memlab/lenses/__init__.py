"""The lenses package, layer 6 of memlab: estimate, simulate, measure, the guard, the H200
reference, any model, parallel formulas.

No re-exports: import a name from the module that owns it (the module map: docs/modules.md)."""
