"""Counting copies from Paddle tensors to the host: every Tensor method that hands a tensor's values to Python or
NumPy, or moves it to the CPU. On a GPU each of them waits for the device; a test that counts only `numpy()` misses
an `item()`, a `float()` or an `np.asarray()`."""

from __future__ import annotations

import functools

import paddle
import pytest

# Each hands the values to the host, whatever its arguments (`__array__`: np.asarray; `__format__`, `__repr__` and
# `__str__` print the values).
TO_HOST = (
    "numpy",
    "tolist",
    "item",
    "__array__",
    "__float__",
    "__int__",
    "__index__",
    "__bool__",
    "__complex__",
    "__format__",
    "__repr__",
    "__str__",
    "cpu",
    "pin_memory",
)
# These copy to the host only when the place they are given is the CPU (or pinned host memory); `to` also casts.
TO_A_PLACE = ("to", "_copy_to")


def _names_the_host(args: tuple, kwargs: dict) -> bool:
    def is_host(value) -> bool:
        if isinstance(value, (paddle.CPUPlace, paddle.CUDAPinnedPlace)):
            return True
        return isinstance(value, str) and value.lower().startswith(("cpu", "gpu_pinned"))

    return any(map(is_host, (*args, *kwargs.values())))


class HostCopies:
    """Patches paddle.Tensor (undone with the monkeypatch) to record each copy to the host: `shapes` holds the
    copied tensor's shape per copy. A copy that calls another of these methods (`float()` through `numpy()`) is
    one copy."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.shapes: list[list[int]] = []
        self._depth = 0
        for name in TO_HOST + TO_A_PLACE:
            monkeypatch.setattr(paddle.Tensor, name, self._counted(name, getattr(paddle.Tensor, name)))

    def __len__(self) -> int:
        return len(self.shapes)

    def _counted(self, name: str, method):
        @functools.wraps(method)
        def counted(tensor, *args, **kwargs):
            if self._depth == 0 and (name in TO_HOST or _names_the_host(args, kwargs)):
                self.shapes.append(list(tensor.shape))
            self._depth += 1
            try:
                return method(tensor, *args, **kwargs)
            finally:
                self._depth -= 1

        return counted
