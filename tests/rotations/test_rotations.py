"""oscar_hf.rotations: data-free bundles, save/load (local, subfolder, Hub cache; atomic saves),
validation of the files read."""

import copy
import functools
import hashlib
import json
import logging
import os
import stat
import time
from pathlib import Path

import huggingface_hub
import pytest
import torch
from helpers import make_model
from safetensors.torch import load_file

import oscar_hf.rotations
from oscar_hf import OscarQuantizedCache
from oscar_hf.config import OscarConfig
from oscar_hf.rotations import OscarRotations, hadamard_matrix, remove_stale_temporaries

TENSOR_NAMES = ("key_rotation", "value_rotation", "key_eigenvalues", "value_eigenvalues")


def random_orthogonal(layers: int, dim: int, seed: int, heads: int | None = None) -> torch.Tensor:
    """``[layers, D, D]``, or ``[layers, heads, D, D]`` (one per KV head)."""
    shape = (layers, dim, dim) if heads is None else (layers, heads, dim, dim)
    q = torch.linalg.qr(torch.randn(shape, generator=torch.Generator().manual_seed(seed))).Q
    return q.contiguous()


def random_bundle(layers: int = 2, dim: int = 64, per_head: bool = False) -> OscarRotations:
    generator = torch.Generator().manual_seed(dim)
    heads = 2 if per_head else None
    values = (layers, dim) if heads is None else (layers, heads, dim)
    return OscarRotations(
        random_orthogonal(layers, dim, seed=1, heads=heads),
        random_orthogonal(layers, dim, seed=2, heads=heads),
        num_kv_heads=2,
        key_eigenvalues=torch.rand(values, generator=generator),
        value_eigenvalues=torch.rand(values, generator=generator),
        source_model="org/tiny-model",
        method="oscar",
        calibration={"dataset": "wikitext-2", "tokens": 4096, "targets": ["k", "v"]},
        config=OscarConfig(bits=4, group_size=32, k_clip=1.0, scale_dtype="float32"),
    )


def assert_same_bundle(loaded: OscarRotations, saved: OscarRotations):
    for name in TENSOR_NAMES:
        assert torch.equal(getattr(loaded, name), getattr(saved, name)), name
    for name in ("num_kv_heads", "source_model", "method", "calibration", "config", "per_head"):
        assert getattr(loaded, name) == getattr(saved, name), name


# ------------------------------------------------------------------------------------- data-free bundles
@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("qwen3-gqa-qknorm-d128", 128, 2), id="qwen3-D128-kv2"),
        pytest.param(("mistral-gqa-d64", 64, 1), id="mistral-D64-kv1"),
    ],
)
def tiny(request):
    arch, head_dim, kv_heads = request.param
    return make_model(arch).config, head_dim, kv_heads


@pytest.mark.parametrize("method", ["identity", "hadamard"])
def test_data_free_bundles(tiny, method):
    config, head_dim, kv_heads = tiny
    bundle = getattr(OscarRotations, method)(config)
    matrix = torch.eye(head_dim) if method == "identity" else hadamard_matrix(head_dim).float()
    assert (bundle.method, bundle.num_layers, bundle.head_dim, bundle.num_kv_heads) == (method, 2, head_dim, kv_heads)
    for rotation in (bundle.key_rotation, bundle.value_rotation):
        assert rotation.dtype == torch.float32 and rotation.shape == (2, head_dim, head_dim)
        assert torch.equal(rotation, matrix.expand(2, -1, -1))
    assert torch.equal(bundle.key_eigenvalues, torch.zeros(2, head_dim))
    assert not bundle.per_head and bundle.format_version == 1
    bundle.check_compatible(config)


@pytest.mark.parametrize(
    "field, value, name",
    [
        pytest.param("num_hidden_layers", 3, "num_layers", id="num_layers"),
        pytest.param("head_dim", 64, "head_dim", id="head_dim"),
        pytest.param("num_key_value_heads", 1, "num_kv_heads", id="num_kv_heads"),
    ],
)
def test_check_compatible_names_the_mismatch(field, value, name):
    config = make_model("qwen3-gqa-qknorm-d128").config
    bundle = OscarRotations.identity(config)
    other = copy.deepcopy(config)
    setattr(other, field, value)
    with pytest.raises(ValueError, match=rf"\b{name} is"):
        bundle.check_compatible(other)


