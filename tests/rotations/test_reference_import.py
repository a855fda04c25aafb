"""OscarRotations.from_reference: the OSCAR reference's rotation files (oscar_method.md §1.6; its per-head fitting
script's JSON; the optional q_rotation, o_rotation and k_mean), read safely."""

import json
import pickle

import pytest
import torch
from helpers import make_model

from oscar_hf import OscarConfig, OscarQuantizedCache, OscarRotations

LAYERS, DIM = 2, 128


def random_orthogonal(seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(LAYERS, DIM, DIM, generator=torch.Generator().manual_seed(seed))).Q


def reference_file(path, rotation, eigenvalues, objective="qqt_r_h_pbr", key=int):
    """``{"format_version": 1, "objective", "source_grouping": "layer", "layers": {i: {...}}}`` as torch.save'd."""
    layers = {key(i): {"layer_id": i, "rotation": r.float(), "eigenvalues": e.float()}
              for i, (r, e) in enumerate(zip(rotation, eigenvalues))}
    torch.save({"format_version": 1, "objective": objective, "source_grouping": "layer", "layers": layers}, path)
    return path


@pytest.fixture
def reference(tmp_path):
    """(K file, V file, their rotations and ascending eigenvalues)."""
    k, v = random_orthogonal(1), random_orthogonal(2)
    k_values, v_values = torch.rand(LAYERS, DIM).sort(-1).values, torch.rand(LAYERS, DIM).sort(-1).values
    k_file = reference_file(tmp_path / "k_rotation_qqt_r_h_pbr.pt", k, k_values)
    v_file = reference_file(tmp_path / "v_rotation_sst_r_h_pbr.pt", v, v_values, "sst_r_h_pbr", key=str)
    return k_file, v_file, (k, v, k_values, v_values)


def test_import_reference_files(reference):
    k_file, v_file, tensors = reference
    bundle = OscarRotations.from_reference(k_file, v_file, num_kv_heads=2, source_model="Qwen/Qwen3-4B")
    loaded = (bundle.key_rotation, bundle.value_rotation, bundle.key_eigenvalues, bundle.value_eigenvalues)
    for got, want in zip(loaded, tensors):
        assert torch.equal(got, want)
    assert (bundle.method, bundle.num_kv_heads, bundle.source_model) == ("oscar-reference", 2, "Qwen/Qwen3-4B")
    assert bundle.calibration["key_objective"] == "qqt_r_h_pbr"
    assert bundle.calibration["value_objective"] == "sst_r_h_pbr"
    cache = OscarQuantizedCache.from_pretrained(bundle, model=make_model("qwen3-gqa-qknorm-d128"))  # fits the model
    assert torch.equal(cache.layers[1].value_rotation, tensors[1][1])


def test_layers_are_read_in_numeric_order(tmp_path, reference):
    """Layer keys "10" < "2" as strings: the importer must sort them as numbers."""
    rotation = torch.linalg.qr(torch.randn(11, 8, 8, generator=torch.Generator().manual_seed(0))).Q
    values = torch.arange(11.0)[:, None].expand(11, 8)
    path = reference_file(tmp_path / "eleven.pt", rotation, values, key=str)
    bundle = OscarRotations.from_reference(path, path, num_kv_heads=1)
    assert torch.equal(bundle.key_rotation, rotation)
    assert bundle.key_eigenvalues[:, 0].tolist() == list(range(11))


def test_non_orthogonal_rotation_raises(tmp_path, reference):
    k_file, _, (k, v, k_values, v_values) = reference
    v = v.clone()
    v[1] *= 1.01
    bad = reference_file(tmp_path / "bad.pt", v, v_values)
    with pytest.raises(ValueError, match="value_rotation of layer 1 is not orthogonal"):
        OscarRotations.from_reference(k_file, bad, num_kv_heads=2)


