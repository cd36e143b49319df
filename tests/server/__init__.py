"""The HTTP server: routes, errors, metrics, a real `layerstream serve` end to end."""
