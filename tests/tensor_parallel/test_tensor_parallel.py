"""Tensor parallelism from the project's collectives (ddp_from_scratch/tensor_parallel): the MLP
block split over 2 ranks against the one-rank block and against torch's parallelize_module with
ColwiseParallel and RowwiseParallel on the same weights and data, the messages against Megatron's
closed form, and bad sizes refused by name.

    pytest tests/tensor_parallel/test_tensor_parallel.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from collectives.testing import run_on_ranks
from ddp_from_scratch.tensor_parallel import parity
from ddp_from_scratch.tensor_parallel.mlp import TensorParallelMLP, one_rank_mlp
from ddp_from_scratch.tensor_parallel.operators import counting

B, S, H = 3, 8, 16
# the backends at 2 ranks, and TP over 4 ranks (a quarter of each layer) on Gloo
BACKENDS_AND_SIZES = pytest.mark.parametrize("backend, world_size", [("gloo", 2), ("shm", 2), ("gloo", 4)],
                                             ids=["gloo-2", "shm-2", "gloo-4"])
# the whole transformer also on shm over 4 ranks: every part of it, end to end
EVERY_BACKEND_AND_SIZE = pytest.mark.parametrize("backend, world_size",
                                                 [("gloo", 2), ("shm", 2), ("gloo", 4), ("shm", 4)],
                                                 ids=["gloo-2", "shm-2", "gloo-4", "shm-4"])


def _data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)


def _one_rank():
    full = one_rank_mlp(H)
    x, dy = _data()
    x.requires_grad_(True)
    y = full(x)
    y.backward(dy)
    return full, x, y


def _ours(env, backend, sequence_parallel):
    group = dist.new_group(backend=backend)
    p, r = env.world_size, env.rank
    full, x_full, y_full = _one_rank()
    mlp = TensorParallelMLP(one_rank_mlp(H), group, sequence_parallel=sequence_parallel)
    x, dy = _data()
    if sequence_parallel:  # this rank's slice of the sequence in, its slice of the output out
        k = S // p
        x, dy = x[:, r * k:(r + 1) * k].contiguous(), dy[:, r * k:(r + 1) * k].contiguous()
    x.requires_grad_(True)
    with counting() as forward:
        y = mlp(x)
    with counting() as backward:
        y.backward(dy)
    k4 = 4 * H // p
    want = y_full[:, r * (S // p):(r + 1) * (S // p)] if sequence_parallel else y_full
    want_dx = x_full.grad[:, r * (S // p):(r + 1) * (S // p)] if sequence_parallel else x_full.grad
    return {
        "y": (y.detach(), want.detach()),
        "dx": (x.grad, want_dx),
        "up.weight.grad": (mlp.up.weight.grad, full[0].weight.grad[r * k4:(r + 1) * k4]),
        "up.bias.grad": (mlp.up.bias.grad, full[0].bias.grad[r * k4:(r + 1) * k4]),
        "down.weight.grad": (mlp.down.weight.grad, full[2].weight.grad[:, r * k4:(r + 1) * k4]),
        # the down-projection's bias is whole on every rank: with sequence parallelism each rank's
        # gradient covers its slice only (a DP-style all_reduce over the TP group completes it)
        "down.bias.grad": (mlp.down.bias.grad, None if sequence_parallel else full[2].bias.grad),
        "messages": (forward, backward),
    }


@BACKENDS_AND_SIZES
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_the_split_mlp_is_the_one_rank_mlp_and_sends_megatrons_messages(backend, world_size, sequence_parallel):
    """Within float32 rounding of the one-rank block (each output element is a sum over 4h
    features, split in p partial sums and added in another order), and exactly Megatron's
    messages: one all_reduce of batch x seq x hidden forward and one backward; with sequence
    parallelism an all_gather of each rank's slice and a reduce_scatter of the whole, each way."""
    for rank, got in enumerate(run_on_ranks(_ours, world_size, args=(backend, sequence_parallel), backend="gloo")):
        for name, (mine, want) in got.items():
            if name == "messages" or want is None:
                continue
            torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}, {name}: {m}")
        forward, backward = got["messages"]
        if sequence_parallel:
            slice_ = B * S // world_size * H
            assert forward == [("all_gather", slice_), ("reduce_scatter", B * S * H)], forward
            assert backward == [("all_gather", slice_), ("reduce_scatter", B * S * H)], backward
        else:
            assert forward == [("all_reduce", B * S * H)] and backward == [("all_reduce", B * S * H)], (forward, backward)


