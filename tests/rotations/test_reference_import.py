"""OscarRotations.from_reference: the OSCAR reference's rotation files (oscar_method.md §1.6), read safely."""

import pickle

import pytest
import torch
from helpers import make_model

from oscar_hf import OscarQuantizedCache, OscarRotations

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
