"""Sharded checkpoints that load into an engine of any config: ``engine.save(path)``, ``engine.load(path)``.

A checkpoint holds every parameter in its *dense* coordinates (the name and shape it has in
``ck.models.GPT(cfg)``), whatever the config that wrote it, so any other config can read it:

- ``model/<name>``: the parameter values; with mixed precision the fp32 masters (the 16-bit
  model is made from them again at load);
- ``optim/<state>/<name>``: the optimizer's per-element states (AdamW's ``exp_avg`` and
  ``exp_avg_sq``, SGD's ``momentum_buffer``), in the same coordinates; its scalar states
  (AdamW's ``step``) are in the manifest, per parameter;
- ``rng/cpu/<rank>`` (and ``rng/cuda/<rank>``): each rank's torch RNG state;
- in the manifest, ``router_bias``: each MoE layer's selection bias (DeepSeek's aux-loss-free balancing, a
  buffer the optimizer does not step), by the layer's MoE number, whichever rank or stage holds it;
- ``manifest.json``: format, parallel config, model config (``GPTConfig``), world size, the
  engine's step count (also the data position: ``SyntheticTokens.batch(step, ...)`` continues
  from it), history and records, the fp16 loss scale, the optimizer's class, per-file bytes and
  sha256, the LR scheduler's state and the data loader's position (``engine.loader``); ``extra.pt``: the
  ``extra`` dict given to ``save`` (``torch.save``; read back with ``weights_only=True``, so tensors, numbers,
  strings, lists and dicts), returned by ``load``.

Saving. Each rank finds where its elements live in the dense model (``layout.local_space``: each
parameter's placement in the engine's placement table, then ZeRO's pieces, through the pipeline
split) as tiles, rectangles of each dense tensor with where they lie in its optimizer tensors (a few
ints per rectangle, none per element), and all ranks exchange the rectangles once (an object
all-gather); a region held by several ranks is written by the lowest of them. Each rank then hands
``torch.distributed.checkpoint.save`` its rectangles as a ``ShardedTensor`` (local shards + the
global list of every rank's shards, built without further collectives): one DCP file per rank,
``.metadata`` from the coordinator. Every dense tensor is stored 2-D (1-D ``[n]`` as ``[1, n]``).
Atomicity: see ``checkpoint.files``.

Worked example, ``ParallelConfig(dp=2, tp=2)`` (ranks ``2 * dp_i + tp_i``), GPT d_model=32,
n_heads=4. ``blocks.0.attn.qkv.weight`` is ``[96, 32]`` in the dense model (heads 0-1 rows 0-47)::

    rank (dp, tp)   holds (1D tensor plan)      writes model/blocks.0.attn.qkv.weight
    0    (0, 0)     rows 0-47                   chunk offsets (0, 0), sizes (48, 32)
    1    (0, 1)     rows 48-95                  chunk offsets (48, 0), sizes (48, 32)
    2    (1, 0)     rows 0-47 (a dp copy)       nothing: rank 0 is lower
    3    (1, 1)     rows 48-95                  nothing: rank 1 is lower

``blocks.0.ln1.weight`` ([32], stored [1, 32]) is whole on all four ranks: rank 0 writes it, one
chunk (0, 0) of (1, 32). ``optim/exp_avg/...`` and ``optim/exp_avg_sq/...`` follow the same
chunks. With ZeRO each rank holds the optimizer's fp32 piece of a flat bucket (or chunk) instead:
its rectangles are a few partial rows and row blocks of several tensors, all written (ZeRO's
pieces overlap nowhere); ``tests/ranks/test_checkpoint.py`` reads both layouts back from DCP's metadata.

Loading. Every rank checks the checkpoint first (``files.check``: the manifest exists, the
model config is this engine's, the files' sizes and hashes, split over ranks, verdicts gathered:
one answer everywhere). Then, one dense tensor at a time, it reads the whole tensor
(``dcp.load`` into a plain tensor, which assembles it from the saved chunks, ``no_dist``: no
collective), copies each of its tiles out of it (a slice into a strided view of the optimizer
tensor), and drops it. Beyond this rank's model states (filled in place), a load holds its tiles
(``LocalSpace.nbytes()``: 64 bytes each, a few per parameter) and, one tensor at a time, the dense
tensor while it is read (``tests/ranks/test_checkpoint.py`` bounds it so). Then the 16-bit model is
made from the masters, ZeRO 1-2 all-gather the updated parameters, and the step count, history, loss
scale and RNG states are set.

RNG states: restored when the world size is the one that saved (rank r gets rank r's); with
another world size they are left as they are (the ranks see other rows and tokens anyway; the
training itself does not draw from them: colab_kit's dropout masks come from the step and global
coordinates, see ``colab_kit.models.dropout``).
The optimizer's class must be the one that saved. Its numeric hyperparameters per param group
(lr, betas, eps, weight decay, momentum, and the ``initial_lr`` an LR scheduler adds) are saved
and restored, as ``torch.optim.Optimizer.load_state_dict`` does, so a scheduler resumed with
``load_state_dict`` goes on from the learning rate it had reached; flags (``foreach``, ``fused``,
``amsgrad``...) stay this engine's. Group by group where the engine has as many groups as the
checkpoint; one set applied to every group where the checkpoint's groups all agree; otherwise
(other groups under another config) this engine's values stay, with a warning.
"""
from __future__ import annotations

