"""Fixtures: tiny models built on the fly (session-scoped, built once)."""

from __future__ import annotations

import os

import pytest

from hubsoup.testing import make_base, make_finetune


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    cache: dict = {}

    def get(arch: str, role: str = "base", seed: int = 0, **kw) -> str:
        """``role`` is 'base' or 'ft<N>' (a fine-tune with seed N)."""
        key = (arch, role, seed, tuple(sorted(kw.items())))
        if key not in cache:
            base = os.path.join(root, f"{arch}-base")
            if not os.path.isdir(base):
                make_base(arch, base, seed=seed)
            if role == "base":
                cache[key] = base
            else:
                n = int(role[2:])
                folder = os.path.join(root, f"{arch}-{role}-{abs(hash(key)) % 10**8}")
                cache[key] = make_finetune(base, folder, seed=n, **kw)
        return cache[key]

    return get


@pytest.fixture()
def llama(model_dir):
    """(base, [ft1, ft2, ft3]) of a tiny Llama."""
    return model_dir("llama"), [model_dir("llama", f"ft{i}") for i in (1, 2, 3)]
