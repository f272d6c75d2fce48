"""A client-side task-result filter that damages the compressed update, to show the server rejecting it.

Round 0 flips one byte inside the payload (its checksum no longer matches), round 1 replaces it with a foreign
blob (a pickle, which the server never unpickles), later rounds truncate it. Put it after the
``UpdateCompressor`` of one site; that site's contributions are then dropped and the others aggregated.
"""

from __future__ import annotations

import pickle

from nvflare.apis.dxo_filter import DXOFilter
from nvflare.app_common.app_constant import AppConstants

from gpu_codec.nvflare import PAYLOAD_KEY


class CorruptPayload(DXOFilter):
    def __init__(self) -> None:
        super().__init__(supported_data_kinds=None, data_kinds_to_filter=None)

    def process_dxo(self, dxo, shareable, fl_ctx):
        blob = dxo.data.get(PAYLOAD_KEY)
        if not isinstance(blob, bytes):
            return None
        rnd = shareable.get_header(AppConstants.CURRENT_ROUND, 0) or 0
        if rnd == 0:
            bad = bytearray(blob)
            bad[len(bad) // 2] ^= 0xFF
            dxo.data[PAYLOAD_KEY] = bytes(bad)
        elif rnd == 1:
            dxo.data[PAYLOAD_KEY] = pickle.dumps({"fc1.weight": [0.0] * 8})
        else:
            dxo.data[PAYLOAD_KEY] = blob[: len(blob) // 3]
        self.log_info(fl_ctx, f"damaged the payload of round {rnd}")
        return dxo


__all__ = ["CorruptPayload"]
