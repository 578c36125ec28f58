"""`vsrq` as a user runs it: real MP4 files in and out, exit codes, no tracebacks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path

import av
import pytest

from worker.media.synthetic import write_clip


def vsrq(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "client.cli", *args], capture_output=True, text=True, timeout=300)


def probe(path) -> tuple[int, int, int, float]:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = sum(1 for _ in container.decode(stream))
        return frames, stream.width, stream.height, float(stream.average_rate)


# the tiny model on 48x24: 4 of its tiles (96x64 took 40, the run's main cost)
@pytest.mark.parametrize(
    ("model", "scale", "source_size", "size"), [("tiny", "2", (24, 48), (96, 48)), ("lanczos", "2.25", (64, 96), (216, 144))]
)
def test_upscale_writes_the_promised_mp4(tmp_path, tiny_piflow, model, scale, source_size, size):
    source = write_clip(tmp_path / "in.mp4", num_frames=10, size=source_size, audio_codec="aac")
    output = tmp_path / "out.mp4"
    # lanczos is asked for the faster tier, which it does not have: it runs, and says what ran instead
    tier = ["--quality", "high"] if model == "lanczos" else []
    result = vsrq("upscale", str(source), "-o", str(output), "--model", str(tiny_piflow) if model == "tiny" else model, "--scale", scale, *tier)
    assert result.returncode == 0, result.stderr
    assert probe(output) == (10, *size, 24.0)
    assert f"10 frames {source_size[1]}x{source_size[0]}" in result.stdout and "audio #1 (aac): copied" in result.stdout
    if tier:
        assert "note: quality=high has no faster path on this model: it ran lossless, the exact engine" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.mp4", "out.mp4"]  # no partial file left


def test_probe_prints_what_the_service_would_see(tmp_path):
    source = write_clip(tmp_path / "in.mkv", num_frames=10, size=(64, 96), audio_codec="libopus")
    result = vsrq("probe", str(source), "--scale", "4")
    assert result.returncode == 0, result.stderr
    assert "10 frames at 24 fps (constant)" in result.stdout and "opus 48000 Hz stereo" in result.stdout
    assert "upscale x4: 384x256, 10 frames in 1 window(s)" in result.stdout and "audio #1 (opus): copied" in result.stdout
    assert "interlaced" not in result.stdout
    info = json.loads(vsrq("probe", str(source), "--json").stdout)
    assert (info["video"]["frames"], info["video"]["fps"], info["audio"][0]["sample_rate"]) == (10, "24", 48000)
    # a picture that starts after its sound: the video's start is said beside the audio's (the audio's alone, "from
    # +112.713 s", read as a lag where the picture started 2.1 s after it)
    late = write_clip(tmp_path / "late.mkv", num_frames=10, size=(64, 96), audio_codec="libopus",
                      timestamps=[500 + round(i * 1000 / 24) for i in range(10)], time_base=Fraction(1, 1000))
    lines = vsrq("probe", str(late)).stdout.splitlines()
    assert lines[1].endswith("10 frames at 24 fps (constant), 0.417 s from +0.500 s") and "s from +0.000 s" in lines[2]


def test_probe_says_when_a_source_looks_like_telecined_film(corpus_cache, tmp_path):
    """A real clip's frames telecined to 29.97i by hand (tests/test_deinterlace.py): `vsrq probe` points to
    `--deinterlace film`; the same frames interlaced as video do not, and are said to be interlaced, with the option
    that gives a frame for each field."""
    from itertools import islice

    from tests.test_deinterlace import CLIP, NTSC, encode, telecine, weave
    from worker.media.probe import probe as probed
    from worker.media.reader import read_frames

    frames = read_frames(corpus_cache / CLIP, probed(corpus_cache / CLIP).video)
    try:
        film = list(islice(frames, 44))[4:]  # its first frames hardly move
    finally:
        frames.close()
    telecined = encode(tmp_path / "telecined.ts", telecine(film, "tff"), "h264", "tff", NTSC)
    interlaced = encode(tmp_path / "interlaced.ts", weave(film, "tff"), "h264", "tff", NTSC)
    hint = "looks like telecined film (3:2 pulldown repeats a field in two of every five frames): --deinterlace film"
    assert hint in vsrq("probe", str(telecined)).stdout
    assert json.loads(vsrq("probe", str(telecined), "--json").stdout)["plan"]["looks_telecined"] is True
    said = vsrq("probe", str(interlaced)).stdout
    assert hint not in said and "at 29.97 fps (constant), 0.667 s, interlaced\n" in said, said
    assert "--deinterlace field gives a frame for each field (59.94 frames/s)" in said


def test_probe_plans_the_tiles_windows_and_cost_a_job_would_compute(corpus_cache, tmp_path):
    """A real 384x288 clip of 446 frames: before any GPU time, `vsrq probe` says the engine's tile plan (at x4 each
    768x512 output tile is a 192x128 input tile, 3x3 of them), the windows, the cost against the limits, and the size
    a target leaves; a clip over a service key's budget is refused as the job would refuse it, its plan still said."""
    clip = str(corpus_cache / "hachoir-flashmob.mkv")
    said = vsrq("probe", clip, "--scale", "4", "--target-resolution", "hd")
    assert said.returncode == 0, said.stderr
    assert "upscale x4: 1536x1152, 446 frames in 5 window(s) of up to 105, then 960x720 (hd, fit)\n" in said.stdout
    assert "  tiles: 9 a window, 45 in all, each 192x128 of the 384x288 model input to 768x512" in said.stdout
    assert "  computes 789 megapixel-frames (limit 150,000), 1.8 megapixels a frame (limit 33.2)\n" in said.stdout
    # x2.25: the x1.125 pre-upscaled 432x324, padded to the VAE's 16-pixel grid, in 384x256 tiles
    plan = json.loads(vsrq("probe", clip, "--scale", "2.25", "--json").stdout)["plan"]
    assert plan["tiles"] == {"per_window": 4, "total": 20, "input_tile": [384, 256], "output_tile": [768, 512],
                             "model_input": [432, 336]}  # fmt: skip
    assert (plan["output_size"], plan["target_size"], plan["refused"]) == ([864, 648], None, None)

    over = vsrq("probe", clip, "--scale", "4", "--max-output-megapixel-frames", "500", "--json")
    assert over.returncode == 2 and over.stderr.startswith("vsrq: output_too_large: the output would be 789 megapixel")
    plan = json.loads(over.stdout)["plan"]
    assert (plan["megapixel_frames"], plan["refused"]["code"]) == (789.185, "output_too_large")
    # an interlaced clip read a frame for each field: twice its frames, and their cost
    interlaced = write_clip(tmp_path / "camcorder.mp4", 13, (144, 256), Fraction(25),
                            video_options={"x264-params": "interlaced=1:tff=1"})  # fmt: skip
    fields = vsrq("probe", str(interlaced), "--deinterlace", "field").stdout
    assert "upscale x2: 512x288, 26 frames in 1 window(s)" in fields and "--deinterlace field gives" not in fields


