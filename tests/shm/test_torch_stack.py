"""torch's own stack on an shm group: the group has a name and torch finds it by it, DeviceMesh
is built on it, the functional collectives and DTensor run on it, and torch's fully_shard
trained on it is bitwise fully_shard trained on Gloo (2 ranks, nested units, several steps);
our sharded steps run on it against fully_shard on it; and on the native path neither DDP's nor
fully_shard's steps call into Python.

    pytest tests/shm/test_torch_stack.py -q
"""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from ddp_from_scratch.workload.models import batch
from ddp_from_scratch.compare.sharded import _full_params, train_sharded_side_by_side
from ddp_from_scratch.parts.step_check import summarise

from ..ddp.test_zero import STEPS, Nested
from collectives.testing import run_on_ranks


def _named_and_found(env):
    from torch.distributed.distributed_c10d import _resolve_process_group

    shm = dist.new_group(backend="shm")
    mesh = DeviceMesh.from_group(shm, "cpu")
    return (shm.group_name, _resolve_process_group(shm.group_name) is shm, dist.get_backend(shm),
            mesh.get_group() is shm, mesh.size())


def test_an_shm_group_has_a_name_torch_finds_it_by():
    for rank, (name, found, backend, same, size) in enumerate(run_on_ranks(_named_and_found, 2)):
        assert name and found and backend == "shm" and same and size == 2, (rank, name, found, backend, same)


def _device_mesh_on_the_shm_world(env):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (env.world_size,))
    d = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    return dist.get_backend(mesh.get_group()), torch.equal(d.full_tensor(), torch.arange(8.0).reshape(4, 2))


def test_init_device_mesh_on_an_shm_world_uses_shm():
    assert run_on_ranks(_device_mesh_on_the_shm_world, 2, backend="shm") == [("shm", True)] * 2


def _functional_on_both(env):
    r, n = env.rank, env.world_size
    rows = []
    for backend in ("shm", "gloo"):
        g = dist.new_group(backend=backend)
        x = torch.arange(4 * n, dtype=torch.float32) * (r + 1)
        got = [funcol.all_reduce(x, "sum", g), funcol.all_gather_tensor(x, 0, g),
               funcol.reduce_scatter_tensor(x, "sum", 0, g), funcol.all_to_all_single(x, None, None, g),
               funcol.broadcast(x, 1, g), funcol.all_reduce(x, "max", g)]
        rows.append([funcol.wait_tensor(t).clone() for t in got])
        mesh = DeviceMesh.from_group(g, "cpu")
        d = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
        rows[-1] += [d.full_tensor(), d.redistribute(mesh, [Replicate()]).to_local(),
                     (d @ distribute_tensor(torch.ones(3, 2), mesh, [Replicate()])).full_tensor()]
    return [torch.equal(a, b) for a, b in zip(*rows)]


def test_functional_collectives_and_dtensor_give_glooss_results_on_shm():
    for world_size in (2, 3):
        for rank, same in enumerate(run_on_ranks(_functional_on_both, world_size)):
            assert all(same), f"{world_size} ranks, rank {rank}: {same}"