def _against_torch(env, backend, bias_in_partial_sums):
    """torch's ColwiseParallel / RowwiseParallel on a copy of the same block, on a DeviceMesh over
    the same group, beside ours (tensor_parallel/parity.py)."""
    return parity.mlp_against_torch(dist.new_group(backend=backend), bias_in_partial_sums)


@BACKENDS_AND_SIZES
def test_the_split_mlp_is_bitwise_torchs_colwise_and_rowwise_parallel(backend, world_size):
    """With torch's order for the down-projection's bias (b / p in each partial sum), every output,
    gradient and input gradient is torch's bit for bit: the same kernels on the same shards, the
    same all_reduces of the same partial sums."""
    for rank, got in enumerate(run_on_ranks(_against_torch, world_size, args=(backend, True), backend="gloo")):
        for name, (mine, theirs) in got.items():
            assert torch.equal(mine, theirs), f"rank {rank}, {name}: {(mine - theirs).abs().max()}"


def test_megatrons_bias_order_differs_from_torchs_in_the_last_bits_only():
    """Megatron's order (the bias once, after the sum) against torch's: y and everything after it
    differ by at most a few units in the last place (one rounding of b / p per rank, and the
    bias added before the sum instead of after); what comes before the bias is the same bits."""
    for rank, got in enumerate(run_on_ranks(_against_torch, 2, args=("gloo", False), backend="gloo")):
        for name, (mine, theirs) in got.items():
            if name in ("up.weight.grad", "up.bias.grad", "down.weight.grad", "dx", "down.bias.grad"):
                torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6, msg=lambda m: f"rank {rank}, {name}: {m}")
            else:
                bound = 4 * torch.finfo(torch.float32).eps * theirs.abs().max()  # 4 units in the last place of the largest
                assert (mine - theirs).abs().max() <= bound, f"rank {rank}, {name}: {(mine - theirs).abs().max()}"
                assert not torch.equal(mine, theirs), f"rank {rank}, {name}: the orders gave the same bits here"


def _refused(env):
    group = dist.new_group(backend="gloo")
    try:
        TensorParallelMLP(one_rank_mlp(4, ffn=7), group)  # 7 inner features over 2 ranks
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_a_size_the_tp_size_does_not_divide_is_refused_by_name():
    for said in run_on_ranks(_refused, 2, backend="gloo"):
        assert said == ("the MLP's up-projection's out_features is 7, which the tensor-parallel size 2 does not "
                        "divide: choose a size that is a multiple of 2"), said


# -- the attention block: heads split over the TP group ------------------------------------------
HEADS = 4


