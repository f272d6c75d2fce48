"""CUDA C++ sources of gpu_codec's kernels (installed as the package data ``gpu_codec.kernels``)."""
