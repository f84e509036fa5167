"""Proof that the sharded steps (ZeRO-1, ZeRO-2, FSDP) compute what torch's FSDP2 and DDP compute.

Each comparison trains ours and torch's side by side from the same weights on the same per-rank
batches (compare/sharded.py's train_sharded_side_by_side) and compares every whole parameter, buffer and the
loss bit for bit after every step. Which pairs must be bitwise at which world sizes is
compare.sharded.must_be_bitwise (the compare program's note says why). Planted faults (a shard off by one,
a missing all-gather, division twice, no gather before backward) must turn the check red.

    pytest tests/ddp/test_zero.py -q
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import collectives
from ddp_from_scratch.parts import sharding as shard_module
from ddp_from_scratch.parts.step_check import summarise
from ddp_from_scratch.compare.sharded import PARITY_IMPLS, _gather_dim0, must_be_bitwise, train_sharded_side_by_side
from ddp_from_scratch.wrap import SHARDED, wrap
from ddp_from_scratch.steps.fsdp import FullyShardedDataParallel, unit_plan, units_of
from ddp_from_scratch.workload.models import Branchy, SmallNet, batch
from ddp_from_scratch.workload.resnet import resnet50
from ddp_from_scratch.parts.sharding import ShardLayout
from ddp_from_scratch.steps.zero1 import ZeroOneDataParallel
from ddp_from_scratch.parts.memory import HeldBytes
from ddp_from_scratch.steps.zero2 import ZeroTwoDataParallel, reduce_buckets
from collectives.testing import run_on_ranks

STEPS = 3


# -- the layout, without ranks ------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 7), min_size=0, max_size=3), min_size=1, max_size=5),
       world_size=st.integers(1, 5))
def test_pack_is_torchs_chunk_cat_and_the_shards_cover_every_row_once(shapes, world_size):
    tensors = [torch.randn(*s) if s else torch.randn(()) for s in shapes]
    layout = ShardLayout(tensors, world_size)
    flat = layout.pack(tensors)
    torch.testing.assert_close(flat, torch._chunk_cat([t.reshape(t.shape[0] if t.dim() else 1, -1) if t.dim() <= 1
                                                       else t for t in tensors], 0, world_size), rtol=0, atol=0)
    for i, t in enumerate(tensors):
        rows = torch.cat([layout.shard(t, i, r).reshape(-1) for r in range(world_size)])
        assert torch.equal(rows, t.reshape(-1)), f"parameter {i} {tuple(t.shape)} on {world_size} ranks"
        for r in range(world_size):
            assert torch.equal(layout.unpack(flat[r], r)[i].reshape(-1), layout.shard(t, i, r).reshape(-1))
            assert torch.equal(layout.pack_row([layout.shard(x, k, r) for k, x in enumerate(tensors)], r), flat[r])


def test_the_layout_printout_names_each_ranks_rows():
    layout = ShardLayout([torch.zeros(10, 2), torch.zeros(3)], 4)
    text = layout.describe(["w", "b"])
    assert "rows r0: 0-2, r1: 3-5, r2: 6-8, r3: 9-9" in text
    assert "r3: -" in text.splitlines()[2]  # 3 rows on 4 ranks: the last owns none
    # per rank: 3 rows of w (6 elements) + 1 of b; 4 ranks hold 28 for 23 real elements
    assert "7 elements per rank" in text and "(5 of them padding)" in text


def test_a_layout_of_two_dtypes_is_refused_not_cast():
    with pytest.raises(ValueError, match=r"mix dtypes \['torch.float16', 'torch.float32'\]"):
        ShardLayout([torch.zeros(4), torch.zeros(4, dtype=torch.float16)], 2)


def test_units_are_the_children_with_parameters_then_the_root():
    net = SmallNet()
    assert units_of(net) == [["conv1.weight"], ["bn1.weight", "bn1.bias"], ["conv2.weight"],
                             ["bn2.weight", "bn2.bias"], ["fc.weight", "fc.bias"]]
    assert units_of(net, "model") == [[n for n, _ in net.named_parameters()]]
    plan = unit_plan(Nested(), ["1", "1.2"])  # a parameter belongs to the innermost listed module
    assert plan == [("1", ["1.0.weight", "1.0.bias"]), ("1.2", ["1.2.weight", "1.2.bias"]),
                    ("", ["0.weight", "0.bias", "4.weight", "4.bias"])]
    blocks = [name for name, _ in unit_plan(resnet50(num_classes=10), "blocks")]
    assert blocks[:4] == ["conv1", "bn1", "layer1.0", "layer1.1"] and blocks[-2:] == ["layer4.2", "fc"]
    with pytest.raises(ValueError, match="no module named"):
        unit_plan(Nested(), ["9"])


class Nested(torch.nn.Sequential):
    """Units inside units: fully_shard on "1.2", then on "1", then on the root."""

    def __init__(self):
        super().__init__(torch.nn.Conv2d(3, 8, 3), torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3), torch.nn.ReLU(),
                                                                       torch.nn.Conv2d(8, 6, 3)),
                         torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(6, 10))


def _nested_units(env):
    return summarise([train_sharded_side_by_side(env, "fsdp", STEPS, against="torch-fsdp", model=Nested,
                                                 units=["1", "1.2"])])


def test_nested_units_are_bitwise_fully_shard_nested_alike():
    for rank, res in enumerate(run_on_ranks(_nested_units, 3, timeout=300)):
        assert res["bitwise"], f"rank {rank}: {res}"


def _gathered_both_ways(env):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # rows 5, 1, 2, 7 on 3 ranks: short and empty last chunks
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(*s)) for s in ((5, 2), (1,), (2, 3), (7,))])
    model = fully_shard(params, mesh=DeviceMesh.from_group(dist.group.WORLD, device_type="cpu"))
    return [(tuple(p.shape), torch.equal(_gather_dim0(p), p.full_tensor())) for p in model.parameters()]


def test_the_parity_check_gathers_fully_shard_parameters_as_full_tensor_does():
    """compare/sharded.py gathers fully_shard's DTensors itself (full_tensor dies on Gloo with CUDA tensors)."""
    for rank, res in enumerate(run_on_ranks(_gathered_both_ways, 3)):
        assert res == [((5, 2), True), ((1,), True), ((2, 3), True), ((7,), True)], f"rank {rank}: {res}"


