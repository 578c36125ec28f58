"""bench/quality.py on the CPU, tiny: every lever set through both phases, with figures that make sense (a CPU times
nothing worth reading), so the GPU run, which has one try, cannot fail on the script."""

from __future__ import annotations

import json

import torch

from bench.quality import main


def test_the_quality_bench_measures_every_lever_set(tmp_path):
    out = tmp_path / "quality.jsonl"
    # the budget counts from the bench module's import, which a test process did long before: no budget here
    main(["--tiny", "--repeat", "1", "--budget-s", "1e9", "--profile", "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["phase"] for r in records] == ["setup", *["attention"] * 4, *["dit"] * 4, *["pipeline"] * 4, "done"]
    attention, dit, pipeline = records[1:5], records[5:9], records[9:13]
    assert [r["variant"] for r in attention] == ["bf16_sdpa", "fp8", "fp8", "fp8"]
    for record in attention[1:]:  # FP8 attention is emulated on a CPU, and close to bf16's
        assert record["ran"] == "fp8_emulated" and 0 < record["relative_l2_vs_bf16"] < 0.1, record
    expected = {
        "lossless": {},
        "fp8_linear": {"fp8_linear": "scaled_mm_rowwise"},
        "fp8_attention": {"fp8_attention": "fp8_emulated"},  # no cuDNN on a CPU: emulated, and said so
        "both": {"fp8_linear": "scaled_mm_rowwise", "fp8_attention": "fp8_emulated"},
    }
    for phase in (dit, pipeline):
        assert {r["levers"]: r["ran"] for r in phase} == expected
        assert all(r["seconds"] > 0 and "error" not in r for r in phase)
    for record in dit[1:]:
        assert 0 < record["relative_l2_vs_lossless"] < 0.1, record
    for record in dit:  # where each lever set's time goes: the top operators of one profiled call, largest first
        top = record["kernels"]["top"]
        assert top and record["kernels"]["total_ms"] >= sum(k["ms"] for k in top) > 0, record
        assert [k["ms"] for k in top] == sorted((k["ms"] for k in top), reverse=True)
    # FP8 linears ran as scaled_mm (on a tiny model under a loaded CPU, its few microseconds may miss the top 12)
    assert any("scaled_mm" in name for name in dit[3]["kernels"]["names"]), dit[3]
    assert not any("scaled_mm" in name for name in dit[0]["kernels"]["names"]), dit[0]
    assert [r["quality"] for r in pipeline] == ["lossless", "high", "high", "high"]
    for record in pipeline[1:]:
        assert 40 < record["psnr_db_worst_frame"] <= record["psnr_db_mean"] < 99, record
        assert 0.99 < record["ssim_worst_frame"] <= record["ssim_mean"] < 1, record


def test_a_spent_budget_skips_the_phases_and_says_so(tmp_path):
    out = tmp_path / "quality.jsonl"
    main(["--tiny", "--budget-s", "0", "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["phase"] for r in records] == ["setup", "attention", "dit:lossless", "pipeline", "done"]
    assert all("past --budget-s 0" in r["skipped"] for r in records[1:4])


def test_the_pipeline_phase_reads_a_real_clip_as_the_worker_sees_it(corpus_cache):
    # --source: the GPU run measures `high` against `lossless` on a real clip; its frames must be the clip's own
    import av
    import numpy as np

    from bench.quality import _clip
    from worker.media.reader import EXACT_8_BIT, _source_colour

    source = corpus_cache / "puremagic-test.3g2"  # 176x144 H.263 from a phone, more than 5 frames
    video = _clip(source, 5)
    assert video.shape == (5, 3, 144, 176) and video.dtype == torch.float32
    with av.open(str(source)) as container:
        fifth = [frame for _, frame in zip(range(5), container.decode(video=0))][-1]
        fifth = fifth.to_ndarray(format="rgb24", **_source_colour(fifth), interpolation=EXACT_8_BIT)
    assert torch.equal((video[4] * 255).round().to(torch.uint8), torch.from_numpy(np.ascontiguousarray(fifth.transpose(2, 0, 1))))
