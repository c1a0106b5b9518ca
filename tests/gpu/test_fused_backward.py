"""The fused Hopper backward (kernels_cu/backward_sm90_fused.cu): which calls take it, its results
against the float64 reference over shapes, grouped heads, layouts, strides, causal masks, sliding
windows, partial key blocks, the softcap and ALiBi, its bitwise determinism, the ordered additions
of dQ's sums when a head's key blocks span several waves of the persistent grid, and non-finite
inputs (the repair of what a masked tile made non-finite). Skipped on GPUs other than sm_90."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kernels import Case, check_case

from cuflash import _compile, _dispatch, testing
from cuflash._dispatch import KernelChoice

pytestmark = pytest.mark.gpu
if testing.gpu_unavailable_reason():
    pytest.skip(f"GPU test: {testing.gpu_unavailable_reason()}", allow_module_level=True)
torch = pytest.importorskip("torch", reason="the GPU tests make their inputs with PyTorch")
if _compile.device_arch(torch.cuda.current_device()) != "sm_90a":
    pytest.skip("the fused backward runs on Hopper (sm_90) only", allow_module_level=True)

FUSED = KernelChoice(backward="fused")
SPLIT = KernelChoice(backward="split")


def backward_paths(plans: tuple) -> tuple[str, str]:
    bwd = plans[1]
    return bwd.dkdv.aligned.launch.spec.path, bwd.dq.aligned.launch.spec.path


@st.composite
def fused_cases(draw):
    layout = draw(st.sampled_from(["bshd", "bhsd", "2d"]))
    two_d = layout == "2d"
    batch = 1 if two_d else draw(st.integers(1, 3))
    heads_kv = 1 if two_d else draw(st.integers(1, 3))
    mask = draw(st.sampled_from(["none", "causal", "window"]))
    causal = mask == "causal"
    # sliding windows (a left bound alone keeps the split kernels)
    windows = [(64, 0), (300, 20), (50, None), (2000, 0)]
    window = draw(st.sampled_from(windows)) if mask == "window" else None
    # grouped heads, under a bound too (the turns' order of FusedBoundedOrder at the second step
    # depends on the group and the window's width)
    group = 1 if two_d else draw(st.sampled_from([1, 2, 4, 8]))
    seq = st.one_of(st.integers(1, 70), st.integers(1, 700), st.integers(600, 1500))
    seq_q = draw(seq)
    seq_k = draw(st.one_of(seq, st.integers(1, 12).map(lambda blocks: 128 * blocks)))
    return Case(
        batch=batch,
        heads_kv=heads_kv,
        group=group,
        seq_q=seq_q,
        seq_k=seq_k,
        # the buckets of 64 (128-row query tiles; 64-row ones, where the consumers split dQ's keys,
        # for the softcap with ALiBi under a bound: _kernels.FUSED_SHORT_FOR), 128 and 256 (two
        # consumers sharing 64 keys; a window with the softcap and ALiBi keeps the split kernels:
        # _kernels.FUSED_WITHOUT)
        head_dim=draw(st.sampled_from([128, 120, 104, 112, 64, 40, 56, 256, 232])),
        dtype=draw(st.sampled_from(["float16", "bfloat16"])),
        layout=layout,
        causal=causal,
        window=window,
        scale=draw(st.one_of(st.none(), st.floats(0.01, 2.0))),
        storage=draw(st.sampled_from(["contiguous", "views"])),  # TMA-readable
        seed=draw(st.integers(0, 2**31 - 1)),
        alibi=draw(st.sampled_from([None, None, "head", "batch"])),
        softcap=draw(st.sampled_from([None, None, None, 0.5, 5.0, 50.0])),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(fused_cases())
def test_fused_backward_against_the_reference(case):
    plans = check_case(case, "fused backward", FUSED)
    paths = backward_paths(plans)
    if _dispatch.fused_backward_fits(plans[1].p):
        assert paths == ("fused", "fused"), case
    else:  # more key blocks than query steps without a bound, a left bound alone
        assert "fused" not in paths, case


@pytest.mark.parametrize(
    "shape",
    [
        # (batch, heads_kv, group, seq_q, seq_k): the third head's 47 key blocks run in two waves
        # of the 132-block grid (items 94 .. 131 and 132 .. 140)
        (3, 1, 1, 6000, 6016),
        # more key blocks than a wave (156 a head), with grouped heads
        (1, 1, 4, 2500, 19968),
        (2, 3, 2, 4096, 4096),
        (1, 8, 4, 4096, 4096),  # 32 / 8 heads: rounds of the paired walk split heads
    ],
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_turns_across_waves(shape, causal, head_dim):
    batch, heads_kv, group, seq_q, seq_k = shape
    if head_dim == 256 and seq_k > 10000:  # 156 of d = 256's 64-key blocks, as 19968 hold of 128
        seq_k //= 2
    shape = (batch, heads_kv, group, seq_q, seq_k, head_dim)
    case = Case(*shape, "bfloat16", "bshd", causal, None, "contiguous", 11)
    plans = check_case(case, "fused waves", FUSED)
    assert backward_paths(plans) == ("fused", "fused")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,seq", [(64, 3000), (128, 3000), (256, 3000), (256, 4096)])
def test_fused_backward_is_deterministic_and_the_default(causal, head_dim, seq):
    import cuflash

    gen = torch.Generator(device="cuda").manual_seed(5)
    kv, d = 2, head_dim
    q, do = (torch.randn(2, seq, 8, d, generator=gen, device="cuda").bfloat16() for _ in "ab")
    # as many keys as queries: the library's choice at d = 64 too (fused_backward_chosen)
    k, v = (torch.randn(2, seq, kv, d, generator=gen, device="cuda").bfloat16() for _ in "ab")
    o, lse = cuflash.attention_forward(q, k, v, causal=causal)
    first = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
    for _ in range(3):
        again = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    fused = testing.attention_backward_with(FUSED, do, q, k, v, o, lse, causal=causal)
    split = testing.attention_backward_with(SPLIT, do, q, k, v, o, lse, causal=causal)
    assert backward_paths((None, fused[3])) == ("fused", "fused")
    assert backward_paths((None, split[3])) == ("tma", "tma")
    # the library's choice: fused, but at d = 256 under a causal mask over fewer than 4096 rows
    # the split kernels (_dispatch.fused_backward_chosen)
    default = split if head_dim == 256 and causal and seq < 4096 else fused
    assert _dispatch.fused_backward_chosen(fused[3].p) == (default is fused)
    assert all(torch.equal(a, b) for a, b in zip(first, default[:3], strict=True))
    # the two agree to the dtype's rounding (they add in other orders)
    for a, b in zip(fused[:3], split[:3], strict=True):
        scale = b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * scale


@pytest.mark.parametrize(
    "causal,window,seq_k",
    [
        (False, (64, None), 500),
        (False, None, 20000),
    ],
)
def test_other_calls_keep_the_split_backward(causal, window, seq_k):
    # a left bound alone, and more key blocks than query steps (group x query tiles) without a
    # bound (the softcap takes the fused kernels since v29: fused_cases draws it)
    case = Case(
        1,
        2,
        1,
        100 if seq_k > 10000 else 500,
        seq_k,
        128,
        "bfloat16",
        "bshd",
        causal,
        None,
        "contiguous",
        3,
        window=window,
    )
    plans = check_case(case, "fused excluded", FUSED)
    assert "fused" not in backward_paths(plans)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "where,value,head_dim",
    [
        ("q", float("nan"), 128),
        ("k", float("nan"), 128),
        ("v", float("inf"), 128),
        ("do", float("nan"), 128),
        ("q", float("nan"), 64),
        ("k", float("inf"), 64),
        ("k", float("nan"), 256),  # two consumers share the keys, each repairs its columns
        ("v", float("inf"), 256),
        ("do", float("nan"), 256),
    ],
)
def test_a_nonfinite_input_reaches_what_depends_on_it(where, value, head_dim, causal):
    # Without a mask every key meets every query in the products, so a non-finite element reaches
    # exactly what the float64 reference says. Causal: pairs a query may not see still meet in
    # the diagonal tiles' products (P = 0, dS = 0: 0 x NaN), and the repair recomputes the rows
    # they made non-finite, so the outcome is again the reference's.
    import numpy as np

    import cuflash
    from cuflash import reference

    gen = torch.Generator(device="cuda").manual_seed(8)
    kv_heads = 2
    d = head_dim
    q, do = (torch.randn(1, 300, 4, d, generator=gen, device="cuda").bfloat16() for _ in "ab")
    k, v = (torch.randn(1, 384, kv_heads, d, generator=gen, device="cuda").bfloat16() for _ in "ab")
    inputs = {"q": q, "k": k, "v": v, "do": do}
    bad = {name: x.clone() for name, x in inputs.items()}
    bad[where][0, 150, 1, 3] = value

    def run(x):
        o, lse = cuflash.attention_forward(x["q"], x["k"], x["v"], causal=causal)
        args = (x["do"], x["q"], x["k"], x["v"], o, lse)
        grads = testing.attention_backward_with(FUSED, *args, causal=causal)
        assert backward_paths((None, grads[3])) == ("fused", "fused")
        return (o, *grads[:3])

    def f64(x):
        return x.double().cpu().numpy()

    def want(x):
        o, lse = reference.forward(f64(x["q"]), f64(x["k"]), f64(x["v"]), causal=causal)
        grads = reference.backward(
            *(f64(x[n]) for n in ("do", "q", "k", "v")), o, lse, causal=causal
        )
        return (o, *grads)

    got, clean = run(bad), run(inputs)
    for name, g, w, c, wc in zip(
        ("o", "dq", "dk", "dv"), got, want(bad), clean, want(inputs), strict=True
    ):
        g, finite = f64(g), np.isfinite(w)
        np.testing.assert_array_equal(np.isfinite(g), finite, err_msg=name)
        own_error = np.abs(f64(c) - wc).max()
        assert np.abs(g[finite] - w[finite]).max() <= 2 * own_error + 1e-6, name
