"""A checkpoint in shards: each rank writes its own file, and rank 0 a manifest that names the
layout, the step and every shard's digest. The transformer runs' checkpoint (train --ep's, and
train/sharded_checkpoint.py's for --tp, --pp and --cp, which may load into another layout).

    save_shard(folder, rank, world_size, state)            # every rank, its own file, atomically
    write_manifest(folder, layout, step, world_size)       # rank 0, once every shard is written
    manifest = read_manifest(folder)                       # before any rank starts: refused in one line
    check_layout(manifest, layout, folder)                 #   if it is damaged, foreign or of another layout
    check_settings(manifest, run, settings, folder)        #   (or, for a run that reshards: of other settings)
    verify_shards(folder, manifest)                        #   or a shard is damaged
    state = load_shard(folder, rank, manifest)             # each rank, its own file, its digest checked

The manifest is written last, so a run killed while writing shards leaves the previous manifest
(and the previous shards: each shard is replaced whole, output_files.py), never a manifest naming
half-written files. A shard whose digest differs from the manifest's is refused by name, which
also catches a shard from another save that a kill left behind.

    folder/manifest.json            {"format": ..., "layout": {...}, "step": 12, "shards": [{"file", "sha256"}]}
    folder/shard-00000-of-00004.pt  rank 0's state (a dict of tensors and plain values)
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import zipfile
from typing import Optional

import torch

from collectives import output_files

FORMAT = "collectives-playground sharded checkpoint 1"
MANIFEST = "manifest.json"


class ShardError(ValueError):
    """The checkpoint is missing, damaged, foreign or of another layout; the message is one line."""


def shard_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


def _bytes_of(state: dict) -> bytes:
    """The shard's file content, in memory: its digest goes in the manifest, then write_output writes it."""
    f = io.BytesIO()
    torch.save(state, f)
    return f.getvalue()


def save_shard(folder: str, rank: int, world_size: int, state: dict) -> str:
    """Write rank `rank`'s state; returns its sha256 (for the manifest)."""
    data = _bytes_of(state)
    output_files.write_output(os.path.join(folder, shard_name(rank, world_size)), data, "--checkpoint")
    return hashlib.sha256(data).hexdigest()


def write_manifest(folder: str, layout: dict, step: int, digests: list, settings: Optional[dict] = None) -> None:
    """Rank 0, after every rank has written its shard: the layout, the steps done, each shard's
    digest, and the settings any layout resuming it must share (when it may reshard)."""
    shards = [{"file": shard_name(r, len(digests)), "sha256": d} for r, d in enumerate(digests)]
    manifest = {"format": FORMAT, "layout": layout, "step": step, "shards": shards}
    if settings is not None:
        manifest["settings"] = settings
    output_files.write_json(os.path.join(folder, MANIFEST), manifest, "--checkpoint")
    named = {s["file"] for s in shards}
    for name in os.listdir(folder):  # another layout's shards, left by the run this one resumed: unused now
        if name.startswith("shard-") and name.endswith(".pt") and name not in named:
            os.remove(os.path.join(folder, name))


def read_manifest(folder: str) -> dict:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise ShardError(f"--resume: there is no checkpoint in {folder} (no {MANIFEST})")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise ShardError(f"{path} is damaged ({type(exc).__name__}); delete the folder or point --checkpoint "
                         "elsewhere") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ShardError(f"{path} is not a sharded checkpoint of this program (its format is "
                         f"{manifest.get('format') if isinstance(manifest, dict) else type(manifest).__name__!r})")
    shards = manifest.get("shards")
    if (not isinstance(shards, list) or not isinstance(manifest.get("layout"), dict)
            or not isinstance(manifest.get("step"), int)):
        raise ShardError(f"{path} is damaged (no layout, step or shard list in it)")
    for shard in shards:
        file = os.path.join(folder, str(shard.get("file")))
        if not os.path.isfile(file):
            raise ShardError(f"{file} is missing: {path} names {len(shards)} shards")
    return manifest


def check_layout(manifest: dict, layout: dict, folder: str) -> None:
    """Refuse a resume on another layout, naming each difference."""
    saved = manifest["layout"]
    differ = [f"{k} {saved.get(k)!r} in the checkpoint, {layout[k]!r} now" for k in layout if saved.get(k) != layout[k]]
    if differ:
        raise ShardError(f"--resume: {os.path.join(folder, MANIFEST)} was written by another layout or settings: "
                         f"{'; '.join(differ)}. Resume with the checkpoint's, or start a new --checkpoint folder")


def check_settings(manifest: dict, run: str, settings: dict, folder: str) -> None:
    """Refuse a resume by another run, or with other settings (the layout may differ: a reshard), naming each difference."""
    path = os.path.join(folder, MANIFEST)
    if manifest["layout"].get("run") != run or not isinstance(manifest.get("settings"), dict):
        raise ShardError(f"--resume: {path} was written by another run ({manifest['layout'].get('run')!r}, not "
                         f"{run!r}); start a new --checkpoint folder")
    saved = manifest["settings"]
    differ = [f"{k} {saved.get(k)!r} in the checkpoint, {settings[k]!r} now" for k in settings if saved.get(k) != settings[k]]
    if differ:
        raise ShardError(f"--resume: {path} was written with other settings: {'; '.join(differ)}. Resume with the "
                         "checkpoint's, or start a new --checkpoint folder")


def verify_shards(folder: str, manifest: dict) -> None:
    """Every shard's digest against the manifest's (before any rank starts)."""
    for entry in manifest["shards"]:
        path = os.path.join(folder, entry["file"])
        with open(path, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != entry["sha256"]:
                raise ShardError(f"{path} is damaged or from another save (its sha256 is not the manifest's); delete "
                                 "the folder or point --checkpoint elsewhere")


def load_shard(folder: str, rank: int, manifest: dict) -> dict:
    """Rank `rank`'s state, its digest checked against the manifest's."""
    entry = manifest["shards"][rank]
    path = os.path.join(folder, entry["file"])
    with open(path, "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ShardError(f"{path} is damaged or from another save (its sha256 is not the manifest's); delete the "
                         "folder or point --checkpoint elsewhere")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as exc:
        raise ShardError(f"{path} is damaged (not a torch file: {type(exc).__name__})") from None