def _attention_ours(env, backend):
    from ddp_from_scratch.tensor_parallel.attention import TensorParallelAttention, one_rank_attention

    group = dist.new_group(backend=backend)
    r, k = env.rank, H // env.world_size
    full = one_rank_attention(H, HEADS)
    x_full, dy = _data()
    x_full.requires_grad_(True)
    full(x_full).backward(dy)
    attn = TensorParallelAttention(one_rank_attention(H, HEADS), group)
    x = _data()[0].requires_grad_(True)
    with counting() as forward:
        y = attn(x)
    with counting() as backward:
        y.backward(dy)
    got = {"y": (y.detach(), full(x_full).detach()), "dx": (x.grad, x_full.grad),
           "out.weight.grad": (attn.out.weight.grad, full.out.weight.grad[:, r * k:(r + 1) * k]),
           "out.bias.grad": (attn.out.bias.grad, full.out.bias.grad)}
    for n in ("q", "k", "v"):
        got[f"{n}.weight.grad"] = (getattr(attn, n).weight.grad, getattr(full, n).weight.grad[r * k:(r + 1) * k])
        got[f"{n}.bias.grad"] = (getattr(attn, n).bias.grad, getattr(full, n).bias.grad[r * k:(r + 1) * k])
    return got, (forward, backward)


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_the_split_attention_is_the_one_rank_attention_with_one_all_reduce_each_way(backend):
    """Heads split 2 + 2 over 2 ranks: within float32 rounding of the one-rank block (the output
    projection's sum over features is split in partial sums), and one all_reduce of batch x seq x
    hidden forward (g) and one backward (f, once for q, k and v)."""
    for rank, (got, (forward, backward)) in enumerate(run_on_ranks(_attention_ours, 2, args=(backend,),
                                                                   backend="gloo")):
        for name, (mine, want) in got.items():
            torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}, {name}: {m}")
        assert forward == [("all_reduce", B * S * H)] and backward == [("all_reduce", B * S * H)], (forward, backward)


def _attention_against_torch(env, backend):
    return parity.attention_against_torch(dist.new_group(backend=backend))


@BACKENDS_AND_SIZES
def test_the_split_attention_is_torchs_colwise_and_rowwise_parallel(backend, world_size):
    """Bit for bit torch's parallelize_module (ColwiseParallel on q, k, v, RowwiseParallel on the
    output projection), but for the input's gradient: torch's three ColwiseParallel layers each
    all-reduce their share of it and add the three sums; ours adds the three shares and
    all-reduces once (a third of the messages). The same numbers added in another order: within
    4 units in the last place of the largest element."""
    for rank, got in enumerate(run_on_ranks(_attention_against_torch, world_size, args=(backend,), backend="gloo")):
        for name, (mine, theirs) in got.items():
            if name == "dx":
                bound = 4 * torch.finfo(torch.float32).eps * theirs.abs().max()
                assert (mine - theirs).abs().max() <= bound, f"rank {rank}, dx: {(mine - theirs).abs().max()}"
            else:
                assert torch.equal(mine, theirs), f"rank {rank}, {name}: {(mine - theirs).abs().max()}"


def _attention_refused(env):
    from ddp_from_scratch.tensor_parallel.attention import TensorParallelAttention, one_rank_attention

    group = dist.new_group(backend="gloo")
    said = []
    for hidden, heads in ((12, 3), (12, 5)):
        try:
            TensorParallelAttention(one_rank_attention(hidden, heads), group)
            said.append("accepted")
        except ValueError as exc:
            said.append(str(exc))
    return said


def test_a_head_count_the_tp_size_does_not_divide_is_refused_by_name():
    for said in run_on_ranks(_attention_refused, 2, backend="gloo"):
        assert said == ["the attention's 3 heads do not split over the tensor-parallel size 2: choose a head count "
                        "that is a multiple of 2",
                        "the hidden size 12 does not split into 5 heads: choose a multiple of 5"], said


# -- the vocabulary: embedding rows and the cross-entropy of split logits -------------------------
VOCAB = 12


def _tokens(seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (B, S), generator=g), torch.randint(0, VOCAB, (B, S), generator=g)


