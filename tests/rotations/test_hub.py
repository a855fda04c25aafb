"""RotationZoo on the Hub: push_to_hub uploads a bundle folder; `hf download --local-dir` output loads."""

import shutil

import huggingface_hub
import torch
from helpers import make_model

from oscar_hf import OscarQuantizedCache, OscarRotations


def test_push_to_hub_uploads_the_bundle_into_the_subfolder(monkeypatch, tmp_path):
    calls = {}

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"] = (repo_id, kwargs)

    def upload_folder(self, *, repo_id, folder_path, path_in_repo, **kwargs):
        shutil.copytree(folder_path, tmp_path / "remote" / path_in_repo)
        calls["upload_folder"] = (repo_id, path_in_repo)
        return "https://huggingface.co/org/zoo/commit/0"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    model = make_model("qwen3-gqa-qknorm-d128")
    bundle = OscarRotations.hadamard(model.config)
    bundle.push_to_hub("org/zoo", subfolder="qwen3-tiny")
    assert calls["create_repo"] == ("org/zoo", {"private": None, "exist_ok": True})
    assert calls["upload_folder"] == ("org/zoo", "qwen3-tiny")
    uploaded = tmp_path / "remote" / "qwen3-tiny"
    assert sorted(p.name for p in uploaded.iterdir()) == ["README.md", "oscar_config.json", "rotations.safetensors"]
    assert "hadamard" in (uploaded / "README.md").read_text()
    # What `hf download org/zoo --include 'qwen3-tiny/*' --local-dir D` leaves behind loads as a local folder.
    loaded = OscarRotations.from_pretrained(tmp_path / "remote" / "qwen3-tiny")
    torch.testing.assert_close(loaded.key_rotation, bundle.key_rotation)
    cache = OscarQuantizedCache.from_pretrained(tmp_path / "remote", subfolder="qwen3-tiny", model=model)
    assert cache.rotations.method == "hadamard"