def test_closed_captions_in_the_video_stream_are_said_to_be_left_out(corpus_cache, tmp_path):
    """CEA-608 captions ride in H.264's pictures (A/53 side data): the output's pictures are new ones without them,
    and the notes said nothing."""
    said = vsrq("upscale", str(corpus_cache / "muxjs-multi-channel-608-captions.ts"), "-o", str(tmp_path / "cc.mp4"),
                "--model", "lanczos", "--preset", "superfast")  # fmt: skip
    assert said.returncode == 0, said.stderr
    note = "note: the source's video carries closed captions (CEA-608/708, in 121 of its 181 frames): the output has"
    assert note in said.stdout, said.stdout
    plain = vsrq("upscale", str(write_clip(tmp_path / "in.mp4", num_frames=5)), "-o", str(tmp_path / "out.mp4"),
                 "--model", "lanczos")  # fmt: skip
    assert plain.returncode == 0 and "closed captions" not in plain.stdout, plain.stdout + plain.stderr


@pytest.mark.parametrize("command", ["upscale", "probe"])
def test_bad_input_exits_2_with_its_code_and_no_output(tmp_path, command):
    source = tmp_path / "in.mp4"
    source.write_text("not a video")
    extra = ["-o", str(tmp_path / "out.mp4"), "--model", "lanczos"] if command == "upscale" else []
    result = vsrq(command, str(source), *extra)
    assert result.returncode == 2
    assert result.stderr.startswith("vsrq: input_unreadable: in.mp4 is not a video file") and "Traceback" not in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["in.mp4"]


