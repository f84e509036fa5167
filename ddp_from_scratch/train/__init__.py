"""The training program: ResNet-50 on CIFAR-10 with torch's DDP or one of ours, as the public DDP tutorials do (the
blog tutorial "Understanding Distributed Training in PyTorch: Exploring Distributed Data Parallelism
and Mixed-Precision Techniques", 2024: torchvision's ResNet-50, CIFAR-10, SGD, lr 0.001, momentum 0.9).

    python -m ddp_from_scratch.train --impl bucketed --nproc 2 --synthetic --epochs 1 --batch-size 32
    python -m ddp_from_scratch.train --impl fsdp --nproc 2 --synthetic --epochs 1    # or zero1, zero2, zero2-bucketed, torch-fsdp
    python -m ddp_from_scratch.train --impl torch --nproc 2 --data ./data --epochs 1 --batch-size 128
    torchrun --nproc_per_node=4 -m ddp_from_scratch.train --impl bucketed --data ./data --amp
    srun -N2 --ntasks-per-node=4 python -m ddp_from_scratch.train --impl bucketed --data ./data
    python -m ddp_from_scratch.train --tp 2 --nproc 4 --synthetic        # the small transformer, TP x DP (train/tp.py)
    python -m ddp_from_scratch.train --pp 2 --schedule 1f1b --microbatches 4 --nproc 4 --synthetic  # PP x DP (train/pp.py)
    python -m ddp_from_scratch.train --ep 2 --nproc 4 --synthetic --experts 4 --top-k 2  # MoE, EP x DP (train/ep.py)
    python -m ddp_from_scratch.train --cp 2 --tp 2 --nproc 4 --synthetic    # ring attention, CP x TP (train/cp.py)
    python -m ddp_from_scratch.train --pp 2 --tp 2 --nproc 8 --checkpoint ck --resume   # any layout resumes any other's
    torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 2 --rdzv-backend c10d --rdzv-endpoint node0:29500 \
        -m ddp_from_scratch.train --checkpoint ckpt --checkpoint-every 20 --auto-resume --data ./data

Each epoch: a DistributedSampler shard per rank (shuffled by seed and epoch), the augmentation
fixed by (seed, epoch, sample), SGD with momentum 0.9, progress with images/s and the time left
on rank 0 (stderr), test accuracy reduced over ranks, and an atomic checkpoint (written to a
temporary file, then renamed), also every K steps with `--checkpoint-every K`. `--resume`
continues from the checkpoint (within an epoch too: the steps done are skipped, the rest of the
epoch's shuffle is the same) and ends with the same parameters as an uninterrupted run;
`--auto-resume` does so when a checkpoint exists, so that workers torchrun's elastic agent
restarts with the same arguments go on where the group stopped; `--stop-at-step N` ends early at
step N with a checkpoint (a run split over short jobs); the checkpoint records the settings that decide the result
(world size, impl, model, batch size, seed, ...) and a resume with other ones is refused, naming
them. Every argument, the dataset files and the checkpoint are checked before any rank starts.
The last line on stdout is a JSON summary; with --synthetic every output says that the data was
synthetic.

The sharded steps (--impl zero1, zero2, zero2-bucketed, fsdp: ours; torch-fsdp: torch's fully_shard on the same
units) start every rank from the same seeded weights. Their checkpoint is gathered on save: whole
parameters and whole optimizer state (each rank's momentum rows all-gathered), written by rank 0
as for DDP, and cut into rows again on resume; so the file does not depend on how the ranks
sharded it.

Its parts, read in order:

    args.py        the flags, TrainConfig, and the ResNet run's checks, made before any rank starts
    transformer_args.py  the transformer runs' sizes, checks and checkpoint layout
    checkpoint.py  the ResNet run's checkpoint: what it holds, when a resume is refused
    resnet.py      the ResNet / CNN run on CIFAR-10 (any --impl)
    progress.py    the transformer runs' progress line
    data.py        the transformer runs' batches (text or synthetic) and when they evaluate
    places.py      where each of a rank's parameter elements sits in the one-rank model
    sharded_checkpoint.py  the --tp/--pp/--cp runs' checkpoint: a shard a rank, resharded on resume
    transformer.py the --tp/--pp/--cp runs' one loop (evaluation, --amp, checkpoints, --sample)
    gradients.py   the EP and CP runs' flat gradient average
    sample.py      --sample: the bytes the model, put together whole, writes
    tp.py          --tp: the small transformer, TP x DP (and DP alone: --tp 1)
    pp.py          --pp: the small transformer in pipeline stages, PP x TP x DP (x CP)
    ep.py          --ep: the transformer with mixture-of-experts blocks, EP x DP
    cp.py          --cp: the small transformer with each sequence over ranks, CP x TP x DP
    program.py     main(): parse, check, run on every rank, print the summary
"""

from .args import TrainConfig, build_parser, torch_powersgd_refusal, validate
from .checkpoint import run_settings
from .program import main
from .resnet import scaled_step, train

__all__ = ["TrainConfig", "build_parser", "main", "run_settings", "scaled_step", "torch_powersgd_refusal", "train",
           "validate"]