@pytest.mark.parametrize("content", [
    pytest.param(torch.eye(4), id="a-tensor"),
    pytest.param({"format_version": 1, "rotation": torch.eye(4)}, id="no-layers"),
    pytest.param({"layers": {}}, id="empty-layers"),
    pytest.param({"layers": [torch.eye(4)]}, id="layers-not-a-dict"),
])
def test_not_a_reference_file_raises(tmp_path, reference, content):
    torch.save(content, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not an OSCAR reference rotation file"):
        OscarRotations.from_reference(tmp_path / "other.pt", reference[1], num_kv_heads=2)


def test_missing_layer_raises(tmp_path, reference):
    _, v_file, (k, _, k_values, _) = reference
    torch.save({"layers": {0: {"rotation": k[0], "eigenvalues": k_values[0]},
                           2: {"rotation": k[1], "eigenvalues": k_values[1]}}}, tmp_path / "gap.pt")
    with pytest.raises(ValueError, match=r"layer ids \[0, 2\]"):
        OscarRotations.from_reference(tmp_path / "gap.pt", v_file, num_kv_heads=2)


class Payload:
    """Unpickling this calls ``open(marker, "w")``: what an unsafe torch.load would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_arbitrary_pickled_objects_are_refused(tmp_path, reference):
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.pt"
    torch.save({"format_version": 1, "layers": {0: {"rotation": Payload(marker), "eigenvalues": torch.ones(4)}}}, path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        OscarRotations.from_reference(path, reference[1], num_kv_heads=2)
    assert not marker.exists()


def reference_file_v2(path, rotation, eigenvalues, ids):
    """A v2 (per KV head) file: ``rotation [len(ids), kv_heads, D, D]`` keyed by the global layer ``ids``."""
    layers = {i: {"layer_id": i, "rotation": r.float(), "eigenvalues": e.float()}
              for i, r, e in zip(ids, rotation, eigenvalues)}
    torch.save({"format_version": 2, "objective": "qqt_r_h_pbr", "source_grouping": "kv_head", "layers": layers}, path)
    return path


def interleaved_config():
    """Gemma-3-style: full attention at layers 2 and 5 of 6, the others sliding; 2 KV heads of 128."""
    import transformers

    return transformers.Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=DIM, sliding_window=8,
        layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"])


def test_v2_per_head_files_keyed_by_global_layer_ids(tmp_path):
    """Per-KV-head rotations of the full-attention layers only (ids 2 and 5) land at those layers, the sliding
    layers get the identity, and the bundle serves the model; a shared V file beside them is repeated per head."""
    config = interleaved_config()
    generator = torch.Generator().manual_seed(3)
    k = torch.linalg.qr(torch.randn(2, 2, DIM, DIM, generator=generator)).Q
    k_values = torch.rand(2, 2, DIM, generator=generator)
    k_file = reference_file_v2(tmp_path / "k.pt", k, k_values, [2, 5])
    v = random_orthogonal(4)
    v_layers = {i: {"layer_id": i, "rotation": r, "eigenvalues": torch.zeros(DIM)} for i, r in zip((2, 5), v)}
    torch.save({"format_version": 1, "objective": "sst_r_h_pbr", "layers": v_layers}, tmp_path / "v.pt")
    bundle = OscarRotations.from_reference(k_file, tmp_path / "v.pt", model_config=config)
    assert bundle.per_head and bundle.key_rotation.shape == (6, 2, DIM, DIM) and bundle.num_kv_heads == 2
    torch.testing.assert_close(bundle.key_rotation[[2, 5]], k)
    torch.testing.assert_close(bundle.key_eigenvalues[[2, 5]], k_values)
    assert torch.equal(bundle.key_rotation[0], torch.eye(DIM).expand(2, DIM, DIM))
    torch.testing.assert_close(bundle.value_rotation[5, 1], v[1])
    bundle.check_compatible(config)
    with pytest.raises(ValueError, match="pass model_config="):
        OscarRotations.from_reference(k_file, tmp_path / "v.pt", num_kv_heads=2)


def test_reference_ids_that_are_not_the_models_full_layers_are_refused(tmp_path):
    config = interleaved_config()
    k = random_orthogonal(5)
    layers = {i: {"layer_id": i, "rotation": r, "eigenvalues": torch.zeros(DIM)} for i, r in zip((1, 5), k)}
    torch.save({"format_version": 1, "objective": "qqt", "layers": layers}, tmp_path / "k.pt")
    with pytest.raises(ValueError, match=r"layer ids \[1, 5\] are neither the model's 6 layers nor its full-attention "
                                         r"layers \[2, 5\]"):
        OscarRotations.from_reference(tmp_path / "k.pt", tmp_path / "k.pt", model_config=config)
    per_head = torch.linalg.qr(torch.randn(2, 3, DIM, DIM, generator=torch.Generator().manual_seed(6))).Q
    reference_file_v2(tmp_path / "k3.pt", per_head, torch.zeros(2, 3, DIM), [2, 5])
    with pytest.raises(ValueError, match="per-head rotations for 3 KV heads; the model has 2"):
        OscarRotations.from_reference(tmp_path / "k3.pt", tmp_path / "k3.pt", model_config=config)
    torch.save({"format_version": 3, "layers": layers}, tmp_path / "v3.pt")
    with pytest.raises(ValueError, match="unsupported format_version 3"):
        OscarRotations.from_reference(tmp_path / "v3.pt", tmp_path / "v3.pt", model_config=config)


def test_files_for_a_model_with_per_layer_head_dims(tmp_path):
    """Gemma-4: the reference's files hold the full-attention layers (head_dim 32 here), keyed by global id; the
    sliding layers (head_dim 16) get identities of their own size, and a file of another head_dim is refused."""
    import transformers
    from helpers import VOCAB

    config = transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB)
    rotation = torch.linalg.qr(torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(0))).Q
    path = tmp_path / "k.pt"
    torch.save({"format_version": 1, "layers": {i: {"rotation": r, "eigenvalues": torch.zeros(32)}
                                                for i, r in zip((1, 3), rotation)}}, path)
    bundle = OscarRotations.from_reference(path, path, model_config=config)
    assert bundle.head_dims == (16, 32, 16, 32) and bundle.kv_heads == (2, 1, 2, 1)
    assert torch.equal(bundle.key_rotation[0], torch.eye(16)) and torch.equal(bundle.value_rotation[3], rotation[1])
    bundle.check_compatible(config)
    torch.save({"format_version": 1, "layers": {i: {"rotation": torch.eye(16), "eigenvalues": torch.zeros(16)}
                                                for i in (1, 3)}}, path)
    with pytest.raises(ValueError, match="layer 1's rotation is 16-dimensional; the model's layer 1 has head_dim 32"):
        OscarRotations.from_reference(path, path, model_config=config)


def per_head_json(path, rotation, **extra):
    """A file as the reference's per-head fitting script writes it: JSON, layer ids as strings, ``rotation``
    ``[H_kv][D][D]`` as nested lists, no eigenvalues; ``extra`` fields added to every layer entry."""
    layers = {str(i): {"layer_id": i, "rotation": r.tolist(), **{k: v[i] for k, v in extra.items()}}
              for i, r in enumerate(rotation)}
    path.write_text(json.dumps({"format_version": 2, "objective": "cov_eig_hadamard_perhead",
                                "source_grouping": "per_kv_head", "layers": layers}))
    return path


def per_head_rotations(seed: int) -> torch.Tensor:
    """``[2 layers, 2 KV heads, 64, 64]``: llama-mha-d64's geometry."""
    return torch.linalg.qr(torch.randn(2, 2, 64, 64, generator=torch.Generator().manual_seed(seed))).Q


def test_per_head_json_files_without_eigenvalues_serve_a_cache(tmp_path):
    model = make_model("llama-mha-d64")
    k, v = per_head_rotations(7), per_head_rotations(8)
    bundle = OscarRotations.from_reference(per_head_json(tmp_path / "k.json", k), per_head_json(tmp_path / "v.json", v),
                                           model_config=model.config)
    assert bundle.per_head and bundle.key_rotation.shape == (2, 2, 64, 64)
    assert torch.equal(bundle.key_rotation, k) and torch.equal(bundle.value_rotation, v)
    assert torch.equal(bundle.key_eigenvalues, torch.zeros(2, 2, 64)) and bundle.config is None
    assert bundle.calibration["key_objective"] == "cov_eig_hadamard_perhead"
    cache = OscarQuantizedCache.from_pretrained(bundle, model=model)
    assert torch.equal(cache.layers[1].value_rotation, v[1])


@pytest.mark.parametrize("name", ["q_rotation", "o_rotation"])
def test_q_and_o_rotations_are_read_and_must_be_the_identity(tmp_path, name):
    """The cache applies K's rotation to Q and V's inverse to the output, no other: an identity (or null) is taken,
    anything else refused by name rather than dropped."""
    config = make_model("llama-mha-d64").config
    k, v = per_head_rotations(7), per_head_rotations(8)
    v_file = per_head_json(tmp_path / "v.json", v)
    identity = per_head_json(tmp_path / "k.json", k, **{name: [torch.eye(64).expand(2, 64, 64).tolist(), None]})
    assert torch.equal(OscarRotations.from_reference(identity, v_file, model_config=config).key_rotation, k)
    rotated = per_head_json(tmp_path / "k.json", k, **{name: [torch.eye(64).tolist(), k[1, 0].tolist()]})
    with pytest.raises(ValueError, match=rf"k.json: layer 1's {name} is not the identity"):
        OscarRotations.from_reference(rotated, v_file, model_config=config)
    torch.save({"format_version": 1, name: torch.eye(64).flip(0),
                "layers": {i: {"rotation": torch.eye(64), "eigenvalues": torch.zeros(64)} for i in range(2)}},
               tmp_path / "k.pt")
    with pytest.raises(ValueError, match=rf"k.pt: the file's {name} is not the identity"):
        OscarRotations.from_reference(tmp_path / "k.pt", v_file, model_config=config)


def test_k_mean_becomes_the_caches_per_sequence_key_centering(tmp_path):
    """A fixed key mean maps to OscarConfig.centering (each sequence's own mean), recorded in the bundle, which
    serves a cache that centers K."""
    model = make_model("llama-mha-d64")
    k, v = per_head_rotations(7), per_head_rotations(8)
    k_file = per_head_json(tmp_path / "k.json", k, k_mean=torch.randn(2, 2, 64).tolist())
    bundle = OscarRotations.from_reference(k_file, per_head_json(tmp_path / "v.json", v), model_config=model.config)
    assert bundle.config == OscarConfig(centering=True) and "k_mean" in bundle.calibration["key_centering"]
    assert "key" in OscarQuantizedCache.from_pretrained(bundle, model=model).config.centered_sides
    per_head_json(k_file, k, k_mean=[[[1.0, 2.0], [3.0]], [[0.0]]])
    with pytest.raises(ValueError, match="k.json: layer 0's k_mean is not a numeric array"):
        OscarRotations.from_reference(k_file, tmp_path / "v.json", model_config=model.config)


@pytest.mark.parametrize("content, match", [
    pytest.param('{"format_version": 2, "layers": {"0": ', "k.json is not valid JSON", id="truncated"),
    pytest.param('{"layers": {"0": {"rotation": [[1.0, 0.0], [0.0]]}}}', "k.json: layer 0's rotation is not a "
                 "numeric array", id="ragged"),
    pytest.param('{"layers": {"first": {"rotation": [[1.0]]}}}', "k.json: layer ids must be integers", id="ids"),
    pytest.param('{"layers": {"0": {"eigenvalues": [1.0]}}}', "k.json: every layer entry needs a 'rotation'",
                 id="no-rotation"),
])
def test_a_malformed_json_file_names_the_file_and_the_field(tmp_path, content, match):
    (tmp_path / "k.json").write_text(content)
    with pytest.raises(ValueError, match=match):
        OscarRotations.from_reference(tmp_path / "k.json", tmp_path / "k.json", num_kv_heads=2)
