"""The same guarantees on a CUDA device (skipped without one): generate equivalence, both backends."""

import pytest
import torch
from helpers import MODES, make_model, run

from oscar_hf import OscarQuantizedCache, OscarRotations, cache_kwargs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_model(arch, dtype=torch.bfloat16, **overrides):
    return make_model(arch, dtype=dtype, **overrides).cuda()


def to_cuda(inputs: dict) -> dict:
    return {k: v.cuda() for k, v in inputs.items()}


def per_head_rotations(config) -> OscarRotations:
    """Random orthogonal rotations, one per layer and KV head (V's others than K's)."""
    from oscar_hf.model_support import ModelShape

    shape = ModelShape.from_config(config)
    generator = torch.Generator().manual_seed(0)
    k, v = (torch.linalg.qr(torch.randn(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.head_dim,
                                        generator=generator)).Q for _ in range(2))
    return OscarRotations(k, v, num_kv_heads=shape.num_kv_heads)


def rotations_for(model, per_head: bool) -> OscarRotations:
    return per_head_rotations(model.config) if per_head else OscarRotations.hadamard(model.config)


@pytest.mark.parametrize("mode", ["greedy", "left-padded-batch", "beam-search", "prompt-lookup"])
def test_token_identical_when_windows_cover_sequence_on_cuda(arch, mode):
    """The torch backend is exact here; the Triton kernel is compared on logits (it is not bit-identical
    to SDPA, and random bf16 models have 1-ulp logit ties)."""
    backend = "torch"
    model = cuda_model(arch)
    make_inputs, kwargs = MODES[mode]
    expected = run(model, to_cuda(make_inputs()), **kwargs)
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.identity(model.config), model=model, backend=backend)
    got = run(model, to_cuda(make_inputs()), cache=cache, **kwargs)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
