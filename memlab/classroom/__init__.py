"""The classroom package, layer 11 of memlab: lessons, predictions, exercises, the technique table,
plots, widgets, collection.

No re-exports: import a name from the module that owns it (the module map: docs/modules.md)."""