def _fully_shard_trained(group, steps):
    torch.manual_seed(100)
    model = Nested()
    mesh = DeviceMesh.from_group(group, device_type="cpu")
    for unit in (model[1][2], model[1], model):  # units inside units, innermost first
        fully_shard(unit, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    after = []
    for step in range(steps):
        x, y = batch(step, dist.get_rank(), 4, 12)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        after.append({k: v.clone() for k, v in _full_params(model).items()})
    return after


def _fully_shard_both_ways(env, steps):
    on_shm = _fully_shard_trained(dist.new_group(backend="shm"), steps)
    on_gloo = _fully_shard_trained(dist.new_group(backend="gloo"), steps)
    return [[name for name in a if not torch.equal(a[name], b[name])] for a, b in zip(on_shm, on_gloo)], \
        sorted(on_shm[0])


def test_fully_shard_on_shm_is_bitwise_fully_shard_on_gloo():
    for rank, (differing, names) in enumerate(run_on_ranks(_fully_shard_both_ways, 2, args=(4,), timeout=120)):
        assert len(names) == 8, names  # every parameter of the nested model compared
        assert differing == [[]] * 4, f"rank {rank}: parameters differing after each step: {differing}"


def _ours_against_fully_shard(env):
    return summarise([train_sharded_side_by_side(env, "fsdp", STEPS, against="torch-fsdp", model=Nested,
                                                 units=["1", "1.2"]),
                      train_sharded_side_by_side(env, "zero2", STEPS, against="torch-fsdp")])


def test_our_sharded_steps_on_shm_are_bitwise_fully_shard_on_shm():
    for rank, res in enumerate(run_on_ranks(_ours_against_fully_shard, 2, backend="shm", timeout=300)):
        assert res["bitwise"], f"rank {rank}: {res}"


def _collectives_from_callbacks(env, large):
    """Two Future callbacks in a chain, each all-reducing and waiting, as torch's PowerSGD hook's do
    (P, then Q), on an all_reduce past the inline size (so it completes on shm's worker thread) or
    under it; the main thread goes on with another all_reduce meanwhile. What every call ended with."""
    first = torch.full((large,), env.rank + 1.0)
    p = torch.full((3,), 10.0 * (env.rank + 1))
    q = torch.full((2,), 1000.0 * (env.rank + 1))
    after = torch.full((5,), 100.0 * (env.rank + 1))

    def reduce_in_callback(t):
        return lambda fut: dist.all_reduce(t, async_op=True).get_future().wait()[0]

    chained = dist.all_reduce(first, async_op=True).get_future().then(reduce_in_callback(p)).then(reduce_in_callback(q))
    dist.all_reduce(after)
    chained.wait()
    return first[:2].tolist(), p.tolist(), q.tolist(), after.tolist()


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_collective_issued_and_waited_in_a_callback_runs_in_the_same_order_on_every_rank(world_size):
    """Past 64 KiB the first all_reduce completes on the worker thread, whose callback issues the
    next one and waits: queued behind itself it would wait forever. It runs at once, so every
    rank runs it right after the call it follows, before the main thread's next one (each
    rank's values show which call met which)."""
    total = sum(range(1, world_size + 1))
    for large in (100_000, 10):
        for first, p, q, after in run_on_ranks(_collectives_from_callbacks, world_size, args=(large,), backend="shm",
                                           timeout=60):
            assert (first, p, q, after) == ([total] * 2, [10.0 * total] * 3, [1000.0 * total] * 2,
                                            [100.0 * total] * 5), (large, first, p, q, after)


def _python_methods() -> list:
    """Every ShmBackend method forward.cpp calls for what the native path does not take (its
    call("...") names), read from the source so that a method added there is counted too."""
    import re

    from collectives.shm import native

    with open(native.SOURCE) as f:
        return sorted(set(re.findall(r'\bcall\("(\w+)"', f.read())))


def _ddp_configurations(group) -> dict:
    """torch's DDP as users configure it on the CPU (each on about 3 buckets), by name: (DDP's
    options, the comm hook to register after, or None)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    def powersgd_hook(model):  # plain all_reduces for the first step, then P and Q all_reduced in each bucket
        state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2)
        model.register_comm_hook(state, powersgd.powerSGD_hook)

    return {"default": ({}, None), "gradient_as_bucket_view": ({"gradient_as_bucket_view": True}, None),
            "find_unused_parameters": ({"find_unused_parameters": True}, None),  # and its int32 all_reduce
            "static_graph": ({"static_graph": True}, None),
            "powerSGD_hook": ({}, powersgd_hook),
            "fp16_compress_hook": ({}, lambda model: model.register_comm_hook(group, default_hooks.fp16_compress_hook))}


def _hooked(model, hook):
    if hook is not None:
        hook(model)
    return model


def _calls_into_python(env):
    """torch's DDP in each configuration of _ddp_configurations, our bucketed DDP with PowerSGD,
    and fully_shard (nested units) train 4 steps each on a native shm group whose Python methods
    count their calls (forward.cpp calls them for what the native path does not take); then the
    list forms of all_gather and reduce_scatter, gather, scatter, all_to_all (even, uneven, of
    lists), DTensor's redistributions and the functional collectives (coalesced all_gathers and
    reduce_scatters), and one non-contiguous all_reduce (the native path hands that one to Python). The calls counted, by method: for each wrapper (in making it, in
    its steps), and for the calls after."""
    import collections

    from torch import nn

    from collectives.shm import backend_of
    from ddp_from_scratch.wrap import wrap

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    group = dist.new_group(backend="shm")
    impl, seen = backend_of(group), collections.Counter()
    names = _python_methods()
    assert {"allreduce", "allgather", "all_gather_single", "reduce_scatter_single"} <= set(names), names
    for name in names:
        original = getattr(impl, name)
        setattr(impl, name, lambda *a, _original=original, _name=name, **k: (seen.update([_name]), _original(*a, **k))[1])
    makers = {f"ddp {name}": (lambda options=options, hook=hook: _hooked(
        nn.parallel.DistributedDataParallel(mlp(), process_group=group, bucket_cap_mb=0.1, **options), hook))
        for name, (options, hook) in _ddp_configurations(group).items()}
    makers["ours bucketed powersgd"] = lambda: wrap(mlp(), "bucketed", group=group, bucket_cap_mb=0.1,
                                                    compress="powersgd")
    mesh = DeviceMesh.from_group(group, "cpu")

    def nested():
        sharded = Nested()
        for unit in (sharded[1][2], sharded[1], sharded):  # units inside units, as fully_shard's tests nest them
            fully_shard(unit, mesh=mesh)
        return sharded

    makers["fully_shard"] = nested
    counted, x = {}, torch.randn(8, 64)
    for what, make in makers.items():
        seen.clear()
        model = make()
        made = dict(seen)
        seen.clear()
        for _ in range(4):
            model(x if what != "fully_shard" else batch(0, env.rank, 4, image=12)[0]).sum().backward()
        counted[what] = (made, dict(seen))
    seen.clear()
    p = env.world_size
    dist.all_gather([torch.empty(3) for _ in range(p)], torch.ones(3), group=group)
    dist.reduce_scatter(torch.empty(3), [torch.ones(3) for _ in range(p)], group=group)
    dist.gather(torch.ones(3), [torch.empty(3) for _ in range(p)] if env.rank == 0 else None, dst=0, group=group)
    dist.scatter(torch.empty(3), [torch.ones(3) for _ in range(p)] if env.rank == 1 else None, src=1, group=group)
    dist.all_to_all_single(torch.empty(2 * p), torch.ones(2 * p), group=group)
    r = env.rank  # every rank sends d + 1 rows to rank d
    dist.all_to_all_single(torch.empty(p * (r + 1)), torch.ones(p * (p + 1) // 2), [r + 1] * p, list(range(1, p + 1)),
                           group=group)
    dist.all_to_all([torch.empty(2) for _ in range(p)], [torch.ones(2) for _ in range(p)], group=group)
    with dist._coalescing_manager(group=group):  # one allreduce_coalesced call to the backend
        dist.all_reduce(torch.ones(3), group=group)
        dist.all_reduce(torch.ones(2, 2), group=group)
    dist.all_gather_coalesced([[torch.empty(2), torch.empty(3)] for _ in range(p)], [torch.ones(2), torch.ones(3)],
                              group=group)
    group.monitored_barrier(datetime.timedelta(seconds=30), True)  # the group's own (dist's takes Gloo only)
    # messages: a ring of batch_isend_irecv, a blocking pair, and a receive from any source
    ring = [dist.P2POp(dist.isend, torch.ones(5), (r + 1) % p, group=group),
            dist.P2POp(dist.irecv, torch.empty(5), (r - 1) % p, group=group)]
    for work in dist.batch_isend_irecv(ring):
        work.wait()
    if r == 0:
        dist.send(torch.ones(70000), 1, group=group)  # past a mailbox: the message thread moves it
        assert dist.recv(torch.empty(2), group=group) == 1
    elif r == 1:
        dist.recv(torch.empty(70000), 0, group=group)
        dist.send(torch.ones(2), 0, group=group)
    counted["list forms, gather, scatter, all_to_all, the coalesced all_reduce and all_gather, monitored_barrier, messages"] = dict(seen)
    seen.clear()  # DTensor's redistributions and the functional collectives: coalesced all_gathers on the CPU
    whole = torch.arange(8.0 * p).reshape(2 * p, 4)
    d = distribute_tensor(whole, mesh, [Shard(0)]).redistribute(mesh, [Shard(1)]).redistribute(mesh, [Replicate()])
    assert torch.equal(d.to_local(), whole)
    funcol.reduce_scatter_tensor(funcol.all_gather_tensor(whole, 0, group), "sum", 0, group).wait()
    counted["DTensor and functional collectives"] = dict(seen)
    seen.clear()
    dist.all_reduce(torch.ones(4, 2)[:, 0], group=group)
    counted["non-contiguous all_reduce"] = dict(seen)
    return counted


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_and_fully_shard_never_call_into_python_on_the_native_path(world_size):
    """Every collective that torch's DDP (with each option and comm hook users reach on the CPU),
    our DDP with PowerSGD and fully_shard issue in their steps runs in C++. A call the native path
    refused would still leave the right bits (the Python path is bitwise the same), so only this
    count, or the benchmark, would show it. Making torch's DDP (its check of the parameters'
    shapes, a list all_gather, and its broadcast of the module's state) runs in C++ too."""
    for rank, counted in enumerate(run_on_ranks(_calls_into_python, world_size, timeout=120)):
        ddp = {what: made_and_steps for what, made_and_steps in counted.items() if what.startswith("ddp ")}
        assert len(ddp) == 6 and all(v == ({}, {}) for v in ddp.values()), (rank, ddp)
        assert counted["ours bucketed powersgd"] == ({}, {}), (rank, counted)
        assert counted["fully_shard"] == ({}, {}), (rank, counted)
        assert counted["list forms, gather, scatter, all_to_all, the coalesced all_reduce and all_gather, monitored_barrier, messages"] == {}, (rank, counted)
        assert counted["DTensor and functional collectives"] == {}, (rank, counted)
        assert counted["non-contiguous all_reduce"] == {"allreduce": 1}, (rank, counted)



