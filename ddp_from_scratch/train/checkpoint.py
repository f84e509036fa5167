"""The training program's checkpoint: what it holds, how it is written and read, and when a
resume is refused.

    state = gather_state(model, opt, impl)            # every rank (the sharded steps gather)
    save(path, config, state, epochs_done, settings, step)   # rank 0, atomically
    state = load_checkpoint(path); check_resume(state, settings, path, epochs); load_state(model, opt, state, impl)

A checkpoint holds whole tensors (the sharded steps' rows gathered), the optimizer state, our
bucketed DDP's rebuilt bucket layout (a resume reduces in it, so it stays bitwise), the epochs and
steps done, and the settings that decide the result (RESUME_KEYS): a resume with other ones is
refused naming each difference. `weights_sha256` is one digest of a model's weights, how runs on
different machines are compared.
"""

from __future__ import annotations

import os
import pickle
import zipfile

import torch
import torch.distributed as dist

from collectives import cli

from ..steps.powersgd import CLI_NAMES as POWERSGD_CLI_NAMES
from ..wrap import SHARDED_IMPLS


# The settings that decide a run's result: a checkpoint records them and --resume must match.
RESUME_KEYS = ("world_size", "impl", "model", "batch_size", "seed", "lr", "synthetic", "train_size", "amp",
               "bucket_cap_mb", "compress")


class RunComplete(Exception):
    """The checkpoint holds every epoch asked for: there is nothing to resume."""


class CheckpointError(ValueError):
    """The checkpoint is missing, damaged, or was written by a run with other settings."""


def check_checkpoint_flags(args, parser, written: str, written_in: str) -> bool:
    """--checkpoint and its companions, for every run: --resume, --auto-resume, --checkpoint-every
    and --stop-at-step need it, --resume and --auto-resume exclude each other, and the folder is a
    folder this process can write (made now). `written`, `written_in`: what the messages say is
    written there. Whether a folder was given (parser.error, exit 2, on anything wrong)."""
    for flag, given in (("--resume", args.resume), ("--auto-resume", args.auto_resume),
                        ("--checkpoint-every", args.checkpoint_every), ("--stop-at-step", args.stop_at_step)):
        if given and not args.checkpoint:
            parser.error(f"{flag} needs --checkpoint FOLDER ({written})")
    if args.resume and args.auto_resume:
        parser.error("--resume and --auto-resume: give one (--auto-resume also starts when there is no checkpoint)")
    if not args.checkpoint:
        return False
    if os.path.exists(args.checkpoint) and not os.path.isdir(args.checkpoint):
        parser.error(f"--checkpoint {args.checkpoint} is a file; it must be a folder ({written_in})")
    try:
        os.makedirs(args.checkpoint, exist_ok=True)
    except OSError as exc:
        parser.error(f"--checkpoint {args.checkpoint}: cannot write there ({exc.strerror or exc})")
    return True


def load_checkpoint(path: str, map_location="cpu") -> dict:
    """The checkpoint at `path`; a damaged file is a CheckpointError naming it, in one line."""
    if not os.path.isfile(path):
        raise CheckpointError(f"--resume: there is no checkpoint at {path}")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"{path} is damaged (empty file); delete it or point --checkpoint elsewhere")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError) as exc:
        # torch's own messages here are long and suggest weights_only=False, which would not help
        why = "truncated" if isinstance(exc, EOFError) or "central directory" in str(exc) else (
            f"not a torch checkpoint: {type(exc).__name__}")
        raise CheckpointError(f"{path} is damaged ({why}); delete it or point --checkpoint elsewhere") from None
    missing = [k for k in ("model", "optimizer", "epoch", "settings") if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path} is not a checkpoint of this program (no {', '.join(missing)} in it)")
    return state


