"""What tests share: the reference models, the CUDA replay harness, the server launcher and other helpers.
No test module imports another; they import from here."""
