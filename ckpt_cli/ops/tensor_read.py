"""One logical tensor, whole, as a numpy array or a torch tensor, gathered from its stored pieces.

The stored bytes go straight into the result's own buffer (one pread per contiguous run, no intermediate
copy) when every piece is contiguous and already in the wanted dtype; the numpy path then never imports
torch. A cast or a strided piece goes through core/reading.py's windows (torch), at most BLOCK_BYTES
beyond the result at a time.
"""

from __future__ import annotations

from typing import Any

from ckpt_cli.core.dtypes import BY_NAME, DType
from ckpt_cli.core.model import ZEROS, TensorEntry
from ckpt_cli.core.reading import SourceFiles, byte_runs, element_windows, read_elements
from ckpt_cli.errors import UsageError

# numpy names every dtype as torch does, but has no bfloat16 or float8: those need torch (or a cast).
NUMPY_NAMES = {name for name in BY_NAME if name != "bfloat16" and not name.startswith("float8")}


def numpy_dtype(dtype: DType, name: str) -> Any:
    import numpy as np

    if dtype.name not in NUMPY_NAMES:
        raise UsageError(f"'{name}' is {dtype.name}, which numpy has no dtype for; read it with .tensor(), or cast: dtype='float32'")
    return np.dtype(dtype.name).newbyteorder("<")


def _fill(runs: list[tuple[str, int, int]], out: memoryview, sources: SourceFiles) -> None:
    pos = 0
    for path, offset, nbytes in runs:
        window = out[pos : pos + nbytes]
        if path == ZEROS:
            window[:] = bytes(nbytes)
        else:
            sources.pread_into(path, offset, window)
        pos += nbytes


def read_numpy(entry: TensorEntry, sources: SourceFiles, dtype: DType | None = None) -> Any:
    """The whole tensor as a numpy array of its shape (cast to `dtype` if given: through torch)."""
    import numpy as np

    target = dtype or entry.dtype
    want = numpy_dtype(target, entry.name)
    runs = byte_runs(entry, target)
    if runs is None:
        return read_torch(entry, sources, target).numpy()
    out = np.empty(entry.numel, dtype=want)
    if entry.numel:
        _fill(runs, out.view(np.uint8).data, sources)
    return out.reshape(entry.shape)


def read_torch(entry: TensorEntry, sources: SourceFiles, dtype: DType | None = None) -> Any:
    """The whole tensor as a torch tensor of its shape, in its dtype or cast to `dtype`."""
    import torch

    target = dtype or entry.dtype
    out = torch.empty(entry.numel, dtype=target.torch())
    runs = byte_runs(entry, target)
    if runs is not None:
        if entry.numel:
            _fill(runs, out.view(torch.uint8).numpy().data, sources)
    else:
        for start, count in element_windows(entry):
            out[start : start + count] = read_elements(entry, start, count, sources).to(target.torch())
    return out.reshape(entry.shape)