def test_a_missing_input_a_bad_option_or_output_name_exit_2_with_their_code(tmp_path):
    """Each was an internal error (exit 1, a Python exception's text) or, the CRF, capped by x264 without a word; an
    output named .mkv was an MP4 by another name."""
    import torch

    lanczos = ["-o", str(tmp_path / "out.mp4"), "--model", "lanczos"]
    missing = vsrq("upscale", str(tmp_path / "nope.mp4"), *lanczos)
    said = f"vsrq: input_not_found: {tmp_path / 'nope.mp4'} does not exist or is not a file\n"
    assert (missing.returncode, missing.stderr) == (2, said)
    source = write_clip(tmp_path / "in.mp4", num_frames=5)
    absent = f"cuda:{torch.cuda.device_count()}"
    refusals = {
        ("--devices", "bogus"): "vsrq: invalid_request: unknown device 'bogus': cpu, cuda or cuda:N",
        ("--devices", absent): f"vsrq: invalid_request: {absent} is not a GPU of this machine: ",
        ("--crf", "60"): "vsrq: invalid_request: crf must be 0 to 51 for h264 (lower is better), got 60",
        ("--crf", "60", "--codec", "hevc"): "vsrq: invalid_request: crf must be 0 to 51 for hevc",
        ("--preset", "bogus"): "vsrq: invalid_request: preset must be one of ultrafast, superfast, ",
        ("--preset", "placebo", "--codec", "av1"): "vsrq: invalid_request: preset must be one of ",
        ("-o", str(tmp_path / "out.mkv")): "vsrq: invalid_request: the output is an MP4: name it out.mp4, not out",
    }
    with ThreadPoolExecutor(4) as pool:  # processes of their own, side by side: each start imports torch
        results = pool.map(lambda option: vsrq("upscale", str(source), *lanczos, *option), refusals)
    for (option, said), result in zip(refusals.items(), results):
        assert result.returncode == 2 and result.stderr.startswith(said), (option, result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.mp4"]
    # /proc takes no new file, though os.access says it does to root: this was an internal error (exit 1) there
    unwritable = vsrq("upscale", str(source), "-o", "/proc/out.mp4", "--model", "lanczos")
    said = "vsrq: output_unwritable: cannot write into /proc ("
    assert unwritable.returncode == 2 and unwritable.stderr.startswith(said), unwritable.stderr
    colour = vsrq("upscale", str(source), *lanczos, "--background", "white")  # as the API takes it: #RRGGBB
    assert colour.returncode == 2 and "argument --background: 'white' is not a colour: #RRGGBB" in colour.stderr
    refused = vsrq("upscale", str(source), *lanczos, "--seed", "-5")  # the API's range: -1 draws one
    assert refused.returncode == 2 and "argument --seed: '-5' is not a seed: 0 to 2**63 - 1, or -1" in refused.stderr
    drawn = vsrq("upscale", str(source), *lanczos, "--seed", "-1")
    seed = int(drawn.stdout.split("seed: ")[1].split()[0])
    assert drawn.returncode == 0 and f"(drawn: --seed {seed} gives this video again)" in drawn.stdout


def test_an_output_folder_is_filled_and_an_existing_output_kept_unless_overwritten(tmp_path):
    source = write_clip(tmp_path / "holiday.mp4", num_frames=5)
    folder = tmp_path / "out"
    folder.mkdir()
    first = vsrq("upscale", str(source), "-o", str(folder), "--model", "lanczos")
    assert first.returncode == 0, first.stderr
    output = folder / "holiday-x2.mp4"  # the input's name and the scale, as `vsrq bulk` names it
    assert sorted(p.name for p in folder.iterdir()) == [output.name]
    kept = output.read_bytes()
    again = vsrq("upscale", str(source), "-o", str(output), "--model", "lanczos", "--crf", "30")
    said = f"vsrq: output_exists: {output} is there already: --overwrite replaces it\n"
    assert (again.returncode, again.stderr) == (2, said)
    assert output.read_bytes() == kept
    replaced = vsrq("upscale", str(source), "-o", str(folder), "--model", "lanczos", "--crf", "30", "--overwrite")
    assert replaced.returncode == 0 and output.read_bytes() != kept, replaced.stderr
    itself = vsrq("upscale", str(source), "-o", str(source), "--model", "lanczos")  # --overwrite would not help
    assert itself.returncode == 2 and "is the input: pick another name" in itself.stderr


def test_missing_model_exits_3_without_traceback_or_output(tmp_path):
    source = write_clip(tmp_path / "in.mp4", num_frames=5)
    result = vsrq("upscale", str(source), "-o", str(tmp_path / "out.mp4"), "--model", str(tmp_path / "no-model"))
    assert result.returncode == 3
    assert "model_not_found" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out.mp4").exists()


def test_what_needs_no_model_is_refused_before_one_loads(tmp_path):
    """A one-frame input, `--window 9` with an overlap it cannot hold, HEVC below x265's least size: each was refused
    only once the model had loaded (7-13 s on the CPU with the tiny checkpoint; a 13 GB load on a GPU). The model
    named here does not exist: it is never reached. And `vsrq probe IN | head -1` ends quietly (BrokenPipeError was
    an internal error)."""
    one = write_clip(tmp_path / "one.mp4", num_frames=1)
    five = write_clip(tmp_path / "five.mp4", num_frames=5, size=(8, 8))
    model = ["--model", str(tmp_path / "no-model")]
    for source, options, said in (
        (one, [], "input_too_short"),
        (five, ["--window", "9", "--window-overlap", "16"], "the window overlap must be in [0, 4] frames"),
        (five, ["--codec", "hevc"], "hevc is written at 64x64 or more"),
    ):
        result = vsrq("upscale", str(source), "-o", str(tmp_path / "out.mp4"), *model, *options)
        assert result.returncode == 2 and said in result.stderr, (options, result.returncode, result.stderr)
    read, write = os.pipe()
    os.close(read)  # a reader that has gone, as `head` has once it has its lines
    try:
        piped = subprocess.run([sys.executable, "-m", "client.cli", "probe", str(five)], stdout=write,
                               stderr=subprocess.PIPE, text=True, timeout=60)  # fmt: skip
    finally:
        os.close(write)
    assert (piped.returncode, piped.stderr) == (141, ""), (piped.returncode, piped.stderr)


def test_an_hevc_output_smaller_than_x265_takes_is_refused_not_a_crash(tmp_path):
    """A 256x128 clip fit into a 48x24 box, in HEVC: x265 corrupted the heap and the process aborted (exit -6,
    "corrupted size vs. prev_size"); as a job, its worker died on every attempt. It is refused before any work."""
    source = write_clip(tmp_path / "in.mp4", num_frames=5, size=(64, 128))
    output = tmp_path / "out.mp4"
    box = ["--codec", "hevc", "--target-resolution", "48x24"]
    result = vsrq("upscale", str(source), "-o", str(output), "--model", "lanczos", *box)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "hevc is written at 64x64 or more here, and the output would be 48x24" in result.stderr
    assert "Traceback" not in result.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["in.mp4"]


def test_checkpoint_tiny_writes_a_loadable_checkpoint(tmp_path):
    result = vsrq("checkpoint", "tiny", str(tmp_path / "ck"), "--variant", "flowmatch", "--no-latent-upscaler")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "ck" / "scheduler" / "scheduler_config.json").read_text().count("FlowMatchEulerDiscreteScheduler") == 1
    assert not (tmp_path / "ck" / "latent_upscaler").exists()


