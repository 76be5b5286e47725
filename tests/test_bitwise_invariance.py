"""Batch-invariant mode (``batch_invariant=True``, ``--batch-invariant``; ARCHITECTURE.md
"Bitwise invariance"): a request's token ids and logprob bits do not depend on its batch, its
prefill chunking, a prefix-cache hit or a preemption, and a seeded sample draws the same tokens
in all of them.

The default model at ``--dtype auto``: bfloat16 on a CPU with AVX-512-BF16, where every step
then runs ``kvserve::decode_layers`` with every matmul in the bf16 kernel's fixed order. Where
the mode is not available (float32 on an AVX2-only CPU, no C++ kernels) the engine tests skip,
saying so, and asking for it is a clear error (tested everywhere)."""

from __future__ import annotations

import random
from importlib import resources

import pytest
import torch

from kvserve.default_model import default_model_path
from kvserve.engine.llm import LLM
from kvserve.kernels.build import load_kernels
from kvserve.platform import detect_cpu_features
from kvserve.sampling import SamplingParams

MAX_TOKENS = 6


def _invariant_default_path() -> bool:
    # the capped features too (KVSERVE_CPU_FEATURES): policies take native bf16 from them
    return (
        load_kernels()
        and bool(torch.ops.kvserve.cpu_has_avx512_bf16())
        and detect_cpu_features().native_bf16
    )


needs_invariant_path = pytest.mark.skipif(
    not _invariant_default_path(),
    reason="batch-invariant mode needs AVX-512-BF16 and the C++ kernels (this CPU's default "
    "path is the float32 kernels or PyTorch, not invariant yet)",
)


def _llm(**kwargs) -> LLM:
    return LLM(str(default_model_path()), batch_invariant=True, **kwargs)


def test_asking_where_it_cannot_run_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="batch_invariant is not available here: .*bfloat16"):
        LLM(str(default_model_path()), dtype="float32", num_kv_blocks=16, batch_invariant=True)


@pytest.fixture(scope="module")
def prose_ids() -> list[int]:
    text = resources.files("kvserve.data").joinpath("eval_prose.txt").read_text()
    return LLM(str(default_model_path()), num_kv_blocks=16).engine.tokenizer.encode(text)


@pytest.fixture(scope="module")
def prompt(prose_ids: list[int]) -> list[int]:
    return prose_ids[:150]


def _params(prompt_logprobs: bool = True, **kwargs) -> SamplingParams:
    base = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 3, "ignore_eos": True}
    if prompt_logprobs:
        base["prompt_logprobs"] = 1
    return SamplingParams(**(base | kwargs))


def _numbers(out) -> tuple:
    """What must be identical: ids, every logprob's bits (floats compare exactly), and the
    prompt's logprobs where computed."""
    return out.token_ids, out.logprobs, out.prompt_logprobs


@pytest.fixture(scope="module")
def alone(prompt: list[int]) -> tuple:
    llm = _llm(enable_prefix_caching=False, num_kv_blocks=64)
    (out,) = llm.generate([prompt], _params(), use_tqdm=False)
    return _numbers(out)


@needs_invariant_path
def test_every_step_runs_the_fixed_order_kernel() -> None:
    fused = _llm(num_kv_blocks=16).engine.fused_decode
    assert fused is not None and fused.every_step


