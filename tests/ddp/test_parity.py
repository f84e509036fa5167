"""Proof, step by step, that our data-parallel wrappers compute what torch's DDP computes.

Each rank builds the same small CNN (with BatchNorm) from a *different* seed, wraps one copy in
torch's DistributedDataParallel and one in ours, and trains both with SGD + momentum on the same
per-rank batches. After every step, every parameter, every buffer (BatchNorm running statistics)
and the loss are compared bit for bit on every rank (compare.StepCheck). Deliberately broken
wrappers must fail the same comparison, so the check can fail.

    pytest tests/ddp/test_parity.py -q
"""

import copy
import itertools
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import collectives
from collectives.testing import run_on_ranks
from ddp_from_scratch.compare import train_side_by_side
from ddp_from_scratch.parts.torch_hooks import bf16_compress_hook_on_gloo
from ddp_from_scratch.steps.ddp import DistributedDataParallel as BucketedDataParallel
from ddp_from_scratch.steps.flat import FlatDataParallel
from ddp_from_scratch.steps.naive import NaiveDataParallel
from ddp_from_scratch.steps.powersgd import PowerSGD
from ddp_from_scratch.workload.models import Branchy, SmallNet, batch


def assert_bitwise(per_rank, what: str, only_params: bool = False) -> None:
    """Every StepCheck of every rank bitwise equal to torch's DDP (or just the parameters)."""
    for rank, steps in enumerate(per_rank):
        for step, check in enumerate(steps):
            ok = check.params if only_params else check.bitwise
            assert ok, f"{what}, rank {rank}, step {step}: differs from torch's DDP by {check.largest_diff:g} ({check})"


# -- broken wrappers: each must turn the parity check red ---------------------------------------
class WrongDivisor(FlatDataParallel):
    def _sync(self):
        self.world_size += 1
        super()._sync()
        self.world_size -= 1


class NoInitialBroadcast(NaiveDataParallel):
    def __init__(self, module):
        saved = {k: v.clone() for k, v in module.state_dict().items()}
        super().__init__(module)
        module.load_state_dict(saved)  # undo the broadcast: ranks keep their own initialisation


class NoBufferBroadcast(NaiveDataParallel):
    def __init__(self, module):
        super().__init__(module, broadcast_buffers=False)


class HookReadsTheParameter(NaiveDataParallel):
    def _sync(self):  # the classic mistake: all-reducing the weights instead of their gradients
        for param in self.params:
            reduced = param.detach().clone().mul_(1.0 / self.world_size)
            collectives.all_reduce(reduced, group=self.group)
            param.grad.copy_(reduced)


class SmallBuckets(BucketedDataParallel):
    def __init__(self, module):  # several buckets even for the small model
        super().__init__(module, bucket_cap_mb=0.0005, first_bucket_mb=0.0001)


class SkipsABucket(SmallBuckets):
    def _finish(self):  # the middle bucket is reduced but never copied back
        for b in self.buckets:
            b.work.wait()
        middle = len(self.buckets) // 2
        kept = self.buckets.pop(middle)
        super()._finish()
        self.buckets.insert(middle, kept)


WRAPPERS = {"naive": NaiveDataParallel, "flat": FlatDataParallel, "bucketed": BucketedDataParallel,
            "bucketed_small": SmallBuckets, "wrong_divisor": WrongDivisor,
            "no_initial_broadcast": NoInitialBroadcast, "no_buffer_broadcast": NoBufferBroadcast,
            "hook_reads_parameter": HookReadsTheParameter, "skips_a_bucket": SkipsABucket}


def _batch(step, rank):
    return batch(step, rank, 4, 12)


def _train_side_by_side(env, impl, steps):
    return train_side_by_side(env, WRAPPERS[impl], steps)


