"""The ResNet-50 (or small CNN) run on CIFAR-10: one rank's training loop under any --impl, with
evaluation, checkpoints, --resume, mixed precision and compression (the package's docstring,
ddp_from_scratch/train/__init__.py, says what the program does; args.py holds its flags).

    summary = train(env, TrainConfig.from_args(build_parser().parse_args(argv)))   # on each rank
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import collectives
from collectives.cli import eta

from ..workload import cifar10
from .checkpoint import check_resume, gather_state, load_checkpoint, load_state, run_settings, save, weights_sha256
from ..workload.models import MODELS
from ..steps.powersgd import CLI_NAMES as POWERSGD_CLI_NAMES
from ..parts.torch_hooks import bf16_compress_hook_on_gloo, powersgd_hook, powersgd_state
from .args import CIFAR_TEST_SIZE, CIFAR_TRAIN_SIZE, TrainConfig
from .compression import compress_of, powersgd_options
from ..wrap import SHARDED_IMPLS, STAGES, wrap


def train(env, config: TrainConfig) -> dict:
    with deterministic_kernels(config.deterministic):
        return _train(env, config)


def _train(env, config: TrainConfig) -> dict:
    torch.manual_seed(config.seed)
    train_set, test_set = _datasets(config)
    model, opt = _build(env, config)
    scaler = torch.amp.GradScaler("cuda") if config.amp and env.device.type == "cuda" else None
    settings = run_settings(config, env.world_size)
    start_epoch, start_step = _resume(env, config, model, opt, settings)
    sampler = DistributedSampler(train_set, num_replicas=env.world_size, rank=env.rank, shuffle=True,
                                 seed=config.seed, drop_last=True)
    steps = len(sampler) // config.batch_size
    to_do = sum(max(0, config.end_of(e, steps) - (start_step if e == start_epoch else 0))
                for e in range(start_epoch, config.epochs))
    progress = _Progress(env, config, to_do)

    def checkpoint(epochs_done: int, step: int = 0) -> dict:
        saved = gather_state(model, opt, config.impl)  # sharded: every rank takes part in gathering
        if env.rank == 0:
            save(config.checkpoint_path, config, saved, epochs_done, settings, step)
        return saved

    # latest: the state of the last checkpoint written here, which the summary's digest reuses
    # when no step came after it (a sharded model is gathered once at the end, not twice)
    images, seconds, accuracy, skipped, stopped_at, latest = 0, 0.0, None, 0, None, None
    for epoch in range(start_epoch, config.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch (every rank the same permutation, disjoint shards)
        (train_set.dataset if isinstance(train_set, torch.utils.data.Subset) else train_set).set_epoch(epoch)
        first = start_step if epoch == start_epoch else 0  # a resume within an epoch skips the steps done
        last = config.end_of(epoch, steps)
        if last <= first:  # --stop-at-step at or before where this epoch starts
            stopped_at = epoch * steps + first
            break
        loader = DataLoader(train_set, batch_size=config.batch_size,
                            sampler=list(sampler)[first * config.batch_size:last * config.batch_size])
        start = time.perf_counter()
        skipped = _train_epoch(env, config, model, opt, loader, scaler, epoch, first, steps, progress, skipped,
                               lambda step, epoch=epoch: checkpoint(epoch, step))
        seconds += time.perf_counter() - start
        images += len(loader) * config.batch_size * env.world_size
        if last < steps:  # --stop-at-step within this epoch
            latest, stopped_at = checkpoint(epoch, last), epoch * steps + last
            if env.rank == 0:
                print(f"\nstopped at step {stopped_at} (--stop-at-step); --resume goes on from "
                      f"{config.checkpoint_path}", file=sys.stderr, flush=True)
            break
        accuracy = _evaluate(model, test_set, env, config.batch_size)
        if env.rank == 0:
            print(f"\nepoch {epoch + 1}: {time.perf_counter() - start:.1f} s, test accuracy {accuracy:.4f}"
                  f"{progress.tag}", file=sys.stderr, flush=True)
        if config.checkpoint:
            latest = checkpoint(epoch + 1)
        collectives.barrier()
    digest = weights_sha256((latest or gather_state(model, opt, config.impl))["model"])  # sharded: every rank gathers
    return _summary(env, config, start_epoch, start_step, stopped_at, skipped, seconds, images, accuracy, digest)


def _build(env, config):
    """(model, optimizer) for config.impl on this rank's device."""
    if config.impl in SHARDED_IMPLS:
        return _sharded(MODELS[config.model]().to(env.device), config)
    device_ids = [env.device.index] if config.impl == "torch" and env.device.type == "cuda" else None
    options = {"device_ids": device_ids} if config.impl == "torch" else {"compress": compress_of(config)}
    model = wrap(MODELS[config.model]().to(env.device), config.impl, bucket_cap_mb=config.bucket_cap_mb, **options)
    if config.impl == "torch" and config.compress:
        state, hook = _torch_hook(config)
        model.register_comm_hook(state, hook)
        model.powersgd_state = state  # None but for PowerSGD; the checkpoint keeps its memories (checkpoint.py)
    return model, torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)


