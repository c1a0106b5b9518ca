"""tools/ptx_diff.py, which holds device-code refactors to unchanged PTX without a GPU: its PTX
reading (what counts as an entry's code, what is only numbering) on written modules, and the
whole tool on this checkout where nvcc and git are at hand."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import repo_tools

ROOT = Path(__file__).resolve().parent.parent


MODULE = """
.version 9.0
.target sm_90a
.address_size 64

	// .globl	_Z5firstv
.extern .shared .align 16 .b8 smem_raw[];
.global .align 4 .b8 table[8] = {1, 0, 0, 0, 2, 0, 0, 0};
.func  (.param .b32 func_retval0) helper(
	.param .b32 helper_param_0
)
{
	ret;
}

.visible .entry _Z5firstv(
	.param .u64 _Z5firstv_param_0
)
{
	.local .align 4 .b8 	__local_depotDEPOT[4];
	mov.u64 	%rd1, table;
	call.uni (retval0), helper, (param0);
$L__BBINDEX_1:
	bra.uni 	$L__BBINDEX_1;
	ret;
}
	// .globl	_Z6secondv
.visible .entry _Z6secondv()
{
	mov.u32 	%r1, smem_raw;
	ret;
}
"""


def module(index: int, depot: int) -> str:
    return MODULE.replace("INDEX", str(index)).replace("DEPOT", str(depot))


def test_an_entry_carries_what_it_names_and_not_its_index_in_the_module():
    tool = repo_tools.load_tool("ptx_diff")
    a = tool.mangled_entries(module(0, 0))
    assert set(a) == {"_Z5firstv", "_Z6secondv"}
    # the same code as the module's third function: another label and depot number only
    assert tool.mangled_entries(module(2, 2)) == a
    # a change in a function or a variable it uses changes the entry, and only that entry
    for old, new in (("ret;\n}\n\n.visible", "exit;\n}\n\n.visible"), ("{1, 0", "{3, 0")):
        changed = tool.mangled_entries(module(0, 0).replace(old, new, 1))
        assert changed["_Z5firstv"] != a["_Z5firstv"], old
        assert changed["_Z6secondv"] == a["_Z6secondv"], old
    items = tool.ptx_items(module(0, 0))
    assert set(items) == {"smem_raw", "table", "helper", "_Z5firstv", "_Z6secondv"}
    # the comment that names the next entry is not part of the one before it
    assert "_Z6secondv" not in items["_Z5firstv"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")
def test_the_tool_finds_the_one_kernel_an_edit_changes(tmp_path):
    tool = repo_tools.load_tool("ptx_diff")
    tree = tmp_path / "tree"  # a copy of the checkout, edited below
    for folder in ("cuflash", "kernels_cu"):
        shutil.copytree(ROOT / folder, tree / folder)
    source = tree / "kernels_cu" / "backward_preprocess.cu"
    text = source.read_text()
    versions = (tool.Version("checkout", ROOT), tool.Version("copy", tree))

    def compared(edited: str, work: str):
        source.write_text(edited)
        return tool.differences(
            versions, "sm_80", tmp_path / work, sources=["backward_preprocess.cu"]
        )

    # a comment changes no code
    found = compared(text.replace("// backward_preprocess.cu", "// edited.cu", 1), "comment")
    assert (found.compared, found.differing, found.only) == (4, [], (0, 0))
    # a sum that starts at 1 for 8-byte elements changes the float64 instance alone
    start = "Acc sum = Acc(0);"
    assert start in text
    found = compared(text.replace(start, "Acc sum = Acc(sizeof(Storage) == 8);"), "code")
    assert found.differing == ["cuflash::attention_backward_preprocess<double>"]