def _vocab(env, backend):
    from torch import nn

    from ddp_from_scratch.tensor_parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

    group = dist.new_group(backend=backend)
    r, k = env.rank, VOCAB // env.world_size
    torch.manual_seed(0)
    full = nn.Embedding(VOCAB, H)
    tokens, targets = _tokens()
    dy = _data()[1]
    full(tokens).backward(dy)
    embed = VocabParallelEmbedding(full, group)
    embed.weight.grad = None
    with counting() as forward:
        x = embed(tokens)
    x.backward(dy)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, S, VOCAB, generator=g, requires_grad=True)
    want = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
    want.backward()
    mine = logits.detach()[..., r * k:(r + 1) * k].clone().requires_grad_(True)
    with counting() as ce_forward:
        loss = vocab_parallel_cross_entropy(mine, targets, group)
    with counting() as ce_backward:
        loss.backward()
    return {"lookup": (x.detach(), full(tokens).detach()), "embedding grad": (embed.weight.grad, full.weight.grad[r * k:(r + 1) * k]),
            "loss": (loss.detach(), want.detach()), "logits grad": (mine.grad, logits.grad[..., r * k:(r + 1) * k]),
            "messages": (forward, ce_forward, ce_backward)}


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_the_split_vocabulary_is_the_one_rank_embedding_and_cross_entropy(backend):
    """The embedding bit for bit the one-rank lookup and its gradient (each row comes from one
    rank, zeros from the others); the cross-entropy of logits split by vocabulary within float32
    rounding of F.cross_entropy on the whole logits, and its gradient; three all_reduces of one
    number per token forward (max, normaliser, target), none backward."""
    for rank, got in enumerate(run_on_ranks(_vocab, 2, args=(backend,), backend="gloo")):
        for name in ("lookup", "embedding grad"):
            mine, want = got[name]
            assert torch.equal(mine, want), f"rank {rank}, {name}: {(mine - want).abs().max()}"
        for name in ("loss", "logits grad"):
            mine, want = got[name]
            torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}, {name}: {m}")
        forward, ce_forward, ce_backward = got["messages"]
        assert forward == [("all_reduce", B * S * H)], forward
        assert ce_forward == [("all_reduce", B * S)] * 3 and ce_backward == [], (ce_forward, ce_backward)


def _vocab_edges(env, backend):
    """What F.cross_entropy and nn.Embedding do at their edges, on split logits and rows: ignored
    targets (the default -100 and another index), logits large enough that only the right shift
    (the maximum over every rank's columns) keeps e^(z - m) from underflowing, and ids outside
    the vocabulary, refused on every rank; the group still works after each refusal."""
    from torch import nn

    from ddp_from_scratch.tensor_parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

    group = dist.new_group(backend=backend)
    r, k = env.rank, VOCAB // env.world_size
    g = torch.Generator().manual_seed(5)
    _, targets = _tokens()
    got = {}
    for name, scale, ignore, ignored in (("ignore -100", 1.0, -100, (0, 3, 7)), ("ignore 5", 1.0, 5, ()),
                                         ("large logits", 3e3, -100, (1,)), ("all ignored", 1.0, -100, range(S))):
        t = targets.clone()
        t[0, list(ignored)] = ignore
        if name == "all ignored":
            t[:] = ignore
        logits = (torch.randn(B, S, VOCAB, generator=g) * scale).requires_grad_(True)
        for reduction in ("mean", "sum", "none"):
            logits.grad = None
            want = F.cross_entropy(logits.transpose(1, 2), t, ignore_index=ignore, reduction=reduction)
            want.sum().backward()
            mine = logits.detach()[..., r * k:(r + 1) * k].clone().requires_grad_(True)
            loss = vocab_parallel_cross_entropy(mine, t, group, reduction=reduction, ignore_index=ignore)
            loss.sum().backward()
            got[f"{name}, {reduction}"] = (loss.detach(), want.detach(), mine.grad, logits.grad[..., r * k:(r + 1) * k])
    said = []
    torch.manual_seed(0)
    embed = VocabParallelEmbedding(nn.Embedding(VOCAB, H), group)
    for bad in (VOCAB, 200, -1):
        for what, call in (("target", lambda t: vocab_parallel_cross_entropy(torch.zeros(B, S, k), t, group)),
                           ("token", lambda t: embed(t))):
            t = targets.clone()
            t[1, 2] = bad
            try:
                call(t)
                said.append("accepted")
            except IndexError as exc:
                said.append(str(exc))
            ones = torch.ones(1)
            dist.all_reduce(ones, group=group)
            said.append(ones.item())
    return got, said


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_the_split_cross_entropy_and_embedding_keep_the_one_rank_edges(backend):
    for rank, (got, said) in enumerate(run_on_ranks(_vocab_edges, 2, args=(backend,), backend="gloo")):
        for name, (loss, want, grad, want_grad) in got.items():
            assert torch.isfinite(want).all() or "all ignored" in name
            torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5, equal_nan=True,
                                       msg=lambda m: f"rank {rank}, {name}, loss: {m}")
            torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}, {name}: {m}")
        expected = []
        for bad in (VOCAB, 200, -1):
            expected += [f"rank {rank}: target {bad} is outside the vocabulary of {VOCAB} (0 to {VOCAB - 1}; 1 such "
                         "targets); a target to leave out of the loss is ignore_index=-100", 2.0,
                         f"rank {rank}: token {bad} is outside the vocabulary of {VOCAB} (0 to {VOCAB - 1}; 1 such "
                         "tokens)", 2.0]
        assert said == expected, said


