"""oscar_hf.calibrate: covariance targets against a hand computation, rotation algebra, a planted case where the
learned rotation provably wins, determinism, data parallelism, inputs and diagnostics."""

import json
import math
import socket
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from helpers import VOCAB, austen, build_family, char_tokenizer, make_model, quick_calibrate, token_ids

from oscar_hf import OscarConfig, OscarRotations, hadamard_matrix
from oscar_hf.calibrate import bit_reversal_permutation, compose_rotation, rotation_from_covariance, token_chunks
from oscar_hf.capture import run_capture
from oscar_hf.quantizer import dequantize, quantize

ARCH = "qwen3-gqa-qknorm-d128"  # 4 query heads, 2 KV heads (groups of 2), head_dim 128, 2 layers
TENSORS = ("key_rotation", "value_rotation", "key_eigenvalues", "value_eigenvalues")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return make_model(ARCH)


# ------------------------------------------------------------------------------- covariance targets
class Recorder:
    """An Observer keeping every layer's q, k, v and attention output as float64 ``[heads, tokens, D]``."""

    def __init__(self):
        self.parts = defaultdict(lambda: defaultdict(list))

    def observe(self, layer_idx, query, key, value, output, scaling):
        for name, x in zip("qkvo", (query, key, value, output)):
            self.parts[layer_idx][name].append(x.double().transpose(0, 1).flatten(1, 2))

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        return {name: torch.cat(parts, dim=1) for name, parts in self.parts[i].items()}


def hand_covariances(t: dict[str, torch.Tensor], kv_heads: int, per_head: bool = False) -> dict[str, torch.Tensor]:
    """oscar_method.md §1.4, §1.5, §9.A, written out head by head in float64: each KV head's ``[H, D, D]``
    (``per_head``: K's from its GQA group's queries, V's weighted by its own query covariance), or their mean."""

    def group_rows(x):  # query heads [Hq, T, D] -> the g·T query rows of each KV head [H, g·T, D]
        return x.unflatten(0, (kv_heads, -1)).flatten(1, 2)

    def cov(x):  # xᵀx / rows, per head
        return x.mT @ x / x.shape[1]

    q, k, v = group_rows(t["q"]), t["k"], t["v"]
    c = cov(q)  # C_h [H, D, D]
    w = torch.einsum("htd,hde,hte->ht", k, c, k)  # w_t = k_t C_h k_tᵀ
    sst = torch.einsum("ht,htd,hte->hde", w, v, v) / w.sum(1)[:, None, None]
    heads = {"qqt": c, "ktk": cov(k), "vtv": cov(v), "softmax": cov(group_rows(t["o"])), "sst": sst}
    return heads if per_head else {name: x.mean(0) for name, x in heads.items()}


@pytest.fixture(scope="module")
def recorded_layers(model):
    """Every layer's captured q, k, v, o on 160 tokens, cut like calibrate cuts them: chunks of 64, 64, 32."""
    recorder = Recorder()
    for chunk in token_ids().flatten()[:160].split(64):
        run_capture(model, recorder, chunk[None])
    return [recorder.layer(i) for i in range(model.config.num_hidden_layers)]


@pytest.fixture(scope="module")
def recorded(recorded_layers):
    """The hand covariances of every layer (the mean over KV heads)."""
    return [hand_covariances(t, kv_heads=2) for t in recorded_layers]


