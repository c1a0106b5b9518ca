"""tools/wgmma_issue.py, and what it holds the Hopper forward to with no GPU: no wgmma descriptor
rebuilt from a pointer at every k step of a product (docs/perf/NOTES.md, v45: at d = 256 those
builds had made S = Q K^T issue-bound)."""

from __future__ import annotations

import pytest
import repo_tools

from cuflash import _kernels, compile_check

LISTING = """
        /*0b20*/                   HGMMA.64x80x16.F32.BF16 R152, gdesc[UR8], RZ, !UPT ;
        /*0b30*/                   R2UR UR11, R27 ;
        /*0b40*/                   LOP3.LUT R4, R4, 0x3fff0, RZ, 0xc0, !PT ;
        /*0b50*/                   UIADD3 UR8, UR6, 0x2, URZ ;
        /*0b60*/                   HGMMA.64x80x16.F32.BF16 R152, gdesc[UR8], R152 ;
        /*0b70*/                   UIADD3 UR8, UR6, 0x4, URZ ;
        /*0b80*/                   HGMMA.64x80x16.F32.BF16 R152, gdesc[UR8], R152, gsb0 ;
        /*0b90*/                   MUFU.EX2 R1, R1 ;
        /*0b98*/                   HGMMA.64x80x16.F32.BF16 R152, gdesc[UR8], RZ, !UPT ;
        /*0ba0*/              @!P0 HGMMA.64x256x16.F32.BF16 R24, R192, gdesc[UR4].tnspB, R24 ;
        /*0bb0*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R152, gdesc[UR8], RZ, !UPT ;
"""


def test_gaps_count_what_lies_between_two_steps_of_one_product():
    tool = repo_tools.load_tool("wgmma_issue")
    listing = tool.instructions(LISTING)
    assert len(listing) == 11 and listing[-2].startswith("@!P0 HGMMA.64x256x16")
    found = tool.gaps(listing)
    # The 64x80 product's second and third steps; the next 64x80 one starts a product (its group
    # ended at gsb0), and so do the 64x256 and QGMMA ones.
    assert [(g.shape, g.count, g.to_uniform, g.descriptor_builds) for g in found] == [
        ("HGMMA.64x80x16.F32.BF16", 3, 1, 1),
        ("HGMMA.64x80x16.F32.BF16", 1, 0, 0),
    ]
    assert "2 steps after another" in tool.summary(found)[0]


def test_an_instance_is_named_once():
    tool = repo_tools.load_tool("wgmma_issue")
    spec = tool.spec_of("attention_forward_tma<cuflash::bf16, 256, 128, 80, 2, 0, 2, 0>", None)
    assert spec.source == "forward_sm90_tma.cu" and spec.head_dim == 256
    with pytest.raises(ValueError, match="name: expected one instance"):
        tool.spec_of("attention_forward_tma<", None)


def test_the_tma_forward_builds_no_descriptor_between_k_steps():
    tool = repo_tools.load_tool("wgmma_issue")
    if compile_check.find_nvcc() is None or tool.find_nvdisasm() is None:
        pytest.skip("nvcc or nvdisasm not found (nvdisasm: pip install nvidia-cuda-nvdisasm)")
    specs = [
        s
        for s in _kernels.all_specs("sm_90a")
        if s.source == "forward_sm90_tma.cu" and s.features == 0 and s.dtype == "bfloat16"
    ]
    # and the FP8 forward's instance at d = 256 (its table's tiles and loop)
    specs.append(_kernels.instance("forward", "tma", _kernels.FP8_DTYPE, 256, None, 0, False))
    assert len(specs) >= 6
    for spec in specs:
        found = tool.gaps(tool.instructions(tool.disassemble(spec)))
        assert found, spec.name_expression
        # A descriptor built once per tile may be scheduled between another product's steps;
        # built at every step (v44: one or two in every gap), it shows in the typical gap.
        for shape in {g.shape for g in found}:
            builds = sorted(g.descriptor_builds for g in found if g.shape == shape)
            assert builds[len(builds) // 2] == 0, (spec.name_expression, shape, builds)
        if spec.head_dim == 256 and spec.dtype == "bfloat16":
            # S's 40-cycle m64n80k16 steps: at most a few instructions apart (v44: 14 each)
            s_steps = [g.count for g in found if g.shape.startswith("HGMMA.64x80x16")]
            assert s_steps and max(s_steps) <= 8, (spec.name_expression, s_steps)
