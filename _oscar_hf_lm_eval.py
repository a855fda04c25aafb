"""Makes ``lm_eval --model hf-oscar`` work: registers oscar-hf's lm-eval model right after lm-eval registers its own.

lm-eval 0.4.13 reads no entry points: its registry knows only the models that ``lm_eval.models`` lists or that an
imported module registers. ``oscar_hf_lm_eval.pth``, installed into site-packages with oscar-hf, runs
:func:`install` at interpreter start. That puts a finder at the front of ``sys.meta_path`` which answers no import but
``lm_eval.models``: then it wraps that module's loader so that, once the module has run (and registered lm-eval's
built-in models), "hf-oscar" is added as a lazy ``"module:class"`` entry. Nothing is imported at start (this module
imports only ``sys``), nothing from oscar_hf until a run asks for "hf-oscar", and a process that never imports
lm-eval pays one string comparison per first import of a module.

Registering after ``lm_eval.models`` matters: ``get_model`` imports it, and with it the built-in models, only into an
empty registry, so an entry made earlier would hide "hf", "vllm", ...
"""

import sys

MODEL = "hf-oscar"
TARGET = "oscar_hf.lm_eval_model:OscarHFLM"
TRIGGER = "lm_eval.models"


def register() -> None:
    """Add "hf-oscar" to lm-eval's model registry unless something (an entry point, the class itself) did."""
    from lm_eval.api.registry import model_registry

    if MODEL not in model_registry:
        model_registry.register(MODEL, target=TARGET)


class _RegisteringLoader:
    """``lm_eval.models``'s own loader, which registers "hf-oscar" after running the module."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):  # resource readers, get_code, ...: the wrapped loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        register()


class Finder:
    """A ``sys.meta_path`` finder that only intercepts ``lm_eval.models``, once."""

    def find_spec(self, name, path=None, target=None):
        if name != TRIGGER:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(name)  # the other finders' answer
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def install() -> None:
    """Register "hf-oscar" now if lm-eval's models are already imported, else when they are."""
    if TRIGGER in sys.modules:
        register()
    elif not any(isinstance(finder, Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, Finder())
