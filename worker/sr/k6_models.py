"""diffusers' Kandinsky 6 SR model modules, imported without the other models of their packages.

`diffusers.models.transformers` and `diffusers.models.autoencoders` are plain packages whose `__init__` imports every
model they hold (~70 transformers, ~20 autoencoders): reaching the K6 SR transformer costs their whole import at a
worker's start (bench/RESULTS.md, "The warm start, step by step"). Importing this module first puts a stand-in for
each of these packages in `sys.modules`: the same name, path and spec, so `import` finds the K6 SR submodules (and
any other) on their own, and diffusers' lazy top level (`diffusers.Kandinsky6SRTransformer3DModel`, what
`from_pretrained` and the pipelines resolve) gets the real classes. A name the package itself defines
(`diffusers.models.transformers.FluxTransformer2DModel`) runs the package's real `__init__` into the stand-in at its
first use, so other code sees the package as it was, one import later. `diffusers.models.unets` gets the same: the K6
SR VAE needs its blocks module, not UNet2DConditionModel and the loaders that one pulls in.

PEFT (LoRA adapters), where the worker's environment has it (ML base images do, as the GPU machine's), is imported
by diffusers' hooks at start, and with it parts of Hugging Face `transformers`, scikit-learn and SciPy: ~2.5 s of a
GPU worker's start (bench/RESULTS.md). No worker path loads adapters: unless diffusers is imported already, PEFT is
hidden from this process (`None` in `sys.modules`: Python's way to make an import, and diffusers' probe, miss it).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types

PACKAGES = ("diffusers.models.transformers", "diffusers.models.autoencoders", "diffusers.models.unets")
UNUSED = ("peft",)  # optional packages diffusers imports where installed, which no worker path uses


class _PackageOnDemand(types.ModuleType):
    """A package whose `__init__` runs the first time a name not yet in it is asked for."""

    _lock = threading.RLock()  # two threads asking at once run the `__init__` once

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):  # probes (`__wrapped__`, `__all__`...) load nothing
            raise AttributeError(name)
        if importlib.util.find_spec(f"{self.__name__}.{name}") is not None:  # a submodule (`from package import it`)
            return importlib.import_module(f"{self.__name__}.{name}")
        with self._lock:
            if not self.__dict__.get("_vsrq_initialised"):
                self.__dict__["_vsrq_initialised"] = True  # first: the `__init__`'s own lookups find what it set
                try:
                    self.__spec__.loader.exec_module(self)  # the real `__init__`, into this module's namespace
                except BaseException:
                    self.__dict__["_vsrq_initialised"] = False  # its error again at the next use, as an import's
                    raise
        try:
            return self.__dict__[name]
        except KeyError:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}") from None


def _stand_in(name: str) -> None:
    if name in sys.modules:  # imported already (in full, or stood in for): nothing to save
        return
    parent, _, child = name.rpartition(".")
    spec = importlib.util.find_spec(name)  # imports the parents (diffusers' lazy top levels), not `name` itself
    if spec is None or spec.submodule_search_locations is None:
        return
    module = _PackageOnDemand(name)
    module.__spec__, module.__loader__, module.__file__ = spec, spec.loader, spec.origin
    module.__path__, module.__package__ = list(spec.submodule_search_locations), name
    sys.modules[name] = module
    setattr(sys.modules[parent], child, module)


if "diffusers" not in sys.modules:  # once in, diffusers has seen them: hiding them now would break its lazy imports
    for _name in UNUSED:
        sys.modules.setdefault(_name, None)

with _PackageOnDemand._lock:
    for _package in PACKAGES:
        _stand_in(_package)

from diffusers.models.autoencoders import autoencoder_kandinsky6_sr as vae  # noqa: E402
from diffusers.models.transformers import transformer_kandinsky6_sr as transformer  # noqa: E402

__all__ = ["transformer", "vae"]
