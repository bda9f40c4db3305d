"""Build the model in host memory, then move it to its GPU in the worker's dtype, so that the device
never holds a float32 copy of weights it keeps in bfloat16."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import paddle

KEEP_FLOAT32 = ("rotary", "layer_attention")  # the model attributes that stay float32: the rotary kernel reads its
# cos/sin so


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Tensors made inside are made in host memory."""
    device = paddle.get_device()
    paddle.set_device("cpu")
    try:
        yield
    finally:
        paddle.set_device(device)


def move_model(model: object, device: str, dtype: str) -> None:
    """Every tensor the model holds copied to `device` (gpu:N), float32 ones cast to `dtype` first, in
    host memory, except those under KEEP_FLOAT32."""
    device_id = int(device.partition(":")[2] or 0)

    def to_device(tensor: paddle.Tensor, cast: bool) -> paddle.Tensor:
        converted = tensor.astype(dtype) if cast and tensor.dtype == paddle.float32 else tensor
        return converted.cuda(device_id, blocking=True)

    map_model_tensors(model, to_device)


def map_model_tensors(model: object, convert: Callable[[paddle.Tensor, bool], paddle.Tensor]) -> None:
    """Replace every tensor the model holds (its attributes, lists such as its layers, frozen dataclasses
    such as its linear layers, objects such as its rotary tables) by convert(tensor, cast), cast False
    under KEEP_FLOAT32. A tensor held twice (a tied lm_head's embedding) is converted once."""
    converted: dict[int, paddle.Tensor] = {}

    def once(tensor: paddle.Tensor, cast: bool) -> paddle.Tensor:
        if id(tensor) not in converted:
            converted[id(tensor)] = convert(tensor, cast)
        return converted[id(tensor)]

    for name, value in vars(model).items():
        cast = name not in KEEP_FLOAT32
        setattr(model, name, _map_tensors(value, lambda tensor, cast=cast: once(tensor, cast)))


def _map_tensors(value: object, convert: Callable[[paddle.Tensor], paddle.Tensor]) -> object:
    if isinstance(value, paddle.Tensor):
        return convert(value)
    if isinstance(value, list | tuple):
        return type(value)(_map_tensors(item, convert) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _map_tensors(getattr(value, f.name), convert) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    if type(value).__module__.startswith("worker.") and hasattr(value, "__dict__"):  # e.g. RotaryEmbedding
        for name, item in vars(value).items():
            setattr(value, name, _map_tensors(item, convert))
    return value