def test_a_second_dev_stack_leaves_the_first_one_findable(tmp_path, monkeypatch):
    """A second `vsrq dev` wrote its state over the first's, and removed it when it stopped: `vsrq status` and
    `vsrq bulk` then found no stack, the first still running."""
    from client import devstate
    from infra.cli import _found_by

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a stack's process, running
    try:
        devstate.write(tmp_path / "a", {"pid": first.pid, "url": "http://127.0.0.1:8000"})
        second = {"pid": os.getpid(), "url": "http://127.0.0.1:8001"}
        written = devstate.write(tmp_path / "b", second)
        assert written == [tmp_path / "b" / "dev.json"]
        assert devstate.read()["url"] == "http://127.0.0.1:8000"
        assert "find the other `vsrq dev` (http://127.0.0.1:8000)" in _found_by(devstate.read(), second["url"])
        devstate.remove(written, os.getpid())  # the second stops
        assert devstate.read()["url"] == "http://127.0.0.1:8000"
    finally:
        first.kill()
        first.wait()
    assert devstate.read() is None  # the first is gone: its file is ignored, and the next stack writes its own
    assert devstate.write(tmp_path / "b", second)[1] == devstate.user_path()


def test_dev_on_a_port_in_use_says_so_and_how_to_choose_another(tmp_path):
    """`vsrq dev` where something already listens on the port (flag, then VSRQ_DEV_PORT): a typed error naming the
    port and both ways to pick another, exit 2, no traceback, nothing started (before: `internal_error`, exit 1)."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        by_flag = vsrq("dev", "--port", port, "--dir", str(tmp_path / "a"))
        by_env = subprocess.run(
            [sys.executable, "-m", "client.cli", "dev", "--dir", str(tmp_path / "b")],
            capture_output=True, text=True, timeout=60, env={**os.environ, "VSRQ_DEV_PORT": port},
        )  # fmt: skip
    for result in (by_flag, by_env):
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"vsrq dev: port_in_use: port {port} on 127.0.0.1 is in use"), result.stderr
        assert "--port N or VSRQ_DEV_PORT=N" in result.stderr and "Traceback" not in result.stderr
        assert "internal_error" not in result.stderr and result.stdout == ""
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing made for a stack never run
    bad = vsrq("dev", "--port", "70000")
    assert bad.returncode == 2 and "is not a port" in bad.stderr and "Traceback" not in bad.stderr
    # the variable's own mistake, named: "argument --port" blamed a flag nobody gave
    bad_env = subprocess.run(
        [sys.executable, "-m", "client.cli", "dev"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "VSRQ_DEV_PORT": "abc"},
    )  # fmt: skip
    assert (bad_env.returncode, bad_env.stderr) == (2, "vsrq dev: VSRQ_DEV_PORT: 'abc' is not a port (1-65535)\n")


def test_a_second_demo_or_dev_on_one_directory_is_refused_at_once(tmp_path):
    """Two `make demo` in one clone: the second rewrote the first's input, started a second Redis on its files, and
    died minutes later in SeaweedFS's Go stack trace (`internal_error`)."""
    from infra.dev import claim

    # as a running demo holds it, and the port a second dev asks for, as the first one's would be: the directory is
    # what it is told about (told to choose another port, it met the directory next)
    with claim(tmp_path / "demo"), socket.create_server(("127.0.0.1", 0)) as taken:
        demo = vsrq("demo", "--dir", str(tmp_path / "demo"))
        dev = vsrq("dev", "--dir", str(tmp_path / "demo"), "--port", str(taken.getsockname()[1]))
    said = f"{tmp_path / 'demo'} is in use by another `vsrq dev` or `vsrq demo` (pid {os.getpid()})"
    for command, result in (("demo", demo), ("dev", dev)):
        assert result.returncode == 2 and result.stderr.startswith(f"vsrq {command}: directory_in_use: {said}"), (
            command, result.returncode, result.stderr,
        )  # fmt: skip
    assert sorted(path.name for path in (tmp_path / "demo").iterdir()) == ["in-use.lock"]  # nothing written
    with claim(tmp_path / "demo"):  # free again once its holder is done
        pass


