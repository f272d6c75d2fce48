"""Array code written once for any array module ``xp`` (NumPy or CuPy), which every backend runs on its own memory
and which is no kernel's twin: the Rice decoder (:mod:`.rice`, validating a received stream), the finite checks
(:mod:`.finite`) and the steps of the aggregator's limb passes (:mod:`.limbs`). The twins of the kernels are in
:mod:`gpu_codec.cpu_fallback`; they may use this code, and it imports none of them."""
