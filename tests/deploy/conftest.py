"""Deploy-file fixtures. What the tests share besides is deploy_files.py."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # deploy_files

import deploy_files  # noqa: E402


@pytest.fixture(scope="session")
def help_flags() -> dict[tuple[str, ...], set[str]]:
    """``{("edge", "serve"): {"--region", ...}, ...}``: each deploy command's flags, from its ``--help``."""
    return deploy_files.help_flags()
