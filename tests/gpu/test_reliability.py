"""Hostile inputs, numeric extremes, large problems and concurrency on the GPU."""

from __future__ import annotations

import math
import re
import threading

import numpy as np
import pytest

import cuflash
from cuflash import testing
from cuflash._dispatch import KernelChoice

pytestmark = pytest.mark.gpu
if testing.gpu_unavailable_reason():
    pytest.skip(f"GPU test: {testing.gpu_unavailable_reason()}", allow_module_level=True)
torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")


def rand(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


def raises(exc, *words):
    return pytest.raises(exc, match=".*".join(re.escape(w) for w in words))


# ---------------------------------------------------------------------------------------------
# Bad input on CUDA arrays: the same errors as on the CPU, raised before any launch.


def test_errors_for_cuda_inputs():
    q, k, v = rand(2, 37, 4, 24), rand(2, 45, 2, 24), rand(2, 45, 2, 24)
    with raises(ValueError, "q must be a 4-D array", "(2, 37, 4)"):
        cuflash.attention(q[..., 0], k, v)
    with raises(ValueError, "batch size 2", "(1, 45, 2, 24)"):
        cuflash.attention(q, k[:1], v[:1])
    with raises(ValueError, "head dim 24", "(2, 45, 2, 20)"):
        cuflash.attention(q, k[..., :20], v[..., :20])
    with raises(ValueError, "k and v must have the same shape"):
        cuflash.attention(q, k, v[:, :44])
    with raises(ValueError, "query heads (4) must be a multiple", "key/value heads (3)"):
        cuflash.attention(q, rand(2, 45, 3, 24), rand(2, 45, 3, 24))
    with raises(TypeError, "q has dtype int32"):
        cuflash.attention(q.to(torch.int32), k, v)
    with raises(TypeError, "q has dtype complex64"):
        cuflash.attention(q.to(torch.complex64), k, v)
    with raises(TypeError, "k must have dtype bfloat16 (like q)", "float16"):
        cuflash.attention(q, k.half(), v)
    with raises(ValueError, "k is on cpu but q is on cuda:0"):
        cuflash.attention(q, k.cpu(), v)
    with raises(TypeError, "k is a cupy array but q is a torch array"):
        cuflash.attention(q, cupy.from_dlpack(k), v)
    with raises(ValueError, "at most 256", "got 300"):
        cuflash.attention(*(rand(1, 8, 1, 300) for _ in range(3)))
    with raises(ValueError, "at least 1"):
        cuflash.attention(q[..., :0], k[..., :0], v[..., :0])
    with raises(ValueError, "q must have a contiguous last dimension"):
        cuflash.attention(rand(2, 37, 4, 48)[..., ::2], k, v)
    with raises(ValueError, "scale must be a finite number > 0"):
        cuflash.attention(q, k, v, scale=float("nan"))
    with raises(ValueError, "layout must be"):
        cuflash.attention(q, k, v, layout="BSHD")
    o, lse = cuflash.attention_forward(q, k, v)
    with raises(ValueError, "do must have the shape of q"):
        cuflash.attention_backward(q[:, :5], q, k, v, o, lse)
    with raises(TypeError, "lse must have dtype float32", "bfloat16"):
        cuflash.attention_backward(q, q, k, v, o, lse.bfloat16())
    with raises(ValueError, "lse must have shape (B, Hq, Nq)"):
        cuflash.attention_backward(q, q, k, v, o, lse[:, :2])


def test_q_and_k_on_different_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU on this machine")
    q = rand(1, 8, 1, 32)
    with raises(ValueError, "k is on cuda:1 but q is on cuda:0"):
        cuflash.attention(q, q.to("cuda:1"), q)


def test_batch_dims_in_any_order_are_read_in_place():
    base = rand(3, 4, 100, 64, seed=1)  # (H, B, N, d) in memory
    q = base.permute(1, 2, 0, 3)  # (B, N, H, d) view, not C-ordered in the batch dims
    assert not q.is_contiguous()
    o = cuflash.attention(q, q, q, causal=True)
    torch.testing.assert_close(
        o, cuflash.attention(*(q.contiguous(),) * 3, causal=True), rtol=0, atol=0
    )


def test_requires_grad_tensor_in_the_plain_api():
    q = rand(1, 64, 2, 64).requires_grad_()
    o = cuflash.attention(q, q, q)
    assert not o.requires_grad  # the plain API is not differentiable (cuflash.torch is)


# ---------------------------------------------------------------------------------------------
# Numerics


def check_against_reference(q, k, v, causal, scale, dtype_name):
    o, lse = cuflash.attention_forward(q, k, v, causal=causal, scale=scale)
    qb, kb, vb = (cupy.from_dlpack(x.double().transpose(1, 2).contiguous()) for x in (q, k, v))
    kw = dict(causal=causal, scale=scale, xp=cupy)
    o_ref, lse_ref = testing.naive_forward(qb, kb, vb, dtype="float64", **kw)
    o_low, lse_low = testing.naive_forward(qb, kb, vb, dtype=dtype_name, **kw)
    ob = cupy.from_dlpack(o.double().transpose(1, 2).contiguous())
    lb = cupy.from_dlpack(lse.double())
    for check in (
        testing.compare("o", ob, o_ref, o_low, dtype_name, cupy),
        testing.compare("lse", lb, lse_ref, lse_low, dtype_name, cupy),
    ):
        assert check.passed, check.message
    assert bool(torch.isfinite(o).all()) and bool(torch.isfinite(lse).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_scores_up_to_1e4(dtype, causal):
    # |S| ~ 1e4: exp of a raw score would overflow every floating format
    q = rand(1, 200, 2, 64, dtype=dtype, seed=2, scale=13.0)
    k = rand(1, 300, 2, 64, dtype=dtype, seed=3, scale=13.0)
    v = rand(1, 300, 2, 64, dtype=dtype, seed=4)
    check_against_reference(q, k, v, causal, 1.0, str(dtype)[6:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_scale_up_to_1e3(dtype):
    q, k, v = (rand(1, 150, 2, 32, dtype=dtype, seed=s) for s in (5, 6, 7))
    check_against_reference(q, k, v, True, 1e3, str(dtype)[6:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_values_near_the_format_limits(dtype):
    big = torch.finfo(dtype).max / 4
    q = rand(1, 100, 2, 64, dtype=dtype, seed=8) * 0.01
    k = rand(1, 100, 2, 64, dtype=dtype, seed=9) * 0.01
    v = (rand(1, 100, 2, 64, dtype=torch.float32, seed=10).clamp(-1, 1) * big).to(dtype)
    check_against_reference(q, k, v, False, 0.125, str(dtype)[6:])
    tiny = rand(1, 100, 2, 64, dtype=dtype, seed=11) * torch.finfo(dtype).tiny
    o = cuflash.attention(tiny, tiny, tiny)
    assert bool(torch.isfinite(o).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_row_max_rising_and_falling_across_key_tiles(dtype, head_dim, causal):
    # The TMA forward's running row max may trail the true one by up to 2^8 (softmax.cuh, SLACK):
    # scores that rise along the keys by 0.5, 3 and 30 log2 units per 128 keys (the max moves
    # within the slack for several tiles, then past it; or past it on every tile), or fall by 30
    # (the first tile holds the max), on 4096 rows (the long tiles of every head dim). In
    # bfloat16 V also sits near the format's top, where the slack must not overflow O's sums.
    n, heads = 4096, 4
    q = rand(1, n, heads, head_dim, dtype=torch.float32, seed=21, scale=0.3)
    k = rand(1, n, heads, head_dim, dtype=torch.float32, seed=22, scale=0.3)
    per_key = torch.tensor([0.5, 3.0, 30.0, -30.0], device="cuda") / 128 / math.log2(math.e)
    q[..., 0] = 1.0
    k[..., 0] = torch.arange(n, device="cuda")[:, None] * per_key  # scale 1: S = q . k
    v = rand(1, n, heads, head_dim, dtype=torch.float32, seed=23).clamp(-1, 1)
    if dtype == torch.bfloat16:
        v = v * (torch.finfo(dtype).max / 4)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    check_against_reference(q, k, v, causal, 1.0, str(dtype)[6:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("where", ["q", "k"])
def test_nan_in_an_input_row_reaches_only_the_rows_it_touches(dtype, causal, where):
    q, k, v = (rand(1, 150, 2, 64, dtype=dtype, seed=s) for s in (12, 13, 14))
    clean_o, clean_lse = cuflash.attention_forward(q, k, v, causal=causal)
    bad_row = 70
    if where == "q":
        q = q.clone()
        q[0, bad_row, 1, 5] = float("nan")
        touched = torch.zeros(150, dtype=torch.bool, device="cuda")
        touched[bad_row] = True
        heads = [1]
    else:
        k = k.clone()
        k[0, bad_row, 1, 5] = float("nan")
        # query i sees key j when j <= i (Nq == Nk)
        touched = (
            torch.arange(150, device="cuda") >= bad_row
            if causal
            else torch.ones(150, dtype=torch.bool, device="cuda")
        )
        heads = [1]
    o, lse = cuflash.attention_forward(q, k, v, causal=causal)
    for h in range(2):
        rows = touched if h in heads else torch.zeros_like(touched)
        nonfinite = ~torch.isfinite(o[0, :, h]).all(-1)
        assert torch.equal(nonfinite, rows), (h, nonfinite.nonzero().flatten())
        assert torch.equal(o[0, ~rows, h], clean_o[0, ~rows, h])  # every other row exact
        assert torch.equal(lse[0, h, ~rows], clean_lse[0, h, ~rows])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize(
    "where,value", [("v", float("nan")), ("v", float("inf")), ("do", float("nan"))]
)
def test_nonfinite_v_or_do_reaches_only_what_depends_on_it(dtype, d, where, value):
    # The bad element sits inside a tile on the causal diagonal, where rows that do not see it
    # meet it with P = 0 (or dS = 0) in the tensor-core products (kernels_cu/repair.cuh).
    from cuflash import reference

    n, bad = 300, 150
    q, k, v, do = (rand(1, n, 2, d, dtype=dtype, seed=s) for s in (40, 41, 42, 43))
    clean_o, clean_lse = cuflash.attention_forward(q, k, v, causal=True)
    clean = (clean_o, *cuflash.attention_backward(do, q, k, v, clean_o, clean_lse, causal=True))
    v2, do2 = v.clone(), do.clone()
    (v2 if where == "v" else do2)[0, bad, 1, 3] = value
    o, lse = cuflash.attention_forward(q, k, v2, causal=True)
    got = (o, *cuflash.attention_backward(do2, q, k, v2, o, lse, causal=True))
    assert torch.equal(lse, clean_lse)

    def f64(x):
        return x.double().cpu().numpy()

    def reference_outputs(v, do):
        o, lse = reference.forward(f64(q), f64(k), f64(v), causal=True)
        return (o, *reference.backward(f64(do), f64(q), f64(k), f64(v), o, lse, causal=True))

    want, want_clean = reference_outputs(v2, do2), reference_outputs(v, do)
    for name, g, w, c, wc in zip(
        ("o", "dq", "dk", "dv"), got, want, clean, want_clean, strict=True
    ):
        g = f64(g)
        finite = np.isfinite(w)
        assert (~finite).any() == (name != ("dv" if where == "v" else "o")), name
        np.testing.assert_array_equal(np.isfinite(g), finite, err_msg=name)
        # Where the value does not depend on the bad element, it is as accurate as without it.
        own_error = np.abs(f64(c) - wc).max()
        assert np.abs(g[finite] - w[finite]).max() <= 2 * own_error + 1e-6, name


# ---------------------------------------------------------------------------------------------
# Scale


def test_offsets_beyond_2_to_the_31_elements():
    # q, k, v are views whose second batch starts 2**31 + 64 elements into one 4.3 GB buffer
    n, h, d = 256, 2, 64
    offset = 2**31 + 64
    base = torch.empty(offset + n * h * d, dtype=torch.bfloat16, device="cuda")
    base[: n * h * d] = rand(n * h * d, seed=15)
    base[offset:] = rand(n * h * d, seed=16)
    x = base.as_strided((2, n, h, d), (offset, h * d, d, 1))
    o, lse = cuflash.attention_forward(x, x, x, causal=True)
    do = rand(2, n, h, d, seed=17)
    grads = cuflash.attention_backward(do, x, x, x, o, lse, causal=True)
    for batch in range(2):
        xb = x[batch : batch + 1].contiguous()
        ob, lseb = cuflash.attention_forward(xb, xb, xb, causal=True)
        assert torch.equal(o[batch : batch + 1], ob) and torch.equal(lse[batch : batch + 1], lseb)
        gb = cuflash.attention_backward(do[batch : batch + 1], xb, xb, xb, ob, lseb, causal=True)
        for g, want in zip(grads, gb, strict=True):
            assert torch.equal(g[batch : batch + 1], want)
    del base


def spot_check(q, k, v, do, o, lse, grads, causal, rows, keys):
    """float64 reference for a few query rows (o, lse, dq) and a few keys (dk, dv), (B,H,N,d)."""
    b, h, n, d = q.shape
    scale = 1.0 / math.sqrt(d)
    q64, k64, v64, do64, o64 = (x.double() for x in (q, k, v, do, o))
    lse64 = lse.double()
    idx = torch.arange(n, device="cuda")
    # rows: full softmax over all keys
    s = (q64[:, :, rows] @ k64.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(idx[None, :] > rows[:, None], -float("inf"))
    lse_ref = torch.logsumexp(s, -1)
    p = torch.exp(s - lse_ref[..., None])
    o_ref = p @ v64
    delta = (do64 * o64).sum(-1)
    dp = do64[:, :, rows] @ v64.transpose(-1, -2)
    dq_ref = ((p * (dp - delta[:, :, rows, None])) @ k64) * scale
    # keys: the column of P over all queries, from the kernel's lse (checked above on `rows`)
    st = (q64 @ k64[:, :, keys].transpose(-1, -2)) * scale
    if causal:
        st = st.masked_fill(keys[None, :] > idx[:, None], -float("inf"))
    pt = torch.exp(st - lse64[..., None])
    dv_ref = pt.transpose(-1, -2) @ do64
    dpt = do64 @ v64[:, :, keys].transpose(-1, -2)
    dk_ref = ((pt * (dpt - delta[..., None])).transpose(-1, -2) @ q64) * scale
    dq, dk, dv = grads
    for got, ref in (
        (o[:, :, rows], o_ref),
        (dq[:, :, rows], dq_ref),
        (dk[:, :, keys], dk_ref),
        (dv[:, :, keys], dv_ref),
    ):
        rel = ((got.double() - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, rel  # bfloat16 outputs
    assert (lse[:, :, rows].double() - lse_ref).abs().max().item() < 1e-3


def test_sequence_of_128k():
    b, h, n, d = 1, 8, 131072, 128
    q, k, v, do = (rand(b, h, n, d, seed=s) for s in (18, 19, 20, 21))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    o, lse = cuflash.attention_forward(q, k, v, causal=True, layout="bhsd")
    grads = cuflash.attention_backward(do, q, k, v, o, lse, causal=True, layout="bhsd")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    outputs = sum(x.numel() * x.element_size() for x in (o, lse, *grads))
    # O(N) extra memory: D (B * H * N floats), and where the fused Hopper backward runs, float32
    # sums of dQ (twice dQ's size: _dispatch.backward_workspace)
    *_, plan = testing.attention_backward_with(
        KernelChoice(), do, q, k, v, o, lse, causal=True, layout="bhsd"
    )
    fused = plan.dkdv.aligned.launch.spec.path == "fused"
    sums = 2 * grads[0].numel() * grads[0].element_size() if fused else 0
    assert peak <= 1.1 * outputs + sums, (peak, outputs, sums)
    rows = torch.tensor([0, 1, 4095, 65536, n - 1], device="cuda")
    keys = torch.tensor([0, 777, 100000, n - 2, n - 1], device="cuda")
    spot_check(q, k, v, do, o, lse, grads, True, rows, keys)


def test_65536_short_rows():
    b, h, n, d = 4096, 16, 32, 64  # B * H = 65536 sequences of 32 tokens
    q, k, v, do = (rand(b, h, n, d, seed=s) for s in (22, 23, 24, 25))
    o, lse = cuflash.attention_forward(q, k, v, layout="bhsd")
    grads = cuflash.attention_backward(do, q, k, v, o, lse, layout="bhsd")
    for sel in (slice(0, 2), slice(b - 2, b)):  # the first and the last sequences
        sub = [x[sel] for x in (q, k, v, do, o, lse, *grads)]
        rows = keys = torch.arange(n, device="cuda")
        spot_check(*sub[:6], tuple(sub[6:]), False, rows, keys)


# ---------------------------------------------------------------------------------------------
# Concurrency


def test_eight_threads_with_racing_first_compilation():
    from cuflash import _compile, _kernels, _plans

    # a configuration no other test uses (mma.sync everywhere: no Hopper kernel at d = 200), so
    # its modules are compiled during the race
    dtype, d = torch.float16, 200
    arch = _compile.device_arch(torch.cuda.current_device())
    names = {
        _kernels.instance(f, _kernels.paths(f, "float16", d, arch)[0], "float16", d).name_expression
        for f in ("forward", "preprocess", "dkdv", "dq")
    }
    assert len(names) == 4
    _compile.forget(names)
    _plans.clear()
    before = _compile.compile_count
    inputs = [
        tuple(rand(1, 97, 2, d, dtype=dtype, seed=100 + 4 * t + i) for i in range(4))
        for t in range(8)
    ]
    results, errors = [None] * 8, []
    barrier = threading.Barrier(8)

    def work(t):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                barrier.wait()
                q, k, v, do = inputs[t]
                o, lse = cuflash.attention_forward(q, k, v, causal=True)
                grads = cuflash.attention_backward(do, q, k, v, o, lse, causal=True)
            stream.synchronize()
            results[t] = (o, lse, *grads)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "a thread is stuck"
    assert not errors, errors
    assert _compile.compile_count - before == 4  # each module compiled once
    for t in range(8):  # each thread's results equal a quiet single-threaded run
        q, k, v, do = inputs[t]
        o, lse = cuflash.attention_forward(q, k, v, causal=True)
        want = (o, lse, *cuflash.attention_backward(do, q, k, v, o, lse, causal=True))
        for got, w in zip(results[t], want, strict=True):
            assert torch.equal(got, w)
    assert np.isfinite(results[0][0].float().cpu().numpy()).all()