def test_per_head_bundle_checks_its_kv_heads():
    """Per-KV-head rotations ``[L, H, D, D]``: H must be the bundle's KV heads, and the model's."""
    config = make_model("qwen3-gqa-qknorm-d128").config  # 2 KV heads
    rotation = torch.eye(128).expand(2, 2, 128, 128)
    bundle = OscarRotations(rotation, rotation, num_kv_heads=2)
    assert bundle.per_head and bundle.format_version == 2 and bundle.key_eigenvalues.shape == (2, 2, 128)
    bundle.check_compatible(config)
    with pytest.raises(ValueError, match="have 2 heads, but num_kv_heads is 1"):
        OscarRotations(rotation, rotation, num_kv_heads=1)
    one_head = torch.eye(128).expand(2, 1, 128, 128)
    other = copy.deepcopy(config)
    other.num_key_value_heads = 1
    OscarRotations(one_head, one_head, num_kv_heads=1).check_compatible(other)
    with pytest.raises(ValueError, match=r"\bnum_kv_heads is 1 in the bundle .* but 2"):
        OscarRotations(one_head, one_head, num_kv_heads=1).check_compatible(config)


# ------------------------------------------------------------------------------------------ save / load
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_save_load_round_trip(tmp_path, per_head):
    """Shared bundles are written as format_version 1 (as before per-head rotations), per-head ones as 2."""
    bundle = random_bundle(per_head=per_head)
    bundle.save_pretrained(tmp_path / "bundle")
    assert sorted(os.listdir(tmp_path / "bundle")) == ["README.md", "oscar_config.json", "rotations.safetensors"]
    tensors = load_file(tmp_path / "bundle" / "rotations.safetensors")
    assert sorted(tensors) == sorted(TENSOR_NAMES)
    assert tensors["key_rotation"].shape == ((2, 2, 64, 64) if per_head else (2, 64, 64))
    metadata = json.loads((tmp_path / "bundle" / "oscar_config.json").read_text())
    assert metadata["format_version"] == (2 if per_head else 1) and metadata["per_head"] is per_head
    loaded = OscarRotations.from_pretrained(tmp_path / "bundle")
    assert_same_bundle(loaded, bundle)
    assert loaded.per_head is per_head


def test_a_save_replaces_the_whole_bundle_with_a_plain_folders_permissions(tmp_path):
    """A second save into a folder leaves none of the first bundle's files (a Hadamard bundle over a calibrated one
    reloads without its diagnostics), and the folder and files get a plain mkdir's and open's modes (umask 022), not
    the temporary folder's 0o700; no hidden folder stays beside it."""
    path = tmp_path / "bundle"
    calibrated = random_bundle()
    calibrated.diagnostics = [{"layer": 0, "k_error": 0.1}]
    calibrated.save_pretrained(path)
    assert (path / "diagnostics.json").is_file()
    umask = os.umask(0o022)
    try:
        OscarRotations.hadamard(_tiny_config(num_key_value_heads=2)).save_pretrained(path)
    finally:
        os.umask(umask)
    assert sorted(os.listdir(path)) == ["README.md", "oscar_config.json", "rotations.safetensors"]
    loaded = OscarRotations.from_pretrained(path)
    assert loaded.method == "hadamard" and loaded.diagnostics is None
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    assert {stat.S_IMODE(f.stat().st_mode) for f in path.iterdir()} == {0o644}
    assert os.listdir(tmp_path) == ["bundle"]


