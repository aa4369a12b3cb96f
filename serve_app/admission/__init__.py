"""Admission: byte budget, leases, bounded FIFO wait, Retry-After. Pure: no ray/torch/fastapi."""
