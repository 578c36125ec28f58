"""Compiled blocks loaded from disk instead of traced: a warm start without Dynamo.

`nn.Module.compile` traces a block's forward with Dynamo and builds its guards at every process start, also when
Inductor then loads the graph from the compile cache: most of a warm start's warmup (bench/RESULTS.md). With a
directory set (`use`, under the compile cache's), `compile_block` sends each call of a block to a function compiled
ahead of time (torch's experimental `torch.compile(...).aot_compile`) for that call's signature: the block's class,
the inputs' shapes, strides, dtypes, devices and constants, and the grad mode. A file's name is
`{block class}-{environment}-{signature}-{structure}.aot`: the environment is a hash of torch's, diffusers' and
Python's versions, the compile options and the devices' capability, so that the workers of other images or GPUs
sharing the directory (a volume) keep files this one never opens. A loaded function whose traced sources have changed
since (their checksums; its guards do not see code) is compiled again. Dynamo's guards, saved with each function, tell
apart the block structures met under one signature (a quality lever swaps layers and the attention processor: one
file per structure). A function found on disk is loaded (no tracing, no guard building); a missing one is compiled
with `compilation.COMPILE`, saved (atomically: workers may share the directory) and used. The block is an input of
the function (its parameters are not baked in), so one file serves every block of the same class and shapes; the
function's graph is the one `nn.Module.compile` builds with the same options, and gives the same bits.

Whatever cannot go this way runs the block's compiled call as `nn.Module.compile` made it: a torch without the API,
a call with hooks or with an argument other than tensors, constants and containers of them, a block that does not
compile ahead of time. A file that does not load (corrupt, from another torch or Python) is compiled and saved
again; one that cannot be saved is used in this process only. Each cause is logged once: a bad directory never
fails a job.

`preload` loads the directory's files of this environment on the engine's devices on a thread while the engine is
built (weights on the devices): the warmup then takes them instead of loading them (each file is loaded once, by
whichever thread gets to it first). It first deletes the files of the naming before (no environment in the name),
which no worker of this version would ever open; other environments' files stay.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import platform
import re
import sys
import threading
import time
import types
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import version
from pathlib import Path
from time import perf_counter
from typing import Any

import torch

from worker.sr.compilation import COMPILE

log = logging.getLogger("vsrq.precompiled")

_directory: Path | None = None
_lock = threading.Lock()  # loads and compiles: one at a time (the compile gate already serialises first calls)
_flag_lock = threading.Lock()  # `_compiler`'s patch of a Dynamo flag: one thread's exit must not undo another's
# signature -> its functions, one per block structure met (a quality lever swaps a block's layers: guards tell them
# apart); replaced, never changed in place, so device threads read it without the lock
_functions: dict[tuple, tuple[Any, ...]] = {}
_searched: set[tuple] = set()  # signatures whose files have been loaded
# Set once a compile ahead of time failed: this torch does not serve these blocks so, and trying each signature again
# would trace it twice (once more for `nn.Module.compile`'s call) at every start
_compile_failed = False
_traced: set[tuple] = set()  # signatures left to `nn.Module.compile`'s call (none of their functions accepts them)
_VARIANTS = 4  # functions per signature at most: past them, something the guards see changes call by call
_logged: set[str] = set()
_counts: Counter[str] = Counter()  # loaded (by any thread), preloaded (of them, on the preloader), compiled, fallback
# loading (the calling threads' own loads and waits for the preloader), preloading (the preloader's), compiling
# (tracing, Inductor, saving)
_seconds: Counter[str] = Counter()
_count_lock = threading.Lock()  # the counters: the preloader updates them without `_lock`, which a caller may hold
# The preloader's files, all under `_preloads`: those it has yet to start, the one it is loading (callers wanting it
# wait), what it loaded (None: not used, corrupt or stale), and every file loaded or claimed in this process (never
# loaded twice). `_lock` may be held while waiting on `_preloads`, never the other way round.
_preloads = threading.Condition()
_preload_queue: list[Path] = []
_preloading: set[Path] = set()
_preloaded: dict[Path, Any] = {}
_claimed: set[Path] = set()
# every preloader started (`preload` may be called again before an earlier one ended): `wait_preloaded` waits for all
_preloaders: list[threading.Thread] = []
_PRIMITIVES = (bool, int, float, str, type(None))
SWITCH_INTERVAL_S = 0.0005  # `sys.setswitchinterval` while the preloader runs (`_preload`)
# Preloaders running (`preload` may be called again before the last one ended): the first saves Python's interval,
# the last puts it back; a second that saved the interval it found would restore the lowered one for good
_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.0
# In every file's name (its environment's hash) and signature hash: another version's naming or hashing never matches
VERSION = "vsrq-precompiled-2"
# A file named before the environment was in the name (vsrq-precompiled-1: `{class}-{signature}-{structure}.aot`),
# which no worker of this version opens; this version's names have a 12-hex part where that one had 32 hex
_OLD_NAME = re.compile(r"[A-Za-z_]\w*-[0-9a-f]{32}-[0-9a-f]{12}\.aot")
OLD_NAMING_AGE_S = 7 * 24 * 3600


def available() -> bool:
    """Whether this torch can compile functions ahead of time and load them back (an experimental API)."""
    return hasattr(torch.compiler, "load_compiled_function") and hasattr(_compiler(lambda: None), "aot_compile")


def _compiler(forward: Callable, **options: Any) -> Any:
    """`torch.compile(forward, **options)`, with its `aot_compile`: torch 2.11 attaches it only under Dynamo's
    `enable_aot_compile` flag (off there, on from 2.13); its function path checks the flag nowhere else."""
    with _flag_lock, torch._dynamo.config.patch(enable_aot_compile=True):  # the patch is process-wide
        return torch.compile(forward, **options)


def use(directory: str | Path | None) -> Path | None:
    """Makes `directory` (created if missing) where compiled blocks' functions are kept; None, or a torch without
    the API (logged), compiles blocks as `nn.Module.compile` does. Call before the engine compiles its blocks."""
    global _directory
    if directory is None:
        _directory = None
        return None
    if not available():
        log.warning("torch %s cannot compile blocks ahead of time: they are traced at every start", torch.__version__)
        _directory = None
        return None
    path = Path(directory).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a read-only volume: blocks are traced as before, the worker still starts
        log.warning("precompiled functions cannot be kept in %s (%s): blocks are traced at every start", path, error)
        _directory = None
        return None
    _directory = path
    return _directory


def compile_block(module: torch.nn.Module) -> None:
    """`module.compile(**COMPILE)`, its calls going through functions compiled ahead of time while a directory is
    set (`use`)."""
    module.compile(**COMPILE)
    if _directory is not None:
        module._compiled_call_impl = _Dispatch(module, module._compiled_call_impl, _directory)


def compile_repeated_blocks(model: torch.nn.Module) -> None:
    """diffusers' `compile_repeated_blocks(**COMPILE)`, each block through `compile_block`."""
    if _directory is None:
        model.compile_repeated_blocks(**COMPILE)
        return
    names = getattr(model, "_repeated_blocks", None) or ()
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise ValueError(f"no repeated blocks ({names}) in {type(model).__name__}")
    for block in blocks:
        compile_block(block)


