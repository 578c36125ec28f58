"""Compiled blocks precompiled into the compile cache directory (worker.sr.precompiled): a second process on the same
directory loads the transformer's and the decoder's block functions instead of tracing them with Dynamo, and every
start gives the bytes `nn.Module.compile`'s blocks give, also when an artifact is corrupt. Real Inductor compiles on
the CPU (a C++ compiler), on the tiny checkpoint's blocks as `open_upscaler` compiles them (`compile="on"`). Three
graphs, to stay quick: the transformer (its blocks share one), and a decoder resnet block over two segments (the
first fills its causal cache, the second reads it and updates it in place)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from worker.sr import precompiled

ROOT = Path(__file__).resolve().parents[1]
# Inductor trusts the CPU's flags for its vector ISAs instead of test-compiling each one (~13 CPU-s per fresh cache
# directory, ~3 s per process): the same ISA is picked here, and the generated code is the same
ENV = {**os.environ, "TORCHINDUCTOR_VEC_ISA_OK": "1"}

# One process: for each precompile setting in turn, an upscaler with every block compiled on the cache directory,
# then (once its preloader is done) the transformer on one latent frame and its first decoder resnet block on two
# segments. Prints, per setting, a hash of the outputs and of the block's cache after them, the graphs Dynamo traced,
# worker.sr.precompiled's counts (also as the upscaler was returned: the engine built), and the files torch's loader
# read more than once (counted on the way through it).
START = """
import collections, hashlib, json, sys, torch
torch._dynamo.config.enable_aot_compile = False  # torch 2.11's default (the GPU image's): the worker turns it on to build its compile wrappers
from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import Kandinsky6SRResnetBlock3D
from worker.sr import precompiled
from worker.sr.backends import open_upscaler

reads, load = collections.Counter(), torch.compiler.load_compiled_function
def counted(file, **options):
    reads[file.name] += 1
    return load(file, **options)
torch.compiler.load_compiled_function = counted