# -- parity on ranks: one call per world size, every pair ---------------------------------------
def _every_pair(env, pairs, steps):
    return {(impl, against): summarise([train_sharded_side_by_side(env, impl, steps, against=against)])
            for impl, against in pairs}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sharded_steps_are_bitwise_where_they_must_be(world_size):
    pairs = [(impl, against) for impl in PARITY_IMPLS for against in ("torch-fsdp", "torch")]
    if world_size > 2:  # the rest differ in rounding by construction; 2 ranks check every pair
        pairs = [p for p in pairs if must_be_bitwise(*p, world_size)]
    per_rank = run_on_ranks(_every_pair, world_size, args=(pairs, STEPS), timeout=300)
    for rank, results in enumerate(per_rank):
        for (impl, against), res in results.items():
            assert res["bitwise"], f"{impl} against {against} on {world_size} ranks, rank {rank}: {res}"
    assert len(pairs) == (8 if world_size == 2 else 3)


def _accumulated(env, impl, steps=2):
    """`steps` optimizer steps, each over two micro-batches: the first backward under no_sync(),
    the second synced. Returns the whole parameters after every step."""
    torch.manual_seed(0)
    net = SmallNet()
    if impl == "torch":
        model = torch.nn.parallel.DistributedDataParallel(net, broadcast_buffers=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        model = wrap(net, impl, bucket_cap_mb=1e-9 if impl == "zero2-bucketed" else None)  # a bucket per parameter
        opt = model.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
    after = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(2):
            x, y = batch(2 * step + micro, env.rank, 4, image=16)
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                (F.cross_entropy(model(x), y) / 2).backward()
        opt.step()
        whole = model.full_state() if hasattr(model, "full_state") else dict(model.module.named_parameters())
        after.append({name: t.detach().clone() for name, t in whole.items()})
    return after


def _accumulation_against_torch(env):
    reference = _accumulated(env, "torch")
    return {impl: [[name for name, t in step.items() if not torch.equal(t, ref[name])]
                   for step, ref in zip(_accumulated(env, impl), reference)]
            for impl in SHARDED}


def test_no_sync_accumulation_is_bitwise_torchs_ddp_on_two_ranks():
    """Gradient accumulation: under no_sync() the sharded steps keep the local gradient (no
    reduce-scatter, FSDP's units stay gathered) and the next backward sends the sum; a step that
    communicated inside no_sync, or dropped the first micro-batch, would differ."""
    for rank, per_impl in enumerate(run_on_ranks(_accumulation_against_torch, 2, timeout=300)):
        for impl, steps in per_impl.items():
            assert steps == [[], []], f"{impl}, rank {rank}: parameters that differ from torch's DDP per step: {steps}"


def _not_bitwise_pairs_differ(env):
    return {p: summarise([train_sharded_side_by_side(env, *p[:1], STEPS, against=p[1])])
            for p in (("zero1", "torch-fsdp"), ("fsdp", "torch"))}


def test_on_four_ranks_the_other_pairs_differ_only_in_rounding():
    for results in run_on_ranks(_not_bitwise_pairs_differ, 4, timeout=300):
        for pair, res in results.items():
            assert not res["bitwise"], f"{pair}: now bitwise; update must_be_bitwise and the note"
            assert 0 < res["largest_diff"] < 1e-5 and res["nonfinite"] is None, (pair, res)


# -- planted faults: each must turn the check red -----------------------------------------------
class NoAllGatherAfterStep(ZeroOneDataParallel):
    def after_step(self, shards):
        pass  # every rank keeps only its own rows up to date


class DividedTwice(ZeroTwoDataParallel):
    def _reduce_scatter(self, u):
        super()._reduce_scatter(u)
        for i in self.units[u]:
            self._grad_shards[i] = self._grad_shards[i] / self.world_size  # "avg" already divided


class NoGatherBeforeBackward(FullyShardedDataParallel):
    def _after_forward(self, u, mod, output):
        if mod is not self.module:
            self._free(u)  # freed, and nothing gathers it again for the backward


def _off_by_one_rows_of(self, i, rank):
    start = min(rank * self.chunk_rows[i] + (1 if rank else 0), self.rows[i])  # skips a row at each border
    return slice(start, min(rank * self.chunk_rows[i] + self.chunk_rows[i], self.rows[i]))


def _planted(env, fault):
    if fault == "shard off by one":
        saved = shard_module.ShardLayout.rows_of
        shard_module.ShardLayout.rows_of = _off_by_one_rows_of
        try:
            return summarise([train_sharded_side_by_side(env, "fsdp", STEPS, against="torch-fsdp")])
        finally:
            shard_module.ShardLayout.rows_of = saved
    impl, against = {"missing all-gather": (NoAllGatherAfterStep, "torch"),
                     "division twice": (DividedTwice, "torch"),
                     "no gather before backward": (NoGatherBeforeBackward, "torch-fsdp")}[fault]
    try:
        return summarise([train_sharded_side_by_side(env, impl, STEPS, against=against)])
    except Exception as exc:  # a fault may also break the step outright: that is red too
        return {"bitwise": False, "raised": f"{type(exc).__name__}: {exc}"}


@pytest.mark.parametrize("fault", ["shard off by one", "missing all-gather", "division twice",
                                   "no gather before backward"])
def test_planted_faults_are_caught(fault):
    for rank, res in enumerate(run_on_ranks(_planted, 2, args=(fault,), timeout=300)):
        assert not res["bitwise"], f"{fault}: rank {rank} still bitwise equal ({res})"


# -- what each stage keeps, and what it tells ---------------------------------------------------
def _what_is_kept(env):
    out = {}
    torch.manual_seed(0)
    for name, cls in (("zero1", ZeroOneDataParallel), ("zero2", ZeroTwoDataParallel),
                      ("fsdp", FullyShardedDataParallel)):
        model = cls(SmallNet())
        opt = model.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
        x, y = batch(0, env.rank, 4, 12)
        F.cross_entropy(model(x), y).backward()
        grads_whole = sum(p.grad.numel() for p in model.params if p.grad is not None)
        grad_shards = sum(g.numel() for g in model.grad_shards() if g is not None)
        opt.step()
        momentum = sum(s["momentum_buffer"].numel() for s in opt.inner.state.values())
        out[name] = {"momentum": momentum, "shard": sum(s.numel() for s in opt.shards),
                     "grads_whole": grads_whole, "grad_shards": grad_shards,
                     "params_whole": sum(p.data.numel() for p in model.params),
                     "total": sum(p.numel() for p in SmallNet().parameters())}
        if name == "fsdp":
            out[name]["timeline"] = [span[0] for span in model.timeline["spans"]]
    return out


def test_each_stage_keeps_what_it_says():
    for rank, kept in enumerate(run_on_ranks(_what_is_kept, 2)):
        total = kept["zero1"]["total"]
        for name in ("zero1", "zero2", "fsdp"):
            k = kept[name]
            assert k["momentum"] == k["shard"] < total, (name, k)  # optimizer state: this rank's rows only
        assert kept["zero1"]["grads_whole"] == total and kept["zero1"]["params_whole"] == total
        assert kept["zero2"]["grads_whole"] == 0 and kept["zero2"]["grad_shards"] == kept["zero2"]["shard"]
        assert kept["zero2"]["params_whole"] == total
        assert kept["fsdp"]["grads_whole"] == 0 and kept["fsdp"]["params_whole"] == 0  # between steps: shards only
        spans = kept["fsdp"]["timeline"]
        units = 5
        forward = [f"all_gather unit {u} (forward)" for u in range(units)]
        assert spans[:units] == forward, spans
        rest = spans[units:]
        for u in range(units - 1):  # the last unit is still whole when its backward starts
            assert rest.index(f"all_gather unit {u} (backward)") < rest.index(f"reduce_scatter unit {u}"), rest
        assert sorted(s for s in rest if s.startswith("reduce_scatter")) == [f"reduce_scatter unit {u}"
                                                                             for u in range(units)]


# -- ZeRO-2 with buckets ---------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(nbytes=st.lists(st.integers(1, 4000), min_size=1, max_size=12), cap_bytes=st.integers(1, 6000))
def test_reduce_buckets_cut_the_backward_order_into_runs_under_the_cap(nbytes, cap_bytes):
    cap = cap_bytes / (1 << 20)
    buckets = reduce_buckets(nbytes, cap)
    assert [i for b in buckets for i in b] == list(reversed(range(len(nbytes))))  # every parameter once, in order
    for b, after in zip(buckets, buckets[1:] + [None]):
        size = sum(nbytes[i] for i in b)
        assert len(b) == 1 or size <= cap_bytes, (b, size)  # only a parameter larger than the cap passes it
        if after is not None:
            assert size + nbytes[after[0]] > cap_bytes  # a bucket closes only when the next one would not fit


@pytest.mark.parametrize("cap", [0, -1, float("nan"), float("inf"), "25", True])
def test_a_bad_bucket_cap_is_refused_by_name(cap):
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number of MiB"):
        ZeroTwoDataParallel.__init__(object.__new__(ZeroTwoDataParallel), torch.nn.Linear(2, 2), bucket_cap_mb=cap)


class Deep(torch.nn.Sequential):
    """Eight equal layers: buckets of about one layer each."""

    def __init__(self):
        super().__init__(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 32),
                         *[torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(32, 32)) for _ in range(8)],
                         torch.nn.Linear(32, 10))


