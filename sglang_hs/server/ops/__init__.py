"""Kernels of the capture path. Importing this package needs torch and triton, never sglang."""
