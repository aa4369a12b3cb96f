"""The Batch API as a client drives it through the official ``openai`` client: lines, a JSONL
file, a batch created and polled to a final status, its output and error lines by
``custom_id`` (each at most once, never in both files)."""

from __future__ import annotations

import json
import time

import openai

FINAL = ("completed", "failed", "cancelled", "expired")


def batch_line(custom_id: str, body: dict, url: str = "/v1/embeddings", **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra}


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def run_batch(sdk: openai.OpenAI, lines: list[dict], endpoint: str = "/v1/embeddings",
         timeout_s: float = 120.0):
    """Upload ``lines``, create their batch, poll it to a final status; the batch."""
    batch = create_batch(sdk, lines, endpoint)
    return wait_batch(sdk, batch.id, timeout_s)


def create_batch(sdk: openai.OpenAI, lines: list[dict], endpoint: str = "/v1/embeddings"):
    file = sdk.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    assert file.purpose == "batch" and file.bytes == len(jsonl(lines))
    batch = sdk.batches.create(input_file_id=file.id, endpoint=endpoint,
                               completion_window="24h", metadata={"test": "yes"})
    assert batch.status == "validating" and batch.metadata == {"test": "yes"}
    return batch


def wait_batch(sdk: openai.OpenAI, batch_id: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while (batch := sdk.batches.retrieve(batch_id)).status not in FINAL:
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def batch_results(sdk: openai.OpenAI, batch) -> tuple[dict[str, dict], dict[str, dict]]:
    """The output and error lines by ``custom_id``; none appears twice, or in both."""
    found = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        text = sdk.files.content(file_id).content if file_id else b""
        lines = [json.loads(line) for line in text.splitlines()]
        ids = [line["custom_id"] for line in lines]
        assert len(ids) == len(set(ids)), "a custom_id twice in one file"
        found.append({line["custom_id"]: line for line in lines})
    assert not set(found[0]) & set(found[1]), "a custom_id in both files"
    return found[0], found[1]


def started_batch(sdk: openai.OpenAI, lines: list[dict], completed: int,
                  timeout_s: float = 60.0):
    """Create the batch of ``lines`` and wait until at least ``completed`` lines are done;
    the batch and how many were done then."""
    batch = create_batch(sdk, lines)
    deadline = time.monotonic() + timeout_s
    while (done := sdk.batches.retrieve(batch.id).request_counts.completed) < completed:
        assert time.monotonic() < deadline, f"{done} of {len(lines)} lines done"
        time.sleep(0.05)
    return batch, done
