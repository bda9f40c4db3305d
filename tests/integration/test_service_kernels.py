"""The whole service (`blockserve serve`: real processes, the real model, the openai client) on the
custom kernels in float32 (their AVX2 path, BLOCKSERVE_CPU_ISA=avx2) and on pure Paddle: the same greedy text, and the metrics say which kernels,
dtype and quantization ran, and how much of the worker's memory is in huge pages (none with BLOCKSERVE_HUGE_PAGES=0)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import loopback_env, start, stop, wait_ready

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 24


def settings_info(metrics_port: str) -> dict[str, str]:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "blockserve_settings_info"]
    return family.samples[0].labels


def greedy_texts(kernels: str, logs, **settings: str) -> tuple[list[str], dict[str, str]]:
    env = loopback_env(BLOCKSERVE_KERNELS=kernels, BLOCKSERVE_MAX_MODEL_LEN="256", OMP_NUM_THREADS="2", **settings)
    serve = start(["-m", "service.launch.cli", "serve"], env, logs / f"serve-{kernels}.log")
    url = f"http://127.0.0.1:{env['BLOCKSERVE_PORT']}"
    try:
        wait_ready(url, timeout_s=180)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        texts = [
            client.completions.create(
                model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
            for prompt in PROMPTS
        ]
        return texts, settings_info(env["BLOCKSERVE_METRICS_PORT"])
    finally:
        stop(serve, timeout_s=60)


def test_service_on_custom_kernels_generates_the_greedy_text_of_pure_paddle(tmp_path):
    # BLOCKSERVE_CPU_ISA=avx2: the AVX2 path a CPU without AVX-512 runs, on any CPU. Both services at once.
    with ThreadPoolExecutor(2) as pool:
        custom = pool.submit(
            greedy_texts,
            "custom",
            tmp_path,
            BLOCKSERVE_DTYPE="float32",
            BLOCKSERVE_QUANTIZATION="none",
            BLOCKSERVE_CPU_ISA="avx2",
        )
        paddle = pool.submit(greedy_texts, "paddle", tmp_path, BLOCKSERVE_HUGE_PAGES="0")
        (custom_texts, custom_info), (paddle_texts, paddle_info) = custom.result(), paddle.result()

    assert custom_texts == paddle_texts and all(custom_texts)
    assert (custom_info["worker_kernels"], custom_info["worker_kernels_isa"]) == ("custom", "avx2")
    assert (custom_info["worker_dtype"], custom_info["worker_quantization"]) == ("float32", "none")
    assert paddle_info["worker_kernels"] == "paddle" and paddle_info["worker_dtype"] == "float32"
    # no bf16 weights: where their GEMMs would run was not measured (layers/gemm_route.py)
    assert custom_info["worker_onednn_gemm_rows"] == paddle_info["worker_onednn_gemm_rows"] == "-"
    assert "avx2" in custom_info["worker_cpu_features"]
    # Huge pages by default (tests/integration/test_huge_pages.py checks them in smaps); off when set to 0.
    assert float(custom_info["worker_huge_pages_mib"]) > 0.5 * float(custom_info["worker_weights_mib"])
    assert paddle_info["worker_huge_pages_mib"] == "0.0"
