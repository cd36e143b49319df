"""The weights package: readers, packed weights, transports (CUDA replayed on CPU), the streamer, experts."""
