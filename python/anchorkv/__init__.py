"""anchorkv: anchor-residual KV cache compression with compact decode attention.

    import numpy as np, anchorkv
    cache = anchorkv.compress(keys, values, window_queries, retain_fraction=0.1)
    out = cache.decode(query)            # attention over every prompt position

`anchorkv._capi` is the raw ctypes layer (one declaration per C function); this package is
the owner-class API over it. The library is loaded and its version checked at import.
"""
from . import _capi
from ._api import (Cache, CacheStats, Context, HeadStats, Shape, compress, compress_options,
                   compressed_size, model_compressed_size, smallest_retain_fraction, status_string)
from ._enums import (Backend, DType, Method, PoolType, ResidualScale, RopeStyle, Status)
from ._errors import (AnchorKVError, BackendError, BackendUnavailableError, BudgetError,
                      CapacityError, CorruptDataError, InternalError, InvalidArgumentError,
                      MismatchError, NonFiniteError, OutOfMemoryError, UnsupportedError,
                      VersionError)

__version__ = "0.2.0"  # of this binding; the library's is library_version()


def library_version() -> str:
    """Version string of the loaded shared library."""
    return _capi.akv_version_string().decode()


def library_version_number() -> int:
    """MAJOR*10000 + MINOR*100 + PATCH of the loaded shared library."""
    return int(_capi.akv_version_number())


__all__ = [
    "Cache", "CacheStats", "Context", "HeadStats", "Shape", "compress", "compress_options",
    "compressed_size", "model_compressed_size", "smallest_retain_fraction", "status_string", "library_version", "library_version_number",
    "Backend", "DType", "Method", "PoolType", "ResidualScale", "RopeStyle", "Status",
    "AnchorKVError", "BackendError", "BackendUnavailableError", "BudgetError", "CapacityError",
    "CorruptDataError", "InternalError", "InvalidArgumentError", "MismatchError",
    "NonFiniteError", "OutOfMemoryError", "UnsupportedError", "VersionError",
]
