"""Train ResNet-50 on CIFAR-10 with torch's DDP or one of ours, as the seeds do.

    python -m ddp_from_scratch.train --impl bucketed --nproc 2 --synthetic --epochs 1 --batch-size 32
    python -m ddp_from_scratch.train --impl torch --nproc 2 --data ./data --epochs 1 --batch-size 128
    torchrun --nproc_per_node=4 -m ddp_from_scratch.train --impl bucketed --data ./data --amp
    srun -N2 --ntasks-per-node=4 python -m ddp_from_scratch.train --impl bucketed --data ./data

Each epoch: a DistributedSampler shard per rank (shuffled by seed and epoch), the augmentation
fixed by (seed, epoch, sample), SGD with momentum 0.9, progress with images/s on rank 0 (stderr),
test accuracy reduced over ranks, and an atomic checkpoint (written to a temporary file, then
renamed). `--resume` continues from the checkpoint and ends with the same parameters as an
uninterrupted run. The last line on stdout is a JSON summary; with --synthetic every output says
that the data was synthetic.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import collectives
from collectives.env import read_env

from . import cifar10
from .compare import MODELS, WRAPPERS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ddp_from_scratch.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--impl", choices=["torch"] + list(WRAPPERS), default="bucketed", help="which DDP")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun/srun")
    p.add_argument("--model", choices=list(MODELS), default="resnet50", help="ResNet-50 (10 classes) or a small CNN")
    p.add_argument("--data", default="./data", help="folder with cifar-10-batches-py/ or cifar-10-python.tar.gz")
    p.add_argument("--synthetic", action="store_true", help="a deterministic CIFAR-shaped stand-in instead of CIFAR-10")
    p.add_argument("--train-size", type=int, default=None, help="use only the first N training images")
    p.add_argument("--test-size", type=int, default=None, help="use only the first N test images")
    p.add_argument("--epochs", type=int, default=1, help="epochs to train (in total, counting resumed ones)")
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step (the seeds use 256 and 128)")
    p.add_argument("--lr", type=float, default=0.001, help="SGD learning rate (momentum 0.9), as in the seeds")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="bucket size for --impl bucketed / torch, MiB (default: torch's, 25 with a 1 MiB first bucket)")
    p.add_argument("--amp", action="store_true", help="mixed precision: bf16 autocast on CPU, fp16 + GradScaler on CUDA")
    p.add_argument("--seed", type=int, default=0, help="initialisation, shuffling and augmentation")
    p.add_argument("--checkpoint", default=None, help="folder for checkpoint.pt, written each epoch")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint/checkpoint.pt")
    p.add_argument("--json", default=None, help="also write the summary to this file")
    return p


def _datasets(config):
    if config["synthetic"]:
        train = cifar10.SyntheticCIFAR10(config["train_size"] or 50_000, augment=True, seed=config["seed"])
        test = cifar10.SyntheticCIFAR10(config["test_size"] or 10_000, seed=config["seed"] + 1)
    else:
        train = cifar10.CIFAR10(config["data"], train=True, augment=True, seed=config["seed"])
        test = cifar10.CIFAR10(config["data"], train=False)
    if config["train_size"] and not config["synthetic"]:
        train = torch.utils.data.Subset(train, range(config["train_size"]))
    if config["test_size"] and not config["synthetic"]:
        test = torch.utils.data.Subset(test, range(config["test_size"]))
    return train, test


def _wrap(model, config, env):
    if config["impl"] == "torch":
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=config["bucket_cap_mb"])
    if config["impl"] == "bucketed":
        return WRAPPERS["bucketed"](model, bucket_cap_mb=config["bucket_cap_mb"])
    return WRAPPERS[config["impl"]](model)


def _evaluate(model, test, env, batch_size) -> float:
    sampler = DistributedSampler(test, num_replicas=env.world_size, rank=env.rank, shuffle=False)
    correct_total = torch.zeros(2, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for x, y in DataLoader(test, batch_size=batch_size, sampler=sampler):
            out = model.module(x.to(env.device))  # no gradient sync needed to evaluate
            correct_total += torch.tensor([(out.argmax(1).cpu() == y).sum().item(), len(y)], dtype=torch.float64)
    model.train()
    collectives.all_reduce(correct_total.to(env.device) if env.backend == "nccl" else correct_total)
    return (correct_total[0] / correct_total[1]).item()


def train(env, config) -> dict:
    torch.manual_seed(config["seed"])
    train_set, test_set = _datasets(config)
    model = _wrap(MODELS[config["model"]]().to(env.device), config, env)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    scaler = torch.amp.GradScaler("cuda") if config["amp"] and env.device.type == "cuda" else None
    amp_dtype = torch.float16 if env.device.type == "cuda" else torch.bfloat16
    path = os.path.join(config["checkpoint"], "checkpoint.pt") if config["checkpoint"] else None
    start_epoch = 0
    if config["resume"]:
        if not path or not os.path.exists(path):
            raise FileNotFoundError(f"--resume: no checkpoint at {path!r}")
        state = torch.load(path, map_location=env.device, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"]
    sampler = DistributedSampler(train_set, num_replicas=env.world_size, rank=env.rank, shuffle=True,
                                 seed=config["seed"], drop_last=True)
    loader = DataLoader(train_set, batch_size=config["batch_size"], sampler=sampler, drop_last=True)
    tag = " [synthetic data]" if config["synthetic"] else ""
    images, seconds, accuracy = 0, 0.0, None
    for epoch in range(start_epoch, config["epochs"]):
        sampler.set_epoch(epoch)
        (train_set.dataset if isinstance(train_set, torch.utils.data.Subset) else train_set).set_epoch(epoch)
        start = time.perf_counter()
        for step, (x, y) in enumerate(loader):
            x, y = x.to(env.device), y.to(env.device)
            opt.zero_grad()
            with torch.autocast(env.device.type, dtype=amp_dtype, enabled=config["amp"]):
                loss = F.cross_entropy(model(x), y)
            if scaler:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            if env.rank == 0:
                done = (step + 1) * config["batch_size"] * env.world_size
                rate = done / (time.perf_counter() - start)
                print(f"\repoch {epoch + 1}/{config['epochs']} step {step + 1}/{len(loader)} loss {loss.item():.4f} "
                      f"{rate:.1f} images/s{tag}", end="", file=sys.stderr, flush=True)
        epoch_seconds = time.perf_counter() - start
        images += len(loader) * config["batch_size"] * env.world_size
        seconds += epoch_seconds
        accuracy = _evaluate(model, test_set, env, config["batch_size"])
        if env.rank == 0:
            print(f"\nepoch {epoch + 1}: {epoch_seconds:.1f} s, test accuracy {accuracy:.4f}{tag}", file=sys.stderr, flush=True)
            if path:
                os.makedirs(config["checkpoint"], exist_ok=True)
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch + 1,
                            "synthetic": config["synthetic"]}, path + ".tmp")
                os.replace(path + ".tmp", path)  # atomic: a crash leaves the previous checkpoint whole
        collectives.barrier()
    return {"impl": config["impl"], "model": config["model"], "world_size": env.world_size, "device": str(env.device),
            "backend": env.backend, "epochs": config["epochs"], "resumed_from_epoch": start_epoch,
            "batch_size_per_rank": config["batch_size"], "amp": config["amp"], "train_seconds": seconds,
            "images_per_second": images / seconds if seconds else None, "test_accuracy": accuracy,
            "synthetic_data": config["synthetic"]}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.synthetic:
        try:
            cifar10.load_arrays(args.data, train=False)  # the small file: fail before any rank starts
        except cifar10.DatasetMissing as exc:
            parser.exit(2, f"error: {exc}\n")
    config = vars(args)
    if read_env(os.environ)["master_addr"] is not None:  # started by torchrun or srun
        env = collectives.init_from_env()
        summary = train(env, config)
        collectives.shutdown()
        if env.rank != 0:
            return 0
    else:
        summary = collectives.run(train, world_size=args.nproc, args=(config,), timeout=7 * 24 * 3600)[0]
    text = json.dumps(summary)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
