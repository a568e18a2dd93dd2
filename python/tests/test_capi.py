"""The ctypes layer against the header: every function declared, struct layout, enums."""
import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import anchorkv
from anchorkv import _capi

HEADER_DIR = Path(os.environ.get("ANCHORKV_INCLUDE_DIR",
                                 Path(__file__).resolve().parents[2] / "include"))

STRUCTS = ("akv_allocator", "akv_context_options", "akv_rope", "akv_compress_options",
           "akv_shape", "akv_prefill", "akv_cache_stats", "akv_head_stats")
ENUMS = {
    "akv_status": anchorkv.Status, "akv_dtype": anchorkv.DType, "akv_backend": anchorkv.Backend,
    "akv_method": anchorkv.Method, "akv_rope_style": anchorkv.RopeStyle,
    "akv_pool_type": anchorkv.PoolType, "akv_residual_scale": anchorkv.ResidualScale,
}
ENUM_PREFIXES = {"akv_status": ("AKV_", "ERR_"), "akv_dtype": ("AKV_DTYPE_",),
                 "akv_backend": ("AKV_BACKEND_",), "akv_method": ("AKV_METHOD_",),
                 "akv_rope_style": ("AKV_ROPE_",), "akv_pool_type": ("AKV_POOL_",),
                 "akv_residual_scale": ("AKV_SCALE_",)}


def c_name(enum_type, member):
    if enum_type == "akv_status":
        return "AKV_OK" if member == "OK" else "AKV_ERR_" + member
    return ENUM_PREFIXES[enum_type][0] + member


def test_every_header_function_is_declared():
    header = (HEADER_DIR / "anchorkv" / "anchorkv.h").read_text()
    declared_in_header = set(re.findall(r"AKV_API\s+[^;]*?\b(akv_\w+)\s*\(", header))
    assert declared_in_header == set(_capi.FUNCTION_NAMES)
    comments = [line for line in Path(_capi.__file__).read_text().splitlines()
                if line.lstrip().startswith("#")]
    for name in _capi.FUNCTION_NAMES:
        function = getattr(_capi, name)
        assert function.argtypes is not None, name
        assert any(f"{name}(" in line for line in comments), f"no C prototype comment for {name}"


