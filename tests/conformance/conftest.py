"""The matrix runs once per session, for the cells pytest selected (``-k`` narrows it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance import matrix


@pytest.fixture(scope="session")
def matrix_out(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cells = [item.callspec.params["cell"] for item in request.session.items
             if hasattr(item, "callspec") and "cell" in item.callspec.params]  # fmt: skip
    out = tmp_path_factory.mktemp("conformance")
    matrix.run(cells, out)
    return out
