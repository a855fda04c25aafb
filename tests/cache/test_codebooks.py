"""Product-quantized keys (oscar_hf.codebooks): the codebook's encode and decode, its training, the "product" K layout
in the cache, the bundle's codebook file, and the config's and the registry's rules for it."""

import json
import math

import pytest
import torch
from helpers import make_model, prompt, quick_calibrate, token_ids

import oscar_hf
from oscar_hf import OscarConfig, OscarQuantizedCache, OscarRotations
from oscar_hf.cli import main
from oscar_hf.codebooks import CENTROIDS, KeyCodebook, fit_codebook
from oscar_hf.diagnostics import diagnose
from oscar_hf.evaluation import METHODS, make_cache
from oscar_hf.kernels.dequantize.reference import unrotate

ARCH = "qwen2-gqa-bias-d64"  # 4 query / 2 KV heads, head_dim 64
WINDOWS = OscarConfig(sink_tokens=4, recent_tokens=8)


def product(bits: int, **fields) -> OscarConfig:
    return WINDOWS.replace(key_quantization="product", key_bits=bits, k_clip=1.0, **fields)


def random_codebook(heads: int, dim: int, bits: int, seed: int = 0) -> KeyCodebook:
    g = torch.Generator().manual_seed(seed)
    sub = 8 // bits
    basis = torch.linalg.qr(torch.randn(heads, dim, dim, generator=g, dtype=torch.float64))[0].float()
    weight = torch.rand(heads, dim, generator=g) + 0.5
    return KeyCodebook(torch.randn(heads, dim // sub, CENTROIDS, sub, generator=g), basis, weight)


@pytest.fixture(scope="module")
def calibrated():
    model = make_model(ARCH)
    rotations = quick_calibrate(model, token_ids(8, 128), num_tokens=1024, max_length=128, config=WINDOWS,
                                key_codebook_bits=[1, 2])
    oscar_hf.enable(model)
    return model, rotations


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("heads", [1, 2])
def test_keys_made_of_centroids_encode_to_their_codes_and_decode_back(bits, heads):
    """Keys built from known codes (the centroids mapped back through the basis and weights) encode to exactly those
    codes, and decode to the keys; a code row is one byte per subspace of 8 / bits channels."""
    book = random_codebook(heads, 64, bits)
    codes = torch.randint(0, CENTROIDS, (2, 2, 37, 64 * bits // 8), generator=torch.Generator().manual_seed(1))
    keys = book.decode(codes.to(torch.uint8))
    assert keys.shape == (2, 2, 37, 64) and book.bits == bits
    assert torch.equal(book.encode(keys), codes.to(torch.uint8))
    # by hand: centroid of each subspace, divided by the weights, rotated back by the basis
    head = torch.arange(2)[:, None, None] if heads > 1 else 0
    z = book.centroids[head, torch.arange(64 * bits // 8), codes].flatten(-2) / book.weight[:, None, :]
    torch.testing.assert_close(keys, z @ book.basis.mT)


def test_encoding_picks_the_nearest_centroid_in_the_weighted_basis():
    """Off the centroids, a key takes the centroid nearest in ``(x @ B) · w`` (brute force over every centroid)."""
    book = random_codebook(1, 64, 2)
    keys = torch.randn(1, 1, 50, 64)
    codes = book.encode(keys).long()
    z = ((keys @ book.basis) * book.weight).unflatten(-1, (16, 4))[0, 0]  # [50, 16, 4]
    distance = ((z[:, :, None, :] - book.centroids[0][None]) ** 2).sum(-1)  # [50, 16, 256]
    assert torch.equal(codes[0, 0], distance.argmin(-1))
    with pytest.raises(ValueError, match="NaN or inf"):
        book.encode(torch.full((1, 1, 2, 64), math.nan))
    with pytest.raises(ValueError, match="does not fit"):
        book.encode(torch.randn(1, 1, 2, 128))


def test_fitting_recovers_clustered_keys_and_two_bits_beat_one():
    """On keys drawn around 256 points per 4-channel subspace (each subspace's spread apart from the others', so that
    the codebook's eigenbasis keeps them apart), the 2-bit codebook finds the clusters, and it is far more exact than
    the 1-bit one on the same keys."""
    g = torch.Generator().manual_seed(0)
    spread = 1.5 ** -torch.arange(16.0)
    centers = torch.randn(16, CENTROIDS, 4, generator=g) * spread[:, None, None]
    pick = torch.randint(0, CENTROIDS, (6000, 16), generator=g)
    keys = centers[torch.arange(16), pick].flatten(1) + 1e-3 * torch.randn(6000, 64, generator=g)
    errors = {}
    for bits in (1, 2):
        book = fit_codebook(keys[None], torch.eye(64)[None], bits)
        back = book.decode(book.encode(keys[None, None]))[0, 0]
        errors[bits] = float(((back - keys) ** 2).sum() / (keys**2).sum())
    assert errors[2] < 0.02 and errors[1] > 5 * errors[2]
    with pytest.raises(ValueError, match="at least 256 keys"):
        fit_codebook(keys[None, :100], torch.eye(64)[None], 2)
    with pytest.raises(ValueError, match="1 or 2 bits"):
        fit_codebook(keys[None], torch.eye(64)[None], 4)


def test_the_config_rules_for_product_keys():
    assert product(1).side_bits == {"key": 1, "value": 2}
    assert product(2).bits_per_element(64) == pytest.approx((2 + 2 + 32 / 64) / 2)  # no K scale: 2.25
    assert product(1).bits_per_element(64) == pytest.approx(1.75)
    with pytest.raises(ValueError, match="k_clip"):
        WINDOWS.replace(key_quantization="product", key_bits=1)
    with pytest.raises(ValueError, match="key_bits"):
        product(4)
    with pytest.raises(ValueError, match="centering"):
        product(1, centering=False)  # the codebooks are trained on centered keys
    with pytest.raises(ValueError, match="key_bits"):
        OscarConfig(key_bits=1)  # 1-bit K is product-quantized only
    with pytest.raises(ValueError, match="bits"):
        WINDOWS.replace(key_quantization="product", k_clip=1.0, bits=4)  # K would take V's 4 bits


def test_the_cache_stores_product_keys_as_codes_and_reads_them_through_the_codebook(calibrated):
    """After a prompt, the history's K is one byte per subspace and no scale; the keys the cache reads back are the
    rotated keys, centered on the history's mean, through the codebook, plus the mean, rotated back; V is as in the
    default layout; the history costs 1.75 / 2.25 bits per element."""
    model, rotations = calibrated
    inputs = prompt(1, 100)
    captured = {}
    hook = model.model.layers[1].self_attn.k_proj.register_forward_hook(lambda m, i, o: captured.update(k=o))
    for bits in (1, 2):
        cache = OscarQuantizedCache(model.config, rotations, product(bits))
        with torch.no_grad():
            model(**inputs, past_key_values=cache, use_cache=True)
        layer = cache.layers[1]
        n_sink, n_hist = layer.n_sink, layer.n_history
        assert layer.history["key_codes"][:, :, :n_hist].shape == (1, 2, n_hist, 64 * bits // 8) and n_hist == 88
        assert layer.history["key_scale"].shape[-1] == 0
        # the keys as the model made them (post-RoPE: taken from the cache's own sink and recent windows would skip
        # the history), so rebuild them from the layer's materialized sequence's windows and the hook's projection
        keys = layer.materialize("key").float()
        rotation = rotations.key_rotation[1]
        book = rotations.key_codebook(1, bits)
        rope_keys = _post_rope_keys(model, captured["k"], inputs, layer=1)
        history = rope_keys[:, :, n_sink : n_sink + n_hist] @ rotation
        mean = history.mean(dim=2, keepdim=True)
        expected = unrotate(book.decode(book.encode(history - mean)) + mean, rotation)
        torch.testing.assert_close(keys[:, :, n_sink : n_sink + n_hist], expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(keys[:, :, :n_sink], rope_keys[:, :, :n_sink])
        stored, elements = layer.history_bits_and_elements()
        assert stored / elements == pytest.approx((bits + 2.5) / 2 + 2 * 32 * 64 * 2 / (2 * 2 * n_hist * 64))
    hook.remove()


def _post_rope_keys(model, projected, inputs, layer):
    """Post-RoPE keys ``[B, H, T, D]`` of a Qwen2 layer from its k_proj output."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    b, t, _ = projected.shape
    k = projected.view(b, t, -1, 64).transpose(1, 2)
    positions = torch.arange(t)[None]
    cos, sin = model.model.rotary_emb(k, positions)
    _, k = apply_rotary_pos_emb(k, k, cos, sin)
    return k.float()


def test_decoding_through_product_keys_tracks_the_default_cache(calibrated):
    """Teacher-forced steps after a prompt whose middle reaches the history: 2-bit product keys stay closer to the
    default cache's logits than 1-bit ones, and both run to the end (the attention reads the codebook)."""
    model, rotations = calibrated
    inputs = prompt(1, 100)
    steps = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(3))
    full = torch.cat([inputs["input_ids"], steps], dim=1)
    with torch.no_grad():
        reference = model(input_ids=full).logits[:, 100:]
        errors = {}
        for bits in (1, 2):
            cache = OscarQuantizedCache(model.config, rotations, product(bits))
            model(**inputs, past_key_values=cache, use_cache=True)
            logits = torch.cat([model(input_ids=steps[:, i : i + 1], past_key_values=cache, use_cache=True).logits
                                for i in range(6)], dim=1)
            errors[bits] = float((logits - reference).abs().max())
    assert 0 < errors[2] < errors[1]


def test_the_bundle_saves_and_loads_its_codebooks(calibrated, tmp_path):
    model, rotations = calibrated
    rotations.save_pretrained(tmp_path / "b")
    assert json.loads((tmp_path / "b" / "oscar_config.json").read_text())["key_codebook_bits"] == [1, 2]
    loaded = OscarRotations.from_pretrained(tmp_path / "b")
    for bits in (1, 2):
        for i in range(2):
            for name, t in rotations.key_codebook(i, bits).tensors().items():
                assert torch.equal(loaded.key_codebook(i, bits).tensors()[name], t), name
    (tmp_path / "b" / "codebooks.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"lists key codebooks of \[1, 2\] bits, but the bundle has no codeb"):
        OscarRotations.from_pretrained(tmp_path / "b")
    plain = OscarRotations(rotations.key_rotation, rotations.value_rotation, num_kv_heads=2)
    with pytest.raises(ValueError, match="no 1-bit key codebook for layer 0"):
        OscarQuantizedCache(model.config, plain, product(1))
    with pytest.raises(ValueError, match="does not fit"):
        OscarRotations(rotations.key_rotation, rotations.value_rotation, num_kv_heads=2,
                       key_codebooks={1: [random_codebook(1, 128, 1)] * 2})
    with pytest.raises(ValueError, match="1 and 2"):
        quick_calibrate(model, token_ids(2, 128), key_codebook_bits=[3])


def test_diagnostics_measure_product_keys(calibrated):
    model, rotations = calibrated
    held_out = list(token_ids(2, 128, seed=5))
    rows = {bits: diagnose(model, rotations, held_out, product(bits)) for bits in (1, 2)}
    for i in range(2):
        assert 0 < rows[2][i]["k_error"] < rows[1][i]["k_error"]
        assert rows[1][i]["v_error"] == pytest.approx(rows[2][i]["v_error"])


def test_the_registry_methods_need_the_codebooks(calibrated):
    model, rotations = calibrated
    for name, bits in (("oscar-pq1", 1), ("oscar-pq2", 2)):
        cache = make_cache(name, model, rotations)
        assert cache.config.key_quantization == "product" and cache.config.side_bits["key"] == bits
        plain = OscarRotations(rotations.key_rotation, rotations.value_rotation, num_kv_heads=2)
        assert METHODS[name].unmet(plain) == (f"method {name!r} needs a bundle with {bits}-bit key codebooks "
                                              f"(oscar-hf calibrate --key-codebooks {bits})")


def test_per_head_codebooks_follow_the_heads_of_a_tensor_parallel_rank(calibrated):
    """With per-KV-head codebooks, rank 1 of 2 keeps the codebook of its own head (the second)."""
    model, rotations = calibrated
    books = [random_codebook(2, 64, 2, seed=i) for i in range(2)]
    per_head = OscarRotations(rotations.key_rotation, rotations.value_rotation, num_kv_heads=2,
                              key_codebooks={2: books})
    cache = OscarQuantizedCache(model.config, per_head, product(2), tensor_parallel=(1, 2))
    layer = cache.layers[0]
    layer.lazy_initialization(torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 1, 64))
    assert torch.equal(layer.key_codebook.centroids, books[0].centroids[1:])


def test_cli_calibrate_trains_codebooks_and_info_shows_them(tmp_path, monkeypatch, capsys):
    from oscar_hf import cli

    model = make_model(ARCH)
    monkeypatch.setattr(cli, "load_model", lambda name, dtype: (model, None))
    monkeypatch.setattr(cli, "load_texts", lambda data: [token_ids(4, 128)])
    main(["calibrate", "tiny", "--recipe", "none", "--num-tokens", "384", "--max-length", "128",
          "--diagnostic-tokens", "128", "--no-choose-layout", "--key-codebooks", "1", "--out", str(tmp_path / "b")])
    bundle = OscarRotations.from_pretrained(tmp_path / "b")
    assert sorted(bundle.key_codebooks) == [1] and bundle.key_codebook(1, 1).bits == 1
    capsys.readouterr()
    main(["info", str(tmp_path / "b")])
    assert "key codebooks: 1-bit (one per layer;" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["calibrate", "tiny", "--key-codebooks", "3", "--out", str(tmp_path / "c")])


def test_cli_eval_on_demand_trains_the_codebooks_its_methods_read(tmp_path, monkeypatch):
    """``oscar-hf eval --rotations auto`` (the default) with a product-key method makes its bundle with that method's
    codebooks; without one, with none; an explicit bundle without them is refused before the model loads."""
    from oscar_hf import autocalibrate, cli
    from oscar_hf.evaluation import runner

    model = make_model(ARCH)
    asked = []
    monkeypatch.setattr(cli, "load_model", lambda name, dtype: (model, "tokenizer"))
    monkeypatch.setattr(runner, "run_eval", lambda *args, **kwargs: None)
    monkeypatch.setattr(autocalibrate, "rotations_for_model", lambda model, tokenizer, **kwargs: asked.append(kwargs)
                        or OscarRotations.hadamard(model.config))
    main(["eval", "--model", "m", "--out", str(tmp_path), "--methods", "oscar,oscar-pq1"])
    main(["eval", "--model", "m", "--out", str(tmp_path), "--methods", "oscar"])
    assert asked == [{"key_codebook_bits": [1]}, {"key_codebook_bits": []}]
    OscarRotations.hadamard(model.config).save_pretrained(tmp_path / "plain")
    monkeypatch.setattr(cli, "load_model", lambda name, dtype: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit):
        main(["eval", "--model", "m", "--out", str(tmp_path), "--methods", "oscar-pq2", "--rotations",
              str(tmp_path / "plain")])


def test_calibration_trains_codebooks_in_the_chosen_layouts_basis_and_refuses_too_short_chunks():
    """With choose_layout, the codebooks are trained after the choice, in the K basis of the bundle it returns (the
    identity where per-channel K wins), so that a product-key cache reads them; chunks that end inside the sink leave
    no keys to train on, and calibration says so."""
    from oscar_hf import layout_choice

    model = make_model(ARCH)
    rotations = quick_calibrate(model, token_ids(4, 256), num_tokens=768, max_length=256, diagnostic_tokens=256,
                                config=WINDOWS, choose_layout=True, key_codebook_bits=[2])
    chosen = layout_choice.LAYOUTS
    assert rotations.calibration["layout"]["chosen"] in {c.name for c in chosen}
    assert rotations.calibration["key_codebook_bits"] == [2] and all(rotations.key_codebooks[2])
    oscar_hf.enable(model)
    cache = make_cache("oscar-pq2", model, rotations)
    with torch.no_grad():
        model(**prompt(1, 100), past_key_values=cache, use_cache=True)
    assert cache.layers[0].n_history > 0
    with pytest.raises(ValueError, match="no keys past the first 64 tokens"):
        quick_calibrate(model, token_ids(4, 64), num_tokens=256, key_codebook_bits=[1])
    with pytest.raises(ValueError, match="choose_layout"):
        quick_calibrate(model, token_ids(4, 64), num_tokens=256, config=product(1), choose_layout=True,
                        diagnostic_tokens=64)