@pytest.mark.parametrize("impl", ["naive", "flat", "bucketed", "bucketed_small"])
def test_bitwise_equal_to_torch_ddp_on_two_ranks(impl):
    assert_bitwise(run_on_ranks(_train_side_by_side, 2, args=(impl, 4)), impl)


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("cap", [None, 0.0005])
def test_bucketed_is_bitwise_equal_to_torch_ddp_on_three_and_four_ranks(cap, n):
    # With more than 2 ranks Gloo's ring rounds an element according to where it sits in the
    # buffer, so this holds only because our buckets are laid out exactly as torch's
    # (test_bucket.py). cap 0.0005 MiB gives the small model several buckets, on both sides.
    kwargs = {} if cap is None else {"bucket_cap_mb": cap}
    assert_bitwise(run_on_ranks(partial(train_side_by_side, ddp_kwargs=kwargs), n, args=("bucketed", 3)), f"cap {cap}, {n} ranks")


@pytest.mark.parametrize("impl", ["naive", "flat"])
def test_naive_and_flat_are_close_to_torch_ddp_on_four_ranks(impl):
    # naive sends one message per parameter and flat one buffer in definition order (torch's
    # layout only in the first iteration), so on 4 ranks the ring rounds some elements differently.
    steps_per_rank = run_on_ranks(_train_side_by_side, 4, args=(impl, 3))
    for rank, steps in enumerate(steps_per_rank):
        for step, check in enumerate(steps):
            assert check.largest_diff < 1e-5, f"{impl}, 4 ranks, rank {rank}, step {step}: {check.largest_diff:g} (relative)"
    if impl == "flat":  # same layout as torch's first iteration: bitwise there
        assert all(steps[0].params for steps in steps_per_rank)


@pytest.mark.parametrize("broken", ["wrong_divisor", "no_initial_broadcast", "no_buffer_broadcast", "hook_reads_parameter",
                                    "skips_a_bucket"])
def test_a_broken_wrapper_turns_the_check_red(broken):
    steps = run_on_ranks(_train_side_by_side, 2, args=(broken, 2))
    assert any(not check.bitwise for rank in steps for check in rank), f"{broken} went unnoticed"


def _mismatched_models(env):
    model = SmallNet() if env.rank == 0 else nn.Sequential(nn.Linear(3, 3))
    with pytest.raises(collectives.CollectiveError, match=r"ranks grouped by identical models: \[\[0\], \[1\]\]"):
        NaiveDataParallel(model)
    t = torch.ones(1)
    collectives.all_reduce(t)
    assert t.item() == 2


def test_different_models_are_refused_by_name():
    run_on_ranks(_mismatched_models, 2)


def _layout_and_rebuild(env):
    model = SmallBuckets(SmallNet())
    before = [list(b.param_indices) for b in model.buckets]
    x, y = _batch(0, env.rank)
    F.cross_entropy(model(x), y).backward()
    seen = list(model._ready_order)
    model(x)  # the next forward rebuilds from the order seen
    after = [list(b.param_indices) for b in model.buckets]
    return before, seen, after, model.layout()


def test_buckets_are_rebuilt_from_the_ready_order():
    before, seen, after, text = run_on_ranks(_layout_and_rebuild, 2)[0]
    assert before == [list(range(len(seen)))]  # first iteration: one bucket in definition order, as torch
    assert sorted(seen) == list(range(len(seen)))  # every gradient arrived once
    assert len(after) > 2 and [i for b in after for i in b] == seen  # rebuilt in the order the gradients arrived
    assert "bucket 0:" in text and "MiB" in text and "fc." in text


def _accumulate(env):
    """Two micro-batches, the first under no_sync(): ours and torch's must end equal."""
    torch.manual_seed(100 + env.rank)
    model = SmallNet()
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ours = SmallBuckets(model)
    for m in (ours, theirs):
        with m.no_sync():
            x, y = _batch(0, env.rank)
            F.cross_entropy(m(x), y).backward()
        x, y = _batch(1, env.rank)
        F.cross_entropy(m(x), y).backward()
    return all(torch.equal(a.grad, b.grad) for a, b in zip(ours.module.parameters(), theirs.module.parameters()))


def test_no_sync_accumulation_matches_torch():
    assert run_on_ranks(_accumulate, 2) == [True, True]


