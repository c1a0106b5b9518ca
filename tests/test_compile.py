"""Every kernel instance of the table builds for sm_80 and sm_90a, as the runtime builds it (NVRTC
with CuPy's options, no GPU needed), with no register spill and no stack frame but the instances
cuflash/local_memory.txt lists, each with exactly its bytes; and the sources ship with the
package."""

from __future__ import annotations

from pathlib import Path

import pytest
import repo_tools

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
            if _kernels.featureless(spec):
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


def test_ptxas_report_parser_reads_serialised_wgmma():
    # ptxas writes the serialisation message on one line (split here by the continuations)
    text = """ptxas info    : Compiling entry function '_Zk' for 'sm_90a'
ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized \
due to non wgmma instructions defining accumulator registers of a wgmma between start and end of \
the pipeline stage in the function '_Zk'
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers
"""
    (report,) = compile_check.parse_ptxas(text)
    assert report.clean and report.wgmma_serialized.startswith("C7515: due to non wgmma")
    problems = compile_check.problems(
        [compile_check.UnitResult("x.cu", "sm_90a", 1, (report,), 0.0, "")]
    )
    assert len(problems) == 1 and "wgmma serialised" in problems[0]


def test_hopper_products_stay_pipelined():
    # ptxas serialises every wgmma of a kernel where a product is in flight across a call or a
    # join of branches, or where other instructions write its accumulators meanwhile (C7514-C7518;
    # docs/perf/NOTES.md, v28 and v37): the kernel still runs, several times slower. NVRTC's log
    # leaves those messages out, so the runtime's compile check cannot see them; nvcc's report
    # names them. The dense bfloat16 instances of the TMA forward and the fused backward, as nvcc
    # builds them (its registers differ from NVRTC's at the limit: spills are the other check's).
    nvcc = compile_check.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (CUDA_HOME, /usr/local/cuda, PATH)")
    specs = [
        s
        for s in _kernels.all_specs("sm_90a")
        if s.dtype == "bfloat16"
        and s.features == 0
        and s.source in ("forward_sm90_tma.cu", "backward_sm90_fused.cu")
    ]
    for source in ("forward_sm90_tma.cu", "backward_sm90_fused.cu"):
        unit = [s for s in specs if s.source == source]
        result = compile_check.compile_unit(nvcc, source, "sm_90a", unit)
        assert not result.error, result.error[-2000:]
        assert len(result.kernels) == len(unit) > 0
        serialized = [
            (k.mangled_name, k.wgmma_serialized) for k in result.kernels if k.wgmma_serialized
        ]
        assert not serialized, serialized


# The NVRTC whose binaries cuflash/local_memory.txt lists (nvidia-cuda-nvrtc 13.0.88, the test
# extra's, as on the H100 machine: its driver reported the same registers and local memory).
NVRTC_OF_THE_LIST = (13, 0)


def test_runtime_binaries_use_local_memory_only_as_listed():
    # The binaries that run are NVRTC's, with cuflash's options and CuPy's (-ftz=true among them:
    # _kernels.runtime_options); NVRTC and its binding come from PyPI with the test extra and need
    # no GPU. Every instance builds for sm_80 and sm_90a, and none uses local memory but the
    # listed ones, each with exactly its listed bytes.
    version = compile_check.nvrtc_version()
    if version is None:
        pytest.skip("NVRTC or cuda-bindings is not installed (pip install '.[test]' brings both)")
    if version != NVRTC_OF_THE_LIST:
        pytest.skip(f"local_memory.txt lists NVRTC {NVRTC_OF_THE_LIST}'s binaries; found {version}")
    results = compile_check.run(("sm_80", "sm_90a"), compiler="nvrtc")
    found = compile_check.problems(results, compile_check.read_kept())
    assert not found, "\n".join(found)
    compiled = sum(len(unit.kernels) for unit in results)
    assert compiled == sum(len(_kernels.all_specs(arch)) for arch in ("sm_80", "sm_90a"))


def test_the_local_memory_list_names_instances_the_library_launches():
    kept = compile_check.read_kept()
    assert kept and all(size > 0 for size in kept.values())
    for arch in {arch for arch, _ in kept}:
        launched = {spec.name_expression for spec in _kernels.all_specs(arch)}
        assert {name for a, name in kept if a == arch} <= launched


def test_local_memory_is_held_to_the_list():
    def report(name, stack):
        return compile_check.KernelReport("sm_80", "_Z" + name, 255, stack, stack, stack, name)

    def unit(*kernels):
        return compile_check.UnitResult("forward.cu", "sm_80", len(kernels), kernels, 1.0, "")

    kept = {("sm_80", "a"): 8}
    assert compile_check.problems([unit(report("a", 8), report("b", 0))], kept) == []
    assert compile_check.local_memory([unit(report("a", 8), report("b", 0))]) == kept
    (more,) = compile_check.problems([unit(report("a", 16))], kept)  # spills more than listed
    assert "a: 16 bytes stack frame" in more and "(8 B listed" in more
    (new,) = compile_check.problems([unit(report("a", 8), report("b", 4))], kept)
    assert "b: 4 bytes stack frame" in new
    (gone,) = compile_check.problems([unit(report("a", 0))], kept)
    assert "remove it from local_memory.txt" in gone
    (unlisted,) = compile_check.problems([unit(report("a", 8))])  # nvcc: no list
    assert "a: 8 bytes stack frame" in unlisted


def test_the_check_of_some_sources_builds_only_their_instances():
    # compile_check --source: the quick check of the kernels one changed (the whole takes ~50 min)
    if compile_check.nvrtc_version() is None:
        pytest.skip("NVRTC or cuda-bindings is not installed (pip install '.[test]' brings both)")
    results = compile_check.run(("sm_90a",), compiler="nvrtc", sources=("work_list.cu",))
    assert [(u.source, u.arch) for u in results] == [("work_list.cu", "sm_90a")]
    launched = [s for s in _kernels.all_specs("sm_90a") if s.source == "work_list.cu"]
    assert results[0].expected == len(launched) and len(results[0].kernels) == len(launched)
    assert compile_check.problems(results, compile_check.read_kept()) == []


def test_runtime_options_are_what_the_runtime_passes_and_cupy_adds():
    # cuflash/_compile.py passes COMPILE_OPTIONS and -arch; CuPy (cupy/cuda/compiler.py) appends
    # -ftz=true, its own -arch=sm_XX and --device-as-default-execution-space
    assert _kernels.runtime_options("sm_90a") == (
        *_kernels.COMPILE_OPTIONS, "-arch=sm_90a", "-ftz=true", "-arch=sm_90",
        "--device-as-default-execution-space",
    )  # fmt: skip
    assert _kernels.runtime_options("sm_80")[1:3] == ("-arch=sm_80", "-ftz=true")


def test_generated_wgmma_specialisations_are_current():
    # kernels_cu/wgmma.cuh holds what tools/gen_wgmma.py writes between its markers
    gen = repo_tools.load_tool("gen_wgmma")
    text = (repo_tools.ROOT / "kernels_cu" / "wgmma.cuh").read_text()
    assert gen.BEGIN + "\n" + gen.generated() + gen.END + "\n" in text