import dataclasses
import os
import uuid
import warnings

import torch
import torch.distributed as dist

from ..models.moe import MoE
from .files import CheckpointError, config_instance, check, data_files, file_digest, finish, replace_refusal, start
from .layout import local_space, owners, store_shape
from .state import hyperparameters, plain, restore_hyperparameters, unplain

__all__ = ["CheckpointError", "save", "load", "check"]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


def _gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _agree(fn):
    """Run ``fn`` on rank 0, then raise its error (if any) on every rank."""
    err = None
    if dist.get_rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - passed on to every rank
            err = f"{type(e).__name__}: {e}"
    box = [err]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise RuntimeError(box[0])


def _states(optimizer, tensors, ks) -> tuple[list[str], dict]:
    """The per-element state names shared by tensors ``ks`` and their scalar states (from the first)."""
    names: set | None = None
    scalars: dict[str, dict] = {}
    for k in ks:
        t, st = tensors[k], optimizer.state.get(tensors[k], {})
        per = {s for s, v in st.items() if torch.is_tensor(v) and v.shape == t.shape}
        names = per if names is None else names & per
        for s, v in st.items():
            if s in per or s in scalars or not (torch.is_tensor(v) or isinstance(v, (int, float))):
                continue
            if torch.is_tensor(v):
                scalars[s] = {"value": v.item(), "dtype": str(v.dtype), "cpu": v.device.type == "cpu"}
            else:
                scalars[s] = {"value": v, "dtype": None, "cpu": True}
    return sorted(names or ()), scalars