def test_an_interrupted_save_leaves_the_bundle_as_it_was(tmp_path, monkeypatch):
    """Killed after the new rotations.safetensors is written, a save leaves the old bundle whole (not the new rotations
    beside the old oscar_config.json), and cleans up after itself."""
    path = tmp_path / "bundle"
    old = random_bundle()
    old.save_pretrained(path)
    real_save_file = oscar_hf.rotations.save_file

    def killed_after_writing(*args, **kwargs):
        real_save_file(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(oscar_hf.rotations, "save_file", killed_after_writing)
    with pytest.raises(KeyboardInterrupt):
        OscarRotations.hadamard(_tiny_config(num_key_value_heads=2)).save_pretrained(path)
    assert_same_bundle(OscarRotations.from_pretrained(path), old)
    assert os.listdir(tmp_path) == ["bundle"]


def test_saving_over_a_folder_of_other_files_is_refused(tmp_path):
    """A model folder is not replaced by a bundle: its files stay, and the error names them."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(FileExistsError, match=r"not a rotation bundle's \(config.json, model.safetensors\)"):
        random_bundle().save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == b"weights"


def test_remove_stale_temporaries_removes_old_hidden_save_folders_only(tmp_path):
    """What killed saves leave (``.<name>.oscar-tmp-*``, with a renamed-aside old bundle) goes once older than the
    limit; a young one (a save under way), the bundle itself and other hidden folders stay."""
    stale = [tmp_path / ".bundle.oscar-tmp-k1ll3d", tmp_path / ".bundle.oscar-tmp-k1ll3d-old"]
    young, other = tmp_path / ".bundle.oscar-tmp-wr1t1ng", tmp_path / ".git"
    for folder in (*stale, young, other, tmp_path / "bundle"):
        folder.mkdir()
        (folder / "rotations.safetensors").write_bytes(b"partial")
    hour_ago = time.time() - 3600
    for folder in (*stale, other):
        os.utime(folder, (hour_ago, hour_ago))
    assert sorted(remove_stale_temporaries(tmp_path, older_than_s=600)) == sorted(stale)
    assert sorted(os.listdir(tmp_path)) == [".bundle.oscar-tmp-wr1t1ng", ".git", "bundle"]
    assert remove_stale_temporaries(tmp_path / "missing") == []


def test_a_bundle_in_the_first_format_loads(tmp_path):
    """A bundle as format_version 1 wrote it (no per_head field, rotations [L, D, D]) loads, and serves a cache; a
    version-1 file with per-head tensors is refused."""
    from safetensors.torch import save_file

    model = make_model("llama-mha-d64")  # 2 layers, 2 KV heads, head_dim 64
    rotation = random_orthogonal(2, 64, seed=4)
    metadata = {"format_version": 1, "library": "oscar_hf", "method": "oscar", "source_model": "org/tiny",
                "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "calibration": {"tokens": 10}, "config": None}
    (tmp_path / "oscar_config.json").write_text(json.dumps(metadata))
    save_file({"key_rotation": rotation, "value_rotation": rotation.mT.contiguous(),
               "key_eigenvalues": torch.zeros(2, 64), "value_eigenvalues": torch.zeros(2, 64)},
              str(tmp_path / "rotations.safetensors"), metadata={"format_version": "1"})
    bundle = OscarRotations.from_pretrained(tmp_path)
    assert not bundle.per_head and bundle.calibration == {"tokens": 10}
    assert torch.equal(bundle.key_rotation, rotation) and torch.equal(bundle.value_rotation, rotation.mT)
    cache = OscarQuantizedCache.from_pretrained(tmp_path, model=model)
    assert torch.equal(cache.layers[1].key_rotation, rotation[1])
    per_head = rotation[:, None].expand(2, 2, 64, 64).contiguous()
    save_file({"key_rotation": per_head, "value_rotation": per_head.clone()}, str(tmp_path / "rotations.safetensors"))
    with pytest.raises(ValueError, match="format_version 1 holds rotations"):
        OscarRotations.from_pretrained(tmp_path)


def test_a_cache_from_a_per_head_bundle_gives_each_layer_its_heads_rotations():
    model = make_model("llama-mha-d64")
    bundle = random_bundle(per_head=True)
    cache = OscarQuantizedCache.from_pretrained(bundle, model=model)
    for i, layer in enumerate(cache.layers):
        assert torch.equal(layer.key_rotation, bundle.key_rotation[i]) and layer.key_rotation.shape == (2, 64, 64)
        assert layer.rotates_keys and layer.rotates_values
    identity = OscarRotations(torch.eye(64).expand(2, 2, 64, 64), torch.eye(64).expand(2, 2, 64, 64), num_kv_heads=2)
    layer = OscarQuantizedCache.from_pretrained(identity, model=model).layers[0]
    assert not layer.rotates_keys and not layer.rotates_values  # an identity per head costs no GEMM either


def test_same_rotation_for_keys_and_values_saves(tmp_path):
    rotation = random_orthogonal(2, 64, seed=3)
    bundle = OscarRotations(rotation, rotation, num_kv_heads=2)
    bundle.save_pretrained(tmp_path)
    assert_same_bundle(OscarRotations.from_pretrained(tmp_path), bundle)


def test_load_from_subfolder(tmp_path):
    bundle = random_bundle()
    bundle.save_pretrained(tmp_path / "qwen3-tiny")
    assert_same_bundle(OscarRotations.from_pretrained(tmp_path, subfolder="qwen3-tiny"), bundle)


def fill_hub_cache(cache: Path, repo_id: str, folder: Path, ref: str) -> str:
    """Store ``folder`` as a snapshot of the model repo ``repo_id`` in the Hugging Face cache folder ``cache``, in
    huggingface_hub's layout (blobs named by their hash, the snapshot's files symlinks to them, ``refs/<ref>``
    naming the commit), as a download would leave it; return the commit hash."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    files = {f.relative_to(folder).as_posix(): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}
    commit = hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return commit


