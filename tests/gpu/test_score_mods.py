"""Sliding windows, softcap and ALiBi on the GPU: every head-dim bucket and path against the
float64 reference, rows that see nothing, NaN locality, determinism and the torch wrapper.

The property test of test_kernels.py draws these options too, with everything else it draws.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_kernels import DTYPES, Case, alibi_slopes, check_case, lse_bh64, make, to_bhsd64

import cuflash
from cuflash import _dispatch, testing

pytestmark = pytest.mark.gpu
if testing.gpu_unavailable_reason():
    pytest.skip(f"GPU test: {testing.gpu_unavailable_reason()}", allow_module_level=True)
torch = pytest.importorskip("torch", reason="the GPU tests make their inputs with PyTorch")
cupy = pytest.importorskip("cupy")

# One of each feature and all three together (kernels_cu/features.cuh bits 1, 2, 4 and 7).
FEATURES = {
    "window": dict(window=(40, 7)),
    "softcap": dict(softcap=2.0),
    "alibi": dict(alibi="batch"),
    "all": dict(window=(100, -1), softcap=30.0, alibi="head"),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 224, 256])
def test_every_bucket_with_each_feature(feature, dtype, head_dim):
    for causal in (False, True):
        base = Case(2, 2, 2, 150, 211, head_dim, dtype, "bshd", causal, None, "contiguous", 3)
        check_case(replace(base, **FEATURES[feature]), "features")


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("path", ["wgmma", "mma"])
def test_slower_paths_with_each_feature(feature, path):
    # the library picks the TMA kernels on Hopper for aligned inputs: the others here
    base = Case(2, 2, 2, 333, 517, 128, "bfloat16", "bshd", True, None, "views", 7)
    check_case(replace(base, **FEATURES[feature]), "features", _dispatch.KernelChoice(path=path))


@pytest.mark.parametrize("window", [(0, 0), (0, -1), (1, 1), (-1, 0), (256, 0), (5000, 5000)])
def test_long_sliding_windows(window):
    # several key tiles per row block and both sides of the band; causal sets right = 0
    for causal in (False, True):
        case = Case(1, 2, 2, 1500, 1300, 128, "bfloat16", "bshd", causal, None, "contiguous", 11)
        check_case(replace(case, window=window), "windows")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqs", [(1500, 1300), (700, 2900), (2048, 2048), (4100, 4200)])
def test_alibi_over_key_tiles_on_both_sides_of_the_diagonal(head_dim, seqs):
    # Slopes small enough (distances of thousands of keys cost a few units of score) that the key
    # tiles far left and right of a row's diagonal weigh in its O and lse: the TMA forward gives
    # the tiles wholly on one side ALiBi's one-sided form and those that straddle a diagonal the
    # general one (kernels_cu/forward_sm90.cuh, alibi_side). Nq < Nk, Nq > Nk and 2048 rows (d =
    # 64's three-warpgroup tiles, from 1024 rows; 4100: d = 128's 160-key tiles), with and
    # without a softcap, causal (every unmasked tile left of the diagonal) and not; and larger
    # slopes, where a row's terms differ between the lanes that hold its columns by more (a first
    # version took the quad's max before adding each lane's term: off by up to 6 slopes, 0.15-0.6
    # in lse).
    nq, nk = seqs
    base = Case(1, 2, 2, nq, nk, head_dim, "bfloat16", "bshd", False, None, "contiguous", 13)
    for causal in (False, True):
        for softcap, alibi_max in ((None, 8.0 / max(seqs)), (20.0, 8.0 / max(seqs)), (None, 0.25)):
            options = dict(causal=causal, softcap=softcap, alibi="head", alibi_max=alibi_max)
            check_case(replace(base, **options), "alibi sides")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_rows_outside_every_window_see_nothing(dtype):
    # Nq > Nk with window (0, 0): query i sees key i + Nk - Nq only, the first Nq - Nk rows none
    case = Case(1, 2, 1, 300, 100, 64, dtype, "bshd", False, None, "contiguous", 5, window=(0, 0))
    check_case(case, "masked rows")
    gen = torch.Generator(device="cuda").manual_seed(2)
    q = make(case, case.shape(300, 2), gen)
    k, v = make(case, case.shape(100, 2), gen), make(case, case.shape(100, 2), gen)
    o, lse = cuflash.attention_forward(q, k, v, window=(0, 0), softcap=5.0)
    assert torch.all(o[:, :200] == 0) and torch.all(torch.isneginf(lse[:, :, :200]))
    # one key each: o is that key's value row, lse its score
    torch.testing.assert_close(o[:, 200:].float(), v.float(), rtol=0, atol=0)
    dq, dk, dv = cuflash.attention_backward(torch.randn_like(q), q, k, v, o, lse, window=(0, 0))
    assert torch.all(dq[:, :200] == 0)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


def test_nan_outside_the_window_stays_outside():
    # A NaN in key/value j reaches only the rows whose window holds j, with every modifier on.
    case = Case(1, 1, 1, 400, 400, 64, "bfloat16", "bshd", False, None, "contiguous", 4)
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (make(case, case.shape(400, 1), gen) for _ in range(3))
    k[0, 123, 0, 5] = float("nan")
    v[0, 300, 0, 7] = float("nan")
    slopes = torch.rand(1, device="cuda")
    options = dict(window=(16, 0), softcap=10.0, alibi_slopes=slopes)
    o, lse = cuflash.attention_forward(q, k, v, **options)
    rows = torch.arange(400, device="cuda")
    sees_nan = ((rows >= 123) & (rows <= 123 + 16)) | ((rows >= 300) & (rows <= 300 + 16))
    finite = torch.isfinite(o[0, :, 0].float()).all(dim=-1)
    assert torch.equal(finite, ~sees_nan)
    dq, dk, dv = cuflash.attention_backward(torch.randn_like(q), q, k, v, o, lse, **options)
    assert torch.isfinite(dq[0, ~sees_nan]).all()


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_backward_with_features_is_bitwise_deterministic(head_dim):
    case = Case(2, 2, 4, 300, 500, head_dim, "bfloat16", "bshd", True, None, "contiguous", 8)
    case = replace(case, **FEATURES["all"])
    gen = torch.Generator(device="cuda").manual_seed(case.seed)
    q = make(case, case.shape(300, 8), gen)
    k, v = make(case, case.shape(500, 2), gen), make(case, case.shape(500, 2), gen)
    do = make(case, case.shape(300, 8), gen)
    options = dict(causal=True, window=case.window, softcap=case.softcap)
    options["alibi_slopes"] = alibi_slopes(case, gen)
    o, lse = cuflash.attention_forward(q, k, v, **options)
    first = cuflash.attention_backward(do, q, k, v, o, lse, **options)
    for _ in range(3):
        again = cuflash.attention_backward(do, q, k, v, o, lse, **options)
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_torch_wrapper_takes_the_new_options():
    import cuflash.torch as cft

    gen = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = (
        torch.randn(2, 200, 4, 64, generator=gen, device="cuda").half().requires_grad_()
        for _ in range(3)
    )
    slopes = torch.rand(2, 4, generator=gen, device="cuda")
    options = dict(causal=True, window=(32, None), softcap=20.0, alibi_slopes=slopes)
    o = cft.attention(q, k, v, **options)
    do = torch.randn_like(o)
    o.backward(do)
    o_api, lse = cuflash.attention_forward(q.detach(), k.detach(), v.detach(), **options)
    assert torch.equal(o.detach(), o_api)
    grads = cuflash.attention_backward(
        do, q.detach(), k.detach(), v.detach(), o_api, lse, **options
    )
    for got, want in zip((q.grad, k.grad, v.grad), grads, strict=True):
        assert torch.equal(got, want)
    compiled = torch.compile(lambda a, b, c: cft.attention(a, b, c, **options), fullgraph=True)
    assert torch.equal(compiled(q.detach(), k.detach(), v.detach()), o_api)


def test_tanh_of_the_half_precision_kernels_is_accurate_on_this_gpu():
    # The tensor-core kernels' tanh is tanh.approx.f32 (kernels_cu/score_mod.cuh): PTX allows a
    # relative error of 2^-11, which would put c * 2^-11 into saturated scores; the kernels rely
    # on the measured unit (2^-16.5 on sm_90), and this holds the GPU that runs them to 2^-15.
    import cupy as cp
    import numpy as np

    from cuflash import testing

    grid = np.linspace(-20.0, 20.0, 1 << 22, dtype=np.float32)
    special = np.array([0.0, -0.0, 1e-30, -1e-30, 1e-6, np.inf, -np.inf, np.nan], np.float32)
    y = cp.asarray(np.concatenate([grid, special]))
    got = testing.kernel_tanh(y).get().astype(np.float64)
    exact = np.tanh(y.get().astype(np.float64))
    finite = np.isfinite(exact)
    relative = np.abs(got[finite] - exact[finite]) / np.maximum(np.abs(exact[finite]), 1e-37)
    assert relative.max() <= 2.0**-15, f"tanh relative error {relative.max():.3g} > 2^-15"
    assert got[-3] == 1.0 and got[-2] == -1.0 and np.isnan(got[-1])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("softcap", [5.0, 30.0, 50.0])
def test_softcap_rows_pinned_at_the_cap(head_dim, softcap):
    # bfloat16 under a softcap alone: a row whose max comes within reach of the cap c is pinned,
    # and the tiles of a warp whose rows all are take no max (kernels_cu/softmax.cuh, CEILING).
    # Row groups of 64 (a warpgroup each): scores near +c from the first key tile; all near -c
    # (c = 50: too far under the cap, never pinned; c = 5: pinned at once); rising across the
    # keys (pinned at a later tile, the accumulator rescaled then); falling; plain normal
    # scores. Each group against the float64 reference on its own (their O differ in size).
    # Then V times 2^120 (bfloat16's top is 2^128): pinned P stay under 2^-p_shift, so the
    # unnormalised accumulator cannot overflow.
    nq, nk, d = 320, 2000, head_dim
    gen = torch.Generator(device="cuda").manual_seed(21)
    scale = 1.0 / d**0.5

    def normal(*shape):
        return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32)

    k = normal(nk, d)
    k[:, 0] = 1.0  # a component every key shares
    k[:, 1] = torch.linspace(-1.0, 1.0, nk, device="cuda")  # one that rises with the key
    q = normal(nq, d)
    q[:, :2] = 0.0
    far = 3.0 * softcap / scale  # q . k * scale = +-3c along a special component
    q[0:64, 0] = far  # near +c
    q[64:128, 0] = -far  # near -c
    q[128:192, 1] = far  # rising
    q[192:256, 1] = -far  # falling
    v = normal(nk, d)
    q, k, v = (x.to(torch.bfloat16)[None, :, None, :] for x in (q, k, v))
    for causal in (False, True):
        options = dict(causal=causal, softcap=softcap)
        o, lse = cuflash.attention_forward(q, k, v, **options)
        qb, kb, vb = (to_bhsd64(x, "bshd") for x in (q, k, v))
        kw = dict(causal=causal, scale=scale, xp=cupy, softcap=softcap)
        o_ref, lse_ref = testing.naive_forward(qb, kb, vb, dtype="float64", **kw)
        o_low, lse_low = testing.naive_forward(qb, kb, vb, dtype="bfloat16", **kw)
        ob, lseb = to_bhsd64(o, "bshd"), lse_bh64(lse, "bshd")
        for g in range(5):
            rows = slice(64 * g, 64 * g + 64)
            for name, got, ref, low in (("o", ob, o_ref, o_low), ("lse", lseb, lse_ref, lse_low)):
                check = testing.compare(
                    name, got[:, :, rows], ref[:, :, rows], low[:, :, rows], "bfloat16", cupy
                )
                assert check.passed, f"group {g}, causal {causal}: {check.message}"
        o_big, lse_big = cuflash.attention_forward(q, k, v * 2.0**120, **options)
        assert torch.isfinite(o_big.float()).all() and torch.equal(lse_big, lse)
        check = testing.compare(
            "o", to_bhsd64(o_big, "bshd") / 2.0**120, o_ref, o_low, "bfloat16", cupy
        )
        assert check.passed, f"V times 2^120, causal {causal}: {check.message}"
