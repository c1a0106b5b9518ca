"""Every kernel instance of the table builds for sm_80 and sm_90a with no register spill and no
stack frame (the CPU compile check: nvcc, no GPU needed), and the sources ship with the package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import cuflash
from cuflash import _kernels, compile_check


def test_every_source_of_the_table_ships_with_the_package():
    root = _kernels.kernel_dir()
    for spec in _kernels.all_specs("sm_80") + _kernels.all_specs("sm_90a"):
        assert (root / spec.source).is_file(), spec.source
        assert spec.name_expression in compile_check.translation_unit(spec.source, [spec])


def test_installed_package_ships_its_kernels():
    package = Path(cuflash.__file__).resolve().parent
    if "site-packages" not in package.parts:
        pytest.skip(f"cuflash is imported from a source tree ({package}), not an installed wheel")
    assert _kernels.kernel_dir() == package / "kernels_cu"
    names = {p.name for p in (package / "kernels_cu").iterdir()}
    assert {spec.source for spec in _kernels.all_specs("sm_90a")} <= names
    assert {"common.cuh", "mma.cuh", "gemm.cuh", "tile.cuh", "mask.cuh", "softmax.cuh"} <= names


def test_compiled_source_is_self_contained():
    for source in {spec.source for spec in _kernels.all_specs("sm_90a")}:
        text = _kernels.compiled_source(source)
        assert '#include "' not in text  # the compiled text (and the cache key) holds every header
        assert text.count("struct ElemTraits<f16>") == 1  # each header inlined once
        assert text.count("struct Params {") == 1
        assert "__builtin_offsetof(cuflash::Params, window_left)" in text  # the layout asserts


def test_table_covers_every_dtype_and_head_dim():
    for d in range(1, _kernels.MAX_HEAD_DIM + 1):
        bucket = _kernels.head_dim_bucket(d)
        assert d <= bucket and bucket - d < 32
        for dtype in _kernels.DTYPES:
            for family in ("forward", "dkdv", "dq"):
                (path,) = _kernels.paths(family, dtype, d, "sm_80")  # one path before Hopper
                assert path == ("mma" if dtype in _kernels.TENSOR_CORE_DTYPES else "exact")
                spec = _kernels.instance(family, path, dtype, d)
                assert spec.head_dim == bucket and spec.path == path
                assert spec.smem_bytes <= 99 * 1024, spec  # fits sm_86/sm_89 as well
                assert spec.threads % 32 == 0 and spec.threads <= 1024
    with pytest.raises(ValueError, match="at most 256"):
        _kernels.head_dim_bucket(257)


def test_hopper_instances():
    # sm_90a has the tma and wgmma kernels for the buckets of their tables and mma.sync for every
    # bucket, fastest first; every other architecture has the portable instances only.
    tma_buckets = {"forward": (64, 128, 256), "dq": (64, 128, 256), "dkdv": (64, 128, 256)}
    wgmma_buckets = {"forward": (64, 128, 256), "dq": (64, 128), "dkdv": (64, 128)}
    portable_source = {"forward": "forward.cu", "dq": "backward_dq.cu", "dkdv": "backward_dkdv.cu"}
    for d in range(1, _kernels.MAX_HEAD_DIM + 1):
        bucket = _kernels.head_dim_bucket(d)
        for family in ("forward", "dq", "dkdv"):
            paths = _kernels.paths(family, "bfloat16", d, "sm_90a")
            want = tuple(
                path
                for path, buckets in (("tma", tma_buckets), ("wgmma", wgmma_buckets))
                if bucket in buckets[family]
            ) + ("mma",)
            assert paths == want, (family, d, paths)
            assert _kernels.paths(family, "bfloat16", d, "sm_89") == ("mma",)
            assert _kernels.instance(family, "mma", "bfloat16", d).source == portable_source[family]
            for path in paths[:-1]:
                spec = _kernels.instance(family, path, "bfloat16", d)
                assert spec.source.endswith(("_sm90.cu", "_tma.cu")) and spec.head_dim == bucket
                assert spec.threads % 128 == 0  # whole warpgroups
                assert spec.smem_bytes <= 227 * 1024, spec  # the sm_90 opt-in limit
            assert _kernels.paths(family, "float32", d, "sm_90a") == ("exact",)


def test_instances_carry_their_features():
    # FEATURES is the last template argument of every instance (kernels_cu/features.cuh) that
    # masks or modifies scores
    for arch in ("sm_80", "sm_90a"):
        for spec in _kernels.all_specs(arch):
            if spec.family in _kernels.FEATURELESS_FAMILIES:
                assert spec.features == 0, spec.name_expression
                continue
            assert spec.features in _kernels.FEATURE_SETS
            assert spec.name_expression.endswith(f", {spec.features}>"), spec.name_expression


def test_ptxas_report_parser():
    text = """ptxas info    : Compiling entry function '_Zkernel' for 'sm_80'
ptxas info    : Function properties for _Zkernel
    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 600 bytes cmem[0]
"""
    (report,) = compile_check.parse_ptxas(text)
    assert (report.registers, report.stack_bytes, report.spill_store_bytes) == (255, 16, 8)
    assert not report.clean


def test_all_kernels_compile_for_sm80_and_sm90a_without_spills():
    # CI machines have nvcc; elsewhere (a fresh machine with the README's command) it skips.
    if not compile_check.find_nvcc():
        pytest.skip("nvcc not found: the compile check needs the CUDA toolkit's bin/ on PATH")
    results = compile_check.run(("sm_80", "sm_90a"))
    found = compile_check.problems(results)
    assert not found, "\n".join(found)
    compiled = sum(len(unit.kernels) for unit in results)
    assert compiled == sum(len(_kernels.all_specs(arch)) for arch in ("sm_80", "sm_90a"))


def test_generated_wgmma_specialisations_are_current():
    # kernels_cu/wgmma.cuh holds what tools/gen_wgmma.py writes between its markers
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("gen_wgmma", root / "tools" / "gen_wgmma.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = (root / "kernels_cu" / "wgmma.cuh").read_text()
    assert gen.BEGIN + "\n" + gen.generated() + gen.END + "\n" in text