def check_resume(state: dict, settings: dict, path: str, epochs: int) -> None:
    """Refuse a resume whose settings differ from the checkpoint's, naming each difference. A
    worker restarted by torchrun's elastic agent on another number of ranks (a host left or
    joined) is told that in one line: the global batch would change, so the result would too."""
    saved = state["settings"]
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restarts and saved.get("world_size") != settings["world_size"]:
        raise CheckpointError(
            f"torchrun restarted this job (restart {restarts}) on {settings['world_size']} ranks, but {path} was "
            f"written by {saved.get('world_size')} ranks: a host left or joined the job (--nnodes MIN:MAX), and "
            "resuming on another number of ranks would change the global batch and so the result; bring the "
            "job back to its hosts, or start a new --checkpoint folder")
    differ = [f"{k} {saved.get(k)!r} in the checkpoint, {settings[k]!r} now" for k in RESUME_KEYS if saved.get(k) != settings[k]]
    if differ:
        raise CheckpointError(f"--resume: {path} was written with other settings: {'; '.join(differ)}. Resume with the "
                              "checkpoint's settings, or start a new --checkpoint folder")
    if state["epoch"] >= epochs:
        raise RunComplete(f"{path} has already trained {state['epoch']} of --epochs {epochs}")


def run_settings(config, world_size: int) -> dict:
    """The settings that decide a run's result, from its config (a TrainConfig or the parsed flags)."""
    settings = {**{k: getattr(config, k) for k in RESUME_KEYS if k != "world_size"}, "world_size": world_size}
    if settings["compress"] in POWERSGD_CLI_NAMES:  # its options decide the result too
        settings["compress"] += f" rank {config.powersgd_rank} from step {config.powersgd_start_iter}"
    return settings


def gather_state(model, opt, impl: str) -> dict:
    """{"model", "optimizer"} to save: whole tensors for the sharded steps (gathered: call on every rank)."""
    if impl == "torch-fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_state, opt_state = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        return {"model": model_state, "optimizer": opt_state}
    if impl in SHARDED_IMPLS:
        return {"model": model.full_model_state(), "optimizer": opt.full_state_dict()}
    buckets = model.bucket_layout_state() if hasattr(model, "bucket_layout_state") else None  # ours: see ddp.py
    saved = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "buckets": buckets}
    local = _powersgd_state(model)
    if local is not None:  # each rank's own (its error-feedback memory is its own): gathered on every rank
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
        saved["powersgd"] = everyone
    return saved


def _powersgd_state(model):
    """This rank's PowerSGD state, ours (compress=PowerSGD) or torch's hook's (train.py keeps it
    on the model as `powersgd_state`); None without PowerSGD."""
    from ..steps.powersgd import PowerSGD
    from ..parts.torch_hooks import powersgd_state_dict

    if isinstance(getattr(model, "compress", None), PowerSGD):
        return model.compress.state_dict()
    if getattr(model, "powersgd_state", None) is not None:
        return powersgd_state_dict(model.powersgd_state)
    return None


def load_state(model, opt, state: dict, impl: str) -> None:
    """Put a checkpoint's model and optimizer state (and our bucketed DDP's layout) into place."""
    if impl == "torch-fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(full_state_dict=True))
    elif impl in SHARDED_IMPLS:
        model.load_full_model_state(state["model"])
        opt.load_full_state_dict(state["optimizer"])
    else:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        if hasattr(model, "load_bucket_layout_state"):
            model.load_bucket_layout_state(state.get("buckets"))
        if state.get("powersgd") is not None:
            from ..steps.powersgd import PowerSGD
            from ..parts.torch_hooks import load_powersgd_state_dict

            mine = state["powersgd"][dist.get_rank()]
            if isinstance(getattr(model, "compress", None), PowerSGD):
                model.compress.load_state_dict(mine)
            else:
                load_powersgd_state_dict(model.powersgd_state, mine)


def save(path: str, config, saved: dict, epochs_done: int, settings: dict, step: int = 0) -> None:
    """Rank 0 writes the checkpoint atomically: a crash, or a write that fails (a full disk), leaves
    the previous one whole and no .tmp behind. `epochs_done` whole epochs and `step` steps of the next."""
    os.makedirs(config.checkpoint, exist_ok=True)
    state = {**saved, "epoch": epochs_done, "step": step, "synthetic": config.synthetic, "settings": settings}
    cli.write_output(path, lambda f: torch.save(state, f), "the checkpoint")


def weights_sha256(state: dict) -> str:
    """One digest of every tensor of a model state (names, dtypes, shapes, bytes, in name order):
    equal digests, bitwise equal weights (how a run on two hosts is compared with one on one)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
