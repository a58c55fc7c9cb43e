"""The checkpoint directory: written under a temporary name, made complete by its manifest, checked.

``path.tmp-<nonce>/`` is made by rank 0 (the nonce broadcast), with ``started.json`` (how many
files the save will write); every rank writes its DCP file there; after a barrier rank 0 writes
``manifest.json`` (format, config, model config, step, per-file bytes and sha256, tensor table)
and renames the directory to ``path``. An older checkpoint at ``path`` is first renamed to
``path.old-<nonce>``, the new one moved into place, then the old one deleted: at every instant
``path`` is either the old complete checkpoint, absent (between the two renames), or the new one.
A complete save also removes the ``path.tmp-*`` and ``path.old-*`` that interrupted saves to the
same path left (``leftovers``).

``check(path, model_cfg)`` is what ``load`` runs on every rank before anything is read (pure:
no process group needed, so a notebook kernel can run it too); the file hashes may be split
over ranks (``part``/``parts``) and the verdicts gathered, so that every rank gives one answer.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil

__all__ = ["CheckpointError", "FORMAT", "MANIFEST", "STARTED", "check", "describe_difference", "file_digest",
           "finish", "leftovers", "read_manifest"]

FORMAT = "colab_kit.checkpoint/1"
MANIFEST = "manifest.json"
STARTED = "started.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, incomplete, corrupted, or of another model."""


def file_digest(path: str) -> dict:
    h = hashlib.sha256()  # read in blocks, as hashlib.file_digest does (3.11+ only; the package runs on 3.10)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"bytes": os.path.getsize(path), "sha256": h.hexdigest()}


def _write_json(path: str, obj) -> None:
    tmp = path + ".part"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def replace_refusal(path: str) -> str | None:
    """Why a save may not replace what is at ``path``: only nothing, an empty directory or a colab_kit checkpoint
    (a manifest of this format) is replaced; a file or any other directory (a project, a data folder, another
    program's checkpoint) is the user's, and stays.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> replace_refusal(os.path.join(d, "new")) is None, replace_refusal(d) is None
    (True, True)
    >>> _ = open(os.path.join(d, "notes.txt"), "w").write("mine")
    >>> replace_refusal(d).split(": ")[0].split(" is ", 1)[1]
    'a directory that is not a colab_kit checkpoint (it holds notes.txt)'

    """
    if not os.path.lexists(path):
        return None
    if os.path.islink(path):  # the link is what a save replaces; its target stays as it is
        target = os.path.realpath(path)
        if not os.path.exists(target) or _replaceable_dir(target):
            return None
        return (f"{path} links to {target}, which is not a colab_kit checkpoint: a save replaces only an earlier "
                f"checkpoint; save to a new path (say {path}.ckpt) or remove the link first")
    if os.path.isdir(path):
        if _replaceable_dir(path):
            return None
        names = sorted(os.listdir(path))
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return (f"{path} is a directory that is not a colab_kit checkpoint (it holds {shown}): a save replaces "
                f"only an earlier checkpoint; save to a new path (say {os.path.join(path, 'checkpoint')}) or remove "
                "it first")
    return (f"{path} is a file, not a colab_kit checkpoint (a checkpoint is a directory): a save replaces only an "
            f"earlier checkpoint; save to a new path (say {path}.ckpt) or remove it first")


def _replaceable_dir(path: str) -> bool:
    """An empty directory, or a colab_kit checkpoint of any format version (its manifest names one)."""
    if not os.path.isdir(path):
        return False
    if not os.listdir(path):
        return True
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as fh:
            return str(json.load(fh).get("format", "")).startswith("colab_kit.checkpoint/")
    except (OSError, ValueError, AttributeError):
        return False


def start(tmp: str, expect: int) -> None:
    os.makedirs(tmp)
    _write_json(os.path.join(tmp, STARTED), {"format": FORMAT, "files": expect})


def data_files(d: str) -> list[str]:
    """The files a save writes (DCP's data files and ``.metadata``, the extra), sorted."""
    return sorted(f for f in os.listdir(d) if f.endswith(".distcp") or f in (".metadata", "extra.pt"))


def finish(tmp: str, path: str, manifest: dict, digests: dict) -> None:
    """Rank 0, after every rank has written: the manifest, then the rename into place."""
    names = data_files(tmp)
    missing = sorted(set(names) - set(digests))
    digests = {**digests, **{n: file_digest(os.path.join(tmp, n)) for n in missing}}
    _write_json(os.path.join(tmp, MANIFEST), {**manifest, "format": FORMAT, "files": digests})
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if os.path.lexists(path):
        old = f"{tmp.rsplit('.tmp-', 1)[0]}.old-{tmp.rsplit('.tmp-', 1)[1]}"
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
    for left in leftovers(path):  # what interrupted saves to this path left behind
        shutil.rmtree(left, ignore_errors=True)