def _two_microbatches(ours, synced, step, rank):
    """One step of two micro-batches: `ours` accumulates both under no_sync() and then calls
    sync_gradients() (a pipeline's step); each of `synced` accumulates the first and syncs in the
    second's backward."""
    with ours.no_sync():
        for k in range(2):
            x, y = _batch(2 * step + k, rank)
            F.cross_entropy(ours(x), y).backward()
    ours.sync_gradients()
    for m in synced:
        with m.no_sync():
            x, y = _batch(2 * step, rank)
            F.cross_entropy(m(x), y).backward()
        x, y = _batch(2 * step + 1, rank)
        F.cross_entropy(m(x), y).backward()


def _sync_gradients_after_no_sync(env):
    """Both micro-batches under no_sync(), then sync_gradients() (a pipeline's step), against the
    same DDP syncing the second micro-batch's backward, in the first step's one bucket and in the
    second step's rebuilt ones; and against torch's DDP in the first step (its default buckets are
    not these small ones, and on 3 ranks other bucket edges round differently)."""
    torch.manual_seed(100 + env.rank)
    model = SmallNet()
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    synced = SmallBuckets(copy.deepcopy(model))
    ours = SmallBuckets(model)
    empty = SmallBuckets(SmallNet())
    with pytest.raises(RuntimeError, match=r"sync_gradients\(\) with \d+ parameter\(s\) holding no gradient: "):
        empty.sync_gradients()
    steps = []
    for step in range(2):
        for m in (ours, synced, theirs):
            m.zero_grad(set_to_none=True)
        _two_microbatches(ours, (synced, theirs), step, env.rank)
        mine = list(ours.module.parameters())
        steps.append(([torch.equal(a.grad, b.grad) for a, b in zip(mine, synced.module.parameters())],
                      [torch.equal(a.grad, b.grad) for a, b in zip(mine, theirs.module.parameters())],
                      ours.buckets and [b.param_indices for b in ours.buckets] == [b.param_indices for b in synced.buckets],
                      len(ours.buckets)))
    return steps


@pytest.mark.parametrize("ranks", [2, 3])
def test_sync_gradients_after_no_sync_is_torchs_synced_backward(ranks):
    for first, second in run_on_ranks(_sync_gradients_after_no_sync, ranks):
        same, as_torch, layout, buckets = first
        assert all(same) and all(as_torch) and layout and buckets == 1, first
        same, _, layout, buckets = second
        assert all(same) and layout and buckets > 2, second  # rebuilt from the order the gradients arrived


def _sync_gradients_under(env, compress, as_view, steps):
    """Per step: both micro-batches under no_sync() then sync_gradients(), against the same
    wrapper, built with the same options, syncing the second micro-batch's backward; SGD steps
    both, so later steps start from trained weights. Whether each gradient and each weight has
    the same bits, and the bucket count."""
    torch.manual_seed(300 + env.rank)
    model = SmallNet()

    def wrap(module):
        option = PowerSGD(start_powerSGD_iter=2) if compress == "powersgd" else compress  # compressed from step 2
        return BucketedDataParallel(module, bucket_cap_mb=0.0005, first_bucket_mb=0.0001, compress=option,
                                    gradient_as_bucket_view=as_view)

    ours, synced = wrap(model), wrap(copy.deepcopy(model))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, synced)]
    out = []
    for step in range(steps):
        for m in (ours, synced):
            m.zero_grad(set_to_none=True)
        _two_microbatches(ours, (synced,), step, env.rank)
        pairs = list(zip(ours.module.named_parameters(), synced.module.parameters()))
        grads = [name for (name, a), b in pairs if not torch.equal(a.grad, b.grad)]
        for opt in optimizers:
            opt.step()
        weights = [name for (name, a), b in pairs if not torch.equal(a, b)]
        out.append((grads, weights, len(ours.buckets), len(synced.buckets), _held_in_buckets(ours),
                    _held_in_buckets(synced)))
    return out


def _held_in_buckets(ddp):
    """Whether every parameter's .grad is the very memory of its bucket slot (a view)."""
    return all(ddp.params[i].grad.data_ptr() == b.views[pos].data_ptr()
               for b in ddp.buckets for pos, i in enumerate(b.param_indices))


