"""The GPU benchmark's own code paths, run tiny on the CPU so the script cannot rot between GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from bench.bench import main
from bench.diagnose import SYNC_WARNING, Diagnosis, kernel_busy


def test_bench_runs_every_phase_and_checks_what_it_claims(tmp_path):
    out = tmp_path / "results.jsonl"
    # W2: two tiles in the tiny configuration (W1 is 12, and the reference pipeline decodes each whole)
    main(["--tiny", "--hot", "1", "--out", str(out), "--phases", "ref:W2*2,ours:W2:cpu,ours:W2:cpu+cpu@tile_major/1,batch:W2:2,ours:W3:cpu*0"])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    reference, single, double, batch, long = records[1:]
    assert reference["impl"] == "diffusers-reference" and reference["hot_median_s"] > 0
    assert len(reference["hot_s"]) == 2 and len(single["hot_s"]) == 1  # ref:W1*2 overrides --hot 1
    assert single["vs_reference"]["max_abs_delta"] <= 1e-5
    stages = single["stage_device_s_last_run"]
    assert {"dit", "decode", "encode", "latent_upscale", "mp4_encode_thread", "host_blend", "host_sink"} <= stages.keys()
    assert long["stage_device_s_last_run"]["host_blend"] > 0  # summed over its windows (W2's rounds to a few ms)
    assert double["devices"] == ["cpu", "cpu"] and double["decode_order"] == "tile_major"
    assert double["bit_identical_to_first_vsrq_phase"] and double["max_abs_delta_to_first_vsrq_phase"] == 0
    assert batch["bit_identical_to_batch_1"]
    assert long["workload"] == "W3" and long["input"].endswith("x129")  # two temporal windows
    assert long["frames_out"] == 129  # every frame, through the windows
    assert "bit_identical_to_first_vsrq_phase" not in long  # its only phase: nothing to compare, no check run
    assert single["stage_device_s_last_run"]["mp4_tail"] >= 0
    assert single["mp4_bytes"] > 1000 and double["mp4_bytes"] > 1000  # the finished file of each phase's last run
    assert single["graphs_compiled"] == {"first": 0, "hot": [0]}  # nothing compiles on a CPU


def test_phases_parse_with_their_hot_run_counts_and_quality():
    from bench.bench import parse_phase

    assert parse_phase("ours:W1:cuda:0+cuda:1@tile_major/2*1") == ("ours", "W1", ["cuda:0+cuda:1@tile_major/2"], "1", None)
    assert parse_phase("ref:W1*0") == ("ref", "W1", [], "0", None)
    assert parse_phase("ours:W2") == ("ours", "W2", [], "", None)
    assert parse_phase("ours:W1:cuda:0+cuda:1~on@lockstep*1") == ("ours", "W1", ["cuda:0+cuda:1~on@lockstep"], "1", None)
    assert parse_phase("ours:W1:cuda:0%high*1") == ("ours", "W1", ["cuda:0"], "1", "high")
    assert parse_phase("ours:W1:cuda:0@parked/2%fp8_attention") == ("ours", "W1", ["cuda:0@parked/2"], "", "fp8_attention")
    with pytest.raises(SystemExit, match="unknown quality option"):
        parse_phase("ours:W1:cuda:0%fast")


def test_a_high_phase_runs_the_levers_compiled_and_measures_its_cost_against_lossless(tmp_path):
    """`%high` as the worker runs `quality=high`: its engine, its levers, the blocks compiled (Inductor, on the CPU
    here: the FP8 GEMM compiled, FP8 attention emulated) and the output's per-frame PSNR and SSIM against the
    lossless phase."""
    out = tmp_path / "results.jsonl"
    main(["--tiny", "--hot", "0", "--compile", "transformer", "--compile-on-cpu", "--out", str(out),
          "--phases", "ours:W2:cpu*0,ours:W2:cpu%high*0"])  # fmt: skip
    lossless, high = [record for record in map(json.loads, out.read_text().splitlines()) if record.get("impl") == "vsrq"]
    assert (lossless["quality"], lossless["levers_ran"]) == ("lossless", {})
    assert (high["quality"], high["quality_ran"], high["high_levers"]) == ("high", "high", ["fp8_linear", "fp8_attention"])
    assert high["levers_ran"] == {"fp8_linear": "scaled_mm_rowwise", "fp8_attention": "fp8_emulated"}
    # compiled: the lossless blocks' graphs, then the blocks again with the levers in them (fullgraph: no fallback)
    assert lossless["graphs_compiled"]["first"] >= 1 and high["graphs_compiled"]["first"] >= 1
    cost = high["vs_lossless"]
    assert 50 <= cost["psnr_db_worst_frame"] <= cost["psnr_db_mean"] < 99  # close to lossless, not lossless
    assert 0.999 <= cost["ssim_worst_frame"] <= cost["ssim_mean"] < 1
    assert not high["bit_identical_to_first_vsrq_phase"] and "bit_identical_to_first_phase_of_its_decode" not in high


def test_a_threads_phase_sets_the_host_threads_of_the_phases_after_it(tmp_path):
    out = tmp_path / "results.jsonl"
    threads = torch.get_num_threads()
    asked = 2 if threads == 1 else 1  # another count than the process's (make test runs on one OpenMP thread)
    try:
        main(["--tiny", "--no-check", "--out", str(out), "--phases", f"ours:W2:cpu*0,threads:{asked},ours:W2:cpu*0"])
    finally:
        torch.set_num_threads(threads)
    records = [record for record in map(json.loads, out.read_text().splitlines()) if record.get("impl") == "vsrq"]
    assert [record["host_threads"] for record in records] == [threads, asked]


def test_the_decoder_layout_option_stores_the_engines_decoder_kernels_ndhwc(tmp_path):
    """`--decoder-layout ndhwc`: the engines' 3D kernels NDHWC, said in each record; the CPU decodes the same."""
    out = tmp_path / "results.jsonl"
    phases = "ours:W2:cpu,ours:W2:cpu@parked"
    main(["--tiny", "--hot", "0", "--decoder-layout", "ndhwc", "--out", str(out), "--phases", phases])
    records = [record for record in map(json.loads, out.read_text().splitlines()) if record.get("impl") == "vsrq"]
    assert [r["decoder_layout"] for r in records] == ["ndhwc", "ndhwc"]
    assert records[1]["bit_identical_to_first_vsrq_phase"]
    with pytest.raises(SystemExit):
        main(["--tiny", "--decoder-layout", "nhwc", "--out", str(out), "--phases", "ours:W2:cpu"])


