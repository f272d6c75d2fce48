"""Where the host's time goes in one GPU call at many tensors: medians and a profile, on a GPU.

For a zoo entry as torch CUDA tensors (split-2^23-1000 unless named): the median of 21 calls (after 3 warm-up
calls, each followed by a device synchronize) of ``compress``, ``decompress`` of its bytes onto the base,
``Payload.from_bytes`` and ``tensor_table`` of the update's tensors (the table of torch CUDA tensors, their addresses,
sizes, dtypes and shapes, which compress reads for the update and for the base), then ``cProfile``'s 30 costliest
functions of 10 calls of compress and of decompress. The recording launcher (``gpu_codec.testing.recording``)
takes NumPy arrays standing for resident tensors, so it does not see the torch glue this shows.

    python benchmarks/gpu_host_profile.py [ENTRY] > profile.txt
"""

from __future__ import annotations

import cProfile
import io
import pathlib
import pstats
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_suite import _ensure_importable

    _ensure_importable()
    import numpy as np
    import torch

    import gpu_codec
    from benchmarks.bench_gpu_against import device_median
    from benchmarks.zoo import ZOO
    from gpu_codec.arrays import tensor_table

    name = argv[0] if argv else "split-2^23-1000"

    def med(fn):
        return device_median(fn, 21, 3)

    u = ZOO[name].build(1.0, 0)
    new = {k: torch.from_numpy(np.asarray(v, order="C")).cuda() for k, v in u.new.items()}
    base = {k: torch.from_numpy(np.asarray(v, order="C")).cuda() for k, v in u.base.items()}
    blob = gpu_codec.compress(new, base, fraction=0.01).to_bytes()
    arrays = list(new.values())
    ops = {
        "compress": lambda: gpu_codec.compress(new, base, fraction=0.01),
        "decompress": lambda: gpu_codec.decompress(blob, base=base),
        "from_bytes": lambda: gpu_codec.Payload.from_bytes(blob),
        "tensor_table": lambda: tensor_table(arrays),
        "torch_sync": torch.cuda.synchronize,
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {name}: {len(new)} tensors")
    for op, fn in ops.items():
        print(f"{name} {op}: {med(fn):.3f} ms", flush=True)
    for op in ("compress", "decompress"):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10):
            ops[op]()
        torch.cuda.synchronize()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        print("----", op)
        print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
