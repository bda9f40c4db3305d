"""A GGUF file's experts, stacked by llama.cpp in one tensor per layer and projection ([experts, out, in]), are read
as one matrix per expert under Hugging Face's names: the blocks of each expert as stored where the custom GEMM
serves their type, else its values (the family tests' files are float32: here quantized ones)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tests.integration.test_worker_accuracy import THRESHOLDS
from tests.support.accuracy import ENGLISH_TEXT, encode, load_runner, mean_kl_nats, paged_logits
from tests.support.family_gguf import _copy_tokenizer, write_family_gguf
from tests.support.tiny_families import GGUF_FAMILY_MODELS, save_tiny_model
from worker.layers.experts import PackedExperts
from worker.layers.weight_format import GgufBlocks, WeightFormat
from worker.loading.gguf_checkpoint import GGUFCheckpoint

NUM_EXPERTS, HIDDEN, WIDTH = 4, 64, 32
STORED = {  # llama.cpp's stacked tensor -> (its type, the name of each expert's matrix)
    "ffn_gate_exps": (GGMLQuantizationType.Q8_0, "gate_proj"),
    "ffn_up_exps": (GGMLQuantizationType.Q4_0, "up_proj"),
    "ffn_down_exps": (GGMLQuantizationType.F16, "down_proj"),  # not served as blocks: read as values
}


def write_mixtral_gguf(path, smollm_path, stacked: dict[str, np.ndarray]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(1)
    writer.add_feed_forward_length(WIDTH)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_expert_count(NUM_EXPERTS)
    writer.add_expert_used_count(2)
    _copy_tokenizer(writer, smollm_path)
    writer.add_tensor("blk.0.ffn_gate_inp.weight", np.ones((NUM_EXPERTS, HIDDEN), np.float32))
    for name, (quant_type, _) in STORED.items():
        writer.add_tensor(f"blk.0.{name}.weight", quantize(stacked[name], quant_type), raw_dtype=quant_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_stacked_quantized_experts_are_read_one_matrix_per_expert(tmp_path, smollm_path):
    rng = np.random.default_rng(0)
    stacked = {
        "ffn_gate_exps": rng.standard_normal((NUM_EXPERTS, WIDTH, HIDDEN), dtype=np.float32),
        "ffn_up_exps": rng.standard_normal((NUM_EXPERTS, WIDTH, HIDDEN), dtype=np.float32),
        "ffn_down_exps": rng.standard_normal((NUM_EXPERTS, HIDDEN, WIDTH), dtype=np.float32),
    }
    path = tmp_path / "mixtral.gguf"
    write_mixtral_gguf(path, smollm_path, stacked)

    checkpoint = GGUFCheckpoint(path)
    read = dict(checkpoint.tensors(keep_blocks=True))

    assert checkpoint.config.architecture == "mixtral" and checkpoint.config.moe_layers == (True,)
    for name, (quant_type, hf_part) in STORED.items():
        for expert in range(NUM_EXPERTS):
            matrix = read[f"model.layers.0.mlp.experts.{expert}.{hf_part}.weight"]
            expected = dequantize(quantize(stacked[name][expert], quant_type), quant_type)
            if quant_type == GGMLQuantizationType.F16:
                np.testing.assert_array_equal(matrix, expected)
            else:
                assert isinstance(matrix, GgufBlocks) and matrix.format == WeightFormat(int(quant_type))
                np.testing.assert_array_equal(matrix.dequantized(), expected)


Q = GGMLQuantizationType
# (gate and up, down): llama.cpp quantizes an expert's gate and up alike, its down often in more bits
EXPERT_TYPES = {"q4_1+q8_0": (Q.Q4_1, Q.Q8_0), "q8_0+q4_0": (Q.Q8_0, Q.Q4_0)}
MOE_CASES = [("qwen3_moe", "q4_1+q8_0"), ("mixtral", "q8_0+q4_0"), ("ernie4_5_moe", "q8_0+q4_0")]


@pytest.mark.parametrize("name, types", MOE_CASES)
def test_a_moe_gguf_with_quantized_experts_serves_their_blocks_within_int8s_distance_of_their_values(
    tmp_path, hf_smollm_tokenizer, smollm_path, name, types
):
    """End to end: a mixture's GGUF file whose experts are Q8_0, Q4_1 or Q4_0 blocks, served as stored
    (quantization gguf: the experts' op multiplies the blocks) against the same file's values (quantization none,
    the blocks dequantized to float32), both float32 otherwise. What differs is the activations, quantized to 8 bits
    for the blocks' integer dot products as int8's are: held to int8's threshold (a wrong block scale or minimum
    is far past it). Measured: Qwen3-MoE (both type pairs) and Mixtral 0.011-0.019 (their experts carry each layer's whole MLP),
    ERNIE-MoE 0.0003-0.0005 (a shared expert in float32 beside them, a dense first layer)."""
    folder = tmp_path / name
    save_tiny_model(name, folder, hf_smollm_tokenizer, **GGUF_FAMILY_MODELS[name])
    path = tmp_path / f"{name}.gguf"
    gate_up_type, down_type = EXPERT_TYPES[types]
    expert_types = {"gate_proj": gate_up_type, "up_proj": gate_up_type, "down_proj": down_type}
    write_family_gguf(folder, path, smollm_path, expert_types=expert_types)

    served = load_runner(path, "float32:gguf")
    experts = [layer.moe.experts for layer in served.model.layers if layer.moe is not None]
    assert experts and all(isinstance(e, PackedExperts) for e in experts)
    served_formats = {(e.gate_up_format, e.down_format) for e in experts}
    assert served_formats == {(WeightFormat(int(gate_up_type)), WeightFormat(int(down_type)))}, "served as stored"
    dequantized = load_runner(path, "float32:none")
    text_ids = encode(dequantized, ENGLISH_TEXT)
    kl = mean_kl_nats(
        paged_logits(dequantized, text_ids, chunk_size=128), paged_logits(served, text_ids, chunk_size=128)
    )

    print(f"{name} quantized experts: mean KL {kl:.5f}")
    assert kl <= THRESHOLDS["float32:int8"][0]
