"""The expected result of every collective, computed locally from every rank's input.

The property tests regenerate each rank's input from (seed, rank), so every rank can compute
what a collective must return without running the code under test:

    check_collective(env, "reduce_scatter", mine, inputs, op="sum", root=0)
"""

import torch

import collectives as C


def reduced(inputs, op: str) -> torch.Tensor:
    """The elementwise `op` over the ranks' equal-shaped inputs."""
    stacked = torch.stack(inputs)  # (n, *shape)
    if not stacked.numel():
        return stacked.sum(0)
    return {"sum": stacked.sum(0), "min": stacked.amin(0), "max": stacked.amax(0)}[op].to(inputs[0].dtype)


def check_collective(env, collective: str, mine: torch.Tensor, inputs, op: str, root: int) -> None:
    """Run `collective` on this rank's `mine` and assert its result; `inputs[i]` is rank i's input."""
    n, r = env.world_size, env.rank
    if collective == "all_reduce":
        assert C.all_reduce(mine, op=op) is mine
        assert torch.equal(mine, reduced(inputs, op)), f"{mine} != {reduced(inputs, op)}"
    elif collective == "reduce":
        C.reduce(mine, dst=root, op=op)
        assert r != root or torch.equal(mine, reduced(inputs, op))
    elif collective == "broadcast":
        assert torch.equal(C.broadcast(mine, src=root), inputs[root])
    elif collective == "all_gather":
        assert torch.equal(C.all_gather(mine), torch.cat([t.reshape(1) if t.dim() == 0 else t for t in inputs]))
    elif collective == "gather":
        got = C.gather(mine, dst=root)
        assert got is None if r != root else torch.equal(got, torch.cat(inputs))
    else:
        chunk = mine.shape[0] // n
        mine_rows = slice(r * chunk, (r + 1) * chunk)
        if collective == "reduce_scatter":
            assert torch.equal(C.reduce_scatter(mine, op=op), reduced(inputs, op)[mine_rows])
        elif collective == "scatter":
            assert torch.equal(C.scatter(mine, src=root), inputs[root][mine_rows])
        elif collective == "all_to_all":
            assert torch.equal(C.all_to_all(mine), torch.cat([inputs[i][mine_rows] for i in range(n)]))
        else:
            raise ValueError(collective)