LAYER_MB = (32 * 32 + 32) * 4 / (1 << 20)


def _bucketed_zero2(env):
    from functools import partial

    out = {}
    for cap in (None, 1e-9, 1.5 * LAYER_MB):
        # gather_cap_mb: the after-step all_gather in groups as small as the buckets, so that its landing
        # buffer is not the peak being measured
        ctor = partial(ZeroTwoDataParallel, bucket_cap_mb=cap, broadcast_buffers=True, gather_cap_mb=1.5 * LAYER_MB)
        report = train_sharded_side_by_side(env, ctor, STEPS, against="torch", model=Deep, image=4)
        torch.manual_seed(0)
        model = ctor(Deep())
        opt = model.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
        held = HeldBytes(model, opt)
        x, y = batch(0, env.rank, 4, 4)
        with held.watching_collectives():
            for _ in range(2):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
        held.remove()
        out[cap] = {"bitwise": [c.bitwise for c in report], "units": len(model.units),
                    "grads_and_comm": held.peak["grads"] + held.peak["comm"],
                    "psi": sum(p.numel() * p.element_size() for p in model.params)}
    return out


def _bucketed_on_three_ranks(env):
    from functools import partial

    ctor = partial(ZeroTwoDataParallel, bucket_cap_mb=1.5 * LAYER_MB, broadcast_buffers=True)
    return summarise([train_sharded_side_by_side(env, ctor, STEPS, against="torch", model=Deep, image=4)])


