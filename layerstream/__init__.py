"""The `layerstream` command: one dispatcher above the engine, the server and the benchmarks."""
