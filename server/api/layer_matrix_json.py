"""The JSON of a heatmap (``GET /api/v1/runs/{id}/layers``), encoded from its numpy cells block by block
and sent as it is made.

A heatmap answer holds up to 1,000,000 cells. Built as Python floats and encoded in one call, the one
heatmap being answered held the GIL for ~50 ms (the lists) and ~40–130 ms (the encoding) at a stretch,
long enough for ``/api/health`` to wait up to a second behind twenty readers (docs/deployment.md,
"Hostile input"), and the cells, their lists and the 18 MB of JSON stayed in the process's heap
afterwards. Here each block of rows (``BLOCK_CELLS`` cells) is encoded straight from the float64 array
(orjson's numpy support: no Python float per cell), a millisecond or two at a time, and handed to the
server to send before the next is made.

The bytes are those the whole reply encoded at once would have had: the same keys in the same order,
each number as Python's ``float`` gives it to the same encoder (orjson when installed, else the
standard library as Starlette's ``JSONResponse`` calls it), ``"NaN"`` / ``"Infinity"`` /
``"-Infinity"`` for non-finite cells and ``null`` where nothing was measured.

>>> import numpy as np
>>> from gradwatch.server.queries import LayerMatrix
>>> m = LayerMatrix(run_id=1, stat="grad_norm", rank=0, agg="max", bucket_size=1, layer_group_size=1,
...                 steps=[0, 1], layers=["a"], cells=np.array([[0.5, np.nan]]), measured=np.array([[True, False]]))
>>> b"".join(layer_matrix_json(m))
b'{"run_id":1,"stat":"grad_norm","rank":0,"agg":"max","bucket_size":1,"layer_group_size":1,"steps":[0,1],"layers":["a"],"values":[[0.5,null]]}'
"""
from __future__ import annotations

import json
from typing import Callable, Iterator, Optional

import numpy as np

from gradwatch.server.wire.numbers import encode_float
from gradwatch.server.queries import LayerMatrix

# cells encoded at a time: ~16,000 floats are ~0.3 MB of JSON and 1–2 ms of one core
BLOCK_CELLS = 16_384

_NULL = b"null"
# what stands where the encoder wrote null for a non-finite cell: index 0 not measured, 1 NaN, 2 +Inf, 3 -Inf
_NONFINITE = np.array([b"null", b'"NaN"', b'"Infinity"', b'"-Infinity"'], dtype=object)


def layer_matrix_json(m: LayerMatrix, *, use_orjson: Optional[bool] = None) -> Iterator[bytes]:
    """The reply's JSON in pieces: the head (every key but ``values``), blocks of rows, the tail.
    ``use_orjson``: default when installed (False: the standard library's encoding)."""
    dumps, dumps_cells = _encoders(use_orjson)
    head = dumps({"run_id": m.run_id, "stat": m.stat, "rank": m.rank, "agg": m.agg, "bucket_size": m.bucket_size,
                  "layer_group_size": m.layer_group_size, "steps": m.steps, "layers": m.layers})
    yield head[:-1] + b',"values":['
    rows, columns = m.cells.shape
    per_block = max(1, BLOCK_CELLS // max(1, columns))
    for first in range(0, rows, per_block):
        cells = m.cells[first:first + per_block]
        text = dumps_cells(cells, m.measured[first:first + per_block])[1:-1]      # without the outer [ ]
        yield text if first + per_block >= rows else text + b","
    yield b"]}"


def _encoders(use_orjson: Optional[bool]) -> tuple[Callable[[object], bytes],
                                                   Callable[[np.ndarray, np.ndarray], bytes]]:
    try:
        import orjson
    except ImportError:
        orjson = None
    if orjson is None or use_orjson is False:
        return _stdlib_dumps, _stdlib_cells

    def dumps_cells(cells: np.ndarray, measured: np.ndarray) -> bytes:
        text = orjson.dumps(np.ascontiguousarray(cells), option=orjson.OPT_SERIALIZE_NUMPY)
        nonfinite = ~np.isfinite(cells)       # orjson writes null for each of these, in row-major order
        if not nonfinite.any():
            return text
        kind = np.where(~measured, 0, np.where(np.isnan(cells), 1, np.where(cells > 0, 2, 3)))[nonfinite]
        if not kind.any():                    # nothing measured there: null is what they should be
            return text
        pieces = text.split(_NULL)            # numbers never contain "null"
        out = np.empty(2 * len(pieces) - 1, dtype=object)
        out[0::2] = pieces
        out[1::2] = _NONFINITE[kind]
        return b"".join(out.tolist())

    return orjson.dumps, dumps_cells


def _stdlib_dumps(content) -> bytes:
    # as Starlette's JSONResponse renders
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def _stdlib_cells(cells: np.ndarray, measured: np.ndarray) -> bytes:
    return _stdlib_dumps([[encode_float(x) if m else None for x, m in zip(row_v, row_m)]
                          for row_v, row_m in zip(cells.tolist(), measured.tolist())])