@pytest.mark.parametrize("key_bits", [None, 4], ids=["k2", "k4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_and_torch_backends_agree_with_int2_history(arch, dtype, key_bits, per_head):
    """One decode step over a quantized history (2-bit V, 2- or 4-bit K), with shared or per-KV-head rotations:
    logits of both backends agree closely."""
    model = cuda_model(arch, dtype=dtype)
    ids = torch.randint(3, 90, (2, 70), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    logits = {}
    for backend in ("torch", "triton"):
        cache = OscarQuantizedCache.from_pretrained(
            rotations_for(model, per_head), model=model, sink_tokens=4, recent_tokens=8, backend=backend,
            key_bits=key_bits,
        )
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True)
            step = model(
                input_ids=ids[:, -1:],
                attention_mask=torch.cat([mask, mask[:, -1:]], 1),
                **cache_kwargs(model, cache),
                use_cache=True,
            )
        assert all(layer.n_history > 0 for layer in cache.layers)
        logits[backend] = step.logits[:, -1].float()
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("key_bits", [1, 2])
def test_product_keys_on_cuda_agree_across_backends_and_with_a_static_cache(key_bits):
    """Product-quantized K (codebooks calibrated on the GPU) on CUDA in bf16: both backends take the dequantize path
    (the kernels read per-token K only) and agree after a prompt whose middle reaches the history, and a static cache
    (no graph steps) generates as the dynamic one does."""
    from helpers import quick_calibrate, token_ids

    model = cuda_model("qwen3-gqa-qknorm-d128")
    windows = {"sink_tokens": 4, "recent_tokens": 8}
    rotations = quick_calibrate(model, token_ids(4, 128).cuda(), num_tokens=512, max_length=128,
                                key_codebook_bits=[key_bits])
    product = {"key_quantization": "product", "key_bits": key_bits, "k_clip": 1.0, **windows}
    ids = torch.randint(3, 90, (2, 70), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    logits = {}
    for backend in ("torch", "triton"):
        cache = OscarQuantizedCache.from_pretrained(rotations, model=model, backend=backend, **product)
        with torch.no_grad():
            model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
            step = model(input_ids=ids[:, -1:], **cache_kwargs(model, cache), use_cache=True)
        assert all(layer.n_history > 0 for layer in cache.layers)
        assert cache.layers[0].history["key_codes"].shape[-1] == 128 * key_bits // 8
        assert not cache.layers[0].packed().per_token_keys
        logits[backend] = step.logits[:, -1].float()
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=0.05, atol=0.05)
    runs = {}
    for max_cache_len in (None, 96):
        cache = OscarQuantizedCache.from_pretrained(rotations, model=model, max_cache_len=max_cache_len, **product)
        runs[max_cache_len] = model.generate(input_ids=ids[:, :40], max_new_tokens=24, do_sample=False,
                                             pad_token_id=0, past_key_values=cache, output_logits=True,
                                             return_dict_in_generate=True)
        assert all(layer.n_history > 0 for layer in cache.layers)
        assert not any(layer.graph_step for layer in cache.layers)
    for step in (0, 1):  # the prefill, and the first step over the history
        torch.testing.assert_close(runs[96].logits[step].float(), runs[None].logits[step].float(), rtol=0,
                                   atol=0.05)


def test_quantized_generation_runs_on_cuda_with_every_mode():
    model = cuda_model("qwen3-gqa-qknorm-d128")
    for mode in ("greedy", "sampling", "beam-search", "num-return-sequences", "prompt-lookup"):
        make_inputs, kwargs = MODES[mode]
        cache = OscarQuantizedCache.from_pretrained(
            OscarRotations.hadamard(model.config), model=model, sink_tokens=4, recent_tokens=4, flush_tokens=2
        )
        inputs = to_cuda(make_inputs())
        out = run(model, inputs, cache=cache, **kwargs)
        assert out.shape[1] > inputs["input_ids"].shape[1]
        assert all(layer.n_history > 0 for layer in cache.layers)


@pytest.mark.parametrize("quantizer", ["symmetric", "compact"])
def test_metadata_formats_agree_across_backends_and_in_cuda_graphs(quantizer):
    """Histories whose zeros are implied (symmetric) or whose scale and zero are bytes (compact), 4-bit K and 2-bit
    V: one step's logits agree across the backends, and a compiled static cache's steps track eager's."""
    model = cuda_model("qwen3-gqa-qknorm-d128", dtype=torch.bfloat16)
    ids = torch.randint(3, 90, (2, 70), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    logits = {}
    for backend in ("torch", "triton"):
        cache = OscarQuantizedCache.from_pretrained(rotations_for(model, False), model=model, sink_tokens=4,
                                                    recent_tokens=8, backend=backend, key_bits=4, quantizer=quantizer)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True)
            step = model(input_ids=ids[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], 1),
                         **cache_kwargs(model, cache), use_cache=True)
        assert all(layer.n_history > 0 for layer in cache.layers)
        assert cache.layers[0].history["value_scale"].dtype == (torch.uint8 if quantizer == "compact"
                                                                 else torch.float16)
        logits[backend] = step.logits[:, -1].float()
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=0.05, atol=0.05)

    def generate(**kwargs):
        cache = OscarQuantizedCache.from_pretrained(rotations_for(model, False), model=model, sink_tokens=4,
                                                    recent_tokens=8, key_bits=4, quantizer=quantizer, **kwargs)
        return model.generate(input_ids=ids[:, :40], attention_mask=mask[:, :40], max_new_tokens=16,
                              do_sample=False, pad_token_id=0, past_key_values=cache, output_logits=True,
                              return_dict_in_generate=True)

    torch._dynamo.reset()
    compiled, eager = generate(max_cache_len=64), generate()
    torch.testing.assert_close(compiled.logits[1].float(), eager.logits[1].float(), rtol=0, atol=0.05)


