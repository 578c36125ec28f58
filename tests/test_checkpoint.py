"""Loading goes through diffusers' real `from_pretrained` on checkpoints our own code writes."""

from __future__ import annotations

import json
import shutil

import diffusers
import pytest
import torch

from tests.conftest import clip, run
from worker.sr.attention import DenseSDPAProcessor
from worker.sr.checkpoint import Components, load, write_tiny
from worker.sr.engine import SREngine
from worker.sr.errors import CheckpointNotFound
from worker.sr.request import SRRequest


def test_saved_checkpoint_loads_back_to_the_same_output(tmp_path):
    write_tiny(tmp_path / "a", seed=5)
    in_memory = diffusers.Kandinsky6SRPipeline.from_pretrained(tmp_path / "a", local_files_only=True)
    in_memory.transformer.set_attn_processor(DenseSDPAProcessor())
    replica = Components(torch.device("cpu"), in_memory.transformer, in_memory.vae, in_memory.scheduler, in_memory.latent_upscaler)
    expected = run(SREngine([replica]), clip(2), SRRequest(scale=2))
    # Saved twice from the same seed: the files are the same model.
    write_tiny(tmp_path / "b", seed=5)
    assert torch.equal(run(SREngine.from_pretrained(str(tmp_path / "b")), clip(2), SRRequest(scale=2)), expected)
    write_tiny(tmp_path / "c", seed=6)
    assert not torch.equal(run(SREngine.from_pretrained(str(tmp_path / "c")), clip(2), SRRequest(scale=2)), expected)


def test_checkpoint_layout_is_diffusers(tiny_checkpoints):
    index = json.loads((tiny_checkpoints[("piflow", True)] / "model_index.json").read_text())
    assert index["_class_name"] == "Kandinsky6SRPipeline"
    assert index["scheduler"][1] == "PiflowScheduler"
    assert index["latent_upscaler"][1] == "Kandinsky6SRLatentUpscalerBank"
    assert json.loads((tiny_checkpoints[("flowmatch", False)] / "model_index.json").read_text())["latent_upscaler"] == [None, None]


def test_a_request_without_steps_gets_the_checkpoints_own(tiny_checkpoints):
    # what SGLang's presets give each scheduler: the distilled pi-Flow checkpoint 2 model calls, flow matching 4
    steps = {
        variant: SREngine.from_pretrained(str(tiny_checkpoints[(variant, True)])).default_steps
        for variant in ("piflow", "flowmatch")
    }
    assert steps == {"piflow": 2, "flowmatch": 4}


def test_unused_upscaler_weights_are_not_loaded(tiny_piflow):
    replicas, report = load(str(tiny_piflow), [torch.device("cpu")])
    bank = replicas[0].latent_upscaler
    x2, x4 = bank._models
    assert not hasattr(x2, "pre_blocks") and not hasattr(x2, "input_proj") and hasattr(x2, "x2_branch")
    assert hasattr(x4, "pre_blocks") and not hasattr(x4, "mid_output_head")
    full = diffusers.Kandinsky6SRLatentUpscalerBank.from_pretrained(tiny_piflow, subfolder="latent_upscaler")
    kept = sum(p.numel() for p in bank.parameters()) * 4
    assert report.skipped_bytes == sum(p.numel() for p in full.parameters()) * 4 - kept > 0
    # The report names every component, its device and its size.
    assert {(name, device) for name, device, _ in report.rows} == {
        ("transformer", "cpu"),
        ("vae", "cpu"),
        ("latent_upscaler", "cpu"),
    }
    assert dict((name, size) for name, _, size in report.rows)["latent_upscaler"] == kept
    assert all(not p.requires_grad for p in replicas[0].transformer.parameters())
    assert not replicas[0].vae.training and replicas[0].dtype == torch.float32


def test_missing_directory_names_the_path_and_the_fix(tmp_path):
    with pytest.raises(CheckpointNotFound) as error:
        load(str(tmp_path / "nowhere"), [torch.device("cpu")])
    assert str(tmp_path / "nowhere") in error.value.message
    assert "vsrq checkpoint tiny" in error.value.message and "hf download" in error.value.message


def test_incomplete_directory_names_what_is_missing(tmp_path, tiny_piflow):
    import shutil

    shutil.copytree(tiny_piflow, tmp_path / "ck")
    shutil.rmtree(tmp_path / "ck" / "vae")
    with pytest.raises(CheckpointNotFound, match="missing vae/"):
        load(str(tmp_path / "ck"), [torch.device("cpu")])


def test_unreachable_hub_id_fails_with_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(CheckpointNotFound, match="kandinskylab/not-a-model"):
        load("kandinskylab/not-a-model", [torch.device("cpu")])


def test_kept_windows_never_replay_after_the_weights_change_under_the_same_path(tmp_path):
    """The engine's signature (the kept windows' key) follows the checkpoint's files, not its path: new weights
    saved over the old ones give another; the same files copied to another worker (new mtimes) give the same."""
    request = SRRequest(scale=2)
    write_tiny(tmp_path / "model", seed=5)
    before = SREngine.from_pretrained(str(tmp_path / "model")).signature(request)
    shutil.copytree(tmp_path / "model", tmp_path / "copy", copy_function=shutil.copy)
    assert SREngine.from_pretrained(str(tmp_path / "copy")).signature(request) == before
    write_tiny(tmp_path / "model", seed=6)  # same shapes, same file sizes
    assert SREngine.from_pretrained(str(tmp_path / "model")).signature(request) != before
    assert json.loads(before)["diffusers"] == diffusers.__version__
