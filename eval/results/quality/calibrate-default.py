"""The three bundles of the `calibrate()` default comparison: ``python calibrate-default.py MODEL OUT`` writes
``OUT/plain`` (``calibrate()`` as called plainly, 16,384 Austen tokens), ``OUT/no-choice`` (the same with
``choose_layout=False``) and ``OUT/on-demand`` (the on-demand path without a recipe, 2,048 tokens)."""

import sys

from oscar_hf import calibrate
from oscar_hf.autocalibrate import cached_rotations, shipped_text
from oscar_hf.models import load_model

model_name, out = sys.argv[1], sys.argv[2]
model, tokenizer = load_model(model_name, "float32")
text = [shipped_text()]
bundles = {
    "plain": calibrate(model, tokenizer, text, num_tokens=16384, show_progress=False),
    "no-choice": calibrate(model, tokenizer, text, num_tokens=16384, choose_layout=False, show_progress=False),
    "on-demand": cached_rotations(model, tokenizer, recipe=None, cache_dir=f"{out}/cache",
                                  show_progress=False).rotations,
}
for name, rotations in bundles.items():
    rotations.save_pretrained(f"{out}/{name}")
    print(name, rotations.calibration.get("layout", {}).get("chosen"), rotations.config.key_bits_layers)