def leftovers(path: str) -> list[str]:
    """``path.tmp-*`` and ``path.old-*`` beside ``path``: the directories of saves to ``path`` that
    were interrupted (a rank killed mid-write leaves its temporary directory; ``load`` refuses it).
    The next complete save to ``path`` removes them: one save to a path runs at a time (two at
    once would rename over each other anyway), so none of them can still be in use."""
    import glob
    return sorted(glob.glob(glob.escape(path) + ".tmp-*") + glob.glob(glob.escape(path) + ".old-*"))


def read_manifest(path: str) -> dict:
    """The manifest of a complete checkpoint, or CheckpointError saying why there is none."""
    if os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at {path}: it is a file, and a colab_kit checkpoint is the directory "
                              "engine.save wrote (a Hugging Face directory of *.safetensors: ck.load_pretrained)")
    if not os.path.isdir(path):
        parent = os.path.dirname(os.path.abspath(path)) or "."
        base = os.path.basename(os.path.abspath(path))
        near = sorted(f for f in os.listdir(parent) if f.startswith(base + ".")) if os.path.isdir(parent) else []
        hint = f" (next to it: {', '.join(near)})" if near else ""
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist{hint}")
    man = os.path.join(path, MANIFEST)
    if not os.path.exists(man):
        started = os.path.join(path, STARTED)
        expect = "?"
        if os.path.exists(started):
            with open(started) as f:
                expect = json.load(f).get("files", "?")
        have = len(data_files(path))
        raise CheckpointError(f"{path} is incomplete: the save was interrupted, {have} of {expect} files written "
                              f"and no {MANIFEST}; a checkpoint is loadable only once its save finished "
                              f"(load the previous one, or save again)")
    with open(man) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {manifest.get('format')!r}; this colab_kit reads {FORMAT!r}")
    return manifest


def config_instance(cfg) -> bool:
    """Whether ``cfg`` is a dataclass instance (a model config such as GPTConfig), not a class."""
    return dataclasses.is_dataclass(cfg) and not isinstance(cfg, type)


def describe_difference(saved: dict | None, model_cfg) -> str | None:
    """Which model-config fields differ between the checkpoint and this engine, or None."""
    mine = dataclasses.asdict(model_cfg) if config_instance(model_cfg) else None
    if saved == mine:
        return None
    if saved is None or mine is None:
        return f"the checkpoint's model config is {saved}, this engine's {mine}"
    keys = sorted(set(saved) | set(mine))
    diff = [f"{k} (checkpoint {saved.get(k)!r}, this engine {mine.get(k)!r})" for k in keys
            if saved.get(k) != mine.get(k)]
    return ", ".join(diff)


def check(path: str, model_cfg=None, part: int = 0, parts: int = 1, check_model: bool | None = None) -> dict:
    """Refuse a checkpoint that is missing, incomplete, corrupted or of another model; return its manifest.

    ``model_cfg`` (checked when given, or with ``check_model=True``): the model it must hold.
    Hashes files ``part::parts`` of the sorted list (every file when ``parts == 1``)::

        ck.checkpoint.check("runs/ck", GPTConfig(...))["step"]    # in a kernel: no ranks needed
    """
    manifest = read_manifest(path)
    if check_model or (check_model is None and model_cfg is not None):
        diff = describe_difference(manifest.get("model"), model_cfg)
        if diff is not None:
            raise CheckpointError(f"{path} holds another model: {type(model_cfg).__name__} differs in {diff}; "
                                  "a checkpoint loads into an engine of any parallel config, but of the same model")
    files = manifest["files"]
    present = set(data_files(path))
    lost = sorted(set(files) - present)
    if lost:
        raise CheckpointError(f"{path} is corrupted: {', '.join(lost)} listed in {MANIFEST} but missing")
    for name in sorted(files)[part::parts]:
        got, want = file_digest(os.path.join(path, name)), files[name]
        if got["bytes"] != want["bytes"]:
            raise CheckpointError(f"{path} is corrupted: {name} has {got['bytes']} bytes, the manifest says "
                                  f"{want['bytes']} (truncated or overwritten)")
        if got["sha256"] != want["sha256"]:
            raise CheckpointError(f"{path} is corrupted: {name}'s sha256 differs from the manifest's "
                                  f"(its bytes changed after the save)")
    return manifest
