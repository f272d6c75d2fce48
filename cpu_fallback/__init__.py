"""NumPy twins of gpu_codec's kernels (installed as ``gpu_codec.cpu_fallback``).

:mod:`.kernels` mirrors each kernel one to one; :mod:`.select` is the NumPy backend's fast composition of the
same selection; :mod:`.elementwise` holds the bit-exact conversions both use; :mod:`.limbs` holds the
aggregator's passes over its integer limbs; :mod:`.parallel` is the thread pool (``GPU_CODEC_THREADS``) the
blocked passes run on.
"""
