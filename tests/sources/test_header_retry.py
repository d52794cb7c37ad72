"""A transient Hub answer on a safetensors header range read is retried as huggingface_hub retries downloads."""

from __future__ import annotations

import os

import pytest
from safetensors.torch import load_file

import hubsoup
from hubsoup.testing import make_base, make_finetune


def test_a_transient_5xx_on_a_header_read_is_retried(hub, tmp_path, monkeypatch):
    import hubsoup.sources.resolve as resolve

    waits: list[float] = []
    monkeypatch.setattr(resolve, "_sleep", waits.append)
    base = make_base("llama", str(tmp_path / "base"))
    hub.seed("alice/base", base)
    hub.seed("alice/ft", make_finetune(base, str(tmp_path / "ft"), seed=1))
    hub.fail_next(2, status=500, method="GET", path=r"^/alice/ft/resolve/.*model\.safetensors$")
    res = hubsoup.merge(["alice/ft"], "linear", base="alice/base", out=str(tmp_path / "soup"), quiet=True)
    assert hub.pending_failures == 0 and waits == [1.0, 2.0]  # two 500s on the header, then its answer
    assert load_file(os.path.join(res.path, "model.safetensors"))
    # a persistent error still ends, naming the repo and the status
    hub.seed("alice/ft2", make_finetune(base, str(tmp_path / "ft2"), seed=2))
    hub.fail_next(100, status=503, method="GET", path=r"^/alice/ft2/resolve/.*model\.safetensors$")
    with pytest.raises(hubsoup.HubsoupError, match="alice/ft2.*503"):
        hubsoup.merge(["alice/ft2"], "linear", base="alice/base", out=str(tmp_path / "soup2"), quiet=True)
    hub.clear_failures()
    assert len(waits) == 2 + 5 and not os.path.exists(tmp_path / "soup2")