def test_status_without_a_stack_says_how_to_start_one(tmp_path):
    from infra.stack import free_ports

    url = f"redis://:secret-pw@127.0.0.1:{free_ports(1)[0]}/0"
    env = {**os.environ, "VSRQ_REDIS_URL": url, "XDG_CONFIG_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "client.cli", "status"], capture_output=True, text=True, env=env,
                            timeout=60)  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "does not answer" in result.stderr and "is the stack up? `vsrq dev` starts one here" in result.stderr
    assert url.replace(":secret-pw@", "") in result.stderr and "secret-pw" not in result.stderr


def test_a_terminated_upscale_leaves_no_partial_output(tmp_path):
    """SIGTERM (`timeout`, `kill`, `docker stop`) killed the process with its hidden .partial output left behind (20
    MB for a trailer cut short by `timeout`), where Ctrl-C removed it."""
    source = write_clip(tmp_path / "in.mp4", num_frames=241, size=(240, 320))
    command = [sys.executable, "-m", "client.cli", "upscale", str(source), "-o", str(tmp_path / "out.mp4"), "--model",
               "lanczos", "--scale", "4"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    partial, deadline = tmp_path / ".out.mp4.partial", time.monotonic() + 120
    while not (partial.exists() and partial.stat().st_size):  # the encoder has written part of it
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.02)
    process.terminate()
    _, stderr = process.communicate(timeout=120)
    assert (process.returncode, stderr.splitlines()[-1]) == (130, "vsrq: cancelled"), stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.mp4"]