def test_load_from_offline_hub_cache(tmp_path, monkeypatch):
    """With HF_HUB_OFFLINE=1, a RotationZoo repo in the local Hugging Face cache loads by repo id, subfolder and
    revision (a branch or tag, or a commit hash), into OscarRotations and into OscarQuantizedCache (from the default
    cache folder); a subfolder or a repo missing from the cache fails at once, naming both."""
    assert huggingface_hub.constants.HF_HUB_OFFLINE  # set by conftest before huggingface_hub was imported
    monkeypatch.chdir(tmp_path)  # "org/rotation-zoo" must not resolve to a local folder
    hub = tmp_path / "hub"
    model = make_model("llama-mha-d64")  # 2 layers, 2 KV heads, head_dim 64: random_bundle's shapes
    main, v2 = random_bundle(), OscarRotations.hadamard(model.config)
    main.save_pretrained(tmp_path / "main" / "llama-tiny")
    v2.save_pretrained(tmp_path / "v2" / "llama-tiny")
    fill_hub_cache(hub, "org/rotation-zoo", tmp_path / "main", "main")
    commit = fill_hub_cache(hub, "org/rotation-zoo", tmp_path / "v2", "v2")
    (cached,) = huggingface_hub.scan_cache_dir(hub).repos  # huggingface_hub reads the layout as its own
    assert cached.repo_id == "org/rotation-zoo" and set(cached.refs) == {"main", "v2"}

    load = functools.partial(OscarRotations.from_pretrained, "org/rotation-zoo", subfolder="llama-tiny", cache_dir=hub)
    assert_same_bundle(load(), main)
    assert_same_bundle(load(revision="v2"), v2)
    assert_same_bundle(load(revision=commit), v2)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    cache = OscarQuantizedCache.from_pretrained("org/rotation-zoo", subfolder="llama-tiny", revision="v2", model=model)
    assert cache.rotations.method == "hadamard"
    torch.testing.assert_close(cache.layers[1].key_rotation, v2.key_rotation[1], rtol=0, atol=0)

    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="'org/rotation-zoo', subfolder 'qwen3-8b' has no oscar_config.json"):
        OscarRotations.from_pretrained("org/rotation-zoo", subfolder="qwen3-8b", cache_dir=hub)
    with pytest.raises(FileNotFoundError, match="org/missing-zoo.*subfolder 'llama-tiny'.*local Hugging Face cache"):
        OscarRotations.from_pretrained("org/missing-zoo", subfolder="llama-tiny", cache_dir=hub)
    assert time.perf_counter() - start < 5


# ----------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("which", ["key_rotation", "value_rotation"])
def test_non_orthogonal_rotation_raises(which):
    rotations = {"key_rotation": random_orthogonal(3, 64, seed=1), "value_rotation": random_orthogonal(3, 64, seed=2)}
    rotations[which][1] *= 1.01
    with pytest.raises(ValueError, match=rf"{which} of layer 1 is not orthogonal"):
        OscarRotations(**rotations, num_kv_heads=2)


def test_non_orthogonal_per_head_rotation_names_layer_and_head():
    key = random_orthogonal(2, 64, seed=1, heads=3)
    key[1, 2] *= 1.01
    with pytest.raises(ValueError, match="key_rotation of layer 1, KV head 2 is not orthogonal"):
        OscarRotations(key, random_orthogonal(2, 64, seed=2, heads=3), num_kv_heads=3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=str)
def test_non_finite_rotation_raises(bad):
    rotation = random_orthogonal(2, 64, seed=1)
    rotation[1, 3, 5] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        OscarRotations(rotation, random_orthogonal(2, 64, seed=2), num_kv_heads=2)


