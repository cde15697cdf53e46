"""Portable (Triton + PyTorch) GPU kernels: paged attention, fused norm, rotary + cache write."""
