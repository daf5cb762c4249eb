"""Framework-free Numba kernels (CPU and CUDA) for bucketed quantization, each beside a NumPy reference."""
