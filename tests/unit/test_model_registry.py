"""The model families the worker runs, as the registry reads their configs: what each family's details become,
the one-line refusals of what is not supported, and the README's table of them, kept true here."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from worker.models.config import SUPPORTED_ROPE_TYPES, UnsupportedModelError
from worker.models.registry import FAMILIES, config_from_gguf, config_from_hf

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
TABLE_ROW = re.compile(
    r"^\| (?P<title>[^|`]+?) \| (?P<hf>[^|]+) \| (?P<gguf>[^|]+) \| (?P<window>yes|no) \| (?P<moe>yes|no) \|$"
)


def hf_config(model_type: str, **fields) -> dict:
    """A config.json of a small model of `model_type`, with `fields` set."""
    return {
        "model_type": model_type,
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        **fields,
    }


def readme_rows() -> list[dict[str, str]]:
    return [match.groupdict() for line in README.splitlines() if (match := TABLE_ROW.match(line))]


def test_the_readme_table_lists_every_family_with_its_names_and_features():
    expected = [
        {
            "title": family.title,
            "hf": ", ".join(f"`{name}`" for name in family.hf_model_types),
            "gguf": ", ".join(f"`{name}`" for name in family.gguf_architectures) or "—",
            "window": "yes" if family.sliding_window else "no",
            "moe": "yes" if family.mixture_of_experts else "no",
        }
        for family in FAMILIES
    ]

    assert readme_rows() == expected


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_a_family_marked_with_sliding_windows_reads_them_from_its_config(family):
    config = config_from_hf(hf_config(family.hf_model_types[0], sliding_window=4, use_sliding_window=True))

    assert config.architecture == family.name
    assert config.has_sliding_window == family.sliding_window


def test_an_unknown_model_type_is_refused_in_one_line_listing_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as refused:
        config_from_hf(hf_config("mamba"))

    message = str(refused.value)
    assert "\n" not in message and "model_type 'mamba' is not supported" in message
    assert all(f.hf_model_types[0] in message for f in FAMILIES)


def test_an_unsupported_mixture_of_experts_is_refused_saying_what_it_is():
    with pytest.raises(UnsupportedModelError, match=r"'qwen2_moe' \(a mixture of experts with a gated shared"):
        config_from_hf(hf_config("qwen2_moe"))


def test_qwen3_moe_reads_its_sparse_layers_and_whether_it_renormalises():
    config = config_from_hf(
        hf_config(
            "qwen3_moe",
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            norm_topk_prob=True,
        )
    )

    assert (config.num_experts, config.num_experts_per_token, config.normalize_expert_weights) == (8, 2, True)
    assert config.moe_layers == (False, True, False, False)
    assert not config.is_llama_layer


def test_ernie_moe_reads_its_dense_first_layers_and_the_floor_of_its_weights_sum():
    config = config_from_hf(
        hf_config("ernie4_5_moe", moe_num_experts=8, moe_k=2, moe_layer_start_index=1, moe_norm_min=1e-9)
    )

    assert config.moe_layers == (False, True, True, True)
    assert config.normalize_expert_weights and config.expert_weights_sum_min == 1e-9


def test_mixtral_renormalises_the_chosen_experts_weights_in_every_layer():
    config = config_from_hf(hf_config("mixtral", num_local_experts=8, num_experts_per_tok=2))

    assert config.moe_layers == (True,) * 4 and config.normalize_expert_weights


@pytest.mark.parametrize(
    "fields, refused",
    [
        (dict(moe_num_experts=[64, 64]), "moe_num_experts"),
        (dict(use_bias=True), "ERNIE 4.5 MoE use_bias"),
    ],
)
def test_ernie_moe_variants_the_worker_cannot_run_are_refused(fields, refused):
    with pytest.raises(UnsupportedModelError, match=refused):
        config_from_hf(hf_config("ernie4_5_moe", **fields))


def gguf_metadata(arch: str, **fields) -> dict:
    return {
        "general.architecture": arch,
        f"{arch}.embedding_length": 64,
        f"{arch}.feed_forward_length": 128,
        f"{arch}.block_count": 2,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.context_length": 256,
        f"{arch}.vocab_size": 128,
        **{f"{arch}.{key}": value for key, value in fields.items()},
    }


def test_a_llama_gguf_file_with_experts_is_mixtral_with_its_router_layers():
    routers = {"blk.0.ffn_gate_inp.weight", "blk.1.ffn_gate_inp.weight"}

    config = config_from_gguf(gguf_metadata("llama", expert_count=8, expert_used_count=2), routers)

    assert config.architecture == "mixtral"
    assert config.moe_layers == (True, True) and config.normalize_expert_weights


def test_a_gguf_router_other_than_softmax_is_refused():
    metadata = gguf_metadata("qwen3moe", expert_count=8, expert_used_count=2, expert_gating_func=2)

    with pytest.raises(UnsupportedModelError, match=r"GGUF expert gating function 2 is not supported"):
        config_from_gguf(metadata, {"blk.0.ffn_gate_inp.weight"})


def test_gemma3s_multimodal_checkpoint_is_refused_pointing_at_its_text_form():
    with pytest.raises(UnsupportedModelError, match="gemma3_text"):
        config_from_hf(hf_config("gemma3"))


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "mrope"])
def test_an_unsupported_rope_scaling_is_refused_listing_the_supported_ones(rope_type):
    rope = {"rope_type": rope_type, "factor": 4.0, "rope_theta": 10000.0}

    with pytest.raises(UnsupportedModelError) as refused:
        config_from_hf(hf_config("qwen3", rope_scaling=rope))

    assert f"rope type {rope_type!r} is not supported" in str(refused.value)
    assert all(supported in str(refused.value) for supported in SUPPORTED_ROPE_TYPES)


def test_a_partial_rotary_factor_is_refused():
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.75"):
        config_from_hf(hf_config("phi3", partial_rotary_factor=0.75))


def test_gemmas_bidirectional_attention_is_refused():
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        config_from_hf(hf_config("gemma3_text", use_bidirectional_attention=True))


def test_an_unknown_gguf_architecture_is_refused_listing_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as refused:
        config_from_gguf({"general.architecture": "rwkv6"}, set())

    assert "GGUF architecture 'rwkv6' is not supported" in str(refused.value)
    assert all(arch in str(refused.value) for f in FAMILIES for arch in f.gguf_architectures)


def test_gemma2_reads_its_alternating_windows_scale_and_soft_caps():
    config = config_from_hf(
        hf_config(
            "gemma2",
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        )
    )

    assert config.sliding_windows == (8, None, 8, None)
    assert config.attention_scale == pytest.approx(24**-0.5)
    assert (config.attention_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert config.embedding_multiplier == pytest.approx(8.0) and config.norm_placement == "sandwich"
    assert not config.is_llama_layer


def test_gemma3s_older_config_gives_sliding_layers_the_local_rope_base():
    config = config_from_hf(
        hf_config(
            "gemma3_text",
            num_hidden_layers=6,
            sliding_window=8,
            rope_theta=1e6,
            rope_local_base_freq=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        )
    )

    assert config.sliding_windows == (8, 8, 8, 8, 8, None)
    assert [rope.theta for rope in config.layer_ropes] == [10000.0] * 5 + [1e6]
    assert config.layer_ropes[5].scaling == {"factor": 8.0} and config.layer_ropes[0].rope_type == "default"


def test_smollm3_leaves_every_fourth_layer_without_rope_by_default():
    config = config_from_hf(hf_config("smollm3", num_hidden_layers=8))

    assert [rope is not None for rope in config.layer_ropes] == [True, True, True, False] * 2


def test_a_window_that_holds_the_served_length_is_no_window_and_the_layers_are_llamas_again():
    config = config_from_hf(hf_config("mistral", sliding_window=4096))

    assert config.has_sliding_window and not config.is_llama_layer
    assert config.served_up_to(4096).is_llama_layer
    assert config.served_up_to(4097).has_sliding_window


def test_phi3_longrope_takes_its_attention_factor_from_the_context_ratio():
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}
    config = config_from_hf(
        hf_config("phi3", rope_scaling=rope, original_max_position_embeddings=4096, max_position_embeddings=131072)
    )

    assert config.rope.rope_type == "longrope" and config.rope.original_max_positions == 4096
    assert config.rope.attention_factor == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