@pytest.fixture(scope="module")
def layout_probe(tmp_path_factory):
    """sizeof/offsetof/enum values from a C program compiled against the header."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        pytest.skip("no C compiler to check the layout against the header")
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include <anchorkv/anchorkv.h>',
             'int main(void) {']
    for struct in STRUCTS:
        ctype = getattr(_capi, struct)
        lines.append(f'printf("sizeof {struct} %zu\\n", sizeof({struct}));')
        for field, *_ in ctype._fields_:
            lines.append(f'printf("offsetof {struct}.{field} %zu\\n", offsetof({struct}, {field}));')
    for enum_type, cls in ENUMS.items():
        for member in cls:
            name = c_name(enum_type, member.name)
            lines.append(f'printf("enum {name} %d\\n", (int){name});')
        lines.append(f'printf("sizeof {enum_type} %zu\\n", sizeof({enum_type}));')
    lines.append("return 0; }")
    directory = tmp_path_factory.mktemp("probe")
    source = directory / "probe.c"
    source.write_text("\n".join(lines))
    binary = directory / "probe"
    subprocess.run([compiler, "-std=c99", "-I", str(HEADER_DIR), str(source), "-o", str(binary)],
                   check=True)
    output = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    return dict((key, int(value)) for key, value in (line.rsplit(" ", 1) for line in output.splitlines()))


def test_struct_layout_matches_header(layout_probe):
    for struct in STRUCTS:
        ctype = getattr(_capi, struct)
        assert ctypes.sizeof(ctype) == layout_probe[f"sizeof {struct}"], struct
        for field, *_ in ctype._fields_:
            assert getattr(ctype, field).offset == layout_probe[f"offsetof {struct}.{field}"], \
                f"{struct}.{field}"


def test_enum_values_match_header(layout_probe):
    for enum_type, cls in ENUMS.items():
        assert ctypes.sizeof(getattr(_capi, enum_type)) == layout_probe[f"sizeof {enum_type}"]
        for member in cls:
            assert int(member) == layout_probe[f"enum {c_name(enum_type, member.name)}"]


def test_version_checked_and_reported():
    number = anchorkv.library_version_number()
    assert number // 10000 == _capi.BINDING_VERSION_MAJOR
    assert number >= _capi.BINDING_VERSION_NUMBER
    major, minor, patch = (int(part) for part in anchorkv.library_version().split(".")[:3])
    assert number == major * 10000 + minor * 100 + patch


def test_version_rule_same_major_at_least_the_binding():
    assert _capi.version_problem(_capi.BINDING_VERSION_NUMBER) is None
    assert _capi.version_problem(_capi.BINDING_VERSION_NUMBER + 1) is None  # newer patch
    assert "major" in _capi.version_problem((_capi.BINDING_VERSION_MAJOR + 1) * 10000)
    if _capi.BINDING_VERSION_NUMBER > _capi.BINDING_VERSION_MAJOR * 10000:
        assert "older" in _capi.version_problem(_capi.BINDING_VERSION_NUMBER - 1)


def test_status_strings_and_empty_last_error():
    for status in anchorkv.Status:
        text = anchorkv.status_string(status)
        assert text  # never NULL, never empty
    assert "BUDGET" in anchorkv.status_string(anchorkv.Status.BUDGET)


def test_raw_call_failure_sets_thread_local_message():
    out = _capi.akv_cache_p()
    status = _capi.akv_compress(None, None, None, ctypes.byref(out), None)
    assert status == anchorkv.Status.INVALID_ARGUMENT
    assert _capi.akv_last_error_message()  # a sentence naming the problem
    assert not out  # nothing was created


def test_option_init_fills_documented_defaults():
    options = _capi.akv_compress_options()
    _capi.akv_compress_options_init(ctypes.byref(options))
    assert options.struct_size == ctypes.sizeof(options)
    assert options.method == anchorkv.Method.ANCHORKV
    assert options.retain_fraction == pytest.approx(0.05)
    assert options.window == 32
    assert options.scored_fraction == pytest.approx(0.3)  # measured on a real model; paper 0.7
    assert options.pool_kernel == 7
    assert (options.sink_tokens, options.fill_budget, options.coverage_rounds) == (4, 1, 8)
    assert (options.anchor_share, options.guard_fraction) == (pytest.approx(0.7), pytest.approx(0.75))
    paper = _capi.akv_compress_options()
    _capi.akv_compress_options_init_paper(ctypes.byref(paper))
    assert paper.scored_fraction == pytest.approx(0.7)
    assert (paper.sink_tokens, paper.fill_budget, paper.coverage_rounds) == (0, 0, 0)
    assert (paper.anchor_share, paper.guard_fraction) == (0.0, 0.0)
    assert options.seed == 42
    assert options.rope.style == anchorkv.RopeStyle.NEOX
    assert options.rope.base == 10000.0
    context_options = _capi.akv_context_options()
    _capi.akv_context_options_init(ctypes.byref(context_options))
    assert context_options.struct_size == ctypes.sizeof(context_options)
    assert context_options.backend == anchorkv.Backend.CPU
    prefill = _capi.akv_prefill()
    _capi.akv_prefill_init(ctypes.byref(prefill))
    assert prefill.struct_size == ctypes.sizeof(prefill)


def test_per_method_defaults_follow_the_header():
    snap = _capi.akv_compress_options()
    _capi.akv_compress_options_init_method(ctypes.byref(snap), anchorkv.Method.SNAPKV)
    assert (snap.method, snap.window, snap.pool_kernel, snap.pool_type) == \
        (anchorkv.Method.SNAPKV, 64, 5, anchorkv.PoolType.AVG)
    quantized = _capi.akv_compress_options()
    _capi.akv_compress_options_init_method(ctypes.byref(quantized), anchorkv.Method.QUANTIZED)
    assert (quantized.window, quantized.quant_bits, quantized.quant_outliers) == (128, 3, 4)
    assert quantized.retain_fraction == 1.0
    andpro = _capi.akv_compress_options()
    _capi.akv_compress_options_init_method(ctypes.byref(andpro), anchorkv.Method.ANDPRO)
    assert (andpro.pool_type, andpro.andpro_chunk) == (anchorkv.PoolType.MAX, 4)
    # The high-level options start from the method's defaults too.
    struct, _ = anchorkv.compress_options(method="pyramidkv", pyramid_beta=10)
    assert (struct.window, struct.pyramid_beta, struct.adakv_alpha) == (64, 10, pytest.approx(0.2))