def test_the_decoder_layout_bench_decodes_each_layout_alike(tmp_path):
    """bench/decoder_layout.py on the tiny decoder (CPU): every layout it times decodes the same latents alike."""
    from bench import decoder_layout

    out = tmp_path / "layout.jsonl"
    decoder_layout.main(["--tiny", "--latent-frames", "5", "--repeat", "1", "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in records] == ["engine_before", "engine_now", "ndhwc", "ncdhw"]
    assert all(r["max_abs_delta_vs_first"] <= 1e-5 for r in records)


def test_the_rollout_bench_checks_the_bits_and_counts_each_side_s_operations(tmp_path):
    """bench/rollout.py on the CPU: diffusers' PiFlow steps and the engine's side by side on one tile's latents, the
    same bits, the engine's operations on the device fewer."""
    from bench import rollout

    out = tmp_path / "rollout.jsonl"
    rollout.main(["--device", "cpu", "--shapes", "tiny", "--repeat", "1", "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    sides = {r["side"]: r for r in records if r["section"] == "rollout"}
    assert [r for r in records if r["section"] == "rollout_bits"] == [
        {"section": "rollout_bits", "shape": "tiny", "device": "cpu", "same_bits": True}
    ]
    assert 0 < 4 * sides["engine"]["device_operations"] < sides["diffusers"]["device_operations"]
    assert all(len(side["seconds"]) == 1 and side["best_s"] > 0 for side in sides.values())


def test_check_only_limits_the_untimed_checks_to_the_named_workloads(tmp_path):
    out = tmp_path / "results.jsonl"
    # W2 and L121: both two tiles of 9 frames in the tiny configuration
    phases = "ours:W2:cpu*0,ours:W2:cpu@parked/1*0,ours:L121:cpu*0,ours:L121:cpu@parked*0"
    main(["--tiny", "--out", str(out), "--phases", phases, "--check-only", "W2"])
    records = [record for record in map(json.loads, out.read_text().splitlines()) if record.get("impl") == "vsrq"]
    checked = {(r["workload"], r["decode_order"]): "bit_identical_to_first_vsrq_phase" in r for r in records}
    assert checked == {("W2", "lockstep"): True, ("W2", "parked"): True, ("L121", "lockstep"): False, ("L121", "parked"): False}
    assert all(r["bit_identical_to_first_vsrq_phase"] for r in records if r["workload"] == "W2")


def test_the_host_lever_times_the_products_own_steps():
    """`levers.py --sections host` (CPU only) runs the engine's normalising, the quantiser and the writer's YUV
    conversion; tiny here so the section cannot rot."""
    from bench.levers import host_segment

    record = host_segment(32, 48, frames=2)
    assert record["size"] == "48x32x2"
    assert all(record[key] >= 0 for key in ("normalise_s", "quantise_s", "yuv_convert_s"))  # rounded to ms


@pytest.mark.parametrize("thread_type", ["SLICE", "FRAME"])
def test_the_threading_lever_times_the_products_writer_with_each_threading(thread_type):
    """`levers.py --sections threading` (CPU only), tiny here so the section cannot rot."""
    from bench.levers import mp4_tail

    record = mp4_tail(16, frames=20, every_s=0.0, content="noise", size=(128, 192), thread_type=thread_type)
    assert record["thread_type"] == thread_type and record["size"] == "192x128"
    assert 0 <= record["tail_s"] <= record["wall_s"] and record["bytes"] > 20 * 1000  # noise: ~13 KB a frame


def test_offloaded_modes_run_under_a_cap_phase_with_their_bits_checked_against_resident(tmp_path):
    """Mode phases (auto, offload_layers with a prefetch depth) beside the resident phase of the same decode order
    and segment: their bits are compared with it, their pinned bytes and ratio to speed recorded (the cap itself
    only bites on a GPU)."""
    out = tmp_path / "results.jsonl"
    phases = "ours:W2:cpu*0,ours:W2:cpu@tile_major/1*0,cap:11.5,ours:W2:cpu@offload_layers/3*0,ours:W2:cpu@auto*0"
    main(["--tiny", "--out", str(out), "--phases", phases])
    records = [record for record in map(json.loads, out.read_text().splitlines()) if record.get("impl") == "vsrq"]
    speed, resident, layers, auto = records
    assert layers["mode"] == "offload_layers" and layers["offload"] == {"layers": True, "resident_blocks": 4, "prefetch": 3}
    assert layers["cap_gib"] == 11.5 and speed["cap_gib"] is None
    assert layers["completes"] and layers["bit_identical_to_first_phase_of_its_decode"]  # tile_major/1, resident
    assert "bit_identical_to_first_phase_of_its_decode" in resident
    assert layers["offloaded_weights_pinned_gib"] is not None and layers["offload_copies"] > 0
    assert resident["offloaded_weights_pinned_gib"] == 0 and "offload_copies" not in resident
    assert "ratio_to_speed" in layers and layers["host_rss_gib"] > 0
    assert auto["mode"] == "speed" and auto["bit_identical_to_first_vsrq_phase"]  # a CPU: speed, the first phase's bits


def test_a_split_phase_reports_its_degree_efficiency_and_distance(tmp_path):
    """Tiny W2 is two tiles: three devices split them (auto), and `~off` keeps them whole."""
    out = tmp_path / "results.jsonl"
    main(["--tiny", "--hot", "1", "--out", str(out), "--phases", "ours:W2:cpu,ours:W2:cpu+cpu+cpu,ours:W2:cpu+cpu+cpu~off*0"])
    single, split, whole = [record for record in map(json.loads, out.read_text().splitlines()) if record.get("impl") == "vsrq"]
    assert (single["split_degree"], split["split_degree"], whole["split_degree"]) == (1, 3, 1)
    assert (split["split"], whole["split"]) == ("auto", "off")
    assert split["scaling_efficiency"] == round(single["hot_median_s"] / (3 * split["hot_median_s"]), 3)
    assert split["max_abs_delta_to_first_vsrq_phase"] <= 1e-5 and split["psnr_db_to_first_vsrq_phase"] >= 50
    assert whole["bit_identical_to_first_vsrq_phase"]


def test_the_kept_windows_bench_prices_each_window_commit(tmp_path):
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "bench/kept_windows.py", "--size", "64x48", "--frames", "17", "--window", "9", "--overlap", "4", "--runs", "2"],
        cwd=root, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    without, kept = [json.loads(line) for line in done.stdout.splitlines()]
    assert (without["kept"], kept["kept"]) == (False, True) and kept["output"] == "128x96x17" and kept["windows"] == 3
    assert without["host_s"]["kept"] == 0 < kept["host_s"]["kept"]  # three windows committed, their uploads handed on
    assert kept["kept_upload_s"] > 0 and kept["join_s"] >= 0 and "kept_upload_s" not in without  # uploaded beside


def test_the_decode_in_bench_times_the_first_windows_input_both_ways(tmp_path):
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "bench/decode_in.py", "--clips", "W2", "--runs", "1", "--dir", str(tmp_path)],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    profile, path = [json.loads(line) for line in done.stdout.splitlines()]
    assert profile["part"] == "profile" and path["part"] == "path" and path["tree"] == "this"
    # the conversion as `read_frames` runs it starts no thread per frame; a context per frame does (33 frames)
    once, per_frame = profile["rgb_one_context_16_threads_threads"], profile["rgb_context_per_frame_16_threads_threads"]
    assert once["max"] <= 16 < 33 <= per_frame["min"]
    assert 0 < path["decoded_s"]["min"] <= path["upscaler_s"]["min"]


def test_the_decode_in_bench_times_the_windows_tensor_before_and_now(tmp_path):
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "bench/decode_in.py", "--parts", "window", "--clips", "W2", "--runs", "1", "--dir", tmp_path],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (window,) = [json.loads(line) for line in done.stdout.splitlines()]
    # the upscaler gets the window's uint8 frames (W2: 33 x 384 x 256 x 3), no longer their float32
    assert window["part"] == "window" and window["before_to_device_mb"]["min"] == 39
    assert round(window["before_to_device_mb"]["min"] / window["now_to_device_mb"]["max"]) == 4
    assert window["now_s"]["min"] > 0 and window["unit_on_cpu_s"]["min"] > 0


def test_diagnose_adds_an_untimed_run_whose_wall_and_syncs_are_reported(tmp_path):
    """`--diagnose`: each ours phase reports one more run's wall and its host-device syncs by call site (a CPU has
    neither kernels nor syncs, so no GPU figures)."""
    out = tmp_path / "results.jsonl"
    main(["--tiny", "--hot", "1", "--diagnose", "--out", str(out), "--phases", "ours:W2:cpu"])
    (record,) = [r for r in map(json.loads, out.read_text().splitlines()) if r.get("impl") == "vsrq"]
    assert record["diagnosis"]["wall_s"] > 0 and record["diagnosis"]["syncs"] == []
    assert "gpu_kernel_s" not in record["diagnosis"]
    assert len(record["hot_s"]) == 1  # the diagnosed run is not among the timed ones


def test_a_sync_is_counted_at_the_line_of_ours_that_asked_for_it():
    """What torch's sync debug mode warns is counted by the innermost frame of ours; other warnings pass through."""

    def asks_for_a_sync() -> None:
        warnings.warn(f"called a {SYNC_WARNING}", UserWarning)

    with warnings.catch_warnings(record=True) as other, Diagnosis() as diagnosis:
        for _ in range(3):
            asks_for_a_sync()
        warnings.warn("something else", UserWarning)
    line = asks_for_a_sync.__code__.co_firstlineno + 1
    assert diagnosis.syncs == {f"tests/test_bench.py:{line} asks_for_a_sync": 3}
    assert [str(w.message) for w in other] == ["something else"]
    # busy time is the union of the kernels' intervals; idle gaps over 1 ms are listed
    assert kernel_busy([(0, 10), (5, 20), (2020, 2030)]) == (30, [2000])