def _torch_hook(config: TrainConfig):
    """(state, hook) of torch's comm hook for --compress, on torch's DDP."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if config.compress == "fp16":
        return None, default_hooks.fp16_compress_hook
    if config.compress == "bf16":
        return None, bf16_compress_hook_on_gloo
    state = powersgd_state(**powersgd_options(config))
    return state, powersgd_hook(batched=config.compress == "batched_powersgd")


def _sharded(net, config):
    """(model, optimizer) for a sharded step; every rank has the same seeded weights already."""
    model = wrap(net, config.impl, bucket_cap_mb=config.bucket_cap_mb)
    if not STAGES[config.impl].ours:  # torch's fully_shard: a torch optimizer over its DTensors
        return model, torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
    return model, model.optimizer(torch.optim.SGD, lr=config.lr, momentum=0.9)


def _datasets(config):
    if config.synthetic:
        train = cifar10.SyntheticCIFAR10(config.train_size or CIFAR_TRAIN_SIZE, augment=True, seed=config.seed)
        test = cifar10.SyntheticCIFAR10(config.test_size or CIFAR_TEST_SIZE, seed=config.seed + 1)
    else:
        train = cifar10.CIFAR10(config.data, train=True, augment=True, seed=config.seed)
        test = cifar10.CIFAR10(config.data, train=False)
    if config.train_size and not config.synthetic:
        train = torch.utils.data.Subset(train, range(config.train_size))
    if config.test_size and not config.synthetic:
        test = torch.utils.data.Subset(test, range(config.test_size))
    return train, test


def _resume(env, config: TrainConfig, model, opt, settings: dict):
    """(epoch, step) this run starts at: (0, 0), or where the checkpoint left off (--resume, or
    --auto-resume when there is one), its state loaded into the model and the optimizer."""
    path = config.checkpoint_path
    if not (config.resume or (config.auto_resume and os.path.exists(path))):
        return 0, 0
    state = load_checkpoint(path, map_location=env.device)
    check_resume(state, settings, path, config.epochs)  # under torchrun, the first place it can be checked
    load_state(model, opt, state, config.impl)
    return state["epoch"], state.get("step", 0)


class _Progress:
    """Rank 0's progress line on stderr: step, loss, images/s, the time left, skipped steps."""

    def __init__(self, env, config, steps_to_do: int):
        self.env, self.config, self.steps_to_do, self.steps_done = env, config, steps_to_do, 0
        self.run_start = time.perf_counter()
        self.tag = " [synthetic data]" if config.synthetic else ""
        self.clear = "\033[K" if sys.stderr.isatty() else ""  # the rest of a longer earlier progress line

    def step(self, epoch: int, step: int, steps: int, first: int, loss, epoch_start: float, skipped: int) -> None:
        self.steps_done += 1
        if self.env.rank != 0:
            return
        done = (step + 1 - first) * self.config.batch_size * self.env.world_size
        now = time.perf_counter()
        left = eta(self.steps_done, self.steps_to_do, now - self.run_start)
        skips = f", {skipped} steps skipped by GradScaler (inf/NaN gradients)" if skipped else ""
        print(f"\repoch {epoch + 1}/{self.config.epochs} step {step + 1}/{steps} loss {loss.item():.4f} "
              f"{done / (now - epoch_start):.1f} images/s, {left}{skips}{self.tag}{self.clear}", end="",
              file=sys.stderr, flush=True)


