"""Fused Triton MoE (and the torch._grouped_mm path) against the torch reference `moe_experts`, on CPU.

Kernels run under the Triton interpreter; sizes are tiny so the module stays well under a minute on 2 cores.
"""



import pytest
import torch

pytest.importorskip("triton")

from conftest import on_device

from qwen4exp.ops.moe import grouped_mm_available, grouped_moe
from qwen4exp.ops.moe import moe_experts_ref as moe_experts
from qwen4exp.ops.moe_triton import MoEConfig, Tile, fused_moe, get_config, moe_align, moe_align_triton, pairwise_moe

fused_moe = on_device(fused_moe)
pairwise_moe = on_device(pairwise_moe)
moe_align = on_device(moe_align)
grouped_moe = on_device(grouped_moe)


def _problem(n, h, i, e, k, dtype, seed=0, experts=None, ids_dtype=torch.int64):
    """Random weights scaled to keep activations O(1); each token picks k distinct experts from `experts`."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(e) if experts is None else torch.tensor(experts)
    x = torch.randn(n, h, generator=g).to(dtype)
    gate_up = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    down = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(n)]).to(ids_dtype)
    weights = torch.softmax(torch.randn(n, k, generator=g), dim=-1).to(dtype)
    return x, gate_up, down, ids, weights


def _rel_err(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


def _align_reference(ids, num_experts, block_m):
    flat = ids.reshape(-1).tolist()
    rows, blocks = [], []
    for e in range(num_experts):
        pairs = [p for p, x in enumerate(flat) if x == e]
        if not pairs:
            continue
        n_blocks = -(-len(pairs) // block_m)
        rows += pairs + [len(flat)] * (n_blocks * block_m - len(pairs))
        blocks += [e] * n_blocks
    return rows, blocks


@pytest.mark.parametrize(
    "n,k,e,block_m,experts",
    [(1, 1, 4, 16, None), (3, 2, 8, 4, None), (17, 3, 16, 16, [1, 4, 9]), (64, 2, 8, 8, None), (9, 1, 6, 4, [5]),
     (64, 10, 128, 16, None), (13, 10, 100, 16, [3, 99, 50, 7, 8, 9, 10, 11, 12, 13])],
)
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_moe_align_matches_reference(n, k, e, block_m, experts, impl):
    _, _, _, ids, _ = _problem(n, 8, 8, e, k, torch.float32, seed=n, experts=experts)
    align = moe_align if impl == "torch" else on_device(moe_align_triton)
    sorted_ids, expert_ids, npp = align(ids.to(torch.int32), e, block_m)

    num_pairs = n * k
    num_blocks = min(num_pairs, (num_pairs + e * (block_m - 1)) // block_m)
    assert sorted_ids.shape == (num_blocks * block_m,) and expert_ids.shape == (num_blocks,) and npp.shape == (1,)
    assert sorted_ids.dtype == expert_ids.dtype == npp.dtype == torch.int32

    rows, blocks = _align_reference(ids, e, block_m)
    used = int(npp)
    assert used == len(rows)
    assert sorted_ids[:used].tolist() == rows
    assert (sorted_ids[used:] == num_pairs).all()
    assert expert_ids[: len(blocks)].tolist() == blocks
    assert (expert_ids[len(blocks) :] == -1).all()


# Small tiles force several K iterations and ragged K / N edges; None takes get_config's choice for the shape.
_SMALL = MoEConfig(block_m=16, gate_up=Tile(block_n=16, block_k=16), down=Tile(block_n=16, block_k=16, group_m=2))
_RAGGED = MoEConfig(block_m=16, gate_up=Tile(block_n=16, block_k=32), down=Tile(block_n=32, block_k=16, group_m=3))


@pytest.mark.parametrize(
    "n,h,i,e,k,config",
    [
        (1, 32, 16, 8, 2, None),
        (3, 64, 32, 8, 3, None),
        (17, 64, 32, 16, 3, _SMALL),
        (64, 32, 16, 8, 2, None),
        (64, 64, 32, 8, 3, _SMALL),
        (17, 48, 24, 8, 2, _RAGGED),
    ],
)
def test_fused_moe_fp32(n, h, i, e, k, config):
    x, gate_up, down, ids, weights = _problem(n, h, i, e, k, torch.float32, seed=n + h)
    out = fused_moe(x, gate_up, down, ids, weights, config=config)
    ref = moe_experts(x, gate_up, down, ids, weights)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert _rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("num_tokens", [1, 300, 3000, 100_000])
def test_fused_moe_every_default_tier(num_tokens):
    # Each tier of get_config (BLOCK_M 16/32/64/128 at the real E=128, k=10) run on a small problem.
    config = get_config(num_tokens, 128, 10, 2560, 640)
    x, gate_up, down, ids, weights = _problem(40, 64, 32, 8, 3, torch.float32, seed=num_tokens)
    out = fused_moe(x, gate_up, down, ids, weights, config=config)
    assert _rel_err(out, moe_experts(x, gate_up, down, ids, weights)) < 1e-4


def test_get_config_block_m_grows_with_rows_per_expert():
    block_m = [get_config(n, 128, 10, 2560, 640).block_m for n in (1, 64, 512, 2048, 16384)]
    assert block_m == sorted(block_m) and block_m[0] == 16 and block_m[-1] == 128


def test_fused_moe_unused_experts_and_int32_ids():
    x, gate_up, down, ids, weights = _problem(17, 64, 32, 16, 3, torch.float32, experts=[2, 7, 11, 15],
                                              ids_dtype=torch.int32)
    out = fused_moe(x, gate_up, down, ids, weights, config=_SMALL)
    assert _rel_err(out, moe_experts(x, gate_up, down, ids, weights)) < 1e-4


@pytest.mark.parametrize("k", [1, 2])
def test_fused_moe_all_tokens_same_experts(k):
    x, gate_up, down, _, weights = _problem(33, 32, 16, 8, k, torch.float32)
    ids = torch.tensor([[5, 1][:k]] * 33)
    out = fused_moe(x, gate_up, down, ids, weights, config=_SMALL)
    assert _rel_err(out, moe_experts(x, gate_up, down, ids, weights)) < 1e-4


@pytest.mark.parametrize("n,config", [(1, None), (17, _SMALL), (64, None)])
def test_fused_moe_bf16(n, config):
    x, gate_up, down, ids, weights = _problem(n, 64, 32, 8, 3, torch.bfloat16, seed=n)
    out = fused_moe(x, gate_up, down, ids, weights, config=config)
    assert out.dtype == torch.bfloat16
    # Against fp32 math on the same bf16 inputs: the kernel rounds less than the bf16 reference does.
    ref = moe_experts(x.float(), gate_up.float(), down.float(), ids, weights.float())
    assert _rel_err(out, ref) < 2e-2
    assert _rel_err(out, moe_experts(x, gate_up, down, ids, weights)) < 3e-2


@pytest.mark.skipif(not grouped_mm_available(torch.empty(0)), reason="torch._grouped_mm unavailable on CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,experts", [(1, None), (17, [0, 3, 6]), (64, None)])
def test_grouped_moe(dtype, n, experts):
    x, gate_up, down, ids, weights = _problem(n, 64, 32, 8, 3, dtype, seed=n, experts=experts)
    out = grouped_moe(x, gate_up, down, ids, weights)
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert _rel_err(out, moe_experts(x, gate_up, down, ids, weights)) < 1e-4
    else:
        ref = moe_experts(x.float(), gate_up.float(), down.float(), ids, weights.float())
        assert _rel_err(out, ref) < 3e-2


@pytest.mark.parametrize("n, k, e, tiles", [(1, 2, 8, {}), (3, 3, 16, {}), (8, 2, 4, {}),
                                            (3, 2, 8, dict(block_n=16, down_block_n=32)),  # the GPU's defaults
                                            (2, 2, 8, dict(block_n=32, block_k=32, down_block_n=16, down_block_k=32))])
def test_pairwise_moe_matches_reference(n, k, e, tiles):
    """The small-batch path (one program per token-expert pair, no sort) against the reference, its weights in one
    tile or several (partial ones included)."""
    g = torch.Generator().manual_seed(n * 100 + k)
    h, i = 64, 48
    x = torch.randn(n, h, generator=g)
    gate_up = torch.randn(e, 2 * i, h, generator=g) / 8
    down = torch.randn(e, h, i, generator=g) / 7
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    weights = torch.softmax(torch.randn(n, k, generator=g), -1)
    out = pairwise_moe(x, gate_up, down, ids, weights, **tiles)
    assert _rel_err(out, moe_experts(x, gate_up, down, ids, weights)) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,weights,shared", [(False, False, False), (True, True, False), (True, True, True),
                                                 (False, False, True)])
@pytest.mark.parametrize("block", [None, 512, 1024])  # the default (256 columns at 5 tokens), overrides
def test_sum_pairs_matches_reference(dtype, rows, weights, shared, block):
    from kernel_references import sum_pairs_ref

    from qwen4exp.ops.moe_triton import sum_pairs

    n, k, h = 5, 3, 1100  # two or three hidden tiles, the last ragged
    g = torch.Generator().manual_seed(11)
    y = torch.randn(n * k, h, generator=g).to(dtype)
    args = dict(
        rows=torch.randperm(n * k, generator=g).view(n, k) if rows else None,
        weights=torch.rand(n, k, generator=g).to(dtype) if weights else None,
        # the shared gate logit is a strided column of the router's merged output, as in the model
        shared=(torch.randn(n, h, generator=g).to(dtype), torch.randn(n, 9, generator=g).to(dtype)[:, 4:5])
        if shared else None,
    )
    out = on_device(sum_pairs)(y, k, **args, block=block)
    ref = sum_pairs_ref(y, k, **args)
    assert out.dtype == dtype and out.shape == (n, h)
    # bf16: one rounding in both, but the interpreter's conversion may land one ulp off the GPU's
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("path", ["pairwise", "fused", "grouped"])
def test_experts_add_the_gated_shared_expert(path):
    """Every fast path's `shared` fold equals the model's routed + sigmoid(logit) * shared_out."""
    from qwen4exp.ops.moe import moe_block_ref

    x, gate_up, down, ids, weights = _problem(6, 64, 48, 8, 3, torch.float32, seed=5)
    g = torch.Generator().manual_seed(8)
    shared = (torch.randn(6, 64, generator=g), torch.randn(6, 1, generator=g))
    fn = {"pairwise": pairwise_moe, "fused": fused_moe, "grouped": grouped_moe}[path]
    if path == "grouped" and not grouped_mm_available(x):
        pytest.skip("torch._grouped_mm unavailable")
    out = fn(x, gate_up, down, ids, weights, shared=shared)
    assert _rel_err(out, moe_block_ref(x, gate_up, down, ids, weights, shared)) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_experts,top_k,renormalize", [(128, 10, True), (8, 2, False), (100, 3, True)])
def test_fused_route_matches_reference(dtype, num_experts, top_k, renormalize):
    from qwen4exp.ops.moe import route_ref
    from qwen4exp.ops.moe_triton import route_triton

    g = torch.Generator().manual_seed(num_experts)
    # distinct values (multiples of 1/16, exact in bf16): which of two equal probabilities top-k takes is unspecified
    logits = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(37)]).to(dtype) / 16 - 3
    weights, ids = on_device(route_triton)(logits, top_k, renormalize)
    ref_weights, ref_ids = route_ref(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == dtype
    assert torch.equal(ids, ref_ids)  # descending order, as torch.topk
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(weights.float(), ref_weights.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,shared_inter", [(1, 4, 48), (3, 2, 40), (9, 1, 300)])
def test_pairwise_moe_computes_the_shared_expert(dtype, n, k, shared_inter):
    """The shared expert's down projection in the routed experts' launch, from strided views of the router GEMM's
    output (as the model passes them), equals the model's routed + sigmoid(logit) * down(silu(gate) * up)."""
    from qwen4exp.ops.moe import moe_block_ref, silu_mul

    x, gate_up, down, ids, weights = _problem(n, 64, 48, 8, k, dtype, seed=n + k)
    g = torch.Generator().manual_seed(3)
    merged = torch.randn(n, 8 + 1 + 2 * shared_inter, generator=g).to(dtype)  # router | gate logit | gate | up
    logit, sg, su = merged[:, 8:9], merged[:, 9:9 + shared_inter], merged[:, 9 + shared_inter:]
    sw = (torch.randn(64, shared_inter, generator=g) / shared_inter**0.5).to(dtype)
    out = pairwise_moe(x, gate_up, down, ids, weights, shared_expert=(sg, su, sw, logit))
    ref = moe_block_ref(x, gate_up, down, ids, weights, (torch.nn.functional.linear(silu_mul(sg, su), sw), logit))
    assert out.dtype == dtype and out.shape == (n, 64)
    assert _rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_halves_matches_eager_silu_mul(dtype):
    """The grouped experts' activation: silu of the first half times the second, rounded as eager rounds (bf16
    bit for bit), from rows of a wider buffer, with row and column tails."""
    from qwen4exp.ops.moe import silu_mul
    from qwen4exp.ops.moe_triton import silu_mul_halves

    g = torch.Generator().manual_seed(4)
    buf = (torch.randn(45, 2 * 200 + 24, generator=g) * 3).to(dtype)
    gate_up = buf[:, : 2 * 200]
    out = on_device(silu_mul_halves)(gate_up)
    ref = silu_mul(*gate_up.chunk(2, dim=-1))
    assert out.shape == (45, 200) and out.dtype == dtype
    if dtype == torch.bfloat16:
        assert (out != ref).float().mean() < 1e-2  # an ulp where the exp differs, never a skipped rounding
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams need a GPU")
def test_shared_expert_on_a_side_stream_is_joined_eagerly_and_in_graphs():
    """At decode sizes `moe_experts` runs the shared expert on a side stream beside the routed experts: the result
    equals computing it in line bit for bit, eagerly and replayed from a CUDA graph with new inputs (an output read
    before the side stream wrote it would differ; an unjoined side stream fails the capture)."""
    from qwen4exp.ops import moe
    from qwen4exp.ops.moe_triton import fused_moe as fused_in_line

    n, h, i, e, k, si = 64, 256, 128, 32, 4, 96
    g = torch.Generator().manual_seed(11)
    x, gate_up, down, ids, weights = (t.cuda() for t in _problem(n, h, i, e, k, torch.bfloat16, seed=11))
    gate, up = (torch.randn(n, si, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    shared_down = (torch.randn(h, si, generator=g) / si**0.5).to("cuda", torch.bfloat16)
    logit = torch.randn(n, 1, generator=g).to("cuda", torch.bfloat16)

    def in_line():
        shared_out = torch.mm(moe.silu_mul(gate, up), shared_down.t())
        return fused_in_line(x, gate_up, down, ids, weights, shared=(shared_out, logit))

    def side():
        return moe.moe_experts(x, gate_up, down, ids, weights, shared_expert=(gate, up, shared_down, logit))

    assert torch.equal(side(), in_line())
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        side()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = side()
    for t in (x, gate, up, logit):
        t.copy_(torch.randn(t.shape, generator=g).to("cuda", torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, in_line())


@pytest.mark.parametrize("tokens,top_k,experts,skew", [(3, 2, 8, False), (250, 10, 128, False), (130, 8, 6, True),
                                                       (103, 10, 128, True), (1, 1, 4, False)])
def test_sort_pairs_is_the_stable_expert_order(tokens, top_k, experts, skew):
    """The grouped path's counting sort (three launches; several 1024-pair blocks here) gives exactly torch's stable
    argsort, the group ends and the inverse permutation, with experts left empty and runs crossing blocks."""
    from kernel_references import sort_pairs_ref

    from qwen4exp.ops.moe_triton import sort_pairs

    g = torch.Generator().manual_seed(tokens + experts)
    if skew:  # most pairs on two experts, some experts unused
        few = torch.randint(0, 2, (tokens, top_k), generator=g)
        ids = torch.where(torch.rand(tokens, top_k, generator=g) < 0.8, few,
                          torch.randint(0, experts, (tokens, top_k), generator=g))
    else:
        ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    for dtype in (torch.int64, torch.int32):
        got = on_device(sort_pairs)(ids.to(dtype), experts)
        want = sort_pairs_ref(ids.to(dtype), experts)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a.cpu(), b), (a, b)


@pytest.mark.parametrize("tokens,top_k,hidden,block,dtype", [
    (37, 10, 80, 32, torch.bfloat16), (5, 3, 100, 1024, torch.float32), (0, 2, 64, 64, torch.float32)])
def test_spread_rows_is_the_gather_in_expert_order(tokens, top_k, hidden, block, dtype):
    """The grouped GEMM's input, written token by token to each pair's sorted row (ragged last column tile here),
    equals the gather x[order // top_k] bit for bit."""
    from kernel_references import sort_pairs_ref

    from qwen4exp.ops.moe_triton import spread_rows

    g = torch.Generator().manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.randint(0, 8, (tokens, top_k), generator=g)
    order, _, rows = sort_pairs_ref(ids, 8)
    got = on_device(spread_rows)(x, rows, top_k, block)
    assert got.shape == (tokens * top_k, hidden) and torch.equal(got, x[order // top_k])
