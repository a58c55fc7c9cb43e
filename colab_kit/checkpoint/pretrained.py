"""The Hugging Face format: ``ck.save_pretrained(engine, directory)`` and ``ck.load_pretrained(engine, directory)``.

Both go through the checkpoint's tiles (``layout.local_space``: the rectangles of each dense tensor
this rank holds and where they lie in its tensors, a few ints each), so they work under every config
the engine runs (tensor modes, pipeline stages, ZeRO pieces, mixed precision: the fp32 masters are
what is read and written).

``save_pretrained`` (every rank calls it): one tensor at a time, each rank hands rank 0 the values
of its tiles with their rectangles (an object gather); rank 0 assembles the tensor, checks that
every element arrived, and adds it to the safetensors file it is filling, written when it reaches
``max_shard_bytes`` (2 GiB), as ``transformers`` shards a save (with ``model.safetensors.index.json``
and ``config.json``), so ``AutoModel.from_pretrained`` / ``GPT2LMHeadModel.from_pretrained`` read it
unchanged. Layers that ``prepare`` turned from ``Conv1D`` into ``nn.Linear`` (GPT-2) are transposed
back. No rank holds more than one file's tensors: a ZeRO-3 run of a model no rank can hold saves too.

``load_pretrained``: every rank opens the safetensors files itself and, tensor by tensor, reads
only the rectangle its tiles lie in (``safe_open(...).get_slice``), and copies each tile out of it
(slices, no index per element) into its parameters (or their fp32 masters, then copied into the
16-bit model; ZeRO 1-2 all-gather the updated pieces). The optimizer's states and the
step count are left as they are: loading pretrained weights starts a fine-tuning run.

Worked example, ``ParallelConfig(tp=2)``, GPT-2 with n_embd=32: ``transformer.h.0.attn.c_attn
.weight`` is ``[32, 96]`` in the file (Conv1D: ``[in, out]``) and ``[96, 32]`` in the engine's dense
coordinates; tp rank 0 holds dense rows 0-15, 32-47 and 64-79 (q, k, v of heads 0-1: the policy's
``fused``), so it reads the whole tensor (its rows are the file's columns) and keeps those rows.
"""
from __future__ import annotations

import glob
import json
import os

import torch
import torch.distributed as dist

from ..models.moe import MoE

from .layout import local_space, owners, store_shape
from ..sharded_init import meta_twin
from ..sharded_init.hf import recipe

__all__ = ["save_pretrained", "load_pretrained", "dense_state_dict"]


def _conv_paths(engine) -> set[str]:
    return set(engine.parts.conv1d)


def _is_conv(name: str, convs: set[str]) -> bool:
    return name.endswith(".weight") and name[: -len(".weight")] in convs


