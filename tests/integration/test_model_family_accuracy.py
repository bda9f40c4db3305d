"""Every family's tiny model in bfloat16 and int8 against its own float32, with the README's KL thresholds
(test_worker_accuracy.py holds them): mean KL of the next-token distributions over the English text, sliding
windows and soft caps in the custom attention kernels too.

The README's greedy-agreement thresholds are not asserted here: a random model's next-token distributions are
nearly flat, so near-ties flip under any rounding (measured 0.73-0.95 agreement at KL <= 0.03); they hold on the
trained SmolLM2 (test_worker_accuracy.py). The agreement is printed. So too a random router's choices: in the tiny
Mixtral (8 experts, 2 renormalised, every layer) bfloat16's rounding changes a choice of 3.5-7% of the tokens in
layers 1-3 (0 in layer 0), each a jump in the layer's output, and its KL (0.03 in bfloat16, 0.16 with int8) measures
those flips more than the kernels (transformers' own bfloat16 is as far from its float32 on this model: KL 0.023, and
0.001 on the tiny Qwen3-MoE and Mistral): it is held to looser bounds of its own (ROUTING_FLIPS), not the README's
(the experts' op is held to NumPy in every format in test_custom_moe.py)."""

from __future__ import annotations

import pytest

from tests.integration.test_worker_accuracy import THRESHOLDS
from tests.support.accuracy import Float32Reference, load_runner
from tests.support.tiny_families import FAMILY_MODELS, save_tiny_model

# see above: a looser bound per quantization for a router whose choices flip under rounding (measured 0.033 and 0.157)
ROUTING_FLIPS = {"mixtral": {"none": 0.05, "int8": 0.25}}


@pytest.fixture(scope="module", params=FAMILY_MODELS)
def family_folder(request, tmp_path_factory, hf_smollm_tokenizer):
    folder = tmp_path_factory.mktemp(f"{request.param}-accuracy")
    save_tiny_model(request.param, folder, hf_smollm_tokenizer)
    return request.param, folder


@pytest.fixture(scope="module")
def reference(family_folder) -> Float32Reference:
    return Float32Reference(load_runner(family_folder[1], "float32:none"))


@pytest.mark.parametrize("precision", ["bfloat16:none", "auto:int8"])
def test_the_family_stays_within_the_documented_distance_from_float32(family_folder, reference, precision):
    name, folder = family_folder
    runner = load_runner(folder, precision)
    dtype = runner.kernels["dtype"]
    assert dtype == "bfloat16" and runner.kernels["kernels"] == "custom"
    max_kl, _ = THRESHOLDS[f"{dtype}:{runner.kernels['quantization']}"]

    accuracy = reference.accuracy_of(runner)

    print(f"{name} {dtype}:{runner.kernels['quantization']}: {accuracy}")
    if name in ROUTING_FLIPS:
        max_kl = ROUTING_FLIPS[name][runner.kernels["quantization"]]
    assert accuracy.mean_kl_nats <= max_kl
