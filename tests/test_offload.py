"""Offloaded weights (`worker/sr/offload.py`): the same bits as resident weights, each component on its device only
while it runs, the transformer's blocks streamed through a ring of slots, and no recompilation for streamed blocks.
On the CPU home and device are both host memory: the same code runs, with synchronous copies, so where every
weight is at each model call is checked by address."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import clip, run
from worker.sr.engine import SREngine
from worker.sr.offload import Offload, StreamedBlocks
from worker.sr.request import SRRequest

WHOLE = Offload()
LAYERS = Offload(layers=True, resident_blocks=0, prefetch=1)  # the tiny transformer has 2 blocks: both streamed
ONE_RESIDENT = Offload(layers=True, resident_blocks=1, prefetch=2)


@pytest.fixture(scope="module")
def resident(engine):
    return run(engine, clip(2, frames=5), SRRequest(scale=2, seed=3))


def _inside(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= tensor.data_ptr() < start + buffer.numel()


def _where(placement, tensors) -> set[str]:
    """"home" or "device" for each tensor (home: in its unit's pinned buffer)."""
    homes = [unit.home for unit in placement._all_units()]
    return {"home" if any(_inside(t, home) for home in homes) else "device" for t in tensors}


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("offload", [WHOLE, LAYERS, ONE_RESIDENT], ids=["whole", "layers", "one_resident"])
def test_offloaded_weights_give_the_resident_bits_and_visit_the_device_only_while_used(tiny_piflow, resident, offload, devices):
    """Each component's weights are on the device while it runs and at home while the others run; streamed blocks
    sit in a slot for their own call only; every call copies each unit in once and each streamed block once per
    transformer call. Two CPU "devices" share one replica, and with it one placement (users are counted)."""
    engine = SREngine.from_pretrained(str(tiny_piflow), devices=["cpu"] * devices, offload=offload)
    replica = engine.replicas[0]
    placement = replica.placement
    components = {
        "encoder": replica.vae.encoder,
        "latent_upscaler": replica.latent_upscaler._models[0],  # x2's: the bank's x4 model stays home
        "transformer": replica.transformer,
        "decoder": replica.vae.decoder,
    }
    weights = {name: list(module.parameters()) for name, module in components.items()}
    blocks = list(replica.transformer.visual_transformer_blocks._modules.values())
    streamed = blocks[offload.resident_blocks :] if offload.layers else []
    seen: dict[str, set] = {}

    def look(name):
        def hook(*_):
            for other, tensors in weights.items():
                if other == "transformer":  # its streamed blocks are the blocks' own business
                    tensors = [t for t in tensors if not any(t is p for block in streamed for p in block.parameters())]
                place = _where(placement, tensors)
                seen.setdefault(f"{other} while {name} runs", set()).update(place)
            for index, block in enumerate(streamed):
                seen.setdefault(f"streamed block {index} while {name} runs", set()).update(_where(placement, block.parameters()))

        return hook

    hooks = [module.register_forward_pre_hook(look(name)) for name, module in components.items()]
    hooks += [block.register_forward_pre_hook(look(f"block {i}")) for i, block in enumerate(streamed)]
    try:
        calls_before = placement.copies
        assert torch.equal(run(engine, clip(2, frames=5), SRRequest(scale=2, seed=3)), resident)
        copies = placement.copies - calls_before
    finally:
        for hook in hooks:
            hook.remove()
    if devices == 1:  # shared by two threads a unit may stay on while the other thread still uses it
        for name in components:
            for other in components:
                if other != name and not (name, other) in {("encoder", "latent_upscaler"), ("latent_upscaler", "transformer"), ("transformer", "decoder")}:
                    # (a unit asks for the next before its work: the next one may be on its way meanwhile)
                    assert seen[f"{other} while {name} runs"] == {"home"}, (other, name)
        for index in range(len(streamed)):
            assert seen[f"streamed block {index} while block {index} runs"] == {"device"}
            others = [i for i in range(len(streamed)) if i != index]
            for other in others:
                assert seen[f"streamed block {other} while block {index} runs"] == {"home"}
            assert seen[f"streamed block {index} while decoder runs"] == {"home"}
    for name in components:
        assert seen[f"{name} while {name} runs"] == {"device"}
    # 4 tiles x 2 steps = 8 transformer calls; the units once each (shared by two threads: possibly twice)
    units = copies - 8 * len(streamed)
    assert (units == 4) if devices == 1 else (4 <= units <= 8)
    assert all(_where(placement, tensors) == {"home"} for tensors in weights.values())  # all home after the call


def test_engines_of_other_modes_take_the_replica_over_in_turn(tiny_piflow, resident):
    """The bench runs `speed` and the offloaded modes on one replica: each call places the weights as its engine
    wants them (resident: none left in pinned buffers) and the output never changes."""
    speed = SREngine.from_pretrained(str(tiny_piflow))
    replica = speed.replicas[0]
    offloaded = SREngine([replica], offload=LAYERS)
    streaming = SREngine([replica], offload=ONE_RESIDENT)
    for engine in (offloaded, speed, streaming, offloaded, speed):
        assert torch.equal(run(engine, clip(2, frames=5), SRRequest(scale=2, seed=3)), resident)
        if engine is speed:
            assert replica.placement is None and type(replica.transformer.visual_transformer_blocks) is torch.nn.ModuleList
        else:
            assert replica.placement.offload == engine.offload and engine.pinned_bytes() > 0
            assert isinstance(replica.transformer.visual_transformer_blocks, StreamedBlocks)


def test_a_resident_mode_frees_the_offloaded_homes_at_once(tiny_piflow):
    """Offloaded, then resident again (a worker's mode changed, the bench's phases): the host copies go at once, not
    at some later full garbage collection (the bench's host RSS rose by the weights' size in a later phase)."""
    import gc
    import weakref

    offloaded = SREngine.from_pretrained(str(tiny_piflow), offload=LAYERS)
    replica = offloaded.replicas[0]
    homes = [weakref.ref(unit.home) for unit in replica.placement._all_units()]
    speed = SREngine([replica])
    gc.disable()  # only reference counting frees now
    try:
        run(speed, clip(2, frames=5), SRRequest(scale=2, seed=3))
        assert replica.placement is None and not [home for home in homes if home() is not None]
    finally:
        gc.enable()


def test_a_failed_call_leaves_every_weight_at_home(tiny_piflow, resident):
    from worker.errors import Cancelled

    engine = SREngine.from_pretrained(str(tiny_piflow), offload=LAYERS)
    events = []
    with pytest.raises(Cancelled):
        engine.upscale(clip(2, frames=5), SRRequest(scale=2, seed=3), lambda _: None, progress=events.append,
                       cancelled=lambda: len(events) >= 3)  # between denoising steps: the transformer is in use
    placement = engine.replicas[0].placement
    assert all(unit.users == 0 and unit.buffer is None for unit in placement.units.values())
    assert _where(placement, engine.replicas[0].transformer.parameters()) == {"home"}
    assert torch.equal(run(engine, clip(2, frames=5), SRRequest(scale=2, seed=3)), resident)


def test_streamed_blocks_run_the_graphs_resident_blocks_built():
    """Dynamo guards a compiled block's parameters on shape, strides, dtype and device: pointing their `.data` at a
    slot of the ring builds no graph. Six blocks, two resident, four streamed through three slots."""
    import diffusers
    from torch._dynamo.utils import counters

    from worker.sr.checkpoint import Components
    from worker.sr.offload import place

    torch.manual_seed(0)
    transformer = diffusers.Kandinsky6SRTransformer3DModel(
        in_visual_dim=4, out_visual_dim=40, time_dim=16, model_dim=24, ff_dim=32, num_visual_blocks=6,
        axes_dims=(4, 4, 4), tile_sizes=((32, 32), (32, 64), (64, 32)),
    ).eval().requires_grad_(False)
    from worker.sr.attention import PROCESSORS

    transformer.set_attn_processor(PROCESSORS["sdpa"]())
    vae = diffusers.Kandinsky6SRVAE(latent_channels=4, encoder_block_out_channels=(4, 8, 8),
                                    decoder_block_out_channels=(4, 8, 8), layers_per_block=1).eval()
    replica = Components(torch.device("cpu"), transformer, vae, None, None)
    torch._dynamo.reset()
    transformer.compile_repeated_blocks(fullgraph=True, dynamic=False, backend="eager")
    hidden = torch.randn(1, 2, 8, 8, 9, generator=torch.Generator().manual_seed(1))
    timestep = torch.tensor([500.0])
    with torch.no_grad():
        expected = transformer(hidden_states=hidden, timestep=timestep, return_dict=False)[0]
        graphs = counters["stats"]["unique_graphs"]
        assert graphs >= 1
        placement = place(replica, Offload(layers=True, resident_blocks=2, prefetch=2))
        for _ in range(3):
            with placement.using("transformer"):
                assert torch.equal(transformer(hidden_states=hidden, timestep=timestep, return_dict=False)[0], expected)
    assert placement.copies == 3 * (1 + 4)  # per use: the transformer's own unit and its four streamed blocks
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


def test_offload_settings_are_checked():
    with pytest.raises(ValueError):
        Offload(prefetch=0)


@pytest.fixture(scope="module")
def full_size_on_meta():
    """The full-size model (bf16, pruned upscaler) on the meta device: sizes without memory. Choosing a mode only
    reads it."""
    import diffusers

    from worker.sr.checkpoint import Components, prune_upscaler

    with torch.device("meta"):
        parts = [diffusers.Kandinsky6SRTransformer3DModel(), diffusers.Kandinsky6SRVAE(), diffusers.Kandinsky6SRLatentUpscalerBank()]
    transformer, vae, upscaler = (torch.nn.Module.to(part, torch.bfloat16) for part in parts)
    return Components(torch.device("cuda:0"), transformer, vae, None, prune_upscaler(upscaler))


def test_the_modes_need_less_memory_from_the_fastest_to_the_smallest(full_size_on_meta):
    """The table `auto` walks (worker.sr.backends.PERFORMANCE_MODES) runs from the fastest mode to the smallest."""
    from worker.sr.backends import PERFORMANCE_MODES, needed_bytes

    needs = [needed_bytes(name, full_size_on_meta) for name in PERFORMANCE_MODES]
    assert needs == sorted(needs, reverse=True)


@pytest.mark.parametrize(
    ("free_gib", "mode"),
    [(139, "speed"), (39.5, "speed"), (23.6, "memory"), (22.5, "memory"), (15, "offload"), (11.5, "offload_layers"), (6, "offload_layers")],
)
def test_auto_picks_the_fastest_mode_that_fits_the_free_memory(full_size_on_meta, free_gib, mode):
    """The full-size model's weights (bf16, pruned upscaler: 10.4 GiB) plus a W1 tile's decode working set: a 24 GB
    card decodes tile by tile with resident weights (W1 measured 20.0 GiB there), a 16 GB card offloads the
    components, a 12 GB one streams the transformer's blocks too; the meta device gives sizes without memory."""
    from worker.sr.backends import choose_mode

    assert choose_mode(full_size_on_meta, int(free_gib * 2**30)) == mode


@pytest.mark.parametrize("mode", ["offload", "offload_layers"])
def test_open_upscaler_runs_the_offloaded_modes_and_auto_is_speed_on_a_cpu(tiny_piflow, resident, mode):
    from worker.sr.backends import PERFORMANCE_MODES, open_upscaler

    engine = open_upscaler(str(tiny_piflow), ["cpu"], mode, offload_prefetch=3)
    assert engine.replicas[0].placement.offload.prefetch == 3
    assert engine.replicas[0].placement.offload.layers == PERFORMANCE_MODES[mode]["offload"].layers
    assert torch.equal(run(engine, clip(2, frames=5), SRRequest(scale=2, seed=3)), resident)
    assert open_upscaler(str(tiny_piflow), ["cpu"]).performance_mode == "speed"