def test_a_terminated_upscale_says_cancelled_even_while_it_loads(tmp_path):
    """SIGTERM in the seconds `vsrq upscale` takes to load torch ended it with 143 and not a word."""
    source = write_clip(tmp_path / "in.mp4", num_frames=5)
    command = [sys.executable, "-m", "client.cli", "upscale", str(source), "-o", str(tmp_path / "out.mp4"), "--model",
               "lanczos"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    maps, deadline = Path(f"/proc/{process.pid}/maps"), time.monotonic() + 60
    while "libtorch" not in maps.read_text():  # torch is loading (its libraries mapped, its modules not yet run)
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.005)
    process.terminate()
    _, stderr = process.communicate(timeout=60)
    assert (process.returncode, stderr.splitlines()[-1:]) == (130, ["vsrq: cancelled"]), stderr


def test_keep_windows_never_deletes_files_it_did_not_write(tmp_path):
    """`--keep-windows` naming a folder of the user's (`.`, `~/Videos`) deleted everything in it at once, and the
    folder itself once the video was done."""
    source = write_clip(tmp_path / "in.mp4", num_frames=5)
    mine = tmp_path / "videos"
    mine.mkdir()
    (mine / "holiday.mov").write_bytes(b"mine")
    (mine / "job.json").write_text('{"title": "mine too"}')
    lanczos = [str(source), "-o", str(tmp_path / "out.mp4"), "--model", "lanczos"]
    refused = vsrq("upscale", *lanczos, "--keep-windows", str(mine))
    said = f"vsrq: invalid_request: {mine} holds files that are not kept windows (holiday.mov, job.json): name a new "
    assert refused.returncode == 2 and refused.stderr.startswith(said), refused.stderr
    assert sorted(path.name for path in mine.iterdir()) == ["holiday.mov", "job.json"]
    a_file = vsrq("upscale", *lanczos, "--keep-windows", str(mine / "holiday.mov"))
    assert a_file.returncode == 2 and "holiday.mov is a file: windows are kept in a folder" in a_file.stderr
    assert (mine / "holiday.mov").read_bytes() == b"mine" and not (tmp_path / "out.mp4").exists()


def test_a_cancel_before_the_first_window_is_kept_leaves_nothing_to_resume(tmp_path):
    """It said "the windows done are kept in DIR: the same command resumes" with no window done, and left DIR."""
    source = write_clip(tmp_path / "in.mp4", num_frames=241, size=(240, 320))
    keep = tmp_path / "keep"
    command = [sys.executable, "-m", "client.cli", "upscale", str(source), "-o", str(tmp_path / "out.mp4"), "--model",
               "lanczos", "--scale", "4", "--keep-windows", str(keep)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (keep / "job.json").exists():  # the store is open: the first window (121 frames to 1280x960) begins
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.01)
    process.terminate()
    _, stderr = process.communicate(timeout=120)
    assert (process.returncode, stderr.splitlines()[-1:]) == (130, ["vsrq: cancelled"]), stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.mp4"]


def test_ctrl_c_with_kept_windows_says_the_same_command_resumes(tmp_path, tiny_piflow):
    source = write_clip(tmp_path / "in.mp4", num_frames=41, size=(48, 64))
    keep = tmp_path / "keep"
    command = [sys.executable, "-m", "client.cli", "upscale", str(source), "-o", str(tmp_path / "out.mp4"), "--model",
               str(tiny_piflow), "--window", "17", "--window-overlap", "4", "--keep-windows", str(keep)]  # fmt: skip
    # SIGINT as a terminal sends it, to a process that handles it by default (not one started in the background)
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(keep.glob("window-*.json")):  # the first window is kept (its metadata is written last)
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.02)
    first.send_signal(signal.SIGINT)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 130, stderr
    assert f"vsrq: cancelled; the windows done are kept in {keep}: the same command resumes" in stderr
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "3 window(s) (" in again.stdout and "(0 restored)" not in again.stdout, again
    assert not keep.exists()  # done: the windows go with their folder