def preload(classes: Sequence[type], devices: Sequence[str | torch.device]) -> threading.Thread | None:
    """Starts a daemon thread loading the directory's functions for a block of `classes` on one of `devices` (the
    engine's), with `_load`'s checks, for the blocks' first calls to take (`_Dispatch._prepare`): the files named with
    a class and this environment on a device (`_environment`); other environments' files are never opened. None
    without a directory (`use`); functions of signatures never met stay unused (small)."""
    if _directory is None:
        return None
    targets = (_directory, tuple(classes), tuple(torch.device(device) for device in devices))
    preloader = threading.Thread(target=_preload, args=targets, name="vsrq-preload", daemon=True)
    preloader.start()
    _preloaders[:] = [thread for thread in _preloaders if thread.is_alive()] + [preloader]
    return preloader


def wait_preloaded(timeout: float | None = None) -> bool:
    """Whether every preloader is done (none started: True), waiting up to `timeout` seconds for them in all."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for thread in list(_preloaders):
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in list(_preloaders))


def _preload(directory: Path, classes: tuple[type, ...], devices: tuple[torch.device, ...]) -> None:
    # The engine's build meanwhile moves its weights in thousands of short copies, each releasing the GIL: at Python's
    # 5 ms switch interval each waits up to that long for this thread to give it back (the build took 4 s longer on
    # the H200, bench/RESULTS.md). A shorter interval while the thread runs hands it back sooner.
    _lower_switch_interval()
    globals_by_path: dict[Path, dict] = {}
    try:
        _remove_old_naming(directory)
        try:  # a GPU's capability initialises CUDA (~0.5 s): here, beside the weights' load, which then finds it done
            environments = sorted({_environment([device]) for device in devices})
        except Exception as error:  # the blocks' first calls load their files themselves
            _note(f"preload {type(error).__name__}", f"precompiled functions not preloaded ({error!r})")
            return
        # in `classes`' order: the blocks a call runs first come first
        found = [(path, cls) for cls in classes for environment in environments
                 for path in sorted(directory.glob(f"{cls.__name__}-{environment}-*.aot"))]  # fmt: skip
        with _preloads:
            for path, cls in found:
                if path not in _claimed:  # loaded or claimed by a caller already
                    _claimed.add(path)
                    _preload_queue.append(path)
                    globals_by_path[path] = cls.forward.__globals__
        while True:
            with _preloads:
                mine = [path for path in _preload_queue if path in globals_by_path]
                if not mine:
                    return
                path = mine[0]
                _preload_queue.remove(path)
                _preloading.add(path)
            started = perf_counter()
            function = _load_file(path, globals_by_path[path])
            with _count_lock:
                _counts["preloaded"] += function is not None
                _counts["loaded"] += function is not None
                _seconds["preloading"] += perf_counter() - started
            with _preloads:
                _preloaded[path] = function
                _preloading.discard(path)
                _preloads.notify_all()
    finally:  # also on an unexpected error: nobody waits for a file the thread will not load, callers load them
        with _preloads:
            left = {path for path in _preload_queue if path in globals_by_path} | (_preloading & set(globals_by_path))
            _preload_queue[:] = [path for path in _preload_queue if path not in left]
            _preloading.difference_update(left)
            _claimed.difference_update(left)
            _preloads.notify_all()
        _restore_switch_interval()


def _lower_switch_interval() -> None:
    global _switch_users, _switch_saved
    with _switch_lock:
        if not _switch_users:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch_saved, SWITCH_INTERVAL_S))
        _switch_users += 1


def _restore_switch_interval() -> None:
    global _switch_users
    with _switch_lock:
        _switch_users -= 1
        if not _switch_users:
            sys.setswitchinterval(_switch_saved)


def _remove_old_naming(directory: Path) -> None:
    """Deletes the directory's files of the naming before (`_OLD_NAME`) neither written nor read for
    `OLD_NAMING_AGE_S`: left by a worker of an earlier version, they would stay unused forever. Others stay: an older
    worker still sharing the volume (a rolling deploy, a recent rollback) would compile again what it uses. Reads
    move a file's atime at least daily under Linux's default `relatime`; under `noatime` its writing time decides. A
    file another worker deleted first is skipped; a volume that refuses is logged once."""
    removed, now = 0, time.time()
    try:
        for path in sorted(directory.glob("*.aot")):
            if not _OLD_NAME.fullmatch(path.name):
                continue
            try:
                seen = path.stat()
                if now - max(seen.st_mtime, seen.st_atime) > OLD_NAMING_AGE_S:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:  # another worker's start got there first
                continue
    except OSError as error:
        _note(f"old naming {type(error).__name__}", f"precompiled files of the old naming not deleted ({error!r})")
    if removed:
        log.info("deleted %d precompiled files of the old naming (no environment in it) in %s", removed, directory)


def _take(path: Path) -> tuple[bool, Any]:
    """(True, the preloader's function or None where it did not load) for a file it has loaded, after waiting for it
    while it is on it; (False, None) for a file the caller is to load itself (now claimed: the preloader skips it)."""
    with _preloads:
        while path in _preloading:
            _preloads.wait()
        if path in _preloaded:
            return True, _preloaded.pop(path)  # popped: the caller keeps it from now on
        if path in _preload_queue:
            _preload_queue.remove(path)
        _claimed.add(path)
        return False, None


def stats() -> dict[str, float]:
    """This process's functions loaded (by any thread) and compiled ahead of time, those of them preloaded, signatures
    left to `nn.Module.compile`'s call instead; seconds the calling threads spent loading (and waiting for the
    preloader), the preloader loading, and compiling."""
    with _count_lock:
        return {
            "loaded": _counts["loaded"],
            "preloaded": _counts["preloaded"],
            "compiled": _counts["compiled"],
            "fallback": _counts["fallback"],
            "loading_s": _seconds["loading"],
            "preloading_s": _seconds["preloading"],
            "compiling_s": _seconds["compiling"],
        }


class _Unkeyable(Exception):
    """An argument the signature cannot describe across processes."""


class _Dispatch:
    """A block's `_compiled_call_impl`: each call to a function for its signature (block class, `_describe` of the
    arguments, grad mode) whose guards (Dynamo's, saved with it: the block's submodule and processor classes, its
    parameters' metadata, the inputs') accept it."""

    def __init__(self, module: torch.nn.Module, compiled_call: Callable, directory: Path) -> None:
        self.module, self.compiled_call, self.directory = module, compiled_call, directory
        self.forward = type(module).forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if module._forward_hooks or module._forward_pre_hooks or _global_hooks():
            _note("hooks", f"{type(module).__name__} has hooks: its calls are traced as before")
            return self.compiled_call(*args, **kwargs)
        try:
            signature = (type(module), _describe((args, kwargs), {}), torch.is_grad_enabled())
        except _Unkeyable as error:
            _note(f"unkeyable {error}", f"a {type(module).__name__} call with a {error} argument: traced as before")
            return self.compiled_call(*args, **kwargs)
        for function in _functions.get(signature, ()):
            if function.guard_check(module, *args, **kwargs):
                return function(module, *args, **kwargs)
        if signature in _traced:
            return self.compiled_call(*args, **kwargs)
        function = self._prepare(signature, args, kwargs)
        if function is None:
            return self.compiled_call(*args, **kwargs)
        return function(module, *args, **kwargs)

    def _prepare(self, signature: tuple, args: tuple, kwargs: dict) -> Any:
        """A function for `signature` that accepts this call: loaded from the directory, else compiled and saved; None
        where neither works."""
        global _compile_failed
        module = self.module
        with _lock:
            environment = _environment(_devices(module, args, kwargs))
            stem = f"{type(module).__name__}-{environment}-{_digest(signature, environment)}"
            if signature not in _searched:
                _searched.add(signature)
                loaded = [self._load(path) for path in sorted(self.directory.glob(f"{stem}-*.aot"))]
                _functions[signature] = (*_functions.get(signature, ()), *filter(None, loaded))
            for function in _functions.get(signature, ()):  # loaded here, or by another device thread meanwhile
                if function.guard_check(module, *args, **kwargs):
                    return function
            if _compile_failed or len(_functions.get(signature, ())) >= _VARIANTS:
                _traced.add(signature)
                with _count_lock:
                    _counts["fallback"] += 1
                return None
            structure = hashlib.sha256(_stable(_structure(module)).encode()).hexdigest()[:12]
            function = self._compile(self.directory / f"{stem}-{structure}.aot", args, kwargs)
            if function is None:
                _compile_failed = True
                _traced.add(signature)
                with _count_lock:
                    _counts["fallback"] += 1
                return None
            _functions[signature] = (*_functions.get(signature, ()), function)
            return function

    def _load(self, path: Path) -> Any:
        """The function in `path`: the preloader's (waited for while it is on it), else loaded here."""
        started = perf_counter()
        preloaded, function = _take(path)
        if not preloaded:
            function = _load_file(path, self.forward.__globals__)
        with _count_lock:
            _counts["loaded"] += function is not None and not preloaded
            _seconds["loading"] += perf_counter() - started
        return function

    def _compile(self, path: Path, args: tuple, kwargs: dict) -> Any:
        # Loading patches Inductor's config, process-wide on torch 2.11: no compile beside the preloader (a start
        # compiles only what no file holds, so this waits for little)
        wait_preloaded()
        started = perf_counter()
        try:
            compiler = _compiler(self.forward, **COMPILE)
            function = compiler.aot_compile(((self.module, *args), kwargs))
            if not function.guard_check(self.module, *args, **kwargs):
                raise RuntimeError("its guards reject the call it was compiled for")
        except Exception as error:
            name = type(self.module).__name__
            _note(f"compile {type(error).__name__}", f"{name} not compiled ahead of time ({error!r}): traced as before")
            return None
        try:
            _save(function, path)
        except Exception as error:  # a full or read-only disk: this process still uses the function
            _note(f"save {type(error).__name__}", f"a precompiled function was not saved ({error!r})")
        function.disable_guard_check()
        with _count_lock:
            _counts["compiled"] += 1
            _seconds["compiling"] += perf_counter() - started
        return function