@needs_invariant_path
def test_the_mode_holds_each_weight_once_interleaved() -> None:
    """Interleaving (models/fixed_order.py) replaces the GGUF rows: the fused layers' members
    view the fused weight's groups and the tied embedding reads the lm_head's, so the bytes
    held are the file's (Q4_1 and Q8_0 keep their bytes per value), the mode holds what the
    default path holds, and the embedding's rows are the file's numbers."""
    import numpy as np
    from gguf import GGUFReader

    from kvserve.kernels.quant_ref import dequantize_rows
    from kvserve.models.quantized_linear import QuantizedEmbedding, QuantizedLinear
    from kvserve.models.weight_formats import resident_bytes

    model = _llm(num_kv_blocks=16).engine.fused_decode.model
    plain = LLM(str(default_model_path()), num_kv_blocks=16, enforce_eager=True)
    base = plain.engine.runner.model
    # (the default path holds them interleaved too, except on AMX CPUs: GGUF rows there)
    linears = [q for q in model.modules() if isinstance(q, QuantizedLinear)]
    assert linears and all(q.policy.interleaved for q in linears)
    assert model.model.embed_tokens.interleaved
    assert resident_bytes(model) == resident_bytes(base)
    reader = GGUFReader(str(default_model_path()))
    quantized = [t for t in reader.tensors if t.tensor_type.name in ("Q4_1", "Q8_0")]
    held = {
        q.qweight.untyped_storage().data_ptr(): q.qweight.untyped_storage().nbytes()
        for q in model.modules()
        if isinstance(q, QuantizedLinear | QuantizedEmbedding)
    }
    assert sum(held.values()) == sum(int(t.n_bytes) for t in quantized)
    (embd,) = [t for t in reader.tensors if t.name == "token_embd.weight"]
    table = torch.from_numpy(np.array(embd.data, copy=True))
    ids = torch.tensor([0, 1, 17, 49151, 300])
    want = dequantize_rows(table, int(embd.tensor_type), ids, table.shape[1] // 34 * 32)
    assert torch.equal(model.model.embed_tokens(ids).float(), want.to(torch.bfloat16).float())
    assert torch.equal(model.model.embed_tokens.weight[ids], want)


@needs_invariant_path
@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_prefill_gives_the_same_bits(prompt: list[int], alone: tuple, chunk: int) -> None:
    llm = _llm(enable_prefix_caching=False, num_kv_blocks=64, max_num_batched_tokens=chunk,
               max_num_seqs=1)  # fmt: skip
    (out,) = llm.generate([prompt], _params(), use_tqdm=False)
    assert _numbers(out) == alone


@needs_invariant_path
def test_a_prompt_over_several_slabs_gives_the_same_bits_in_chunks(prose_ids: list[int]) -> None:
    """decode_layers runs its per-row ops 256 rows at a time: a 600-token step (slabs of 256,
    256, 88) gives the same numbers as chunks of 64 (one slab each)."""
    long_prompt = prose_ids[:600]
    numbers = []
    for chunk in (2048, 64):
        llm = _llm(enable_prefix_caching=False, num_kv_blocks=64, max_num_batched_tokens=chunk)
        (out,) = llm.generate([long_prompt], _params(), use_tqdm=False)
        numbers.append(_numbers(out))
    assert numbers[0] == numbers[1]


@needs_invariant_path
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_with_others_gives_the_same_bits(
    prompt: list[int], prose_ids: list[int], alone: tuple, seed: int
) -> None:
    rng = random.Random(seed)
    others = []
    for _ in range(rng.randint(2, 7)):
        start = rng.randrange(200, len(prose_ids) - 300)
        others.append(prose_ids[start : start + rng.randint(1, 260)])
    at = rng.randint(0, len(others))
    prompts = others[:at] + [prompt] + others[at:]
    params = [_params(temperature=1.0, seed=rng.randint(0, 99)) for _ in others]
    params.insert(at, _params())
    chunk = rng.choice([32, 100, 2048])
    llm = _llm(enable_prefix_caching=False, num_kv_blocks=256, max_num_batched_tokens=chunk)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _numbers(outs[at]) == alone


@needs_invariant_path
@pytest.mark.parametrize("shared", [16, 64, 144])
def test_a_prefix_hit_gives_the_same_bits(
    prompt: list[int], prose_ids: list[int], shared: int
) -> None:
    # prompt logprobs need every position computed: the hit is checked on the output's
    # numbers (the last prompt position's logits and every decode's)
    cold = _llm(enable_prefix_caching=False, num_kv_blocks=64)
    (want,) = cold.generate([prompt], _params(prompt_logprobs=False), use_tqdm=False)
    llm = _llm(num_kv_blocks=64)
    llm.generate([prompt[:shared] + prose_ids[600:640]], _params(False), use_tqdm=False)
    (got,) = llm.generate([prompt], _params(prompt_logprobs=False), use_tqdm=False)
    assert got.num_cached_tokens == shared
    assert _numbers(got) == _numbers(want)


@needs_invariant_path
def test_preemption_and_recompute_give_the_same_bits(
    prompt: list[int], prose_ids: list[int], alone: tuple
) -> None:
    # 24 blocks of 16 tokens: two 150-token prompts (10 blocks each) start, and growing by 80
    # (15 blocks each) one of them is preempted and recomputed later
    prompts = [prompt] + [prose_ids[300 * i : 300 * i + 150] for i in range(1, 4)]
    llm = _llm(enable_prefix_caching=False, num_kv_blocks=24)
    outs = llm.generate(prompts, [_params(max_tokens=80) for _ in prompts], use_tqdm=False)
    assert sum(o.num_preemptions for o in outs) > 0
    (ref,) = _llm(enable_prefix_caching=False, num_kv_blocks=64).generate(
        [prompt], _params(max_tokens=80), use_tqdm=False
    )
    assert _numbers(outs[0]) == _numbers(ref)


@needs_invariant_path
def test_a_seeded_sample_draws_the_same_whatever_the_cache_and_batch(
    prompt: list[int], prose_ids: list[int]
) -> None:
    sampled = _params(prompt_logprobs=False, temperature=1.0, top_p=0.9, seed=1234)
    (want,) = _llm(enable_prefix_caching=False, num_kv_blocks=64).generate(
        [prompt], sampled, use_tqdm=False
    )
    llm = _llm(num_kv_blocks=128)
    llm.generate([prompt[:100]], _params(False), use_tqdm=False)  # a hit of 96 tokens
    outs = llm.generate([prose_ids[500:620], prompt], [_params(False), sampled], use_tqdm=False)
    assert outs[1].num_cached_tokens == 96
    assert _numbers(outs[1]) == _numbers(want)


@needs_invariant_path
def test_n_samples_equal_n_separately_seeded_requests(prompt: list[int]) -> None:
    llm = _llm(num_kv_blocks=64)
    params = _params(prompt_logprobs=False, temperature=1.0, seed=7)
    together = llm.generate([prompt], _params(False, temperature=1.0, seed=7, n=3), use_tqdm=False)
    for i, out in enumerate(together):  # sample i draws from seed + i
        alone_llm = _llm(enable_prefix_caching=False, num_kv_blocks=64)
        (single,) = alone_llm.generate(
            [prompt], SamplingParams(**{**_asdict(params), "seed": 7 + i}), use_tqdm=False
        )
        assert _numbers(out) == _numbers(single)


def _asdict(params: SamplingParams) -> dict:
    from dataclasses import fields

    return {f.name: getattr(params, f.name) for f in fields(params)}


@pytest.mark.skipif(not _invariant_default_path(), reason="needs AVX-512-BF16 and the kernels")
@pytest.mark.parametrize("qtype", [2, 3, 6, 8])  # Q4_0, Q4_1 (register GEMV), Q5_0, Q8_0
def test_fixed_order_kernel_gives_a_row_the_same_bits_at_any_row_count(qtype: int) -> None:
    from kvserve.kernels.quant_ref import quantize

    torch.manual_seed(qtype)
    n, k = 70, 1536  # a tail tile of weight rows (70 % 4 == 2) and two K chunks of 1024
    qweight = quantize(torch.randn(n, k), qtype)
    x = torch.randn(2049, k).to(torch.bfloat16)

    def mm(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvserve.quant_matmul_bf16(rows.contiguous(), qweight, qtype, n, 0, True)

    alone = torch.cat([mm(x[i : i + 1]) for i in range(0, 2049, 97)])
    for m in (1, 3, 17, 64, 129, 512, 2049):
        got = mm(x[:m])
        for j, i in enumerate(range(0, 2049, 97)):
            if i < m:
                assert torch.equal(got[i], alone[j]), (m, i)


@needs_invariant_path
def test_same_text_through_the_server_with_the_cache_on_off_and_hit(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The lesson's check ("same text? True") through `kvserve serve --batch-invariant`: a completion
    of the first 1,500 characters of a text, temperature 0, 24 tokens, computed cold, then as a
    prefix hit, then on a server with the prefix cache off; the texts and logprobs equal."""
    from server_helpers import start_server

    text = resources.files("kvserve.data").joinpath("eval_prose.txt").read_text()[:1500]
    body = {"model": "tiny-chat", "prompt": text, "max_tokens": 24, "temperature": 0}
    body |= {"logprobs": 2}
    results = []
    for args in ((), ("--no-prefix-caching",)):
        log_dir = tmp_path_factory.mktemp("serve")
        server = start_server(default_model_path(), log_dir, "--batch-invariant", *args)
        try:
            with server.http() as http:
                for _ in range(1 if args else 2):
                    r = http.post("/v1/completions", json=body, timeout=120)
                    assert r.status_code == 200, r.text
                    results.append(r.json())
        finally:
            server.stop()
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results]
    assert cached[0] == 0 and cached[1] > 256 and cached[2] == 0, cached
    first = results[0]["choices"][0]
    for r in results[1:]:
        assert r["choices"][0]["text"] == first["text"]
        assert r["choices"][0]["logprobs"] == first["logprobs"]


@pytest.mark.skipif(not _invariant_default_path(), reason="needs AVX-512-BF16 and the kernels")
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [
    (9, 3, 64, 16), (8, 8, 64, 16), (16, 2, 128, 8), (4, 1, 256, 16),
])  # fmt: skip
def test_attention_gives_a_query_the_same_bits_as_decode_or_in_any_chunk(
    heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    """paged_decode_attention_dp (batch-invariant mode's attention over a bfloat16 cache): the
    rows of one request at consecutive positions (a prefill chunk, computed 16 queries at a
    time) equal each row computed alone (a decode, keys in lanes), in chunks of any length, and
    beside another request's rows; and it is attention (against a float64 reference)."""
    torch.manual_seed(head_dim + heads)
    length, num_blocks = 150, 64
    kc = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(torch.bfloat16)
    vc = torch.randn_like(kc)
    width = -(-length // block_size)
    table = torch.randperm(num_blocks)[:width]
    q = (torch.randn(length, heads, head_dim) * 0.2).to(torch.bfloat16).float()
    pos = torch.arange(length)

    def attend(rows: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        lens = pos[rows] + 1
        return torch.ops.kvserve.paged_decode_attention_dp(
            q[rows].contiguous(), kc, vc, tables, lens.contiguous(), 1.0
        )

    alone = torch.cat([attend(pos[i : i + 1], table[None]) for i in range(length)])
    # attention with P rounded to bfloat16 (as the kernel's VDPBF16PS takes it) and the sum of
    # the unrounded P, in float64: the kernel differs by its float32 exp and summation order
    # (a bfloat16 ulp of one P at most: up to ~8e-4 at head_dim 128); from exact attention by
    # ~2.5e-3 and more
    keys = kc[table].flatten(0, 1)[:length].double().repeat_interleave(heads // kv_heads, 1)
    vals = vc[table].flatten(0, 1)[:length].double().repeat_interleave(heads // kv_heads, 1)
    s = torch.einsum("ihd,jhd->hij", q.double(), keys)
    s = s.masked_fill(pos[None, :, None] < pos[None, None, :], float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    ref = torch.einsum("hij,jhd->ihd", p.float().bfloat16().double(), vals)
    ref = ref / p.sum(-1).T[..., None]
    torch.testing.assert_close(alone.double(), ref, rtol=1e-2, atol=2e-3)
    for chunk in (1, 3, 7, 16, 17, 64, length):
        for lo in range(0, length, chunk):
            rows = pos[lo : lo + chunk]
            got = attend(rows, table.expand(len(rows), -1).contiguous())
            assert torch.equal(got, alone[rows]), (chunk, lo)
    # beside another request's chunk and a decode: the same
    other = torch.randperm(num_blocks)[:width]
    rows = torch.cat([pos[100:101], pos[20:60], pos[70:90]])
    tables = torch.cat([other[None], table.expand(40, -1), other.expand(20, -1)])
    got = attend(rows, tables.contiguous())
    assert torch.equal(got[1:41], alone[20:60])