@pytest.mark.parametrize(
    "key, value, match",
    [
        pytest.param(random_orthogonal(1, 64, 1)[0], random_orthogonal(1, 64, 2)[0],
                     r"\[layers, \(num_kv_heads,\) head_dim", id="2d"),
        pytest.param(torch.zeros(2, 64, 32), random_orthogonal(2, 64, 2), r"layer 0 must be \[head_dim, head_dim\]",
                     id="not-square"),
        pytest.param(random_orthogonal(2, 64, 1), random_orthogonal(3, 64, 2), "differ", id="layers-mismatch"),
        pytest.param(random_orthogonal(2, 64, 1), random_orthogonal(2, 32, 2), "differ", id="head_dim-mismatch"),
        pytest.param(random_orthogonal(2, 64, 1, heads=2), random_orthogonal(2, 64, 2), "differ",
                     id="per-head-and-shared"),
        pytest.param(torch.eye(64).expand(1, 1, 2, 64, 64), torch.eye(64).expand(1, 1, 2, 64, 64),
                     r"\[layers, \(num_kv_heads,\) head_dim", id="5d"),
    ],
)
def test_bad_rotation_shapes_raise(key, value, match):
    with pytest.raises(ValueError, match=match):
        OscarRotations(key, value, num_kv_heads=2)


@pytest.mark.parametrize("which", ["key_eigenvalues", "value_eigenvalues"])
@pytest.mark.parametrize("heads, shape", [(None, (2, 32)), (None, (3, 64)), (None, (64,)), (None, (2, 2, 64)),
                                          (2, (2, 64)), (2, (2, 3, 64))], ids=str)
def test_eigenvalue_shape_mismatch_raises(which, heads, shape):
    rotations = random_orthogonal(2, 64, seed=1, heads=heads), random_orthogonal(2, 64, seed=2, heads=heads)
    with pytest.raises(ValueError, match=which):
        OscarRotations(*rotations, num_kv_heads=2, **{which: torch.rand(shape)})


@pytest.mark.parametrize("missing", ["rotations.safetensors", "oscar_config.json"])
def test_missing_file_raises(tmp_path, missing):
    random_bundle().save_pretrained(tmp_path)
    (tmp_path / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing):
        OscarRotations.from_pretrained(tmp_path)


@pytest.mark.parametrize("version", [3, 0, "1", None, True], ids=repr)
def test_bad_format_version_raises(tmp_path, version):
    random_bundle().save_pretrained(tmp_path)
    path = tmp_path / "oscar_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "format_version": version}))
    with pytest.raises(ValueError, match="format_version"):
        OscarRotations.from_pretrained(tmp_path)


def test_invalid_json_raises(tmp_path):
    random_bundle().save_pretrained(tmp_path)
    (tmp_path / "oscar_config.json").write_text('{"format_version": 1,')
    with pytest.raises(ValueError, match="not valid JSON"):
        OscarRotations.from_pretrained(tmp_path)


@pytest.mark.parametrize("edit, match", [
    pytest.param(lambda m: [m], r"oscar_config.json must be a JSON object; got list", id="a-list"),
    pytest.param(lambda m: {k: v for k, v in m.items() if k != "num_kv_heads"},
                 r"oscar_config.json lacks the field 'num_kv_heads'", id="no-num_kv_heads"),
    pytest.param(lambda m: m | {"num_kv_heads": None}, r"oscar_config.json: the field 'num_kv_heads' must be .*None",
                 id="null-num_kv_heads"),
    pytest.param(lambda m: m | {"num_kv_heads": "2"}, r"oscar_config.json: the field 'num_kv_heads' must be .*'2'",
                 id="string-num_kv_heads"),
    pytest.param(lambda m: m | {"calibration": [1]}, r"oscar_config.json: the field 'calibration' must be",
                 id="list-calibration"),
    pytest.param(lambda m: m | {"config": {"scale_dtype": ["float16"]}},
                 r"oscar_config.json: the field 'config': OscarConfig.scale_dtype must be", id="list-scale_dtype"),
    pytest.param(lambda m: m | {"key_codebook_bits": "1"}, r"oscar_config.json: the field 'key_codebook_bits'",
                 id="string-key_codebook_bits"),
])
def test_malformed_metadata_names_the_file_and_the_field(tmp_path, edit, match):
    random_bundle().save_pretrained(tmp_path)
    path = tmp_path / "oscar_config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    with pytest.raises(ValueError, match=match):
        OscarRotations.from_pretrained(tmp_path)