@pytest.mark.parametrize("dtype, key_bits, inductor_fast, per_head",
                         [(torch.float32, None, False, False), (torch.bfloat16, None, False, False),
                          (torch.bfloat16, 4, False, False), (torch.bfloat16, None, True, False),
                          (torch.bfloat16, None, False, True), (torch.float32, None, False, True)],
                         ids=["fp32", "bf16", "bf16-k4", "bf16-inductor-fast", "bf16-per-head", "fp32-per-head"])
def test_generate_compiles_with_cuda_graphs_around_a_static_cache(dtype, key_bits, inductor_fast, per_head):
    """On CUDA, max_cache_len makes generate compile the model (reduce-overhead: CUDA graphs) around the cache.
    fp32: the same tokens as eager; bf16 (Triton kernels): each step's logits track eager's closely until the
    tokens part, also with the settings of the fastest runs (``inductor_fast``: inductor's kernels launched early,
    ``TORCHINDUCTOR_ENABLE_PDL``, around the cache's, which are too; matrix-vector products as tuned reductions,
    ``TORCHINDUCTOR_COORDINATE_DESCENT_TUNING``); shared rotations and one per KV head."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    model = cuda_model("qwen3-gqa-qknorm-d128", dtype=dtype)
    ids = torch.randint(3, 90, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0

    def generate(**kwargs):
        cache = OscarQuantizedCache.from_pretrained(
            rotations_for(model, per_head), model=model, sink_tokens=4, recent_tokens=8, key_bits=key_bits,
            **kwargs
        )
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
                              past_key_values=cache, output_logits=True, return_dict_in_generate=True)

    torch._dynamo.reset()
    counters.clear()
    with inductor_config.patch({"triton.enable_pdl": inductor_fast, "coordinate_descent_tuning": inductor_fast}):
        compiled = generate(max_cache_len=64)
    assert counters["stats"]["unique_graphs"] > 0, "generate did not compile"
    eager = generate()
    if dtype == torch.float32:
        torch.testing.assert_close(compiled.sequences, eager.sequences, rtol=0, atol=0)
        return
    # step 0 is the (eager) prefill; the compiled decode steps follow while both runs have chosen the same tokens
    new_tokens = compiled.sequences.shape[1] - ids.shape[1]
    same = (compiled.sequences[:, ids.shape[1]:] == eager.sequences[:, ids.shape[1]:]).all(dim=0).tolist()
    steps = same.index(False) + 1 if False in same else new_tokens
    for step in range(steps):  # up to the step where the tokens part, if they do
        torch.testing.assert_close(compiled.logits[step].float(), eager.logits[step].float(), rtol=0, atol=0.05,
                                   msg=lambda m, step=step: f"step {step}: {m}")
    if steps < new_tokens:  # parted: only where eager's two best tokens were as close as the two runs' roundings
        column = ids.shape[1] + steps - 1
        parted = compiled.sequences[:, column] != eager.sequences[:, column]
        best, second = eager.logits[steps - 1][parted].float().topk(2, dim=-1).values.unbind(-1)
        margin = float((best - second).max())
        assert margin < 0.1, f"the tokens part at step {steps - 1} where eager's best token led by {margin:.3f}"


def test_overlapped_generate_runs_ahead_in_cuda_graphs_and_undoes_the_extra_step(monkeypatch):
    """overlapped_sample around the compiled (CUDA-graph) decode step: the stop check deferred, the same graph as
    generate's (no recompilation), the same tokens, and after an EOS stop the extra step undone, so that the cache
    holds what generate's holds and a next turn gives the same tokens."""
    from torch._dynamo.utils import counters

    from oscar_hf import generation, overlapped_sample

    model = cuda_model("qwen3-gqa-qknorm-d128")
    ids = torch.randint(3, 90, (1, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(3))

    def run(eos=None, **kwargs):
        cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model, sink_tokens=4,
                                                    recent_tokens=8, flush_tokens=3, max_cache_len=80)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             pad_token_id=0, eos_token_id=eos, past_key_values=cache, **kwargs)
        more = torch.cat([out, out[:, -1:]], dim=1)
        again = model.generate(input_ids=more, attention_mask=torch.ones_like(more), max_new_tokens=4,
                               do_sample=False, pad_token_id=0, past_key_values=cache, **kwargs)
        return out, again, cache

    torch._dynamo.reset()
    plain, _, _ = run()
    new = plain[0, 40:].tolist()
    eos = next(t for i, t in enumerate(new) if i >= 6 and t not in new[:i])
    want, want_again, want_cache = run(eos)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0, "generate did not compile"
    finished = []
    finish = generation.deferred_stop_check().finish
    monkeypatch.setattr(generation.deferred_stop_check(), "finish",
                        lambda self: finished.append(finish(self)) or finished[-1])
    got, got_again, got_cache = run(eos, custom_generate=overlapped_sample)
    assert len(finished) == 2 and finished[0] == 1, "both turns deferred their stop checks; the EOS stop undid a step"
    assert counters["stats"]["unique_graphs"] == graphs
    assert got.shape[1] < 56
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_again, want_again, rtol=0, atol=0)
    for a, b in zip(got_cache.layers, want_cache.layers):
        assert a.counts.tolist()[:4] == b.counts.tolist()[:4]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_layers_split_over_two_gpus_generate_like_one(tmp_path):
    """from_pretrained(device_map=...) puts layers 0-1 on cuda:0 and 2-3 on cuda:1: each cache layer lives with its
    attention layer, the Triton kernels launch on that layer's device, and the logits match a one-GPU run."""
    from transformers import AutoModelForCausalLM

    make_model("qwen3-gqa-qknorm-d128", dtype=torch.bfloat16, num_hidden_layers=4).save_pretrained(tmp_path)
    split_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 1,
                 "model.layers.3": 1, "model.norm": 1, "model.rotary_emb": 1, "lm_head": 1}
    ids = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    runs = {}
    for name, device_map in (("one", {"": 0}), ("two", split_map)):
        model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map=device_map)
        cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model, sink_tokens=4,
                                                    recent_tokens=8)
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=6,
                             do_sample=False, pad_token_id=0, past_key_values=cache, output_logits=True,
                             return_dict_in_generate=True)
        assert all(layer.n_history > 0 for layer in cache.layers)
        devices = [layer.sink["key"].device.index for layer in cache.layers]
        runs[name] = (torch.stack(out.logits, 1).float().cpu(), devices)
    assert runs["two"][1] == [0, 0, 1, 1] and runs["one"][1] == [0, 0, 0, 0]
    torch.testing.assert_close(runs["two"][0][:, :3], runs["one"][0][:, :3], rtol=0, atol=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensor_parallel_over_two_gpus_generates_like_one_gpu_and_a_device_map(tmp_path):
    """tp_plan="auto" over two GPUs (NCCL), bf16, the Triton kernels: each rank's cache holds its KV head with its
    per-head rotation, and the logits match one GPU's and a device_map split's; calibration (float32) on the two ranks
    gives one GPU's bundle."""
    from parallel.tp_worker import CACHE_SETTINGS, calibrate_both, launch, run_cache
    from transformers import AutoModelForCausalLM

    make_model("qwen3-gqa-qknorm-d128", dtype=torch.bfloat16, num_hidden_layers=4).save_pretrained(tmp_path / "model")
    rotations = per_head_rotations(make_model("qwen3-gqa-qknorm-d128", num_hidden_layers=4).config)
    rotations.save_pretrained(tmp_path / "per-head")
    ranks = launch(tmp_path / "model", tmp_path, "bfloat16", [tmp_path / "per-head"])
    split_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 1,
                 "model.layers.3": 1, "model.norm": 1, "model.rotary_emb": 1, "lm_head": 1}
    for device_map in ({"": 0}, split_map):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.bfloat16, device_map=device_map)
        cache = OscarQuantizedCache.from_pretrained(rotations, model=model, **CACHE_SETTINGS)
        logits, tokens = run_cache(model, cache)
        assert cache.layers[0].n_history > 0
        for outputs, _ in ranks:
            error = (outputs["per-head.logits"] - logits).abs().max()
            print(f"tensor parallel against {len(set(device_map.values()))} GPU(s): max |logit difference| {error:.4f}")
            torch.testing.assert_close(outputs["per-head.logits"], logits, rtol=0, atol=5e-2)
    one = calibrate_both(AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32,
                                                              device_map={"": 0}))
    for per_head, bundle in one.items():
        two = OscarRotations.from_pretrained(tmp_path / f"calibrated-per-head-{per_head}-rank0")
        for name in ("key_eigenvalues", "value_eigenvalues"):
            assert len(getattr(two, name)) == len(getattr(bundle, name)) == 4
            for a, b in zip(getattr(two, name), getattr(bundle, name)):
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)
        assert len(two.diagnostics) == len(bundle.diagnostics) == 4
        for a, b in zip(two.diagnostics, bundle.diagnostics):
            assert a["score_kl"] == pytest.approx(b["score_kl"], rel=1e-2, abs=1e-6)


