"""The seams between the parts: api and worker meet only in storage, media knows frames and files (not the model),
and the client side (`vsrq bulk`, the `vsrq` command's help) runs with requests-level packages only.

The import rules are read from every module's source with `ast`, so a forbidden import fails here even where no
test runs the code that holds it; the subprocesses check what importing actually pulls in, transitively.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "av", "flask", "celery", "pydantic", "pydantic_settings", "boto3", "botocore", "redis")
# (package whose modules are checked, packages they must never import, anywhere in the module)
NEVER = [
    ("api", ("worker", "client")),
    ("worker", ("api", "client")),
    ("worker/media", ("worker.sr", "worker.upscale", "worker.resized")),
    ("storage", ("api", "worker", "client", "infra")),
]
# The client's imports inside functions, each light or only for what needs it; nothing else.
CLIENT_LAZY = {
    ("client/cli.py", "worker.media.limits"),  # a dataclass of numbers: the limits' defaults in `vsrq upscale --help`
    ("client/bulk.py", "botocore.exceptions"),  # s3:// sources only
    ("client/bulk.py", "boto3"),
    ("client/bulk.py", "botocore.config"),
}


def imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, whether at module level) for every import in `path`; relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    in_function = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for node in ast.walk(fn) if node is not fn}  # fmt: skip
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) not in in_function) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            # `from worker import sr` imports worker.sr: count each name as a submodule too
            found += [(base, id(node) not in in_function)]
            found += [(f"{base}.{alias.name}", id(node) not in in_function) for alias in node.names]
    return found


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize(("folder", "forbidden"), NEVER, ids=[folder for folder, _ in NEVER])
def test_no_module_imports_across_a_seam(folder, forbidden):
    crossing = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in modules(folder)
        for name, _ in imports(path)
        for package in forbidden
        if within(name, package)
    ]
    assert crossing == []


def test_the_client_imports_only_light_packages():
    bad = []
    for path in modules("client"):
        relative = str(path.relative_to(ROOT))
        for name, top_level in imports(path):
            if not any(within(name, package) for package in (*HEAVY, "worker", "api", "infra", "storage")):
                continue
            lazy_allowed = any(path_ == relative and within(name, allowed) for path_, allowed in CLIENT_LAZY)
            if top_level or not lazy_allowed:
                bad.append(f"{relative} imports {name}" + ("" if top_level else " in a function"))
    assert bad == []


def _loaded(code: str) -> tuple[list[str], str]:
    """Runs `code` in a fresh interpreter; the HEAVY (and torch-side) packages it left in sys.modules, its stdout."""
    probe = f"{code}\nimport sys\nprint(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    *output, loaded = result.stdout.strip().splitlines()
    return ast.literal_eval(loaded), "\n".join(output)


def test_the_api_never_imports_torch_or_pyav():
    names = [f"api.{path.stem}" for path in modules("api") if path.stem != "__init__"]
    loaded, _ = _loaded(f"import {', '.join(names)}")
    assert "torch" not in loaded and "av" not in loaded and "flask" in loaded  # flask: the probe did import the API


def test_vsrq_help_and_bulk_load_no_heavy_package(tmp_path):
    """`vsrq --help`, `vsrq bulk --help` and a `vsrq bulk` run (refused here for its missing source, after the
    whole command module loaded) on the client's packages only."""
    code = (
        "import contextlib, io\n"
        "from client import cli\n"
        "for argv in (['--help'], ['bulk', '--help'], ['upscale', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        cli.main(argv)\n"
        f"print(cli.main(['bulk', {str(tmp_path / 'missing')!r}, '--token', 'sk-test', '--report', "
        f"{str(tmp_path / 'r.csv')!r}]))\n"
        "import client.bulk, client.http"
    )
    loaded, status = _loaded(code)
    assert loaded == [] and status == "2"


@pytest.mark.parametrize(
    ("argv", "extra"), [(["upscale", "in.mp4", "-o", "out.mp4", "--model", "lanczos"], "worker"), (["status"], "api")]
)
def test_a_command_whose_part_is_not_installed_says_which_extra(argv, extra):
    """Without torch, PyAV, pydantic (the client extra alone): one actionable line and exit 2, no traceback."""
    code = (
        "import sys\n"
        "for name in ('torch', 'av', 'pydantic', 'pydantic_settings'):\n"
        "    sys.modules[name] = None  # as if not installed: importing it raises ModuleNotFoundError\n"
        "from client import cli\n"
        f"sys.exit(cli.main({argv!r}))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"vsrq {argv[0]} needs the {extra} extra: pip install 'vsrq[{extra}]'")
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr


def test_a_lanczos_worker_starts_without_the_diffusion_stack():
    """A Lanczos worker (the dev stack's, CI's) and `vsrq probe` need torch and PyAV, not diffusers and the compiler
    stack it pulls in: ~2.5 CPU-s per process start. Nor does a job's bookkeeping (the graphs Dynamo built): it
    imported Dynamo in a restarted dev worker's first job, 5-8 s of it under load."""
    code = (
        "import worker.tasks\nfrom worker.sr.backends import open_upscaler\nopen_upscaler('lanczos')\n"
        "assert worker.tasks._graphs_built() == 0\n"
        "import sys\nprint(sorted({m for m in ('diffusers', 'torch._dynamo', 'torch._inductor') if m in sys.modules}))"
    )
    loaded, output = _loaded(code)
    assert "torch" in loaded and "av" in loaded  # the probe did import the worker
    assert output == "[]"