def dense_state_dict(engine, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The dense model's parameters (and an MoE layer's router bias, the buffer training changes), by the dense
    model's names, assembled on rank ``dst`` (None elsewhere;
    every rank calls it): one tensor at a time, each rank hands ``dst`` the values it holds with their dense
    rectangles (an object gather), fp32 (the masters under mixed precision). An element no rank holds is an
    error. ``dst`` holds the dense model once, at the end. A tied weight appears under each of its names
    (BERT's ``tok.weight`` and ``mlm.decoder.weight``), so ``model.load_state_dict(sd)`` takes it as it is.

    Worked example, ``ParallelConfig(tp=2)``: rank 0 sends rows 0-47 of ``blocks.0.attn.qkv.weight`` with
    its rectangle ``(0, 0, 48, 32)``, rank 1 rows 48-95 with ``(48, 0, 48, 32)``; rank 0 returns the whole
    ``[96, 32]``; rank 1 returns None.
    """
    space = local_space(engine)
    table = space.table
    rank, world = dist.get_rank(), dist.get_world_size()
    dense: dict[str, torch.Tensor] = {}
    for name in table.names:
        whole = _assemble(space, name, dst)
        if whole is not None:
            dense[name] = whole
    biases: list | None = [None] * world if rank == dst else None  # MoE router biases: training state too
    dist.gather_object({str(m.layer): _bias(m) for m in engine.module.modules() if isinstance(m, MoE)}, biases,
                       dst=dst)
    if rank != dst:
        return None
    assert biases is not None
    layer_bias = {k: v for d in biases for k, v in d.items()}
    for path, m in engine.dense_twin.named_modules():
        if isinstance(m, MoE) and str(m.layer) in layer_bias:
            dense[f"{path}.score_bias"] = layer_bias[str(m.layer)]
    canonical = {id(p): n for n, p in engine.dense_twin.named_parameters()}
    for n, p in engine.dense_twin.named_parameters(remove_duplicate=False):  # tied weights under each of their names
        if n not in dense and canonical.get(id(p)) in dense:
            dense[n] = dense[canonical[id(p)]]
    return dense


def _assemble(space, name: str, dst: int) -> torch.Tensor | None:
    """Dense tensor ``name``, whole on rank ``dst`` (None elsewhere), from every rank's tiles (an object gather);
    fp32. An element no rank holds is an error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [(t.rect, space.read(space.tensors, name, t.rect)) for t in space.tiles(name)]
    parts: list | None = [None] * world if rank == dst else None
    dist.gather_object(mine, parts, dst=dst)
    if rank != dst:
        return None
    assert parts is not None  # made on dst
    shape = space.table.shapes[name]
    try:
        owners([[rect for rect, _ in tiles] for tiles in parts], store_shape(shape))  # raises if one is missing
    except RuntimeError as e:
        raise RuntimeError(f"dense_state_dict: {name}: {e}") from None
    flat = torch.empty(store_shape(shape), dtype=torch.float32)
    for tiles in parts:
        for (r, c, n, m), values in tiles:
            flat[r:r + n, c:c + m] = values.to(torch.float32)
    return flat.view(shape)


def _bias(layer: MoE) -> torch.Tensor:
    bias: torch.Tensor = layer.score_bias  # type: ignore[assignment]  # a buffer
    return bias.detach().float().cpu()


def save_pretrained(engine, directory, max_shard_bytes: int = 2 << 30) -> None:
    """Write ``directory`` in the Hugging Face format of the engine's model (see the module docstring), one
    tensor at a time: rank 0 assembles a tensor, adds it to the safetensors file being filled and writes the
    file when it reaches ``max_shard_bytes`` (then ``model.safetensors.index.json`` names each tensor's file),
    so no rank ever holds more than one file's tensors, not the whole model. Persistent buffers (a DeepSeek
    router's correction bias) are written as the model's own init makes them; ``config.json`` beside."""
    twin = engine.dense_twin
    if not hasattr(twin, "save_pretrained") or not hasattr(twin, "config"):
        raise TypeError(f"save_pretrained writes transformers models; this engine trains a {type(twin).__name__}: "
                        f"use engine.save(path) for colab_kit's own sharded checkpoints")
    space, convs, directory = local_space(engine), _conv_paths(engine), os.fspath(directory)
    writer = _ShardWriter(directory, max_shard_bytes) if dist.get_rank() == 0 else None
    for name in space.table.names:
        whole = _assemble(space, name, 0)
        if writer is not None and whole is not None:
            writer.add(name, whole.t().contiguous() if _is_conv(name, convs) else whole)
    if writer is not None:
        params = {n for n, _ in twin.named_parameters(remove_duplicate=False)}
        buffers = [n for n in twin.state_dict() if n not in params and n not in writer.where]
        if buffers:
            make = recipe(twin, meta_twin(twin))
            for n in buffers:
                t = twin.get_buffer(n)
                writer.add(n, make(n, torch.empty(t.shape, dtype=t.dtype)))
        writer.close()
        twin.config.save_pretrained(directory)
    dist.barrier()


class _ShardWriter:
    """Tensors into safetensors files of at most ``limit`` bytes each (one tensor larger than that: a file of its
    own), named as ``transformers`` names a sharded save."""

    def __init__(self, directory: str, limit: int):
        os.makedirs(directory, exist_ok=True)
        self.directory, self.limit = directory, limit
        self.written = 0  # files written so far
        self.pending: dict[str, torch.Tensor] = {}
        self.where: dict[str, int] = {}
        self.size = self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.limit:
            self._flush()
        self.pending[name], self.where[name] = tensor, self.written
        self.size, self.total = self.size + nbytes, self.total + nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file
        save_file(self.pending, os.path.join(self.directory, f"part-{self.written}.tmp"), metadata={"format": "pt"})
        self.written += 1
        self.pending, self.size = {}, 0

    def close(self) -> None:
        if self.pending or not self.written:
            self._flush()
        n = self.written
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, final in enumerate(names):
            os.replace(os.path.join(self.directory, f"part-{i}.tmp"), os.path.join(self.directory, final))
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": {k: names[i] for k, i in self.where.items()}}
            with open(os.path.join(self.directory, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)


def _files(directory: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index of a sharded save or from the files themselves."""
    from safetensors import safe_open
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return {k: os.path.join(directory, v) for k, v in json.load(f)["weight_map"].items()}
    where = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            where.update({k: path for k in f.keys()})
    if not where:
        if os.path.exists(os.path.join(directory, "manifest.json")):
            raise FileNotFoundError(f"{directory} is a colab_kit checkpoint (engine.save's), not a save_pretrained "
                                    f"directory: read it with engine.load({directory!r})")
        raise FileNotFoundError(f"{directory} holds no *.safetensors files (a save_pretrained directory)")
    return where


@torch.no_grad()
def load_pretrained(engine, directory) -> int:
    """Read ``directory`` (a ``save_pretrained`` directory) into this engine's parameters (see the module
    docstring); returns how many elements this rank read from the files. Of a matrix a rank reads the
    rectangle its tiles lie in (a 1D column block its rows, a row block its columns, a 2D tile its
    tile); of a vector or a table above 2-D, the rows."""
    from safetensors import safe_open
    directory = os.fspath(directory)
    where = _files(directory)
    space = local_space(engine)
    table, convs = space.table, _conv_paths(engine)
    absent = [n for n in table.names if n not in where]
    if absent:
        more = "..." if len(absent) > 5 else ""
        raise KeyError(f"{directory} has no tensors {absent[:5]}{more}: it holds another model")
    read = 0
    for name in table.names:
        tiles = space.tiles(name)
        if not tiles:
            continue
        shape = table.shapes[name]
        r0, c0 = min(t.row for t in tiles), min(t.col for t in tiles)
        r1, c1 = max(t.row + t.rows for t in tiles), max(t.col + t.cols for t in tiles)
        with safe_open(where[name], framework="pt") as f:
            sl = f.get_slice(name)
            got = tuple(sl.get_shape())
            conv = _is_conv(name, convs)
            if got != (tuple(reversed(shape)) if conv else tuple(shape)):
                raise ValueError(f"{name} is {list(got)} in {directory}, this engine's model has {list(shape)}")
            if len(shape) == 2:  # only the rectangle this rank's tiles lie in (a Conv1D stores [in, out])
                block = sl[c0:c1, r0:r1].t() if conv else sl[r0:r1, c0:c1]
            elif len(shape) < 2:
                block, r0, c0 = sl[:].reshape(1, -1), 0, 0
            else:  # only the rows this rank's tiles come from
                block, c0 = sl[r0:r1].reshape(r1 - r0, -1), 0
        read += block.numel()
        space.write(space.tensors, name, block.to(torch.float32), origin=(r0, c0))
    masters = engine.data_parallel.masters
    if masters is not None:
        masters.copy_to_model()
    if engine.config.zero in (1, 2):
        engine.data_parallel.gather_params()
    dist.barrier()
    return read