def assert_stages_then_gemm(prof, stages: tuple[str, ...]) -> None:
    """The profiled GPU work is ``stages`` in order, then only the R_Vᵀ GEMM's kernels (cuBLAS may split it)."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    work = [e.name for e in sorted(events, key=lambda e: e.time_range.start)]
    assert len(work) > len(stages) and all(stage in name for stage, name in zip(stages, work)), work
    assert not any(word in name.lower() for name in work[len(stages):] for word in ("fill", "copy", "elementwise",
                                                                                    "triton")), work


def layer_rotation(per_head: bool) -> torch.Tensor:
    """The Hadamard ``[128, 128]``, or per KV head (2) random orthogonal ones ``[2, 128, 128]``."""
    from oscar_hf.rotations import hadamard_matrix

    if per_head:
        return torch.linalg.qr(torch.randn(2, 128, 128, generator=torch.Generator().manual_seed(0))).Q
    return hadamard_matrix(128).float()


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("sink_tokens", [4, 0])
def test_a_static_layers_decode_launches_only_its_three_stages(masked, sink_tokens, per_head):
    """A static layer's decode step is q's rotation, stage 1, stage 2 and the GEMM that brings the history's share of
    the output back by R_Vᵀ (batched over the KV heads for per-head rotations), and no other kernel: a fill or copy
    (of a placeholder for an absent mask or an empty sink) between the kernel before and stage 1 would keep stage 1
    from launching early."""
    from oscar_hf import OscarConfig, StaticOscarLayer
    from oscar_hf.kernels.decode.triton import decode_static

    rotation = layer_rotation(per_head)
    config = OscarConfig(backend="triton", sink_tokens=sink_tokens, recent_tokens=8, flush_tokens=4)
    layer = StaticOscarLayer(config, rotation, rotation.mT, 200)
    kv = torch.randn(2, 1, 2, 101, 128, device="cuda").to(torch.bfloat16)
    layer.update(kv[0, :, :, :100], kv[1, :, :, :100])
    layer.update(kv[0, :, :, 100:], kv[1, :, :, 100:])  # a graph step
    query = torch.randn(1, 8, 1, 128, device="cuda").to(torch.bfloat16)
    mask = torch.ones(1, 1, 1, 200, dtype=torch.bool, device="cuda") if masked else None
    decode_static(query, layer.packed(), mask, None, layer._decode_splits)  # compiles
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        decode_static(query, layer.packed(), mask, None, layer._decode_splits)
        torch.cuda.synchronize()
    assert_stages_then_gemm(prof, ("rotate_query", "stage1", "stage2"))


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_a_step_left_to_the_attention_launches_the_append_and_two_stages(per_head):
    """A static layer's step as OscarQuantizedCache.update and the attention function run it: the append kernel
    (which rotates q as well), stage 1, stage 2 and the R_Vᵀ GEMM, and no other kernel; with shared or per-KV-head
    rotations."""
    from oscar_hf import OscarConfig, StaticOscarLayer

    rotation = layer_rotation(per_head)
    config = OscarConfig(backend="triton", sink_tokens=4, recent_tokens=8, flush_tokens=4)
    layer = StaticOscarLayer(config, rotation, rotation.mT, 200)
    kv = torch.randn(2, 1, 2, 100, 128, device="cuda").to(torch.bfloat16)
    layer.update(kv[0], kv[1])
    steps = [torch.randn(2, 1, 2, 1, 128, device="cuda").to(torch.bfloat16) for _ in range(2)]  # contiguous K/V
    query = torch.randn(1, 8, 1, 128, device="cuda").to(torch.bfloat16)

    def step(new):  # as the attention function calls it: the layer attends (the graph step's path)
        handles = layer.update(new[0], new[1])
        return handles[0].attend(None, query, handles[1], None, None)[0]

    step(steps[0])  # compiles
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(steps[1])
        torch.cuda.synchronize()
    assert_stages_then_gemm(prof, ("append_token", "stage1", "stage2"))


@pytest.mark.parametrize("family", ["gemma2-softcap", "gpt-oss-sinks", "gemma4-per-layer-geometry",
                                    "gemma4-kv-sharing"])
def test_attention_variants_on_both_backends_and_in_cuda_graphs(family):
    """Soft-capped logits, learned sinks, Gemma-4's full layers at head_dim 512 (16 query heads on 1 KV head) and
    its KV-sharing layers, bf16: one decode step over an INT2 history gives close logits on both backends, and a
    compiled generate around a static cache tracks eager's logits."""
    import transformers
    from helpers import build_family

    if family == "gemma4-kv-sharing" and not hasattr(transformers.Gemma4TextConfig(), "kv_sharing_modes"):
        pytest.skip(f"transformers {transformers.__version__} has no kv_sharing_modes (the cache refuses KV sharing)")
    # head_dims the kernels serve (64 here; 512 for Gemma-4's full layers, 16 query heads on one KV head)
    overrides = dict(global_head_dim=512, num_attention_heads=16) if "gemma4" in family else dict(head_dim=64)
    model = build_family(family, torch.bfloat16, **overrides).cuda()
    rotations = OscarRotations.hadamard(model.config)
    ids = torch.randint(3, 90, (2, 70), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    logits = {}
    for backend in ("torch", "triton"):
        cache = OscarQuantizedCache.from_pretrained(rotations, model=model, sink_tokens=4, recent_tokens=8,
                                                    backend=backend)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True)
            step = model(input_ids=ids[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], 1),
                         **cache_kwargs(model, cache), use_cache=True)
        logits[backend] = step.logits[:, -1].float()
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=0.05, atol=0.05)

    def generate(**kwargs):
        cache = OscarQuantizedCache.from_pretrained(rotations, model=model, sink_tokens=4, recent_tokens=8, **kwargs)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                             **cache_kwargs(model, cache), output_logits=True, return_dict_in_generate=True)
        return out, cache

    torch._dynamo.reset()
    (compiled, static), (eager, _) = generate(max_cache_len=96), generate()
    assert any(getattr(layer, "graph_step", False) for layer in static.layers), "no layer took graph steps"
    same = (compiled.sequences[:, 70:] == eager.sequences[:, 70:]).all(dim=0).tolist()
    steps = same.index(False) + 1 if False in same else len(same)
    for step in range(steps):
        torch.testing.assert_close(compiled.logits[step].float(), eager.logits[step].float(), rtol=0, atol=0.05)