@pytest.mark.parametrize("content", [b'{"format_version": 1,', b"\x80\x81 not text", b""], ids=repr)
def test_metadata_that_is_not_json_names_the_file(tmp_path, content):
    random_bundle().save_pretrained(tmp_path)
    (tmp_path / "oscar_config.json").write_bytes(content)
    with pytest.raises(ValueError, match="oscar_config.json is not valid JSON"):
        OscarRotations.from_pretrained(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32, torch.float64], ids=str)
def test_rotations_of_another_dtype_are_refused_by_name(tmp_path, dtype):
    """A bundle stores float32: another dtype is named (fp16 rotations would fail the orthogonality check instead)."""
    from safetensors.torch import save_file

    random_bundle().save_pretrained(tmp_path)
    weights = tmp_path / "rotations.safetensors"
    tensors = load_file(weights)
    save_file(tensors | {"key_rotation": tensors["key_rotation"].to(dtype)}, str(weights))
    with pytest.raises(ValueError, match=rf"rotations.safetensors: the tensor 'key_rotation' is {dtype}"):
        OscarRotations.from_pretrained(tmp_path)


def test_loading_errors_name_the_problem(tmp_path, monkeypatch):
    """A missing local folder, an unreachable name offline, a missing subfolder and a truncated weights file each
    fail at once with an error that names what is wrong."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="no such folder: .*not a Hub repo id"):
        OscarRotations.from_pretrained(tmp_path / "nowhere" / "deeper")
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match="no such folder: org/zoo.*local Hugging Face cache.*offline"):
        OscarRotations.from_pretrained("org/zoo", subfolder="qwen3-8b", cache_dir=tmp_path / "hub")
    assert time.monotonic() - start < 5
    bundle = OscarRotations.identity(_tiny_config())
    bundle.save_pretrained(tmp_path / "zoo" / "a")
    with pytest.raises(FileNotFoundError, match="has no subfolder 'b'"):
        OscarRotations.from_pretrained(tmp_path / "zoo", subfolder="b")
    weights = tmp_path / "zoo" / "a" / "rotations.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="rotations.safetensors is not a readable safetensors file"):
        OscarRotations.from_pretrained(tmp_path / "zoo" / "a")


def test_a_mismatch_names_the_model_the_bundle_was_made_for():
    config = _tiny_config()
    bundle = OscarRotations.identity(config)
    other = _tiny_config(num_hidden_layers=3)
    with pytest.raises(ValueError, match="made for a model whose name it does not record"):
        bundle.check_compatible(other)
    bundle.source_model = "org/tiny"
    with pytest.raises(ValueError, match=r"num_layers is 2 in the bundle \(made for org/tiny\) but 3 in this model"):
        bundle.check_compatible(other)


def test_a_bundle_made_for_another_model_of_the_same_shape_warns_once(caplog):
    """Both name their model: a warning naming both, once; a Hub id and a local path (a download or conversion of
    it) are not compared, and the same name does not warn."""
    config = _tiny_config()
    config._name_or_path = "org/served-model"
    bundle = OscarRotations.identity(config)
    with caplog.at_level(logging.WARNING, logger="oscar_hf.rotations"):
        for source in (None, "org/served-model", "/models/calibrated-model"):
            bundle.source_model = source
            bundle.check_compatible(config)
        assert not caplog.records
        bundle.source_model = "org/calibrated-model"
        bundle.check_compatible(config)
        bundle.check_compatible(config)
    (record,) = caplog.records
    assert "made for org/calibrated-model, not for org/served-model" in record.getMessage()


def _tiny_config(**overrides):
    import transformers

    fields = dict(vocab_size=32, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64)
    return transformers.LlamaConfig(**{**fields, **overrides})


def test_a_cache_keeps_its_own_copy_of_the_rotations():
    """Changing a bundle in place after the cache is built changes nothing the cache reads."""
    from oscar_hf import OscarQuantizedCache

    config = _tiny_config()
    bundle = OscarRotations.hadamard(config)
    cache = OscarQuantizedCache(config, bundle)
    want = bundle.key_rotation[0].clone()
    bundle.key_rotation.zero_()
    bundle.value_rotation.zero_()
    assert torch.equal(cache.layers[0].key_rotation, want) and cache.layers[0].value_rotation.abs().sum() > 0