@pytest.mark.parametrize("compress", [None, "fp16", "bf16", "powersgd"])
@pytest.mark.parametrize("as_view", [False, True])
@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_sync_gradients_is_the_synced_backward_under_every_option(n, compress, as_view):
    """A pipeline's sync_gradients() goes the way a synced backward goes for every wire and
    gradient layout the wrapper takes, in the first step's one bucket and in the rebuilt ones
    (PowerSGD: plain for two steps, then compressed, with error feedback and warm start)."""
    for rank, per_step in enumerate(run_on_ranks(_sync_gradients_under, n, args=(compress, as_view, 4))):
        for step, (grads, weights, mine, theirs, my_views, their_views) in enumerate(per_step):
            assert not grads and not weights, f"rank {rank} step {step}: gradients {grads}, weights {weights} differ"
            assert mine == theirs and (mine == 1) == (step == 0), (rank, step, mine, theirs)
            assert my_views == their_views == as_view, f"rank {rank} step {step}: .grad a bucket view: " \
                f"{my_views} after sync_gradients(), {their_views} after a synced backward, asked {as_view}"


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.used(self.body(x))


def _unused(env):
    model = BucketedDataParallel(TwoHeads(), bucket_cap_mb=0.00002, first_bucket_mb=0.00001)
    with pytest.raises(RuntimeError, match=r"2 parameter\(s\) got no gradient in this backward.*unused.weight, unused.bias"):
        model(torch.ones(3, 4)).sum().backward()
    t = torch.ones(1)
    collectives.all_reduce(t)  # the group is still usable
    return t.item()


def test_unused_parameters_are_named_at_the_end_of_that_backward():
    assert run_on_ranks(_unused, 2) == [2.0, 2.0]


class Fp16Buckets(BucketedDataParallel):
    WIRE = torch.float16

    def __init__(self, module):
        super().__init__(module, compress="fp16")

    def _launch(self, b):
        super()._launch(b)
        assert b.sent.dtype == self.WIRE, f"bucket {b.index} went out as {b.sent.dtype}"  # the wire dtype, each launch


class Bf16Buckets(Fp16Buckets):
    WIRE = torch.bfloat16

    def __init__(self, module):
        BucketedDataParallel.__init__(self, module, compress="bf16")


def _with_fp16_hook(env, steps):
    return train_side_by_side(env, Fp16Buckets, steps, torch_comm_hook=default_hooks.fp16_compress_hook)


def test_fp16_compression_is_bitwise_torchs_fp16_hook():
    assert_bitwise(run_on_ranks(_with_fp16_hook, 2, args=(3,)), "fp16 against fp16_compress_hook", only_params=True)


def _with_bf16_hook(env, steps):
    return train_side_by_side(env, Bf16Buckets, steps, torch_comm_hook=bf16_compress_hook_on_gloo)


def test_bf16_compression_is_bitwise_torchs_bf16_hook():
    # torch's bf16_compress_hook refuses Gloo by name; compare.bf16_compress_hook_on_gloo runs its body
    assert_bitwise(run_on_ranks(_with_bf16_hook, 2, args=(3,)), "bf16 against the bf16 hook's body", only_params=True)


def test_bf16_compression_differs_from_uncompressed_ddp():
    # the check can see compression at all; and it is only compression: bf16 keeps 8 bits of
    # mantissa (a relative rounding of at most 2**-9 per gradient element), so after 3 steps the
    # weights stay within 1e-2 of uncompressed DDP's, relative to each tensor's largest weight
    for rank, steps in enumerate(run_on_ranks(train_side_by_side, 2, args=(Bf16Buckets, 3))):
        assert not all(check.params for check in steps), f"rank {rank}: bf16 changed nothing"
        largest = max(check.largest_diff for check in steps)
        assert largest < 1e-2, f"rank {rank}: largest relative difference {largest:g}"


@pytest.mark.slow
def test_resnet50_bucketed_is_bitwise_equal_to_torch_ddp_on_two_ranks():
    """The real model: ResNet-50 (BatchNorm everywhere, several 25 MiB buckets), 2 steps."""
    assert_bitwise(run_on_ranks(train_side_by_side, 2, args=("bucketed", 2, "resnet50", 2, 32)), "ResNet-50, 2 ranks")


@pytest.mark.slow
def test_resnet50_bucketed_is_bitwise_equal_to_torch_ddp_on_four_ranks():
    assert_bitwise(run_on_ranks(train_side_by_side, 4, args=("bucketed", 2, "resnet50", 2, 32)), "ResNet-50, 4 ranks")


