"""Left-padded batches (what lm-eval's generation tasks send): each row equals that row run alone, once its tokens
reach the quantized history."""

import pytest
import torch
from helpers import VOCAB, make_model

from oscar_hf import OscarQuantizedCache, OscarRotations
from oscar_hf.cache.padding import LeftPadding

WINDOWS = dict(sink_tokens=4, recent_tokens=8, flush_tokens=4)
LENGTHS = (72, 24, 40)  # pads (0, 48, 32): far more than the windows, multiples of the demotion unit
NEW = 6


def ragged_batch(seed: int = 0) -> tuple[dict, list[torch.Tensor]]:
    """A left-padded batch of LENGTHS prompts, and each prompt alone."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, VOCAB, (n,), generator=g) for n in LENGTHS]
    width = max(LENGTHS)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return {"input_ids": ids, "attention_mask": mask}, rows


def cache_for(model, static: bool, **config) -> OscarQuantizedCache:
    rotations = OscarRotations.hadamard(model.config)
    return OscarQuantizedCache.from_pretrained(rotations, model=model, **WINDOWS, **config,
                                               max_cache_len=max(LENGTHS) + NEW if static else None)


def generated(model, inputs: dict, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """(new tokens [B, NEW], their logits [B, NEW, V]) of greedy generation."""
    out = model.generate(**inputs, cache=cache, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, -NEW:], torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("centering", [True, False], ids=["centered", "uncentered"])
def test_each_left_padded_row_equals_the_row_alone(static, centering):
    model = make_model("qwen2-gqa-bias-d64")
    batch, rows = ragged_batch()
    tokens, logits = generated(model, batch, cache_for(model, static, centering=centering))
    for i, row in enumerate(rows):
        alone = {"input_ids": row[None], "attention_mask": torch.ones(1, len(row), dtype=torch.long)}
        cache = cache_for(model, static, centering=centering)
        want_tokens, want_logits = generated(model, alone, cache)
        assert cache.layers[0].n_history > 0, "the row's tokens must reach the history"
        assert torch.equal(tokens[i], want_tokens[0]), i
        torch.testing.assert_close(logits[i], want_logits[0], atol=2e-4, rtol=1e-4)


def test_teacher_forced_rows_equal_the_rows_alone():
    """One forward over a padded batch (no generate), then one more token: each row's logits as the row alone."""
    model = make_model("llama-mha-d64")
    batch, rows = ragged_batch(seed=1)
    nxt = torch.randint(3, VOCAB, (len(rows), 1), generator=torch.Generator().manual_seed(2))
    cache = cache_for(model, static=False)
    position = batch["attention_mask"].cumsum(-1) - 1
    model(**batch, position_ids=position.clamp(min=0), cache=cache)
    mask = torch.cat([batch["attention_mask"], torch.ones_like(nxt)], dim=1)
    got = model(input_ids=nxt, attention_mask=mask, position_ids=position[:, -1:] + 1, cache=cache).logits
    for i, row in enumerate(rows):
        alone = cache_for(model, static=False)
        model(input_ids=row[None], cache=alone)
        want = model(input_ids=nxt[i : i + 1], cache=alone).logits
        assert alone.layers[0].n_history > 0
        torch.testing.assert_close(got[i], want[0], atol=2e-4, rtol=1e-4)


def test_padding_is_read_from_the_prompt_mask():
    mask = torch.ones(3, 1, 5, 5, dtype=torch.bool).tril()
    mask[1, ..., :2] = False
    padding = LeftPadding.of_prompt(mask, 5, sink_tokens=2)
    assert padding.pads.tolist() == [0, 2, 0] and padding.start.tolist() == [2, 2, 2]
    assert padding.index(6).tolist()[1] == [2, 3, 0, 1, 4, 5]  # own first two tokens, the pads, the rest
    assert LeftPadding.of_prompt(torch.ones(3, 1, 5, 5, dtype=torch.bool).tril(), 5, 2) is None  # no pads
    holes = torch.ones(1, 1, 5, 5, dtype=torch.bool)
    holes[..., 2] = False
    assert LeftPadding.of_prompt(holes, 5, 2) is None  # not left padding: stored as given


def test_graph_steps_read_a_padded_row_as_the_row_alone():
    """A static layer's device-only steps (the Triton append and decode kernels; Triton's interpreter on a CPU) read
    the attention mask in the stored order: each row of a padded bf16 batch decodes as the row alone."""
    pytest.importorskip("triton")
    from triton_interpreter import faster_triton_interpreter  # noqa: F401

    model = make_model("qwen3-gqa-qknorm-d128", dtype=torch.bfloat16, num_hidden_layers=1)
    batch, rows = ragged_batch(seed=3)

    def greedy(inputs):
        cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model, **WINDOWS,
                                                    backend="triton", max_cache_len=max(LENGTHS) + NEW)
        out = model.generate(**inputs, cache=cache, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True, disable_compile=True)
        assert cache.layers[0].graph_step and cache.layers[0].n_history > 0
        return out.sequences[:, -NEW:], torch.stack(out.logits, dim=1).float()

    tokens, logits = greedy(batch)
    for i, row in enumerate(rows):
        want_tokens, want_logits = greedy({"input_ids": row[None], "attention_mask": torch.ones_like(row)[None]})
        for step in range(NEW):  # until the tokens part (bf16 sums in another order can flip a near tie)
            torch.testing.assert_close(logits[i, step], want_logits[0, step], rtol=0, atol=0.05)
            if tokens[i, step] != want_tokens[0, step]:
                break


def test_a_layer_emptied_by_a_crop_forgets_the_padding():
    model = make_model("llama-mha-d64")
    batch, _ = ragged_batch()
    cache = cache_for(model, static=False)
    model(**batch, cache=cache)
    layer = cache.layers[0]
    assert layer._padding is not None
    layer.crop(-layer.get_seq_length())
    model(input_ids=batch["input_ids"][:, -1:], cache=cache)
    assert layer._padding is None and layer.get_seq_length() == 1
