"""tritonkit-client CLI against a real server: embed (args/file/stdin, JSONL/.npy), similar, server down."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from tritonkit_client import ServerUnavailable, embed

from tests.support.text_support import INT8_PACKING_NOISE, start_text_server
from tritonkit import data
from tritonkit.runtime.server import free_port


@pytest.fixture(scope="module")
def server(start_server):
    return start_text_server(start_server)


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tritonkit_client", *args], input=stdin, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_embed_args_to_jsonl(server):
    proc = cli("embed", "a cat sat on the mat", "the dog barked", "--url", server.http_url)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["text"] for r in rows] == ["a cat sat on the mat", "the dog barked"]
    vectors = np.array([r["embedding"] for r in rows])
    assert vectors.shape == (2, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert all(r["truncated"] is False and r["num_tokens"] > 2 for r in rows)


@pytest.mark.slow
def test_embed_file_to_npy_over_grpc_async(server, tmp_path):
    texts = data.split("demo")[:40]
    src = tmp_path / "texts.txt"
    src.write_text("\n".join(texts[:20]) + "\n\n" + "\n".join(texts[20:]) + "\n")  # blank line skipped
    out = tmp_path / "vectors.npy"
    proc = cli("embed", "--file", str(src), "-o", str(out), "--protocol", "grpc", "--url", server.grpc_url,
               "--async", "--batch-size", "7", "--concurrency", "3")
    assert proc.returncode == 0, proc.stderr
    vectors = np.load(out)
    direct = embed(texts, url=server.http_url)
    assert vectors.shape == (40, 384)
    # Batches of 7 vs one batch of 40: the INT8 packed graph's measured batching noise, no more.
    assert (1.0 - (vectors * direct.vectors).sum(1)).max() <= INT8_PACKING_NOISE


@pytest.mark.slow
def test_embed_from_stdin(server):
    proc = cli("embed", "--url", server.http_url, stdin="first line\nsecond line\n")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 2


@pytest.mark.slow
def test_similar_ranks_the_related_text_first(server, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "Return the number of items in a container.\n"
        "Open a network socket and connect it to a remote host.\n"
        "Compress data with the zlib algorithm.\n"
        "The weather today is sunny and warm.\n"
    )
    proc = cli("similar", "create a TCP connection to a server", "--file", str(corpus), "-k", "2", "--json",
               "--url", server.http_url)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == 2 and rows[0]["text"].startswith("Open a network socket")
    assert rows[0]["score"] > rows[1]["score"]


def test_server_down_gives_a_clear_error():
    port = free_port()
    proc = cli("embed", "hello", "--url", f"127.0.0.1:{port}")
    assert proc.returncode == 2
    assert "cannot reach Triton" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli("embed", "hello", "--url", f"127.0.0.1:{port}", "--protocol", "grpc", "--async")
    assert proc.returncode == 2 and "cannot reach Triton" in proc.stderr
    with pytest.raises(ServerUnavailable):
        embed(["hello"], url=f"127.0.0.1:{port}")


@pytest.mark.slow
def test_bad_input_is_reported_not_a_traceback(server):
    proc = cli("embed", "ok", "   ", "--url", server.http_url)
    assert proc.returncode == 2
    assert "text[1] is empty or whitespace-only" in proc.stderr and "Traceback" not in proc.stderr


def test_rerank_and_classify_text_check_their_arguments_before_calling():
    url = f"127.0.0.1:{free_port()}"  # nothing listens: each error must come before a request
    proc = cli("rerank", "a query", "a document", "--model", "any", "--top-n", "0", "--url", url)
    assert proc.returncode == 2 and "--top-n must be >= 1, got 0" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli("classify-text", "premise\thypothesis", "no tab here", "--pairs", "--model", "any", "--url", url)
    assert proc.returncode == 2 and "text 1 has no TAB" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli("rerank", "a query", "a document", "--model", "any", "--url", url, "--protocol", "grpc")
    assert proc.returncode == 2 and "cannot reach Triton" in proc.stderr
    proc = cli("rerank", "a query", "a document", "--url", url)
    assert proc.returncode == 2 and "--model" in proc.stderr  # required: no default model of these kinds