def test_captured_output_is_causal_attention_of_captured_qkv(model):
    recorder = Recorder()
    run_capture(model, recorder, token_ids(1, 40))
    t = recorder.layer(1)
    q, k, v = t["q"], t["k"].repeat_interleave(2, 0), t["v"].repeat_interleave(2, 0)
    scores = (q @ k.mT / math.sqrt(q.shape[-1])).masked_fill(torch.ones(40, 40).triu(1).bool(), -torch.inf)
    torch.testing.assert_close(scores.softmax(-1) @ v, t["o"], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("side, target", [("key", "qqt"), ("key", "ktk"), ("value", "sst"), ("value", "vtv"),
                                          ("value", "softmax")], ids=lambda x: x)
def test_covariance_target_matches_hand_computation(model, recorded, side, target):
    targets = {"k_target": "identity", "v_target": "identity", f"{side[0]}_target": target}
    rotations = quick_calibrate(model, token_ids(), num_tokens=160, composition="U", eigen_order="ascending",
                                **targets)
    for layer, covariances in enumerate(recorded):
        sigma = covariances[target]
        r = getattr(rotations, f"{side}_rotation")[layer].double()
        values = getattr(rotations, f"{side}_eigenvalues")[layer].double()
        torch.testing.assert_close(values, torch.linalg.eigvalsh(sigma), rtol=1e-5, atol=1e-6 * float(sigma.norm()))
        # R·Λ·Rᵀ = Σ with Λ ascending and R orthogonal: R's columns are Σ's eigenvectors, ascending (R = U)
        torch.testing.assert_close(r @ values.diag() @ r.T, sigma, rtol=0, atol=1e-5 * float(sigma.abs().max()))


@pytest.mark.parametrize("side, target", [("key", "qqt"), ("key", "ktk"), ("value", "sst"), ("value", "vtv"),
                                          ("value", "softmax")], ids=lambda x: x)
def test_per_head_covariance_target_matches_hand_computation(model, recorded_layers, side, target):
    """per_head=True: one rotation per layer and KV head, each from its own head's covariance (K: its GQA group's
    queries for qqt; V: weighted by its own query covariance for sst)."""
    targets = {"k_target": "identity", "v_target": "identity", f"{side[0]}_target": target}
    rotations = quick_calibrate(model, token_ids(), num_tokens=160, composition="U", eigen_order="ascending",
                                per_head=True, **targets)
    assert rotations.per_head and rotations.key_rotation.shape == (2, 2, 128, 128)
    assert rotations.calibration["per_head"] is True
    for layer, captured in enumerate(recorded_layers):
        per_head = hand_covariances(captured, kv_heads=2, per_head=True)[target]
        assert not torch.allclose(per_head[0], per_head[1], rtol=0.05)  # the heads differ
        for head, sigma in enumerate(per_head):
            r = getattr(rotations, f"{side}_rotation")[layer, head].double()
            values = getattr(rotations, f"{side}_eigenvalues")[layer, head].double()
            torch.testing.assert_close(values, torch.linalg.eigvalsh(sigma), rtol=1e-5,
                                       atol=1e-6 * float(sigma.norm()))
            torch.testing.assert_close(r @ values.diag() @ r.T, sigma, rtol=0, atol=1e-5 * float(sigma.abs().max()))
    other = "value" if side == "key" else "key"
    assert torch.equal(getattr(rotations, f"{other}_rotation"), torch.eye(128).expand(2, 2, 128, 128))


def test_per_head_with_one_kv_head_is_the_shared_calibration():
    """With one KV head (Gemma-3-270M's case) the per-head rotations are the shared ones."""
    model = make_model("mistral-gqa-d64")  # 4 query heads, 1 KV head
    shared, per_head = (quick_calibrate(model, token_ids(), num_tokens=160, per_head=p) for p in (False, True))
    assert per_head.key_rotation.shape == (2, 1, 64, 64)
    for name in TENSORS:
        assert torch.equal(getattr(per_head, name)[:, 0], getattr(shared, name)), name


def test_targets_differ(recorded):
    """The hand covariances are distinct, so the comparison above can tell a wrong target apart."""
    names = list(recorded[0])
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not torch.allclose(recorded[0][a], recorded[0][b], rtol=0.05), (a, b)


# ---------------------------------------------------------------------------------- rotation algebra
def test_bit_reversal_permutation_d8():
    """perm[bitrev(i)] = argsort(λ, desc)[i]: position 0 <- largest, 4 <- 2nd, 2 <- 3rd, 6 <- 4th, 1, 5, 3, 7."""
    perm = bit_reversal_permutation(torch.arange(8.0))
    assert perm.tolist() == [7, 3, 5, 1, 6, 2, 4, 0]
    m = torch.randn(8, 8)
    torch.testing.assert_close(m @ torch.eye(8)[:, perm], m[:, perm])


def test_bit_reversal_follows_eigenvalue_rank_not_position():
    values = torch.tensor([5.0, 1.0, 7.0, 3.0])  # ranks (desc): 2 -> 0 -> 3 -> 1; bitrev on 2 bits: 0, 2, 1, 3
    assert bit_reversal_permutation(values).tolist() == [2, 3, 0, 1]


def random_eigensystem(d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * d, d, generator=g, dtype=torch.float64)
    values, vectors = torch.linalg.eigh(x.T @ x)
    return vectors, values


def test_compose_uhp_is_u_times_h_times_p():
    u, values = random_eigensystem(16)
    p = torch.eye(16, dtype=torch.float64)[:, bit_reversal_permutation(values)]
    torch.testing.assert_close(compose_rotation(u, values, "UHP"), u @ hadamard_matrix(16) @ p)
    torch.testing.assert_close(compose_rotation(u, values, "HU"), hadamard_matrix(16) @ u)


@pytest.mark.parametrize("composition", ["U", "H", "P", "UH", "HP", "UHP", "HUP", "PUH"])
def test_every_composition_is_orthogonal(composition):
    u, values = random_eigensystem(32, seed=1)
    r = compose_rotation(u, values, composition)
    torch.testing.assert_close(r.T @ r, torch.eye(32, dtype=torch.float64))


@pytest.mark.parametrize("composition", ["", "UU", "X", "UHPX", "uhp"], ids=repr)
def test_invalid_composition_raises(composition):
    u, values = random_eigensystem(8)
    with pytest.raises(ValueError, match="composition"):
        compose_rotation(u, values, composition)


def test_rotation_from_covariance_orders():
    u, values = random_eigensystem(8)
    cov = u @ values.diag() @ u.T
    r_up, up = rotation_from_covariance(cov, "U", "ascending")
    r_down, down = rotation_from_covariance(cov, "U", "descending")
    torch.testing.assert_close(up, values)
    torch.testing.assert_close(down, values)  # eigenvalues are always returned ascending
    torch.testing.assert_close(r_up.T @ cov @ r_up, values.diag())
    torch.testing.assert_close(r_down.T @ cov @ r_down, values.flip(0).diag())


# ------------------------------------------------------------------------------------ planted case
def int2_logit_error(q: torch.Tensor, k: torch.Tensor, r: torch.Tensor) -> float:
    """mean (q·(k − k̂))² with k̂ = dequantize(quantize(k·R))·Rᵀ: INT2, one group per row, no clipping."""
    stored = quantize((k @ r).float(), bits=2, scale_dtype=torch.float32)
    k_hat = dequantize(stored, 2).double() @ r.T
    return float((((k - k_hat) @ q.T) ** 2).mean())


def planted(seed: int, outlier: str, d: int = 64, n: int = 2048):
    """Queries with energy 100, 9, 4 along three random orthonormal directions (aligned with neither the axes nor
    the Hadamard basis), 0.09 in the bulk and 0.0025 along one more. Keys: unit noise plus a per-token outlier of
    size ~20 along the queries' top direction ("top") or along the direction they barely read ("ignored")."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q
    scales = torch.full((d,), 0.3, dtype=torch.float64)
    scales[:3], scales[-1] = torch.tensor([10.0, 3.0, 2.0]), 0.05
    q = torch.randn(n, d, generator=g, dtype=torch.float64) * scales @ basis.T
    direction = basis[:, 0] if outlier == "top" else basis[:, -1]
    k = torch.randn(n, d, generator=g, dtype=torch.float64)
    k += 20 * torch.randn(n, 1, generator=g, dtype=torch.float64) * direction
    return q, k


@pytest.mark.parametrize("outlier, eigen_order", [("top", "descending"), ("ignored", "ascending")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_planted_case_oscar_beats_identity_and_hadamard(outlier, eigen_order, seed):
    """Query-weighted INT2 error of R = U·H·P against R = I and R = H, one group per row, no clipping.

    R = U·H·P turns a key component along U's first column into a constant row (k·U puts it on coordinate 0, row 0
    of the Sylvester H is 1/√D everywhere, P maps a constant row to itself). Min-max quantization of x + c·1 is
    that of x shifted by c: the zero point absorbs the component at no error. That is Theorem 1 (oscar_method.md
    §7.8) in the form it takes for this quantizer: the constant direction is where the residual is smallest, and
    eigen_order "descending" puts the largest query-energy direction there. Planted "top": the keys' outlier lies
    along that direction, so it costs nothing and the rest is quantized on the scale of the unit noise, while I and
    H spread it over every coordinate (a step ~20/√D, an error ~400·tr(C_Q)/D). Lemma 1 makes all other stored
    coordinates equally important, so nothing else separates the rotations. With "ascending" (the reference's order)
    U's first column is the least-read query direction: the rotation wins when the outlier lies there ("ignored")
    and loses, about 2x against H, when it lies along the top query direction. P does nothing at G = D (§2.1).
    """
    q, k = planted(seed, outlier)
    r, _ = rotation_from_covariance(q.T @ q / len(q), "UHP", eigen_order)
    oscar = int2_logit_error(q, k, r)
    d = q.shape[1]
    baseline = min(int2_logit_error(q, k, r) for r in (torch.eye(d, dtype=torch.float64), hadamard_matrix(d)))
    assert oscar < 0.5 * baseline
    r_uh, _ = rotation_from_covariance(q.T @ q / len(q), "UH", eigen_order)
    assert int2_logit_error(q, k, r_uh) == pytest.approx(oscar, rel=1e-9)


# ------------------------------------------------------------------------------- determinism, DDP
def test_calibrate_is_deterministic(model):
    first, second = (quick_calibrate(model, token_ids()) for _ in range(2))
    for name in TENSORS:
        assert torch.equal(getattr(first, name), getattr(second, name)), name


def test_batching_does_not_change_the_statistics(model):
    """Batches of 2 chunks, the short last chunk (160 = 64 + 64 + 32) in a batch of its own."""
    one, batched = (quick_calibrate(model, token_ids(), num_tokens=160, batch_size=b) for b in (1, 2))
    for name in TENSORS:
        torch.testing.assert_close(getattr(batched, name), getattr(one, name), atol=1e-5, rtol=1e-5)


DDP_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from accelerate import PartialState
from helpers import make_model, quick_calibrate, token_ids

state = PartialState(cpu=True)  # gloo; the PartialState() inside calibrate shares this state
assert state.num_processes == 2, state
rotations = quick_calibrate(make_model({arch!r}), token_ids(int(sys.argv[2]), 48), max_length=48)
if state.is_main_process:
    rotations.save_pretrained(sys.argv[1])
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_processes(tmp_path: Path, chunks: int) -> OscarRotations:
    script, out = tmp_path / "calibrate_ddp.py", tmp_path / "bundle"
    script.write_text(DDP_SCRIPT.format(tests=str(Path(__file__).parents[1]), arch=ARCH))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(script), str(out), str(chunks)]
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return OscarRotations.from_pretrained(out)


@pytest.mark.slow
@pytest.mark.parametrize("chunks", [
    pytest.param(5, id="5-chunks-split-3-2"),
    pytest.param(1, id="1-chunk-one-process-idle"),
])
def test_two_processes_equal_one(model, tmp_path, chunks):
    two = launch_two_processes(tmp_path, chunks)
    one = quick_calibrate(model, token_ids(chunks, 48), max_length=48)
    assert two.calibration["tokens"] == one.calibration["tokens"] == 48 * chunks
    for name in ("key_rotation", "value_rotation"):
        torch.testing.assert_close(getattr(two, name), getattr(one, name), atol=1e-5, rtol=0)
    for name in ("key_eigenvalues", "value_eigenvalues"):
        torch.testing.assert_close(getattr(two, name), getattr(one, name), rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------ inputs
def expected_ids(tokenizer, texts, num_tokens) -> list[int]:
    ids = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ids[:num_tokens]


def test_token_chunks_joins_documents_with_eos_and_cuts_chunks():
    tokenizer = char_tokenizer()
    texts = [austen(120), "   ", austen(400)[200:], "never reached"]
    chunks, held_out = token_chunks(tokenizer, texts, 300, 128, held_out_tokens=20)
    assert [len(c) for c in chunks] == [128, 128, 44] and [len(c) for c in held_out] == [20]
    assert torch.cat(chunks + held_out).tolist() == expected_ids(tokenizer, [texts[0], texts[2]], 320)
    assert chunks[0][120] == tokenizer.eos_token_id


def test_chunks_start_with_bos_when_the_tokenizer_adds_one():
    texts = [austen(120), austen(1000)[200:]]
    chunks, held_out = token_chunks(char_tokenizer(bos=True), texts, 300, 128, held_out_tokens=200)
    # BOS included: 300 = 128 + 128 + 44 calibration tokens, 200 = 128 + 72 held-out ones (chunks <= min(128, 1024))
    assert [len(c) for c in chunks] == [128, 128, 44] and [len(c) for c in held_out] == [128, 72]
    assert all(c[0] == 1 for c in chunks + held_out)
    text = torch.cat([c[1:] for c in chunks + held_out]).tolist()  # the text tokens, in order, no other BOS
    assert text == expected_ids(char_tokenizer(), texts, 500 - 5) and 1 not in text


def test_calibration_and_diagnostics_run_on_the_bos_chunks(model):
    tokenizer, texts = char_tokenizer(bos=True), [austen(2000)]
    chunks, held_out = token_chunks(tokenizer, texts, 300, 64, held_out_tokens=128)
    from_text = quick_calibrate(model, texts, tokenizer, num_tokens=300, diagnostic_tokens=128)
    from_ids = quick_calibrate(model, torch.cat(chunks + held_out)[None], num_tokens=300, diagnostic_tokens=128)
    assert from_text.calibration["tokens"] == 300 and [row["tokens"] for row in from_text.diagnostics] == [128, 128]
    for name in TENSORS:
        assert torch.equal(getattr(from_text, name), getattr(from_ids, name)), name
    assert from_text.diagnostics == from_ids.diagnostics


def test_token_tensor_inputs():
    ids = token_ids(3, 50)
    assert torch.equal(torch.cat(token_chunks(None, ids, 120, 64)[0]), ids.flatten()[:120])
    assert torch.equal(torch.cat(token_chunks(None, list(ids), 150, 64)[0]), ids.flatten())
    assert torch.equal(torch.cat(token_chunks(None, ids[0], 999, 64)[0]), ids[0])


def test_strings_dataset_and_token_tensor_give_the_same_rotations(model):
    datasets = pytest.importorskip("datasets")
    tokenizer = char_tokenizer()
    texts = [austen(2000)[:700], austen(2000)[700:]]
    ids = torch.tensor(expected_ids(tokenizer, texts, 300))
    from_strings = quick_calibrate(model, texts, tokenizer, num_tokens=300)
    from_dataset = quick_calibrate(model, datasets.Dataset.from_dict({"text": texts}), tokenizer, num_tokens=300)
    from_ids = quick_calibrate(model, ids[None], num_tokens=300)
    for bundle in (from_strings, from_dataset, from_ids):
        assert bundle.calibration["tokens"] == 300
        for name in TENSORS:
            assert torch.equal(getattr(bundle, name), getattr(from_ids, name)), name


def test_short_text_uses_what_there_is(model):
    rotations = quick_calibrate(model, ["Emma Woodhouse, handsome, clever, and rich."], char_tokenizer(),
                                num_tokens=1000)
    assert rotations.calibration["tokens"] == len("Emma Woodhouse, handsome, clever, and rich.") + 1  # + EOS


def test_dataset_without_text_column_raises(model):
    datasets = pytest.importorskip("datasets")
    with pytest.raises(ValueError, match="'text' column"):
        quick_calibrate(model, datasets.Dataset.from_dict({"content": ["a b c"]}), char_tokenizer(), num_tokens=10)


@pytest.mark.parametrize("name, value", [("k_target", "kkt"), ("v_target", "qqt"), ("eigen_order", "up"),
                                         ("num_tokens", 0), ("num_tokens", 10.0), ("max_length", -1),
                                         ("batch_size", 0), ("composition", "UHX")], ids=str)
def test_bad_arguments_raise_naming_the_argument(model, name, value):
    with pytest.raises(ValueError, match=name):
        quick_calibrate(model, token_ids(), **{name: value})


@pytest.mark.parametrize("texts", [[], ["", "  \n"]], ids=["no-texts", "blank-texts"])
def test_empty_texts_raise(model, texts):
    with pytest.raises(ValueError, match="no calibration tokens"):
        quick_calibrate(model, texts, char_tokenizer(), num_tokens=100)


def test_text_without_tokenizer_or_as_plain_string_raises(model):
    with pytest.raises(ValueError, match="tokenizer"):
        quick_calibrate(model, ["some text"], None, num_tokens=100)
    with pytest.raises(TypeError, match="list of strings"):
        quick_calibrate(model, "some text", char_tokenizer(), num_tokens=100)


# ------------------------------------------------------------------------------------ diagnostics
METRICS = ("k_error", "v_error", "score_kl", "output_error", "k_clip_rate", "v_clip_rate")


def diagnosed(model, config: OscarConfig) -> OscarRotations:
    """Calibrated on 256 tokens, diagnosed on 4 held-out chunks of 64 tokens, all but a 4-token sink quantized."""
    return quick_calibrate(model, token_ids(8, 64), num_tokens=256, diagnostic_tokens=256,
                           config=config.replace(sink_tokens=4))


def test_diagnostics_per_layer(model, tmp_path):
    rotations = diagnosed(model, OscarConfig())
    assert [row["layer"] for row in rotations.diagnostics] == [0, 1]
    for row in rotations.diagnostics:
        assert row["tokens"] == 256
        assert all(math.isfinite(row[name]) and row[name] >= 0 for name in METRICS), row
        assert row["k_error"] > 0 and row["score_kl"] > 0
        # D = 128: k_clip 0.96 clamps |x| above the floor(0.96·128) + 1 = 123rd smallest: 5 of 128 per row;
        # v_clip 0.92: above the 118th smallest, 10 of 128
        assert row["k_clip_rate"] == pytest.approx(5 / 128)
        assert row["v_clip_rate"] == pytest.approx(10 / 128)
    rotations.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "diagnostics.json").read_text()) == rotations.diagnostics
    assert OscarRotations.from_pretrained(tmp_path).diagnostics == rotations.diagnostics


def test_per_head_diagnostics(model):
    """Per-head bundles are diagnosed with each KV head's rotations (queries with their KV head's R_K): a bundle whose
    heads all hold the layer's rotations gives the shared bundle's numbers; distinct random rotations per head keep
    the attention scores (a query rotated by another head's R_K would scramble them)."""
    from oscar_hf.diagnostics import diagnose

    shared = quick_calibrate(model, token_ids(8, 64), num_tokens=256)
    held_out = list(token_ids(2, 64, seed=1))
    config = OscarConfig(bits=4, k_clip=1.0, v_clip=1.0, sink_tokens=4)
    expanded = OscarRotations(shared.key_rotation[:, None].expand(2, 2, 128, 128),
                              shared.value_rotation[:, None].expand(2, 2, 128, 128), num_kv_heads=2)
    want, got = (diagnose(model, bundle, held_out, config) for bundle in (shared, expanded))
    for a, b in zip(want, got):
        assert a.keys() == b.keys() and all(b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-9) for k in a)
    generator = torch.Generator().manual_seed(0)
    random = OscarRotations(*(torch.linalg.qr(torch.randn(2, 2, 128, 128, generator=generator)).Q for _ in range(2)),
                            num_kv_heads=2)
    for row in diagnose(model, random, held_out, config):
        assert row["score_kl"] < 0.05 and row["output_error"] < 0.05, row


