"""Q4_K for tests: a plain quantizer (gguf-py only dequantizes Q4_K) and a copy of a GGUF model with some
matrices stored as Q4_K, as a llama.cpp Q4_K_M file stores most of them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """uint8 Q4_K rows of an fp32 [out, in] matrix (in a multiple of 256): per group of 32, w ~ d*sc*q - dmin*m
    with q in 0..15 and 6-bit sc, m under the super-block's fp16 d and dmin (min/max per group, not llama.cpp's
    search: good enough to serve a model that still talks)."""
    out_features, in_features = weight.shape
    groups = weight.reshape(-1, 8, 32).astype(np.float32)  # [super-blocks, 8, 32]
    low = np.minimum(groups.min(axis=-1), 0.0)
    scale = (groups.max(axis=-1) - low) / 15.0
    offset = -low  # >= 0
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (offset.max(axis=-1) / 63.0).astype(np.float16)
    d32 = np.where(d > 0, d.astype(np.float32), 1.0)[:, None]
    dmin32 = np.where(dmin > 0, dmin.astype(np.float32), 1.0)[:, None]
    sc = np.clip(np.rint(scale / d32), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(offset / dmin32), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    base = (dmin.astype(np.float32)[:, None] * m)[..., None]
    q = np.clip(np.rint((groups + base) / np.where(step > 0, step, 1.0)), 0, 15).astype(np.uint8)
    scales = np.empty((len(groups), 12), np.uint8)  # gguf's Q4_K.get_scale_min layout
    scales[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    quants = q.reshape(-1, 4, 2, 32)  # group 2c + h -> nibble h of bytes 32c..32c+31
    packed = (quants[:, :, 0] | (quants[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales, packed], axis=1)
    return blocks.reshape(out_features, -1)


def write_with_q4_k(source: Path, target: Path, store_as_q4_k) -> list[str]:
    """Copies the GGUF `source` to `target` with every matrix whose name store_as_q4_k(name) accepts (and whose
    rows are whole super-blocks) re-stored as Q4_K; the names re-stored."""
    reader = GGUFReader(source)
    writer = GGUFWriter(target, arch=reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type)
    restored = []
    for tensor in reader.tensors:
        shape = [int(dim) for dim in reversed(tensor.shape)]
        if len(shape) == 2 and shape[1] % 256 == 0 and store_as_q4_k(tensor.name):
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32).reshape(shape)
            writer.add_tensor(tensor.name, quantize_q4_k(values), raw_dtype=GGMLQuantizationType.Q4_K)
            restored.append(tensor.name)
        else:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return restored