def _vocab_refused(env):
    from torch import nn

    from ddp_from_scratch.tensor_parallel.vocab import VocabParallelEmbedding

    try:
        VocabParallelEmbedding(nn.Embedding(11, 4), dist.new_group(backend="gloo"))
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_a_vocabulary_the_tp_size_does_not_divide_is_refused_by_name():
    for said in run_on_ranks(_vocab_refused, 2, backend="gloo"):
        assert said == ("the embedding's vocabulary is 11, which the tensor-parallel size 2 does not divide: "
                        "choose a size that is a multiple of 2"), said


# -- TP x DP on a 2 x 2 mesh of subgroups, the DP dimension under the bucketed DDP ----------------
def _tp_by_dp(env, backend):
    from ddp_from_scratch.steps.ddp import DistributedDataParallel
    from ddp_from_scratch.tensor_parallel.mesh import Mesh2D

    mesh = Mesh2D(tp=2, backend=backend)
    d, t = mesh.coordinates(env.rank)
    model = DistributedDataParallel(TensorParallelMLP(one_rank_mlp(H), mesh.tp), group=mesh.dp)
    x, dy = _data(seed=10 + d)  # each DP group its own batch; the two TP ranks of a group the same
    x.requires_grad_(True)  # as inside a model (an embedding below it): f's backward then all-reduces
    with counting() as tp_messages:
        model(x).backward(dy)
    full = one_rank_mlp(H)  # the one-rank model on both batches, the loss averaged over them
    for dd in range(mesh.dp_size):
        xd, dyd = _data(seed=10 + dd)
        full(xd).backward(dyd / mesh.dp_size)
    k4 = 4 * H // mesh.tp_size
    mlp = model.module
    pairs = {"up.weight.grad": (mlp.up.weight.grad, full[0].weight.grad[t * k4:(t + 1) * k4]),
             "up.bias.grad": (mlp.up.bias.grad, full[0].bias.grad[t * k4:(t + 1) * k4]),
             "down.weight.grad": (mlp.down.weight.grad, full[2].weight.grad[:, t * k4:(t + 1) * k4]),
             "down.bias.grad": (mlp.down.bias.grad, full[2].bias.grad)}
    groups = ([sorted(dist.get_process_group_ranks(g)) for g in (mesh.tp, mesh.dp)])
    return pairs, tp_messages, groups


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_tp_by_dp_on_a_2x2_mesh_is_the_one_rank_model_on_both_batches(backend):
    """4 ranks as 2 (DP) x 2 (TP): TP groups [0, 1] and [2, 3], DP groups [0, 2] and [1, 3]. Each
    DP group trains its own batch, the bucketed DDP averages the gradients over its DP group;
    every rank's shard of every gradient is then the one-rank model's gradient of the mean loss
    over both batches (within float32 rounding), and TP sent Megatron's messages in its group."""
    for rank, (pairs, tp_messages, groups) in enumerate(run_on_ranks(_tp_by_dp, 4, args=(backend,), backend="gloo")):
        assert groups == [[0, 1] if rank < 2 else [2, 3], [rank % 2, rank % 2 + 2]], (rank, groups)
        for name, (mine, want) in pairs.items():
            torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}, {name}: {m}")
        assert tp_messages == [("all_reduce", B * S * H)] * 2, tp_messages  # g forward, f backward


