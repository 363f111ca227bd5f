"""SmolLM2-135M (a real trained model) published through the origin with its chat template."""

from __future__ import annotations

from pathlib import Path

from kdn.adapters.hf import load_model
from kdn.origin.publish import head_text

from origin_helpers import publish, running_origin
from test_origin_publish import check_published

DOC = Path(__file__).resolve().parents[2] / "kdn" / "data" / "docs" / "harbor-policy.md"


async def test_smollm2_publish_with_chat_template(tmp_path, etcd_url):
    loaded = load_model("smollm2-135m")
    text = DOC.read_text()[:2400]  # ~530 tokens with the template: 2 full chunks + a tail
    async with running_origin(tmp_path, etcd_url, model="smollm2-135m") as (server, session):
        job = await publish(session, {"name": "harbor", "text": text, "template": "chat"})
        assert job["state"] == "done", job
        m = job["manifest"]
        head = loaded.tokenizer.encode(head_text(loaded.tokenizer, "chat", None, None), add_special_tokens=False)
        doc = loaded.tokenizer.encode(text, add_special_tokens=False)
        assert m["template"] == "chat" and m["head_tokens"] == len(head) > 0
        assert m["prefix_tokens"] == head + doc
        # the published tokens are what the chat template renders for a user turn holding the document
        rendered = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False)
        assert rendered.startswith(loaded.tokenizer.decode(m["prefix_tokens"]))
        await check_published(session, etcd_url, m, loaded, m["prefix_tokens"], store=tmp_path / "store")