def _owned_shards(values, space, name, all_rects, shape2d):
    """The ShardedTensor of ``name``: this rank's rectangles' values (``space.read``: strided views of
    ``values``, no index per element), every rank's rectangles' metadata."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    local, mds = [], []
    rank = dist.get_rank()
    dtype = None
    for r, rects in enumerate(all_rects):
        for a, b, n, m in rects:
            md = ShardMetadata([a, b], [n, m], f"rank:{r}/cpu")
            mds.append(md)
            if r == rank:
                vals = space.read(values, name, (a, b, n, m))
                dtype = vals.dtype
                local.append(Shard(vals, md))
    # a rank that holds no rectangle of it has no dtype to give (None, as it always had)
    meta = ShardedTensorMetadata(mds, torch.Size(shape2d), TensorProperties(dtype=dtype))  # type: ignore[arg-type]
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta), str(dtype)


def save(engine, path, extra: dict | None = None) -> None:
    """Write ``engine``'s checkpoint to ``path`` (a directory on a filesystem every rank sees),
    atomically; every rank calls it with the same path."""
    import torch.distributed.checkpoint as dcp
    path = os.path.abspath(os.fspath(path))
    rank, world = dist.get_rank(), dist.get_world_size()
    space = local_space(engine)
    everyone = _gather((path, _held(space, engine.optimizer), replace_refusal(path) if rank == 0 else None))
    paths = sorted({p for p, *_ in everyone})
    if len(paths) > 1:
        raise ValueError(f"engine.save needs the same path on every rank, got {', '.join(paths)}")
    if everyone[0][2] is not None:  # rank 0's look, the same answer on every rank
        raise CheckpointError(f"engine.save({path!r}) refused: {everyone[0][2]}")
    box = [uuid.uuid4().hex[:8] if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    tmp = f"{path}.tmp-{box[0]}"

    def begin():
        start(tmp, world + 1 + (extra is not None))
        if extra is not None:
            torch.save(extra, os.path.join(tmp, "extra.pt"))
    _agree(begin)
    blind = [r for r, seen in enumerate(_gather(os.path.isdir(tmp))) if not seen]
    if blind:
        raise RuntimeError(f"ranks {blind} do not see {tmp}, which rank 0 made: a checkpoint is written to a "
                           "directory every rank shares (one filesystem, or a network one)")
    sd, tensors = _state_dict(space, engine.optimizer, [h for _, h, _ in everyone])
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp))
    except (Exception, dcp.api.CheckpointException) as e:  # DCP's is a BaseException
        raise RuntimeError(f"saving {path} failed ({type(e).__name__}: {e}); {tmp} is left incomplete (load "
                           f"refuses it); the checkpoint at {path}, if any, is unchanged") from e
    digests = {n: file_digest(os.path.join(tmp, n)) for n in data_files(tmp) if n.startswith(f"__{rank}_")}
    digests = {k: v for d in _gather(digests) for k, v in d.items()}
    for d in _gather({n: {k: v for k, v in t.items() if k.startswith("dtype")} for n, t in tensors.items()}):
        for n, kv in d.items():  # the dtypes, known where a rank writes
            tensors[n].update(kv)
    manifest = _manifest(engine, tensors, extra is not None, any(k.startswith("rng/cuda/") for k in sd))
    manifest["router_bias"] = {k: v for d in _gather(_router_bias(engine)) for k, v in d.items()}
    _agree(lambda: finish(tmp, path, manifest, digests))


def _moe_layers(engine) -> list:
    return [m for m in engine.module.modules() if isinstance(m, MoE)]


def _router_bias(engine) -> dict:
    """``{MoE layer number (str): its selection bias}`` of the layers on this rank (a pipeline stage's)."""
    return {str(m.layer): m.score_bias.float().tolist() for m in _moe_layers(engine)}


def _held(space, opt) -> dict:
    """Per dense tensor this rank holds: its rectangles, per-element state names, scalar states."""
    held = {}
    for name in space.table.names:
        tiles = space.tiles(name)
        if tiles:
            held[name] = ([t.rect for t in tiles], *_states(opt, space.tensors, space.tensor_ids(name)))
    return held


def _state_dict(space, opt, everyone: list[dict]) -> tuple[dict, dict]:
    """What this rank hands DCP (its owned rectangles of every tensor and state, its RNG states), and
    the manifest's tensor table."""
    rank, table, sd, tensors = dist.get_rank(), space.table, {}, {}
    for name in table.names:
        shape2d = store_shape(table.shapes[name])
        holders = [e.get(name) for e in everyone]
        first = next((h for h in holders if h is not None), None)
        if first is None:
            raise RuntimeError(f"colab_kit.checkpoint: no rank holds {name}")
        states = sorted(set.intersection(*(set(h[1]) for h in holders if h is not None)))
        own = owners([h[0] if h is not None else [] for h in holders], shape2d)
        entry = {"shape": list(table.shapes[name]), "store": list(shape2d), "states": states, "scalars": first[2]}
        if own[rank]:
            sd[f"model/{name}"], entry["dtype"] = _owned_shards(space.tensors, space, name, own, shape2d)
            for s in states:
                vals = [opt.state.get(t, {}).get(s) for t in space.tensors]
                sd[f"optim/{s}/{name}"], entry[f"dtype/{s}"] = _owned_shards(vals, space, name, own, shape2d)
        tensors[name] = entry
    sd[f"rng/cpu/{rank}"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        sd[f"rng/cuda/{rank}"] = torch.cuda.get_rng_state()
    return sd, tensors


def _manifest(engine, tensors: dict, extra: bool, cuda_rng: bool) -> dict:
    cfg, mcfg = engine.config, engine.model_cfg
    return {"config": dataclasses.asdict(cfg), "describe": cfg.describe(), "world_size": dist.get_world_size(),
            "model": dataclasses.asdict(mcfg) if config_instance(mcfg) else None,
            "model_class": type(mcfg).__name__ if mcfg is not None else None,
            "step": engine.step_count, "history": list(engine.history), "records": list(engine.records),
            "scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
            "optimizer": type(engine.optimizer).__name__, "tensors": tensors, "extra": extra,
            "param_groups": [hyperparameters(g) for g in engine.optimizer.param_groups], "rng": {"cuda": cuda_rng},
            "lr_scheduler": plain(engine.lr_scheduler.state_dict()) if engine.lr_scheduler is not None else None,
            "loader": engine.current_loader.state_dict() if engine.current_loader is not None else None}


def _reader(path: str):
    """A DCP reader of ``path`` that unpickles its ``.metadata`` once for the whole load. ``dcp.load`` given a
    path makes a new reader per call, and ``load`` calls it per dense tensor and state: each call read the
    metadata file again (every chunk of every tensor), 2.7% of tests/ranks' CPU and growing with the
    checkpoint's tensors squared."""
    from torch.distributed.checkpoint import FileSystemReader

    class OnceReader(FileSystemReader):
        metadata = None

        def read_metadata(self, *args, **kwargs):
            if self.metadata is None:
                self.metadata = super().read_metadata(*args, **kwargs)
            return self.metadata

    return OnceReader(path)


def _read(reader, key: str, shape2d, dtype: torch.dtype) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp
    out = torch.empty(tuple(shape2d), dtype=dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({key: out}, storage_reader=reader, no_dist=True)
    return out


def load(engine, path) -> dict:
    """Load ``path`` into ``engine`` (any config, same model); return the ``extra`` dict saved with it."""
    path = os.path.abspath(os.fspath(path))
    rank, world = dist.get_rank(), dist.get_world_size()
    err, manifest = None, None
    try:
        manifest = check(path, engine.model_cfg, part=rank, parts=world, check_model=True)
        if manifest["optimizer"] != type(engine.optimizer).__name__:
            raise CheckpointError(f"{path} was saved with optimizer {manifest['optimizer']}, this engine's is "
                                  f"{type(engine.optimizer).__name__}: its states would not mean the same")
    except (CheckpointError, OSError, ValueError) as e:
        err = f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)
    errors = [e for e in _gather(err) if e is not None]
    if errors:
        raise CheckpointError(errors[0])
    assert manifest is not None  # no rank failed: check() returned it here too
    space, opt = local_space(engine), engine.optimizer
    table = space.table
    saved = manifest["tensors"]
    if sorted(saved) != sorted(table.names) or any(saved[n]["shape"] != list(table.shapes[n]) for n in table.names):
        raise CheckpointError(f"{path} holds other parameters: "
                              f"{sorted(set(saved) ^ set(table.names)) or 'the same names with other shapes'}")
    reader = _reader(path)
    with torch.no_grad():
        for name in table.names:
            ks = space.tensor_ids(name)
            if not ks:
                continue
            meta, store = saved[name], saved[name]["store"]
            dense = _read(reader, f"model/{name}", store, _dtype(meta["dtype"]))
            space.write(space.tensors, name, dense)
            del dense
            for s in meta["states"]:
                for k in ks:
                    st, t = opt.state[space.tensors[k]], space.tensors[k]
                    if s not in st:
                        st[s] = torch.zeros_like(t, dtype=_dtype(meta[f"dtype/{s}"]))
                dense = _read(reader, f"optim/{s}/{name}", store, _dtype(meta[f"dtype/{s}"]))
                space.write([opt.state.get(t, {}).get(s) for t in space.tensors], name, dense)
                del dense
            for s, v in meta["scalars"].items():
                for k in ks:
                    t = space.tensors[k]
                    value = v["value"] if v["dtype"] is None else torch.tensor(
                        v["value"], dtype=_dtype(v["dtype"]), device="cpu" if v["cpu"] else t.device)
                    opt.state[t][s] = value
    masters = engine.data_parallel.masters
    if masters is not None:
        masters.copy_to_model()
    if engine.config.zero in (1, 2):
        engine.data_parallel.gather_params()
    restore_hyperparameters(opt, manifest.get("param_groups"), path)
    saved_sched = manifest.get("lr_scheduler")
    if engine.lr_scheduler is not None and saved_sched is not None:
        engine.lr_scheduler.load_state_dict(unplain(saved_sched))  # after the groups' lr: its last value
    elif (engine.lr_scheduler is None) != (saved_sched is None) and dist.get_rank() == 0:
        warnings.warn(f"{path} was saved {'without' if saved_sched is None else 'with'} an LR scheduler and this "
                      f"engine has {'one' if saved_sched is None else 'none'}: "
                      + ("its schedule starts at step 0" if saved_sched is None else "the saved schedule is not used"),
                      stacklevel=3)  # the line that called engine.load
    if engine.current_loader is not None and manifest.get("loader") is not None:
        engine.current_loader.load_state_dict(manifest["loader"])
    biases = manifest.get("router_bias") or {}
    with torch.no_grad():
        for m in _moe_layers(engine):
            if str(m.layer) in biases:
                m.score_bias.copy_(torch.tensor(biases[str(m.layer)]))
    engine.step_count = manifest["step"]
    engine.history[:] = manifest["history"]
    engine.records[:] = manifest["records"]
    if engine.scaler is not None and manifest["scaler"] is not None:
        engine.scaler.load_state_dict(manifest["scaler"])
    if manifest["world_size"] == world:
        torch.set_rng_state(_read(reader, f"rng/cpu/{rank}", [torch.get_rng_state().numel()], torch.uint8))
        if manifest["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(_read(reader, f"rng/cuda/{rank}", [torch.cuda.get_rng_state().numel()],
                                           torch.uint8))
    extra = {}
    if manifest["extra"]:
        extra = torch.load(os.path.join(path, "extra.pt"), weights_only=True)
    dist.barrier()
    return extra