def noise(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

checkpoint, cache, *settings = sys.argv[1:]
for setting in settings:
    traced, before = torch._dynamo.utils.counters["stats"], precompiled.stats()
    graphs = traced["unique_graphs"]
    upscaler = open_upscaler(checkpoint, compile_cache_dir=cache, warmup_frames=None, compile="on", precompile=setting == "on")
    precompiled.wait_preloaded()
    built = {name: value - before[name] for name, value in precompiled.stats().items()}
    transformer, vae = upscaler.replicas[0].transformer, upscaler.replicas[0].vae
    block = next(module for module in vae.decoder.modules() if isinstance(module, Kandinsky6SRResnetBlock3D))
    state = block.make_cache()
    with torch.no_grad():
        latents = noise(1, 1, 8, 16, 2 * transformer.config.in_visual_dim + 1, seed=0)
        outputs = [transformer(hidden_states=latents, timestep=torch.tensor([0.5]), return_dict=False)[0]]
        zq = noise(1, vae.config.latent_channels, 1, 8, 16, seed=1)
        outputs += [block(noise(1, block.in_channels, 1, 8, 16, seed=2 + segment), state, zq=zq) for segment in range(2)]
    outputs += [state["conv1"]["padding"], state["conv2"]["padding"]]
    found = {name: value - before[name] for name, value in precompiled.stats().items()}
    digest = hashlib.sha256(b"".join(output.numpy().tobytes() for output in outputs)).hexdigest()
    twice = sorted(name for name, count in reads.items() if count > 1)
    print(json.dumps({"setting": setting, "output": digest, "traced": traced["unique_graphs"] - graphs, **found,
                      "built": built, "read_twice": twice, "read": sorted(reads)}))
"""


def start(checkpoint: Path, cache: Path, *settings: str) -> tuple[list[dict], str]:
    done = subprocess.run(
        [sys.executable, "-c", START, str(checkpoint), str(cache), *settings],
        cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")], done.stderr


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="Inductor's CPU code needs a C++ compiler")
def test_a_restart_loads_the_compiled_blocks_without_tracing_and_gives_the_same_bytes(tiny_piflow, tmp_path):
    cache = tmp_path / "compile-cache"
    # Today's compiled blocks, then the same blocks compiled ahead of time and saved, in one process
    (traced, first), _ = start(tiny_piflow, cache, "off", "on")
    assert traced["traced"] == 3 and traced["compiled"] == 0 and traced["loaded"] == 0, traced
    assert first["output"] == traced["output"], "precompiled blocks give other bits than nn.Module.compile's"
    artifacts = sorted((cache / "precompiled").glob("*.aot"))
    kinds = {path.name.split("-")[0] for path in artifacts}
    assert len(artifacts) == 3 and kinds == {"Kandinsky6SRTransformerBlock", "Kandinsky6SRResnetBlock3D"}, artifacts
    assert sorted((cache / "precompiled").iterdir()) == artifacts, "a temporary file was left beside the functions"
    assert first["compiled"] == len(artifacts) and first["loaded"] == 0 and first["fallback"] == 0, first

    # A new process: only the directory carries the functions over; Dynamo traces nothing. The preloader loads them
    # while the engine is built: the blocks' first calls take them, each file read once. A worker of another
    # environment (image, GPU) sharing the directory left a file of its own, which is never opened
    block, environment, rest = artifacts[0].name.split("-", 2)
    foreign = artifacts[0].with_name(f"{block}-{'0' * len(environment)}-{rest}")
    shutil.copy(artifacts[0], foreign)
    [warm], _ = start(tiny_piflow, cache, "on")
    assert (warm["traced"], warm["compiled"], warm["fallback"]) == (0, 0, 0), warm
    assert warm["loaded"] == len(artifacts) and warm["output"] == traced["output"], warm
    assert warm["preloaded"] == warm["built"]["preloaded"] == len(artifacts) and warm["read_twice"] == [], warm
    assert sorted(Path(name).name for name in warm["read"]) == [path.name for path in artifacts], warm
    assert warm["loading_s"] - warm["built"]["loading_s"] < warm["preloading_s"] / 5, warm  # the calls load nothing

    # A corrupt artifact: logged, compiled again (and rewritten), the same bytes; the others still load
    artifacts[0].write_bytes(b"not a compiled function")
    [mended], log = start(tiny_piflow, cache, "on")
    assert "did not load" in log, log[-3000:]
    assert (mended["loaded"], mended["compiled"], mended["fallback"]) == (len(artifacts) - 1, 1, 0), mended
    assert mended["preloaded"] == len(artifacts) - 1 and mended["read_twice"] == [], mended  # the corrupt one unused
    assert mended["output"] == traced["output"], mended
    assert artifacts[0].stat().st_size > 1000  # saved again over the corrupt one


# A block class of its own, in a module file the test edits between two processes
BLOCK = """
import torch


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.linear(x)) * FACTOR
"""
EDITED = """
import collections, json, sys, torch
torch._dynamo.config.enable_aot_compile = False  # torch 2.11's default
sys.path.insert(0, sys.argv[1])
from block import Block
from worker.sr import precompiled

reads, load = collections.Counter(), torch.compiler.load_compiled_function
def counted(file, **options):  # torch's loader, counting the files opened
    reads[file.name.rsplit("/", 1)[-1]] += 1
    return load(file, **options)
torch.compiler.load_compiled_function = counted

precompiled.use(sys.argv[2])
precompiled.preload([Block], ["cpu"])  # as a worker's start does: the file loads on a thread, with the same checks
precompiled.wait_preloaded()
torch.manual_seed(0)
block = Block()
precompiled.compile_block(block)
with torch.no_grad():
    x = torch.rand(4, 8)
    same = torch.equal(block(x), torch.relu(block.linear(x)) * int(sys.argv[3]))
print(json.dumps({"same_as_eager": same, "switch_interval": sys.getswitchinterval(), "read": reads,
                  **precompiled.stats()}))