@pytest.mark.parametrize("family", ["qwen3.5-hybrid", "qwen3-next-hybrid", "deepseek-v3-mla", "kimi-linear-mla-hybrid"])
def test_hybrid_and_latent_attention_on_both_backends(family):
    """Linear-attention hybrids (their full-attention layers through the decode kernel) and multi-head latent
    attention (its INT2 latent history through the dequantize kernel), bf16: a decode step over an INT2 history
    gives close logits on both backends, and a greedy generate runs on each."""
    import transformers
    from helpers import FAMILIES, build_family

    from oscar_hf import UnsupportedModelError, check_model_supported

    if not hasattr(transformers, FAMILIES[family][0]):
        pytest.skip(f"transformers {transformers.__version__} has no {FAMILIES[family][0]}")
    model = build_family(family, torch.bfloat16, **({} if "mla" in family else dict(head_dim=64))).cuda()
    try:
        check_model_supported(model)
    except UnsupportedModelError as refusal:
        pytest.skip(str(refusal))
    rotations = OscarRotations.hadamard(model.config)
    ids = torch.randint(3, 90, (2, 70), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    logits = {}
    for backend in ("torch", "triton"):
        cache = OscarQuantizedCache.from_pretrained(rotations, model=model, sink_tokens=4, recent_tokens=8,
                                                    backend=backend)
        with torch.no_grad():
            model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
            step = model(input_ids=ids[:, -1:], **cache_kwargs(model, cache), use_cache=True)
        assert cache.bits_per_element < 16, "nothing was quantized"
        logits[backend] = step.logits[:, -1].float()
        out = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                             **cache_kwargs(model, OscarQuantizedCache.from_pretrained(
                                 rotations, model=model, sink_tokens=4, recent_tokens=8, backend=backend)))
        assert out.shape == (2, 78)
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=0.05, atol=0.05)