def _load_file(path: Path, f_globals: dict) -> Any:
    """The function saved in `path`, or None where it does not load or traced code that has changed since (logged)."""
    try:
        with open(path, "rb") as file:
            function = torch.compiler.load_compiled_function(file, f_globals=f_globals)
    except Exception as error:  # corrupt, truncated, another torch or Python: compiled again if needed
        _note(f"load {type(error).__name__}", f"a precompiled function did not load ({path.name}: {error!r})")
        return None
    if changed := _changed_source(function):
        # Dynamo's guards saved with it do not see code changes (a deploy of new diffusers or vsrq code): the
        # checksums of every function it traced do, as torch's own package loader checks them
        _note(f"stale {path.name}", f"a precompiled function traced code that has changed since ({changed}): compiled again")
        return None
    function.disable_guard_check()  # checked by the dispatch, which falls back instead of failing
    return function


def _save(function: Any, path: Path) -> None:
    """The function's bytes written to a temporary file renamed into place: workers sharing the directory never read
    a half-written one (torch 2.11's `save_compiled_function` writes the path itself)."""
    data = type(function).serialize(function).serialized_data
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())  # a host crash leaves the old name or the whole file, not an empty one
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _changed_source(function: Any) -> str | None:
    """The first source a loaded function traced whose lines differ now (module:first-last), or None."""
    from torch._dynamo.package import _hash_sourcelines

    for code in function.source_info().inlined_sources:
        try:
            checksum = _hash_sourcelines(importlib.import_module(code.module), code.firstlineno, code.lastlineno)
        except Exception:  # a module gone or renamed
            checksum = None
        if checksum != code.checksum:
            return f"{code.module}:{code.firstlineno}-{code.lastlineno}"
    return None