def test_diagnostics_int4_unclipped_is_much_better_than_int2(model):
    int2 = diagnosed(model, OscarConfig(bits=2, k_clip=1.0, v_clip=1.0)).diagnostics
    int4 = diagnosed(model, OscarConfig(bits=4, k_clip=1.0, v_clip=1.0)).diagnostics
    for row2, row4 in zip(int2, int4):
        assert row4["k_clip_rate"] == row4["v_clip_rate"] == 0.0
        for name in ("k_error", "v_error", "score_kl", "output_error"):
            assert row4[name] < 0.2 * row2[name], (name, row4[name], row2[name])


def test_no_diagnostics_when_disabled(model):
    assert quick_calibrate(model, token_ids()).diagnostics is None


def test_capture_puts_every_part_of_a_composite_model_on_the_oscar_attention():
    """A composite model whose parts run different attention implementations is captured, and left on "oscar" in
    every part, as enable leaves it."""
    import transformers

    config = transformers.Gemma3Config(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14))
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.set_attn_implementation({"": "eager", "text_config": "eager", "vision_config": "sdpa"})
    seen = []

    class Counter:
        def observe(self, layer_idx, *tensors):
            seen.append(layer_idx)

    run_capture(model, Counter(), token_ids(1, 16))
    assert seen == [0, 1]
    assert {config._attn_implementation for config in (model.config, config.text_config, config.vision_config)} == {
        "oscar"}


@pytest.mark.parametrize("family", ["gemma2-softcap", "gpt-oss-sinks"])
def test_capture_runs_the_models_own_attention_softcap_and_sinks_included(family):
    """Calibration sees what the model computes: Gemma-2's soft-capped and gpt-oss's sink logits are applied, so every
    layer's attention output (what its o_proj receives) is that of a plain forward, bit for bit."""
    model, ids = build_family(family), token_ids(1, 24)
    outputs = []
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda module, args: outputs.append(args[0]))
             for layer in model.model.layers]
    model(ids)
    run_capture(model, Recorder(), ids)
    for hook in hooks:
        hook.remove()
    layers = len(model.model.layers)
    assert len(outputs) == 2 * layers
    for plain, captured in zip(outputs[:layers], outputs[layers:]):
        torch.testing.assert_close(captured, plain, rtol=0, atol=0)