@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_each_left_padded_row_equals_the_row_alone_on_cuda(static):
    """Ragged prompts whose lengths differ by far more than the windows, left-padded as lm-eval batches them: each
    row, teacher-forced (one more token after the prompt: the decode kernel, a static layer's graph step) and greedy
    (generate: compiled around a static cache), gives the logits of that row alone, through the Triton kernels."""
    model = cuda_model("qwen3-gqa-qknorm-d128")
    g = torch.Generator("cuda").manual_seed(3)
    rows = [torch.randint(3, 90, (n,), device="cuda", generator=g) for n in (72, 24, 40)]
    ids = torch.zeros(3, 72, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, 72 - len(row):], mask[i, 72 - len(row):] = row, 1
    nxt = torch.randint(3, 90, (3, 1), device="cuda", generator=g)

    def cache():
        return OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model, sink_tokens=4,
                                                   recent_tokens=8, max_cache_len=96 if static else None)

    def forced(ids, mask, nxt):
        oscar, position = cache(), (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=position, past_key_values=oscar)
            out = model(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1),
                        position_ids=position[:, -1:] + 1, past_key_values=oscar).logits[:, -1].float()
        assert all(layer.n_history > 0 for layer in oscar.layers)
        return out

    def greedy(ids, mask):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                              past_key_values=cache(), output_logits=True, return_dict_in_generate=True)

    together, batch = forced(ids, mask, nxt), greedy(ids, mask)
    for i, row in enumerate(rows):
        alone = forced(row[None], torch.ones_like(row)[None], nxt[i : i + 1])
        torch.testing.assert_close(together[i], alone[0], rtol=0, atol=0.05)
        single = greedy(row[None], torch.ones_like(row)[None])
        for step, logits in enumerate(single.logits):  # until the tokens part (where two tokens tie)
            torch.testing.assert_close(batch.logits[step][i].float(), logits[0].float(), rtol=0, atol=0.05)
            if batch.sequences[i, 72 + step] != single.sequences[0, len(row) + step]:
                break
