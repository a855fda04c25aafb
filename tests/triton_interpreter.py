"""Triton's interpreter for tests on the CPU: importing this module sets TRITON_INTERPRET=1 where no GPU is present
(or where it is set already), before the Triton kernels are imported, and the test module or conftest that imports
:func:`faster_triton_interpreter` runs its tests in a faster interpreter."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET"):
    os.environ["TRITON_INTERPRET"] = "1"
    # Interpreter mode is fixed when triton.language is imported, and transformers may have imported it already: drop
    # triton's Python modules so that they are imported again (the compiled triton._C stays). oscar_hf imports its
    # Triton kernels on first use, so they are built in interpreter mode.
    for name in [m for m in sys.modules if m.split(".")[0] == "triton" and not m.startswith("triton._C")]:
        del sys.modules[name]


# ------------------------------------------------------------------------------ Triton's interpreter, faster
def _share_the_launchs_language_patch(interpreter) -> bool:
    """Under TRITON_INTERPRET=1 every call of a ``@triton.jit`` helper from inside a kernel patches
    ``triton.language`` again (an ``inspect.getmembers`` of each module per call: ~40% of the kernel tests' time),
    although the launch that runs it has patched the same modules already and keeps them patched until it ends.
    Skip that second patch where the helper sees no language module that the launch, or a helper before it (whose
    patch the interpreter never undoes), patched; run everything else as the interpreter does. Returns False (and
    changes nothing) on an interpreter whose code is not the one this was written against (triton 3.9's)."""
    import inspect

    executor, function = getattr(interpreter, "GridExecutor", None), getattr(interpreter, "InterpretedFunction", None)
    if executor is None or function is None or getattr(function, "_oscar_hf_tests_patched", False):
        return False
    try:
        call_source = inspect.getsource(function.__call__)
        launch_source = inspect.getsource(executor.__call__)
    except (OSError, TypeError):
        return False
    expected = ((call_source, "_patch_lang(self.fn)"), (call_source, "self.rewrite()"),
                (launch_source, "_patch_lang(self.fn)"), (launch_source, ".restore()"))
    if not all(text in source for source, text in expected) or "restore" in call_source:
        return False
    tl = interpreter.tl
    patched: list[frozenset] = []  # per launch in progress: the language modules it patched
    seen: dict = {}

    def languages(fn) -> frozenset:
        """The modules _patch_lang patches for ``fn`` (a rewritten function: its module's globals are final)."""
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return seen[fn]

    launch, device_call = executor.__call__, function.__call__

    def launch_with_record(self, *args, **kwargs):
        patched.append(languages(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def device_call_without_repatch(self, *args, **kwargs):
        fn = self.rewrite()
        if not patched:
            return device_call(self, *args, **kwargs)
        if not languages(fn) <= patched[-1]:  # (triton's own helpers, tl.max and the like, also see tl.core)
            patched[-1] |= languages(fn)  # a device call's patch is never undone: it holds for the rest of the launch
            return device_call(self, *args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    executor.__call__, function.__call__ = launch_with_record, device_call_without_repatch
    function._oscar_hf_tests_patched = True
    return True


@pytest.fixture(scope="session", autouse=True)
def faster_triton_interpreter():
    """Applies _share_the_launchs_language_patch to the interpreter the kernels run in (this module re-imports
    triton with TRITON_INTERPRET=1 while the tests are collected, so it is done here, when they run)."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if interpreter is not None and os.environ.get("TRITON_INTERPRET") == "1":
        _share_the_launchs_language_patch(interpreter)
    yield