def _calls_into_python_on_a_2d_mesh(env):
    """A 2 x 2 mesh of shm groups (rows and columns): DTensor's redistributions over both of its
    dimensions, and fully_shard over it (HSDP: shards along the rows' groups, replicas across),
    counting the calls handed to Python on the two groups this rank is in."""
    import collections

    from torch import nn

    from collectives.shm import backend_of

    r = env.rank
    rows = [dist.new_group([0, 1], backend="shm"), dist.new_group([2, 3], backend="shm")]
    cols = [dist.new_group([0, 2], backend="shm"), dist.new_group([1, 3], backend="shm")]
    mine = [cols[r % 2], rows[r // 2]]  # mesh dim 0 (across rows), dim 1 (along a row)
    mesh = DeviceMesh.from_group(mine, "cpu", mesh=torch.arange(4).view(2, 2), mesh_dim_names=("replicate", "shard"))
    seen = collections.Counter()
    for group in mine:
        impl = backend_of(group)
        for name in _python_methods():
            original = getattr(impl, name)
            setattr(impl, name, lambda *a, _original=original, _name=name, **k: (seen.update([_name]), _original(*a, **k))[1])
    whole = torch.arange(48.0).reshape(8, 6)
    d = distribute_tensor(whole, mesh, [Shard(0), Shard(1)])
    for placements in ([Replicate(), Shard(0)], [Shard(1), Replicate()], [Replicate(), Replicate()]):
        d = d.redistribute(mesh, placements)
    assert torch.equal(d.to_local(), whole)
    redistributed = dict(seen)
    seen.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    for step in range(3):
        torch.manual_seed(step * 4 + r)
        model(torch.randn(5, 16)).sum().backward()
    return redistributed, dict(seen)


def test_dtensor_and_fully_shard_on_a_2d_mesh_never_call_into_python():
    """The 1-D mesh test above, on two mesh dimensions: each dimension's groups take the same calls."""
    for rank, (redistributed, hsdp) in enumerate(run_on_ranks(_calls_into_python_on_a_2d_mesh, 4, timeout=180)):
        assert redistributed == {}, (rank, redistributed)
        assert hsdp == {}, (rank, hsdp)
