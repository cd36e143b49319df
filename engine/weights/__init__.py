"""The weights package: everything that knows where a model's weights live and how they reach compute.

(Its public interface is written down here as it takes shape; see docs/ARCHITECTURE.md.)
"""
