"""Triton kernels of the layers (GPU); each has a torch reference beside its caller and a test."""
