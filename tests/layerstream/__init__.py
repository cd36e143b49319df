"""The `layerstream` command's own modules: convert, the reference generator, the benchmarks' pieces."""
