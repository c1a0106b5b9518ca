"""python -m cuflash, the demo: it runs and checks itself on the CPU backend, and bad arguments get
a usage message and exit status 2, never a traceback."""

from __future__ import annotations

import importlib.util

import pytest

from cuflash.__main__ import main


def test_demo_on_the_cpu_backend(capsys):
    assert main(["--cpu", "--seq", "40", "--batch", "1", "--heads", "4", "--kv-heads", "2"]) == 0
    out = capsys.readouterr().out
    assert "backend CPU" in out and out.rstrip().endswith("PASS")


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--seq", "0"], "--seq: expected a number >= 1, got 0"),
        (["--seq", "many"], "--seq: expected a whole number, got 'many'"),
        (["--head-dim", "300"], "head dims run from 1 to 256, got 300"),
        (["--dtype", "int8"], "invalid choice: 'int8'"),
        (["--heads", "3", "--kv-heads", "2"], "--heads (3) must be a multiple of --kv-heads (2)"),
    ],
)
def test_bad_arguments_get_a_clear_message(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_info:
        main(["--cpu", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_bfloat16_on_the_cpu_without_ml_dtypes(capsys):
    if importlib.util.find_spec("ml_dtypes") is not None:
        assert main(["--cpu", "--dtype", "bfloat16", "--seq", "40", "--heads", "2"]) == 0
        return
    with pytest.raises(SystemExit) as exit_info:
        main(["--cpu", "--dtype", "bfloat16"])
    assert exit_info.value.code == 2 and "ml_dtypes" in capsys.readouterr().err


def test_precompile_report_lists_the_binaries_that_use_local_memory():
    """cuflash.precompile's summary: slowest first, then every instance whose runtime binary uses
    local memory, and exit status 3 when there is one (0 when there is none)."""
    from cuflash.precompile import report

    times = [("k<1>", 1.0, 0, 168), ("k<2>", 3.0, 24, 255), ("k<3>", 2.0, 0, 90)]
    lines, status = report(times, 5.0, 4)
    assert status == 3
    assert [line.split()[-1] for line in lines[:3]] == ["k<2>", "k<3>", "k<1>"]
    assert lines[3] == "local memory 24 B per thread: k<2>"
    assert lines[-1].endswith("(slowest 3.00 s); 1 use local memory")
    clean, status = report([t for t in times if t[2] == 0], 5.0, 4)
    assert status == 0 and clean[-1].endswith("0 use local memory")