def _note(cause: str, message: str) -> None:
    """Logs `message` once per cause, for the process."""
    if cause not in _logged:
        _logged.add(cause)
        log.warning(message)


def _global_hooks() -> bool:
    hooks = torch.nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


def describe(value: Any) -> Any:
    """What of a call's arguments shapes its compiled graphs (`_describe`): equal for calls that run the same ones."""
    return _describe(value, {})


def _describe(value: Any, seen: dict[int, int]) -> Any:
    """What of an argument shapes the compiled graph: a tensor's metadata (an alias of an earlier one as such),
    constants by value, containers by structure."""
    if isinstance(value, torch.Tensor):
        if id(value) in seen:
            return ("alias", seen[id(value)])
        seen[id(value)] = len(seen)
        return _tensor(value)
    if isinstance(value, _PRIMITIVES):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_describe(item, seen) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple((_describe(key, seen), _describe(item, seen)) for key, item in value.items()))
    raise _Unkeyable(type(value).__qualname__)


def _tensor(tensor: torch.Tensor) -> tuple:
    return (tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device, tensor.requires_grad, type(tensor))


def _structure(module: torch.nn.Module) -> tuple:
    """The block as its graph sees it: each submodule's class, settings and parameter and buffer metadata (a swapped
    layer, processor or dtype is another graph)."""
    parts = []
    for name, sub in module.named_modules():
        settings = tuple((key, _setting(value, 0)) for key, value in vars(sub).items() if not key.startswith("_"))
        tensors = tuple(
            (key, None if tensor is None else _tensor(tensor))
            for key, tensor in (*sub._parameters.items(), *sub._buffers.items())
        )
        parts.append((name, type(sub), settings, tensors))
    return tuple(parts)