"""


def edited(directory: Path, factor: int, env: dict[str, str] = ENV) -> tuple[dict, str]:
    """`EDITED` in a new process: the block (its forward scaled by `factor`) on the cache `directory / "cache"`."""
    (directory / "block.py").write_text(BLOCK.replace("FACTOR", str(factor)))
    done = subprocess.run(
        [sys.executable, "-c", EDITED, str(directory), str(directory / "cache"), str(factor)],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


@pytest.fixture(scope="module")
def compiled_block(tmp_path_factory) -> tuple[Path, dict]:
    """`edited(directory, 2)` on an empty directory, once for the tests that start from it: the directory (the block's
    module, the cache with its one compiled file) and what the process said. Each test works on a copy of its own."""
    directory = tmp_path_factory.mktemp("compiled-block")
    first, _ = edited(directory, 2)
    assert first["compiled"] == 1 and first["loaded"] == 0, first
    return directory, first


def started_from(compiled_block: tuple[Path, dict], directory: Path) -> dict:
    """Makes `directory` what `edited(directory, 2)` leaves on an empty one, from a copy of `compiled_block`'s (a
    process of its own takes ~7 s on 2 cores, mostly importing torch's compiler): that first start's result."""
    source, first = compiled_block
    shutil.copytree(source, directory, dirs_exist_ok=True)
    return first


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="Inductor's CPU code needs a C++ compiler")
def test_a_function_traced_from_code_changed_since_is_compiled_again(compiled_block, tmp_path):
    """A deploy of new code onto a kept cache: Dynamo's saved guards do not see the change; the sources' checksums do."""

    first = started_from(compiled_block, tmp_path)
    again, _ = edited(tmp_path, 2)
    assert (first["compiled"], again["loaded"], again["compiled"]) == (1, 1, 0) and again["same_as_eager"], again
    assert again["preloaded"] == 1, again
    assert again["switch_interval"] == 0.005, again  # the preloader's shorter interval ends with it (Python's default)
    changed, log = edited(tmp_path, 3)
    assert "has changed since" in log, log[-3000:]
    assert changed["compiled"] == 1 and changed["loaded"] == 0 and changed["same_as_eager"], changed
    assert changed["preloaded"] == 0, changed  # the stale file, loaded on the preloader, is not used


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="Inductor's CPU code needs a C++ compiler")
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT", reason="this CPU's capability is the other one")
def test_a_shared_directory_holds_files_of_another_environment_that_are_never_opened(compiled_block, tmp_path):
    """Workers of other images or devices on one volume: the preloader and the blocks' first calls open only the files
    of their own environment. The other one here is a CPU of another capability (ATen's kernels capped to DEFAULT),
    started on the directory this worker's first start left (`compiled_block`'s: one process fewer than starting it
    again)."""
    first = started_from(compiled_block, tmp_path)
    assert first["compiled"] == 1, first
    [mine] = (tmp_path / "cache").glob("Block-*.aot")

    # Their first start: this worker's file (a valid function, of this environment) is neither preloaded nor loaded
    foreign, log = edited(tmp_path, 2, {**ENV, "ATEN_CPU_CAPABILITY": "default"})
    assert (foreign["compiled"], foreign["loaded"], foreign["preloaded"], foreign["read"]) == (1, 0, 0, {}), foreign
    assert foreign["same_as_eager"] and "did not load" not in log, foreign
    [theirs] = set((tmp_path / "cache").glob("Block-*.aot")) - {mine}
    assert mine.name.split("-")[1] != theirs.name.split("-")[1], (mine.name, theirs.name)  # the environment's part

    # This worker's restart preloads its own file only, and so does theirs
    again, _ = edited(tmp_path, 2)
    assert (again["compiled"], again["loaded"], again["preloaded"], again["read"]) == (0, 1, 1, {mine.name: 1}), again
    assert again["same_as_eager"], again
    foreign, _ = edited(tmp_path, 2, {**ENV, "ATEN_CPU_CAPABILITY": "default"})
    assert (foreign["compiled"], foreign["preloaded"], foreign["read"]) == (0, 1, {theirs.name: 1}), foreign


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="Inductor's CPU code needs a C++ compiler")
def test_a_start_deletes_the_files_of_the_old_naming_and_keeps_every_environment_s(compiled_block, tmp_path):
    """Files named before the environment was in the name (`{class}-{signature}-{structure}.aot`), which no worker of
    this version opens, go as a worker starts (its preloader) once over a week old; a younger one, this environment's
    file, another environment's (as a shared volume holds) and anything not named so stay."""
    first = started_from(compiled_block, tmp_path)
    assert first["compiled"] == 1, first
    cache = tmp_path / "cache"
    [mine] = cache.glob("Block-*.aot")
    _, environment, signature, structure = mine.stem.split("-")
    old = [cache / f"Block-{signature}-{structure}.aot", cache / f"OtherBlock-{'a' * 32}-{'b' * 12}.aot"]
    week_ago = time.time() - precompiled.OLD_NAMING_AGE_S - 60
    for path in old:  # an earlier version's files, written over a week ago: this one's bytes, under their names
        path.write_bytes(mine.read_bytes())
        os.utime(path, (week_ago, week_ago))
    theirs = cache / f"Block-{'c' * 12}-{signature}-{structure}.aot"  # another environment's
    # an earlier version's file written just now: a worker of that version still shares the volume
    young = cache / f"YoungBlock-{'d' * 32}-{'e' * 12}.aot"
    kept = [theirs, young, cache / f".Block-{signature}-{structure}.aot.1.2.tmp", cache / "notes.txt"]
    for path in kept:
        path.write_bytes(mine.read_bytes())

    again, _ = edited(tmp_path, 2)
    assert (again["compiled"], again["preloaded"], again["read"]) == (0, 1, {mine.name: 1}), again
    assert again["same_as_eager"], again
    assert sorted(cache.iterdir()) == sorted([mine, *kept]), sorted(path.name for path in cache.iterdir())


