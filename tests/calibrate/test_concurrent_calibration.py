"""Calibration beside other users of one model: another thread's ``generate`` with an OSCAR cache, another thread
calibrating, and processes that ask for the same on-demand bundle at once."""

import multiprocessing
import threading

import pytest
import torch
from helpers import char_tokenizer, make_model, quick_calibrate, token_ids

from oscar_hf import OscarQuantizedCache, OscarRotations, cache_kwargs
from oscar_hf import autocalibrate as auto

ARCH = "llama-mha-d64"
WAIT = 60  # seconds a thread waits for the other before the test fails
ON_DEMAND = dict(num_tokens=128, recipe="smollm2-135m", show_progress=False)  # a recipe: no layout to choose

pytestmark = pytest.mark.usefixtures("one_thread")


def run_threads(**targets) -> None:
    """Run each target in a thread named by its key; re-raise the first exception any of them raised."""
    errors = []

    def run(target):
        try:
            target()
        except BaseException as err:  # re-raised below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(target,), name=name) for name, target in targets.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def pause_first_capture(model, name: str, reached: threading.Event, resume: threading.Event):
    """A hook on the first attention layer: thread ``name``'s first forward through it sets ``reached`` and waits for
    ``resume`` (the other threads pass through)."""

    def hook(module, args):
        if threading.current_thread().name == name and not reached.is_set():
            reached.set()
            assert resume.wait(WAIT), f"{name}: the other thread never got there"

    return model.model.layers[0].self_attn.register_forward_pre_hook(hook)


def oscar_cache(model) -> OscarQuantizedCache:
    return OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model)


def generate(model, ids, cache):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          **cache_kwargs(model, cache))


def test_a_calibration_leaves_another_threads_generate_untouched(tmp_path):
    """One thread generates with an OSCAR cache while another, midway through a capture forward, calibrates the same
    model on demand: the tokens are those of a generate alone."""
    model, ids = make_model(ARCH), token_ids(1, 12)
    expected, cache = generate(model, ids, oscar_cache(model)), oscar_cache(model)
    capturing, generated, got = threading.Event(), threading.Event(), {}
    hook = pause_first_capture(model, "calibrating", capturing, generated)

    def generating():
        try:
            assert capturing.wait(WAIT), "the calibration never reached its capture"
            got["tokens"] = generate(model, ids, cache)
        finally:
            generated.set()

    try:
        run_threads(calibrating=lambda: auto.cached_rotations(model, char_tokenizer(), cache_dir=tmp_path,
                                                              **ON_DEMAND),
                    generating=generating)
    finally:
        hook.remove()
    assert torch.equal(got["tokens"], expected)


def test_two_threads_calibrating_one_model_at_once_both_capture_every_layer():
    """Thread b starts its capture while thread a is in one, and resumes after a's calibration ended: both bundles
    are the one a calibration alone makes, and the model still serves an OSCAR cache."""
    model, ids = make_model(ARCH), token_ids(2, 64)
    expected = quick_calibrate(model, ids)
    a_in, b_in, a_done, got = threading.Event(), threading.Event(), threading.Event(), {}
    hooks = [pause_first_capture(model, "a", a_in, b_in), pause_first_capture(model, "b", b_in, a_done)]

    def a():
        try:
            got["a"] = quick_calibrate(model, ids)
        finally:
            a_done.set()

    def b():
        assert a_in.wait(WAIT), "thread a never reached its capture"
        got["b"] = quick_calibrate(model, ids)

    try:
        run_threads(a=a, b=b)
    finally:
        for hook in hooks:
            hook.remove()
    for rotations in got.values():
        for name in ("key_rotation", "value_rotation"):
            torch.testing.assert_close(getattr(rotations, name), getattr(expected, name), rtol=0, atol=1e-6)
    assert generate(model, ids[:1, :12], oscar_cache(model)).shape == (1, 20)


def calibrate_on_demand(cache_dir: str, start, results) -> None:
    """The tiny model's on-demand bundle, asked for once both processes pass the barrier ``start``: (calibrated,
    folder) goes to the queue ``results``."""
    torch.set_num_threads(1)
    model = make_model(ARCH)
    start.wait(WAIT)
    found = auto.cached_rotations(model, char_tokenizer(), cache_dir=cache_dir, **ON_DEMAND)
    results.put((found.calibrated, str(found.path)))


def test_processes_asking_for_one_bundle_at_once_calibrate_it_once(tmp_path):
    """This process and a spawned one ask at once: one calibrates (holding the bundle's file lock), the other waits
    and reads its bundle."""
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(2), context.Queue()
    other = context.Process(target=calibrate_on_demand, args=(str(tmp_path), start, results))
    other.start()
    try:
        calibrate_on_demand(str(tmp_path), start, results)
        found = sorted([results.get(timeout=WAIT), results.get(timeout=WAIT)])
    finally:
        other.join(timeout=WAIT)
    assert other.exitcode == 0
    assert [calibrated for calibrated, _ in found] == [False, True] and found[0][1] == found[1][1]
