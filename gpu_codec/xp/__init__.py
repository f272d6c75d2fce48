"""Array code written once for any array module ``xp`` (NumPy or CuPy) that every backend runs on its own memory and
that is no kernel's twin: the Rice decoder (:mod:`.rice`), which validates a received stream. The twins of the
kernels are in :mod:`gpu_codec.cpu_fallback`."""
