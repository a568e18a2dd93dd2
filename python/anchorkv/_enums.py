"""Enumerations of the C header as IntEnums, with lenient parsing from strings."""
from __future__ import annotations

import enum


# Other spellings accepted by parse(), per enum class.
_ALIASES = {
    "DType": {"FLOAT32": "F32", "FP32": "F32", "FLOAT16": "F16", "FP16": "F16", "HALF": "F16",
              "BFLOAT16": "BF16"},
    "Method": {"FULL": "FULLKV", "ANCHOR": "ANCHORKV"},
}


class _ParsedEnum(enum.IntEnum):
    @classmethod
    def parse(cls, value):
        """An enum member from a member, an int, or a case-insensitive name ("bf16")."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().upper().replace("-", "_")
            key = _ALIASES.get(cls.__name__, {}).get(key, key)
            try:
                return cls[key]
            except KeyError:
                names = ", ".join(member.name.lower() for member in cls)
                raise ValueError(f"unknown {cls.__name__} {value!r}; expected one of {names}") from None
        return cls(int(value))


class Status(_ParsedEnum):
    OK = 0
    INVALID_ARGUMENT = 1
    UNSUPPORTED = 2
    BUDGET = 3
    NON_FINITE = 4
    OUT_OF_MEMORY = 5
    CORRUPT_DATA = 6
    VERSION = 7
    BACKEND_UNAVAILABLE = 8
    BACKEND = 9
    MISMATCH = 10
    CAPACITY = 11
    INTERNAL = 12


class DType(_ParsedEnum):
    AUTO = 0
    F32 = 1
    F16 = 2
    BF16 = 3

    @property
    def itemsize(self) -> int:
        if self is DType.AUTO:
            raise ValueError("AUTO has no element size")
        return 4 if self is DType.F32 else 2


class Backend(_ParsedEnum):
    CPU = 0
    CUDA = 1


class Method(_ParsedEnum):
    FULLKV = 0
    ANCHORKV = 1
    SNAPKV = 2
    PYRAMIDKV = 3
    ADAKV = 4
    ANDPRO = 5
    QUANTIZED = 6
    TOVA = 7
    KNORM = 8
    STREAMINGLLM = 9


class RopeStyle(_ParsedEnum):
    NONE = 0
    NEOX = 1
    GPTJ = 2


class PoolType(_ParsedEnum):
    AVG = 0
    MAX = 1


class ResidualScale(_ParsedEnum):
    LEAST_SQUARES = 0
    RMS = 1
    ABSMAX = 2
