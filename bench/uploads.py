"""A big upload against a running API (`vsrq dev`, or a deployment): in parts through OpenAI's SDK, then `complete`
(with and without `md5`, alternately), against the same file sent whole, side by side in one run. What `complete`
costs is what a user waits for after the last part.

    python bench/uploads.py --api http://127.0.0.1:8000 --gib 1 --runs 4 --out uploads.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

import openai
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: `bench` the package

from bench.lines import emit  # noqa: E402

PART_BYTES = 64 * 1024 * 1024  # the SDK's own part size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api", default=os.environ.get("VSRQ_API_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--out")
    args = parser.parse_args()
    token = os.environ.get("VSRQ_TOKEN") or "EMPTY"
    client = openai.OpenAI(base_url=f"{args.api}/v1", api_key=token, max_retries=0, timeout=900)
    with tempfile.NamedTemporaryFile(suffix=".mp4") as file:
        size = int(args.gib * 1024**3)
        for _ in range(0, size, PART_BYTES):  # random bytes: what storage and hashing cost, not a video's content
            file.write(os.urandom(min(PART_BYTES, size - file.tell())))
        file.flush()
        md5 = hashlib.md5(Path(file.name).read_bytes()).hexdigest()
        for run in range(args.runs):
            checked = run % 2 == 1
            started = time.perf_counter()
            upload = client.uploads.create(bytes=size, filename="big.mp4", mime_type="video/mp4", purpose="user_data")
            part_ids = []
            with open(file.name, "rb") as source:
                while data := source.read(PART_BYTES):
                    part_ids.append(client.uploads.parts.create(upload_id=upload.id, data=data).id)
            sent = time.perf_counter()
            client.uploads.complete(upload_id=upload.id, part_ids=part_ids, **({"md5": md5} if checked else {}))
            completed = time.perf_counter()
            with open(file.name, "rb") as source:
                whole = requests.post(
                    f"{args.api}/v1/uploads", files={"file": ("big.mp4", source, "video/mp4")},
                    headers={"Authorization": f"Bearer {token}"}, timeout=900,
                )  # fmt: skip
            whole.raise_for_status()
            emit({
                "bench": "uploads", "run": run, "bytes": size, "parts": len(part_ids), "md5": checked,
                "parts_s": round(sent - started, 2), "complete_s": round(completed - sent, 2),
                "whole_s": round(time.perf_counter() - completed, 2),
            }, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
