"""Installing and deploying: the wheel, the image context, Kubernetes manifests, Ray Serve, the GPU check."""
