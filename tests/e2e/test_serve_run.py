"""``serve run configs/local.yaml`` as a user runs it, called over HTTP on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from tests.support import (
    SENTENCES,
    as_from_a_terminal,
    assert_idle_invariants,
    free_port,
    interrupt,
    settled_status,
    wait_until_ready,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The local config, moved to a free port, under a real ``serve run`` process."""
    config = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    path = tmp_path_factory.mktemp("e2e") / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_bin = Path(sys.executable).with_name("serve")
    log = (path.parent / "serve.log").open("w")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a fresh local Ray
    process = subprocess.Popen([str(serve_bin), "run", str(path)], cwd=ROOT, env=env,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=as_from_a_terminal)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(base_url, timeout_s=240, alive=lambda: process.poll() is None)
        yield base_url
    except TimeoutError:
        log.flush()
        raise AssertionError((path.parent / "serve.log").read_text()[-5000:]) from None
    finally:
        interrupt(process)
        subprocess.run([str(serve_bin.with_name("ray")), "stop", "--force"],
                       capture_output=True, timeout=120)


def test_readme_request_returns_three_unit_vectors(served: str) -> None:
    response = httpx.post(f"{served}/v1/embeddings", json={"input": SENTENCES}, timeout=60)
    assert response.status_code == 200
    vectors = np.array([d["embedding"] for d in response.json()["data"]])
    assert vectors.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.5


def test_nothing_a_client_sends_is_a_500(served: str) -> None:
    bodies = [b"", b"null", b"{bad", b'{"input": null}', b'{"input": {"a": 1}}',
              b'{"input": ["ok", 3]}', b"\xff" * 10, b'{"input": "x", "dimensions": "a"}']
    for body in bodies:
        response = httpx.post(f"{served}/v1/embeddings", content=body, timeout=30,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400, (body, response.text)
    assert_idle_invariants(settled_status(served))