def _tp_by_dp_against_torch(env):
    return {backend: parity.tp_by_dp_against_torch(backend) for backend in ("gloo", "shm")}


def test_tp_by_dp_is_bitwise_torchs_tp_on_a_2d_device_mesh_with_ddps_arithmetic():
    """4 ranks as 2 x 2, each DP index its own batch: our split block under the bucketed DDP over
    the mesh's DP groups (on Gloo, and on shm) against torch's parallelize_module on the "tp"
    dimension of a 2-D DeviceMesh with DDP's arithmetic over "dp" (each gradient / 2, then
    all-reduced): every output, input gradient and weight gradient is the same bits."""
    for rank, found in enumerate(run_on_ranks(_tp_by_dp_against_torch, 4, backend="gloo")):
        for backend, got in found.items():
            for name, (mine, theirs) in got.items():
                assert torch.equal(mine, theirs), f"{backend}, rank {rank}, {name}: {(mine - theirs).abs().max()}"


def _bad_meshes(env):
    from ddp_from_scratch.tensor_parallel.mesh import Mesh2D

    said = []
    for kwargs in ({"tp": 3}, {"tp": 2, "ranks": [0, 1, 2, 7]}):
        try:
            Mesh2D(**kwargs)
            said.append("accepted")
        except ValueError as exc:
            said.append(str(exc))
    mesh = Mesh2D(tp=2, ranks=[0, 1])  # every rank makes it; ranks 2 and 3 get no groups
    try:
        mesh.coordinates(3)
    except ValueError as exc:
        said.append(str(exc))
    said.append((mesh.tp is None, mesh.dp is None))
    return said


def test_a_mesh_that_does_not_fit_and_a_rank_outside_it_are_refused_by_name():
    for rank, said in enumerate(run_on_ranks(_bad_meshes, 4, backend="gloo")):
        assert said[0] == ("a mesh with tensor-parallel size 3 does not fit 4 ranks: the TP size must divide the "
                           "number of ranks"), said[0]
        assert said[1] == ("the mesh's ranks [0, 1, 2, 7] must be distinct ranks of the world of 4 (0 to 3); [7] "
                           "are not"), said[1]
        assert said[2] == "rank 3 is not in the mesh's ranks [0, 1]", said[2]
        assert said[3] == (rank >= 2, rank >= 2), (rank, said[3])


# -- the small transformer, whole ------------------------------------------------------------------
def _transformer(env, backend, sequence_parallel=False):
    from ddp_from_scratch.tensor_parallel.model import TensorParallelTransformer
    from ddp_from_scratch.workload.transformer import TinyTransformer, token_batch

    group = dist.new_group(backend=backend)
    vocab, hidden, heads, layers, batch, seq = 32, 16, 4, 2, 2, 8
    torch.manual_seed(0)
    full = TinyTransformer(vocab, hidden, heads, layers)
    torch.manual_seed(0)
    tp = TensorParallelTransformer(TinyTransformer(vocab, hidden, heads, layers), group,
                                   sequence_parallel=sequence_parallel)
    tokens, targets = token_batch(0, 0, batch, seq, vocab)
    want = full.loss(tokens, targets)
    want.backward()
    with counting() as forward:
        loss = tp.loss(tokens, targets)
    with counting() as backward:
        loss.backward()
    tp.sequence_parallel_grads()  # with sequence parallelism: the whole parameters' slice gradients summed
    r, k = env.rank, vocab // env.world_size
    pairs = {"loss": (loss.detach(), want.detach()),
             "blocks.0.attn.out.bias.grad": (tp.blocks[0].attn.out.bias.grad, full.blocks[0].attn.out.bias.grad),
             "embed.weight.grad": (tp.embed.weight.grad, full.embed.weight.grad[r * k:(r + 1) * k]),
             "head.weight.grad": (tp.head.weight.grad, full.head.weight.grad[r * k:(r + 1) * k]),
             "ln.weight.grad": (tp.ln.weight.grad, full.ln.weight.grad),
             "blocks.1.ln2.bias.grad": (tp.blocks[1].ln2.bias.grad, full.blocks[1].ln2.bias.grad),
             "blocks.0.mlp.down.bias.grad": (tp.blocks[0].mlp.down.bias.grad, full.blocks[0].mlp[2].bias.grad)}
    return pairs, forward, backward, (batch, seq, hidden, layers)


