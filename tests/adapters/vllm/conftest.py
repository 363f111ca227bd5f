"""Fixtures of the vLLM connector tests; the process harness is ``vllm_harness.py``."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory, request) -> Path:
    """One temp folder per test module: its processes' stores, registries and logs."""
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
