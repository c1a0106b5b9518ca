"""Plans per call signature: the second call with the same metadata skips validation.

A signature is everything validation depends on: the arrays' type, shape, strides, dtype and
device (the ALiBi slopes' too), and the options (causal, window, softcap, scale, layout). Only
PyTorch tensors and CuPy arrays on CUDA devices have signatures (their metadata is cheap to read);
other inputs always take the full path. Data pointers are read on every call, and the plan
re-checks their 16-byte alignment itself.
"""

from __future__ import annotations

from typing import Any

_MAX_PLANS = 512
_plans: dict[tuple, Any] = {}


def signature(
    kind: str,
    arrays: tuple,
    causal: Any,
    window: Any,
    softcap: Any,
    scale: Any,
    layout: Any,
) -> tuple | None:
    """The cache key of a call, or None when this call has none (always validated in full).

    Flat, so that making and hashing it is cheap (it runs on every call: its cost is most of a
    small call's host time): (kind, type, the number of arrays, each option with its type (a
    window's bounds each with theirs), then shape, strides, dtype and device of each array: q, k,
    v, ..., and the ALiBi slopes where given).
    """
    first = arrays[0]
    cls = type(first)
    module = cls.__module__
    key = [kind, cls, len(arrays), type(causal), causal, type(window), window, type(softcap)]
    key += (softcap, type(scale), scale, type(layout), layout)
    if type(window) is tuple:
        key += map(type, window)
    if module.startswith("torch"):
        if not first.is_cuda:
            return None
        for a in arrays:
            if type(a) is not cls:
                return None
            key += (a.shape, a.stride(), a.dtype, a.get_device())
    elif module.startswith("cupy"):
        for a in arrays:
            if type(a) is not cls:
                return None
            key += (a.shape, a.strides, a.dtype, a.data.device_id)
    else:
        return None
    return tuple(key)


def pointers(arrays: tuple) -> list[int]:
    if type(arrays[0]).__module__.startswith("torch"):
        return [a.data_ptr() for a in arrays]
    return [a.data.ptr for a in arrays]


def get(key: tuple | None) -> Any:
    if key is None:
        return None
    try:
        return _plans.get(key)
    except TypeError:  # an unhashable argument (e.g. scale=[0.1]): validation will say so
        return None


def put(key: tuple | None, plan: Any) -> None:
    if key is None:
        return
    try:
        hash(key)
    except TypeError:
        return
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    _plans[key] = plan


def clear() -> None:
    """Drops every plan (tests that change how new plans are built, or what they load)."""
    _plans.clear()
