"""notebooks/quickstart.ipynb executes top to bottom in a fresh python3 kernel (nbclient) and
shows what it promises: a falling loss, exact-answer scores, samples and the edge-gate plot."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import single_device_env

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow          # a Jupyter kernel subprocess; about 20 s
def test_quickstart_notebook_executes(monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel inherits this environment: one CPU device, as on a user's machine (without the
    # simulated devices tests/conftest.py adds for the sharding tests).
    env = single_device_env()
    for name in ("XLA_FLAGS", "JAX_PLATFORMS"):
        monkeypatch.setenv(name, env[name])
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "aggregation=dag" in text and "loss: step 1" in text
    assert "lis {4:" in text and "edit_distance {4:" in text
    assert text.count("T=0.0: ") == 2 and "T=0.8: " in text
    images = [o for o in outputs if o.get("output_type") == "display_data"
              and "image/png" in o.get("data", {})]
    assert len(images) == 1 and len(images[0]["data"]["image/png"]) > 1000