def _setting(value: Any, depth: int) -> Any:
    if isinstance(value, _PRIMITIVES):
        return value
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        return f"{getattr(value, '__module__', None)}.{value.__qualname__}"
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if isinstance(value, (tuple, list)):
        return tuple(_setting(item, depth + 1) for item in value)
    if depth < 2 and hasattr(value, "__dict__") and not callable(getattr(value, "forward", None)):
        # an attention processor and what it wraps
        return (type(value), tuple((key, _setting(item, depth + 1)) for key, item in vars(value).items()))
    return type(value)


def _devices(module: torch.nn.Module, args: tuple, kwargs: dict) -> set[torch.device]:
    """The devices of a call's tensors and of the block's parameters."""
    tensors = (*args, *kwargs.values(), *module.parameters())
    return {value.device for value in tensors if isinstance(value, torch.Tensor)}


def _environment(devices: Iterable[torch.device]) -> str:
    """A file name's environment: a hash of what decides the compiled code beside the call (torch, diffusers, Python,
    the compile options, the devices' capability)."""
    capabilities = tuple(sorted({_capability(device) for device in devices}))
    environment = (VERSION, torch.__version__, torch.version.git_version, version("diffusers"),
                   platform.python_version(), repr(COMPILE), capabilities)  # fmt: skip
    return hashlib.sha256(_stable(environment).encode()).hexdigest()[:12]


def _digest(signature: tuple, environment: str) -> str:
    """A file name's signature hash: the signature, with classes by qualified name, in its environment."""
    return hashlib.sha256(_stable((VERSION, environment, signature)).encode()).hexdigest()[:32]


def _capability(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda {torch.cuda.get_device_name(index)} sm_{major}{minor} cuda {torch.version.cuda}"
    if device.type == "cpu":
        return f"cpu {torch.backends.cpu.get_cpu_capability()}"
    return device.type


def _stable(value: Any) -> str:
    """`repr` with classes as qualified names (a device keeps its index: guards pin a function to its device)."""
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, tuple):
        return "(" + ",".join(_stable(item) for item in value) + ")"
    return repr(value)
