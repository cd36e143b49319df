"""The kernels and their dispatch (engine/ops.py, engine/kernels/, engine/attention_backend.py)."""
