"""A worker imports diffusers' K6 SR modules alone (worker.sr.k6_models), and loads our checkpoints as before."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from worker.sr.checkpoint import write_tiny

ROOT = Path(__file__).resolve().parents[1]


def fingerprint(checkpoint: str) -> dict:
    """Loads a checkpoint as the worker does and runs one clip: a digest of every weight and of the output, the
    packages' model modules imported, and what other code still finds in those packages afterwards."""
    import diffusers
    import torch

    from tests.conftest import clip, run
    from worker.sr import k6_models
    from worker.sr.engine import SREngine
    from worker.sr.request import SRRequest

    engine = SREngine.from_pretrained(checkpoint)
    replica = engine.replicas[0]
    weights = hashlib.sha256()
    for name, module in sorted(replica.modules().items()):
        for key, tensor in sorted(module.state_dict().items()):
            weights.update(f"{name}.{key}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            weights.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    output = run(engine, clip(2), SRRequest(scale=2))
    found = {
        "weights": weights.hexdigest(),
        "output": hashlib.sha256(output.numpy().tobytes()).hexdigest(),
        "transformer_class": type(replica.transformer).__module__,
        "models": sorted(m for m in sys.modules if m.startswith(tuple(f"{package}." for package in k6_models.PACKAGES))),
    }
    from diffusers.models.autoencoders import AutoencoderKL

    found["flux"] = diffusers.models.transformers.FluxTransformer2DModel.__module__
    found["autoencoder_kl"] = AutoencoderKL.__module__
    from diffusers.pipelines.kandinsky6 import pipeline_kandinsky6_sr  # its top-level name needs `transformers`

    pipeline = pipeline_kandinsky6_sr.Kandinsky6SRPipeline.from_pretrained(checkpoint)
    found["pipeline"] = type(pipeline.transformer).__module__
    found["transformers_imported"] = sys.modules.get("transformers") is not None
    return found


def test_the_worker_imports_only_the_k6_models_and_loads_the_same_bytes(tmp_path):
    checkpoint = str(write_tiny(tmp_path / "tiny", seed=3))
    # A fresh interpreter that opens its model as a worker's start does: this one imported the engine with the tests
    start = "from worker import service; service.upscaler(); from tests.test_k6_models import fingerprint"
    worker = {"VSRQ_WORKER_MODEL": checkpoint, "VSRQ_WORKER_WARMUP": "false", "VSRQ_WORKER_COMPILE": "off"}
    done = subprocess.run(
        [sys.executable, "-c", f"import json; {start}; print(json.dumps(fingerprint({checkpoint!r})))"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **worker},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    alone = json.loads(done.stdout.splitlines()[-1])
    # Here, the packages imported whole first, as before the stand-ins (and as any other code may)
    import diffusers.models.autoencoders
    import diffusers.models.transformers
    import diffusers.models.unets

    assert diffusers.models.transformers.FluxTransformer2DModel and diffusers.models.autoencoders.AutoencoderKL
    assert diffusers.models.unets.UNet2DConditionModel
    full = fingerprint(checkpoint)
    # Of the packages' ~100 model modules, the K6 SR ones and the few their own imports name (unets' blocks)
    assert "diffusers.models.unets.unet_2d_condition" in full["models"] and "diffusers.models.unets.unet_2d_condition" not in alone["models"]
    assert "diffusers.models.transformers.transformer_kandinsky6_sr" in alone["models"]
    assert "diffusers.models.autoencoders.autoencoder_kandinsky6_sr" in alone["models"]
    assert len(alone["models"]) <= 10 < len(full["models"]), (alone["models"], len(full["models"]))
    # The same classes, weights and output bits as with the packages whole
    assert alone["transformer_class"] == full["transformer_class"] == "diffusers.models.transformers.transformer_kandinsky6_sr"
    assert (alone["weights"], alone["output"]) == (full["weights"], full["output"])
    # The packages' other names, and diffusers' own pipeline loading, are there for any other code
    for found in (alone, full):
        assert found["flux"] == "diffusers.models.transformers.transformer_flux"
        assert found["autoencoder_kl"] == "diffusers.models.autoencoders.autoencoder_kl"
        assert found["pipeline"] == found["transformer_class"]
    # Hugging Face `transformers`, which diffusers imports wherever it is installed: left out of a worker's process
    assert (alone["transformers_imported"], full["transformers_imported"]) == (False, True)


# An installed PEFT as far as Python and diffusers can tell (a package and its distribution metadata), recording its
# import in a file; with the two names diffusers' hooks import from it, so a worker that imports it still starts
PEFT = {
    "peft/__init__.py": "import os\nopen(os.environ['VSRQ_TEST_PEFT_IMPORTED'], 'w').close()\n",
    "peft/helpers.py": "def disable_input_dtype_casting(*args, **kwargs):\n    pass\n",
    "peft/tuners/__init__.py": "",
    "peft/tuners/tuners_utils.py": "class BaseTunerLayer:\n    pass\n",
    "peft-0.17.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: peft\nVersion: 0.17.0\n",
    "peft-0.17.0.dist-info/top_level.txt": "peft\n",
}
SEES_PEFT = (
    "import importlib.metadata, importlib.util, json, sys\n"
    "installed = importlib.util.find_spec('peft') is not None and importlib.metadata.version('peft') == '0.17.0'\n"
    "if sys.argv[1] == 'worker':\n"
    "    import worker.sr.engine\n"
    "from diffusers.utils import is_peft_available\n"
    "print(json.dumps({'installed': installed, 'diffusers_sees_it': is_peft_available()}))\n"
)


def test_an_installed_peft_costs_a_worker_no_import(tmp_path):
    site = tmp_path / "site"
    for name, text in PEFT.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    imported = tmp_path / "peft-imported"
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "VSRQ_TEST_PEFT_IMPORTED": str(imported)}

    def start(what: str) -> dict:
        done = subprocess.run([sys.executable, "-c", SEES_PEFT, what], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.splitlines()[-1])

    # diffusers alone finds it installed (so the worker below has something to miss)
    assert start("diffusers") == {"installed": True, "diffusers_sees_it": True}
    # A worker importing its engine: not imported, not seen by diffusers
    imported.unlink(missing_ok=True)
    assert start("worker") == {"installed": True, "diffusers_sees_it": False}
    assert not imported.exists(), "the worker imported PEFT"
