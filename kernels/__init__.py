"""Triton kernels for the hot stages, each with a torch reference (`*_ref`)."""