def _train_epoch(env, config, model, opt, loader, scaler, epoch: int, first: int, steps: int, progress: _Progress,
                 skipped: int, checkpoint) -> int:
    """Steps `first`.. of one epoch of `steps` (`loader` starts at step `first`); `checkpoint(step)` after
    every --checkpoint-every steps but the epoch's last. The number of steps GradScaler has skipped so far."""
    amp_dtype = torch.float16 if env.device.type == "cuda" else torch.bfloat16
    start, every = time.perf_counter(), config.checkpoint_every
    for step, (x, y) in enumerate(loader, start=first):
        x, y = x.to(env.device), y.to(env.device)
        opt.zero_grad()
        with torch.autocast(env.device.type, dtype=amp_dtype, enabled=config.amp):
            loss = F.cross_entropy(model(x), y)
        if scaler:
            skipped += not scaled_step(scaler, loss, opt)
        else:
            loss.backward()
            opt.step()
        progress.step(epoch, step, steps, first, loss, start, skipped)
        if every and (step + 1) % every == 0 and step + 1 < steps:
            checkpoint(step + 1)
    return skipped


def scaled_step(scaler, loss, opt) -> bool:
    """Backward and an optimizer step through a GradScaler (fp16 on CUDA). False when the scaler
    skipped the step: a gradient held inf or NaN, so it left the weights as they were and halved
    its scale (the only time the scale goes down)."""
    before = scaler.get_scale()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale() >= before


def _evaluate(model, test, env, batch_size) -> float:
    sampler = DistributedSampler(test, num_replicas=env.world_size, rank=env.rank, shuffle=False)
    # counted where the backend reduces (NCCL: the GPU)
    correct_total = torch.zeros(2, dtype=torch.float64, device=env.device if env.backend == "nccl" else "cpu")
    model.eval()
    with torch.no_grad():
        for x, y in DataLoader(test, batch_size=batch_size, sampler=sampler):
            out = getattr(model, "module", model)(x.to(env.device))  # no gradient sync needed to evaluate
            correct_total += torch.tensor([(out.argmax(1).cpu() == y).sum().item(), len(y)], dtype=torch.float64,
                                          device=correct_total.device)
    model.train()
    collectives.all_reduce(correct_total)
    return (correct_total[0] / correct_total[1]).item()


def _summary(env, config: TrainConfig, start_epoch, start_step, stopped_at, skipped, seconds, images, accuracy,
             digest) -> dict:
    """The run's JSON summary (the last line on stdout)."""
    return {"impl": config.impl, "model": config.model, "world_size": env.world_size, "device": str(env.device),
            "backend": env.backend, "epochs": config.epochs, "resumed_from_epoch": start_epoch,
            "resumed_from_step": start_step, "stopped_at_step": stopped_at,
            "batch_size_per_rank": config.batch_size, "amp": config.amp, "compress": config.compress,
            **({"powersgd": powersgd_options(config)} if config.compress in POWERSGD_CLI_NAMES else {}),
            "skipped_steps": skipped,
            "deterministic": config.deterministic, "train_seconds": seconds,
            "images_per_second": images / seconds if seconds else None, "test_accuracy": accuracy,
            "synthetic_data": config.synthetic, "weights_sha256": digest}


@contextlib.contextmanager
def deterministic_kernels(enabled: bool):
    """cuDNN's deterministic mode and torch.use_deterministic_algorithms (warnings only, for ops
    with no deterministic kernel) while training; the previous settings are restored after, since a
    rank of a shared pool runs other work next."""
    if not enabled:
        yield
        return
    before = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
              torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if workspace is None:  # deterministic cuBLAS needs it; read when cuBLAS first starts, later
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[:2]
        torch.use_deterministic_algorithms(before[2], warn_only=before[3])
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
