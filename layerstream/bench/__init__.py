"""Benchmarks: each prints ratios side by side in one run and can write a PNG chart."""