# The block's first call arriving while the preloader is on that call's file: torch's loader holds the preloader's
# thread at the file until the call waits for it (or is done without waiting), then lets it load
RACE = """
import json, sys, threading, time, torch
torch._dynamo.config.enable_aot_compile = False  # torch 2.11's default
sys.path.insert(0, sys.argv[1])
from block import Block
from worker.sr import precompiled

loads, load, loading, go = [], torch.compiler.load_compiled_function, threading.Event(), threading.Event()
def held(file, **options):
    if threading.current_thread().name == "vsrq-preload":
        loading.set()
        go.wait()
    function = load(file, **options)
    loads.append((threading.current_thread().name, file.name.rsplit("/", 1)[-1], function))
    return function
torch.compiler.load_compiled_function = held

precompiled.use(sys.argv[2])
torch.manual_seed(0)
block = Block()
precompiled.compile_block(block)
x = torch.rand(4, 8)
precompiled.preload([Block], ["cpu"])
assert loading.wait(60), "the preloader did not reach the file"
same = []
def first_call():
    with torch.no_grad():
        same.append(torch.equal(block(x), torch.relu(block.linear(x)) * 2))
caller = threading.Thread(target=first_call, name="caller")
caller.start()
deadline = time.monotonic() + 60
while caller.is_alive() and not precompiled._preloads._waiters and time.monotonic() < deadline:
    time.sleep(0.01)
waited = bool(precompiled._preloads._waiters)
go.set()
caller.join()
precompiled.wait_preloaded()
used = [function for functions in precompiled._functions.values() for function in functions]
print(json.dumps({"waited": waited, "same_as_eager": same, "loads": [load[:2] for load in loads],
                  "uses_the_preloaders": [function is loads[0][2] for function in used], **precompiled.stats()}))
"""


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="Inductor's CPU code needs a C++ compiler")
def test_a_first_call_waits_for_the_file_the_preloader_is_loading(compiled_block, tmp_path):
    """`_take`: a block's first call wanting the file the preloader is loading waits for it and takes its function;
    the file is read once."""
    first = started_from(compiled_block, tmp_path)
    assert first["compiled"] == 1, first
    [path] = (tmp_path / "cache").glob("Block-*.aot")
    done = subprocess.run(
        [sys.executable, "-c", RACE, str(tmp_path), str(tmp_path / "cache")],
        cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    race = json.loads(done.stdout.splitlines()[-1])
    assert race["waited"] and race["same_as_eager"] == [True], race
    assert race["loads"] == [["vsrq-preload", path.name]] and race["uses_the_preloaders"] == [True], race
    assert (race["loaded"], race["preloaded"], race["compiled"], race["fallback"]) == (1, 1, 0, 0), race


# Two block classes, each with its file; two preloaders that overlap, each held at its file until the test lets it
# load: the first started and ended first, so that the second one alone runs in between
PRELOADS = """
import json, sys, threading, torch
torch._dynamo.config.enable_aot_compile = False  # torch 2.11's default
sys.path.insert(0, sys.argv[1])
from blocks import Block, Other
from worker.sr import precompiled

directory = precompiled.use(sys.argv[2])
environment = precompiled._environment([torch.device("cpu")])
for cls in (Block, Other):  # files the loader takes its time over, then refuses: the interval is all that is watched
    (directory / f"{cls.__name__}-{environment}-{'0' * 12}-{'0' * 12}.aot").write_bytes(b"not a function")

load, go = torch.compiler.load_compiled_function, {"Block": threading.Event(), "Other": threading.Event()}
reached = {name: threading.Event() for name in go}
def held(file, **options):
    name = file.name.rsplit("/", 1)[-1].split("-")[0]
    reached[name].set()
    go[name].wait()
    return load(file, **options)
torch.compiler.load_compiled_function = held

"""
OVERLAP = PRELOADS + """
seen = {"original": sys.getswitchinterval()}
first = precompiled.preload([Block], ["cpu"])
assert reached["Block"].wait(60), "the first preloader did not reach its file"
second = precompiled.preload([Other], ["cpu"])
assert reached["Other"].wait(60), "the second preloader did not reach its file"
seen["both"] = sys.getswitchinterval()
go["Block"].set()
first.join(60)
seen["second"] = sys.getswitchinterval()
go["Other"].set()
second.join(60)
seen["after"] = sys.getswitchinterval()
print(json.dumps({**seen, "alive": [first.is_alive(), second.is_alive()], **precompiled.stats()}))
"""
# The same two preloaders, the second let through while the first is still held at its file: what `wait_preloaded`
# says meanwhile, and once the first is let through too
WAIT = PRELOADS + """
first = precompiled.preload([Block], ["cpu"])
assert reached["Block"].wait(60), "the first preloader did not reach its file"
second = precompiled.preload([Other], ["cpu"])
go["Other"].set()
second.join(60)
seen = {"second_alive": second.is_alive(), "waited": precompiled.wait_preloaded(1), "first_alive": first.is_alive()}
go["Block"].set()
seen["waited_after"] = precompiled.wait_preloaded(60)
print(json.dumps(seen))
"""
# Two block classes for the preloader's globs: their files are refused before any of their code would run
BLOCKS = """
import torch


class Block(torch.nn.Module):
    pass


class Other(torch.nn.Module):
    pass
"""


def overlap(directory: Path, script: str = OVERLAP) -> dict:
    (directory / "blocks.py").write_text(BLOCKS)
    done = subprocess.run(
        [sys.executable, "-c", script, str(directory), str(directory / "cache")],
        cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_overlapping_preloads_put_the_switch_interval_back(tmp_path):
    """`preload` called again while its first preloader runs: the interval stays lowered while either runs and is
    Python's own again once both have ended, whichever ends last (the second saved the lowered one)."""
    seen = overlap(tmp_path)
    assert seen["alive"] == [False, False] and seen["preloaded"] == 0, seen  # both files tried, and refused
    assert (seen["original"], seen["both"], seen["second"], seen["after"]) == (0.005, 0.0005, 0.0005, 0.005), seen


def test_waiting_for_the_preloader_waits_for_every_preload_still_running(tmp_path):
    """`preload` called again while its first preloader runs (several engines in one process): `wait_preloaded`
    (which a compile waits on, since loading patches Inductor's config process-wide) says the preloaders are done only
    once the first has ended too, not as soon as the latest has."""
    seen = overlap(tmp_path, WAIT)
    assert (seen["second_alive"], seen["first_alive"]) == (False, True), seen
    assert (seen["waited"], seen["waited_after"]) == (False, True), seen


def test_old_naming_files_another_worker_deleted_first_are_skipped_not_an_end_to_the_cleanup(tmp_path):
    """Two workers start on one volume: a week-old file of the old naming that the other deleted between this one's
    listing and its look at it (here: a link to nothing) is skipped, and the other old files still go."""
    week_ago = time.time() - precompiled.OLD_NAMING_AGE_S - 60
    names = [f"{cls}-{digit * 32}-{'e' * 12}.aot" for cls, digit in (("ABlock", "a"), ("BBlock", "b"), ("CBlock", "c"))]
    (tmp_path / names[0]).symlink_to(tmp_path / "gone.aot")  # listed first (sorted), then not there
    for name in names[1:]:
        (tmp_path / name).write_bytes(b"an earlier version's function")
        os.utime(tmp_path / name, (week_ago, week_ago))
    precompiled._remove_old_naming(tmp_path)
    assert [path.name for path in tmp_path.iterdir()] == [names[0]]  # the link, never a file of this naming
