"""Circuit discovery measured the way the field measures it: MIB's graph, patched evaluation and edge scores."""