# -- options: find_unused_parameters, gradient_as_bucket_view -----------------------------------
@pytest.mark.parametrize("n", [2, 4])
def test_find_unused_parameters_matches_torch(n):
    """Branchy: `extra` is used on rank 0 only, `never` nowhere; grads (None or not) compared too."""
    kwargs = {"find_unused_parameters": True}
    results = run_on_ranks(partial(train_side_by_side, ddp_kwargs=kwargs), n, args=("bucketed", 3, "branchy"))
    assert_bitwise(results, f"find_unused_parameters, {n} ranks")


def _unused_grads(env):
    model = BucketedDataParallel(Branchy(), find_unused_parameters=True)
    x, y = _batch(0, env.rank)
    F.cross_entropy(model(x), y).backward()
    return model.module.extra.weight.grad is not None, model.module.never.weight.grad is None


def test_find_unused_parameters_averages_the_locally_unused_and_leaves_the_globally_unused():
    assert run_on_ranks(_unused_grads, 2) == [(True, True), (True, True)]


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("n", [2, 4])
def test_gradient_as_bucket_view_matches_torch(n, set_to_none):
    kwargs = {"gradient_as_bucket_view": True}
    results = run_on_ranks(partial(train_side_by_side, ddp_kwargs=kwargs, set_to_none=set_to_none), n, args=("bucketed", 3))
    assert_bitwise(results, f"gradient_as_bucket_view, set_to_none={set_to_none}, {n} ranks")


HOOKS = {None: None, "fp16": default_hooks.fp16_compress_hook, "bf16": bf16_compress_hook_on_gloo}


@pytest.mark.slow  # trains 16 times
@pytest.mark.parametrize("compress", sorted(HOOKS, key=str))
@pytest.mark.parametrize("n", [2, 3])
def test_the_options_together_are_torchs_ddp(n, compress):
    """Each option is checked alone above; here every combination meets: find_unused_parameters
    (on Branchy, whose `extra` only rank 0 uses), gradient_as_bucket_view, either zero_grad, and a
    compressed wire against torch's DDP with the same comm hook (parameters then, as for the wire
    alone), in DDP's default buckets (one for these models) and in small ones (several, rebuilt
    after the first step where find_unused_parameters is off). 96 combinations in all, each trained for 3 steps."""
    for cap, find_unused, as_view, set_to_none in itertools.product((None, 0.0005), *[(False, True)] * 3):
        kwargs = {"bucket_cap_mb": cap, "find_unused_parameters": find_unused, "gradient_as_bucket_view": as_view}
        train = partial(train_side_by_side, ddp_kwargs=kwargs, set_to_none=set_to_none,
                        torch_comm_hook=HOOKS[compress], ours_kwargs={"compress": compress} if compress else None)
        results = run_on_ranks(train, n, args=("bucketed", 3, "branchy" if find_unused else "small"))
        assert_bitwise(results, f"{n} ranks, bucket_cap_mb={cap}, find_unused_parameters={find_unused}, "
                                f"gradient_as_bucket_view={as_view}, "
                                f"compress={compress}, set_to_none={set_to_none}", only_params=bool(compress))


def _grads_are_bucket_views(env, gradient_as_bucket_view):
    model = BucketedDataParallel(SmallNet(), bucket_cap_mb=0.0005, gradient_as_bucket_view=gradient_as_bucket_view)
    answers = []
    for step in range(3):  # step 1 rebuilds the buckets: the views must move with them
        model.zero_grad(set_to_none=False)
        x, y = _batch(step, env.rank)
        F.cross_entropy(model(x), y).backward()
        storages = {b.buffer.untyped_storage().data_ptr() for b in model.buckets}
        answers.append([p.grad.untyped_storage().data_ptr() in storages for p in model.params])
    return answers


def test_gradient_as_bucket_view_makes_grads_views_of_the_buckets():
    assert all(all(step) for step in run_on_ranks(_grads_are_bucket_views, 2, args=(True,))[0])
    assert not any(any(step) for step in run_on_ranks(_grads_are_bucket_views, 2, args=(False,))[0])