def test_bucketed_zero2_on_three_ranks_differs_from_ddp_only_in_rounding():
    """With 3 ranks Gloo's reduce_scatter adds in another order than DDP's all_reduce: close, not
    bitwise; a bucket reduced twice, lost or put in another bucket's place would be far off."""
    for rank, res in enumerate(run_on_ranks(_bucketed_on_three_ranks, 3)):
        assert res["largest_diff"] < 1e-5 and res["nonfinite"] is None, (rank, res)


def test_bucketed_zero2_is_bitwise_ddp_and_holds_about_two_buckets_not_a_whole_gradient():
    """Each bucket reduce-scattered as soon as its gradients are there: bitwise torch's DDP on 2
    ranks, and at its peak a rank holds its gradient shards and a bucket or two, where the one-unit
    ZeRO-2 holds every gradient packed. A bucketed ZeRO-2 that waited for the end of backward
    would hold all its buckets at once and fail the memory bound."""
    for rank, out in enumerate(run_on_ranks(_bucketed_zero2, 2)):
        n_params = 2 * 10
        assert [out[c]["units"] for c in (None, 1e-9)] == [1, n_params], out
        assert 1 < out[1.5 * LAYER_MB]["units"] < n_params, out
        for cap, res in out.items():
            assert res["bitwise"] == [True] * STEPS, (rank, cap, res)
        psi = out[None]["psi"]
        whole, bucketed = out[None]["grads_and_comm"], out[1.5 * LAYER_MB]["grads_and_comm"]
        assert whole >= psi, out  # the one-unit form packs every gradient
        # shards (psi/2) + the bucket filling + one in flight (with its output row): under 0.5 psi + 4 layers
        assert bucketed < psi / 2 + 4 * LAYER_MB * (1 << 20) < whole, out


def _unused_parameter(env):
    model = ZeroTwoDataParallel(Branchy())
    x, y = batch(0, env.rank, 4, 12)
    try:
        F.cross_entropy(model(x), y).backward()
    except collectives.CollectiveError as exc:
        return str(exc)
    return "no error"


def test_a_parameter_without_a_gradient_is_named():
    for message in run_on_ranks(_unused_parameter, 2):
        assert "reduce_scatter was never issued" in message and "never.weight" in message, message
