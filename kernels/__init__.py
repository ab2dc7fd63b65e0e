"""Production kernels (Triton, and the Python side of csrc/), registered as torch custom ops."""