@EVERY_BACKEND_AND_SIZE
def test_the_split_transformer_is_the_one_rank_transformer_with_megatrons_messages(backend, world_size):
    """The small transformer over 2 ranks: its loss and gradients (sharded ones against the one-rank
    model's shard, whole ones against the whole) within float32 rounding; and the messages of the
    closed form in model.py: 1 + 2L all_reduces of b x s x h forward and 3 of b x s (the
    cross-entropy), 2L + 1 of b x s x h backward."""
    for rank, (pairs, forward, backward, (b, s, h, layers)) in enumerate(
            run_on_ranks(_transformer, world_size, args=(backend,), backend="gloo")):
        for name, (mine, want) in pairs.items():
            torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}, {name}: {m}")
        assert sorted(forward) == sorted([("all_reduce", b * s * h)] * (1 + 2 * layers) + [("all_reduce", b * s)] * 3), forward
        assert backward == [("all_reduce", b * s * h)] * (2 * layers + 1), backward


@EVERY_BACKEND_AND_SIZE
def test_the_sequence_parallel_transformer_is_the_one_rank_transformer(backend, world_size):
    """With sequence parallelism (the activations between blocks split along the sequence): the
    loss and every gradient, after the whole parameters' slice gradients are all-reduced, within
    float32 rounding of the one-rank model; each forward all_reduce of b x s x h is now a
    reduce_scatter of b x s x h (the embedding, after each attention and MLP) and each f an
    all_gather of b x s/p x h (before each attention and MLP, and the head), and backward the
    reverse; the cross-entropy's 3 all_reduces of b x s stay."""
    for rank, (pairs, forward, backward, (b, s, h, layers)) in enumerate(
            run_on_ranks(_transformer, world_size, args=(backend, True), backend="gloo")):
        for name, (mine, want) in pairs.items():
            torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}, {name}: {m}")
        rs, ag = ("reduce_scatter", b * s * h), ("all_gather", b * s // world_size * h)
        assert sorted(forward) == sorted([rs] * (1 + 2 * layers) + [ag] * (2 * layers + 1) +
                                         [("all_reduce", b * s)] * 3), forward
        assert sorted(backward) == sorted([ag] * (1 + 2 * layers) + [rs] * (2 * layers + 1)), backward


# -- sequence parallelism against torch's SequenceParallel -------------------------------------------
def _sp_against_torch(env, backend):
    """torch's SequenceParallel on the LayerNorm, ColwiseParallel(input_layouts=Shard(1)) and
    RowwiseParallel(output_layouts=Shard(1)) on the MLP, beside ours. One backend a process: a
    second DeviceMesh over the same ranks is equal to the first, and torch's DTensors made on it
    ran their collectives on the first mesh's group (torch 2.13)."""
    return parity.sequence_parallel_against_torch(dist.new_group(backend=backend))


@BACKENDS_AND_SIZES
def test_sequence_parallelism_is_bitwise_torchs_sequence_parallel(backend, world_size):
    """The LayerNorm on this rank's slice of the sequence, the all_gather into the column-parallel
    up-projection, the reduce_scatter out of the row-parallel down-projection (torch's bias order:
    b / p in each partial sum): every output, input gradient and weight gradient is torch's bit
    for bit, the LayerNorm's once its slice gradients are all-reduced (torch keeps them Partial
    until asked)."""
    for rank, got in enumerate(run_on_ranks(_sp_against_torch, world_size, args=(backend,), backend="gloo")):
        for name, (mine, theirs) in got.items():
            assert mine.shape == theirs.shape and torch.equal(mine, theirs), \
                f"rank {rank}, {name}: {(mine - theirs).abs().max()}"
